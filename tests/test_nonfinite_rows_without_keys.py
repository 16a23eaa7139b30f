"""nonfinite_inputs_propagate on a row that an Inf in q leaves without a key (every score -inf): the reference calls
it fully masked, and a kernel claiming fully_masked="zeros" may give 0 there or propagate the NaN/Inf; a finite value
other than 0 still fails. Found 2026-12-05: the README's quick-start kernel (a plain softmax) gave NaN on
`B=1 Lq=Lk=1 D=32 float16 q[0]=inf` and failed one seed's ci run (tests/test_quickstart.py, in CI)."""
import math

import torch

import attnverify as av
from attnverify.case import CaseRecipe, build_case
from attnverify.properties import get_property
from attnverify.reference import reference_forward


def _softmax_attention(q, k, v, spec):
    s = (q.float() @ k.float().transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
    return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype)  # all -inf row: NaN


def _zero_dead_rows(q, k, v, spec):
    s = (q.float() @ k.float().transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
    dead = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return (p @ v.float()).to(q.dtype)


def _uniform_dead_rows(q, k, v, spec):  # wrong: a row without keys averages V (finite, not 0)
    s = (q.float() @ k.float().transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
    dead = torch.isneginf(s).all(-1, keepdim=True)
    return (torch.softmax(s.masked_fill(dead, 0.0), dim=-1) @ v.float()).to(q.dtype)


KW = dict(dtypes=("float16",), devices=("cpu",), head_dims=(32,), fully_masked="zeros")
plain = av.adapter("plain_softmax", register=False, **KW)(_softmax_attention)
zeros = av.adapter("zero_dead_rows", register=False, **KW)(_zero_dead_rows)
uniform = av.adapter("uniform_dead_rows", register=False, **KW)(_uniform_dead_rows)


def _keyless_recipe():
    """Lq = Lk = 1 with q[0] = +inf and k[0] < 0: the one score is -inf."""
    for seed in range(100):
        r = CaseRecipe(len_q=1, len_k=1, head_dim=32, dtype="float16", seed=seed, poison=(("q", 0, 0, 0, 0, "inf"),))
        c = build_case(r)
        if math.isinf(float(reference_forward(c.q, c.k, c.v, c.spec).lse.reshape(-1)[0])):
            return r
    raise AssertionError("no seed in 0..99 draws k[0] < 0")


def test_a_row_an_inf_leaves_without_keys_may_be_zero_or_propagate_but_not_anything_else():
    prop, r = get_property("nonfinite_inputs_propagate"), _keyless_recipe()
    drawn = {"recipe": r.to_dict()}
    assert prop.run_example(plain, drawn).status == "passed"  # NaN propagated
    assert prop.run_example(zeros, drawn).status == "passed"  # the declared convention
    wrong = prop.run_example(uniform, drawn)
    assert wrong.status == "failed" and "out: MISMATCH" in wrong.message, wrong.message
