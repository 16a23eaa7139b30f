"""The float32 bound grows with the number of terms an output sums (tolerances.ACC_NORM_U, ACC_ELEM_U): a correct kernel that sums
its keys in sequence (an FMA chain, as a GPU's IEEE float32 dot does) errs ~0.3 sqrt(Lk) u, past the constant
float32 floor at a few thousand keys; wrong float32 answers still fail at the same length."""
from __future__ import annotations

import math

import pytest
import torch

import attnverify as av
from attnverify.magnitudes import accumulated_terms, magnitudes
from attnverify.tolerances import ACC_ELEM_U, ACC_NORM_U, UNIT_ROUNDOFF, floors_of, tolerance_for

LONG = dict(batch=1, heads_q=2, heads_kv=2, len_q=2, len_k=8192, head_dim=16, dtype="float32", v_mean=10.0,
            q_std=0.2, k_std=0.2, return_lse=True)


def _online(q, k, v, spec, *, pv_dtype=torch.float32):
    """Online softmax one key at a time, in float32: the order of a sequential FMA chain over the keys. pv_dtype:
    the accumulator's dtype (bfloat16: a wrong kernel)."""
    s_all = (q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
    shape = s_all.shape[:-1] + (1,)
    m = torch.full(shape, -math.inf)
    l, acc = torch.zeros(shape), torch.zeros(shape[:-1] + (v.shape[-1],), dtype=pv_dtype)
    for j in range(s_all.shape[-1]):
        s = s_all[..., j:j + 1]
        m_new = torch.maximum(m, s)
        a, p = torch.exp(m - m_new), torch.exp(s - m_new)
        l = l * a + p
        acc = (acc.float() * a + p * v[:, :, j:j + 1, :]).to(pv_dtype)
        m = m_new
    return av.Output(acc.float() / l, lse=(m + torch.log(l)).squeeze(-1))


CLAIMS = dict(register=False, dtypes=("float32",), lse=True, max_seqlen=65536)
SEQUENTIAL = av.adapter("sequential-fp32", **CLAIMS)(_online)
BF16_ACC = av.adapter("bf16-accumulator", **CLAIMS)(lambda q, k, v, s: _online(q, k, v, s, pv_dtype=torch.bfloat16))


@av.adapter("tf32-pv", **CLAIMS)
def tf32_pv(q, k, v, spec):  # P and V rounded to TF32's 10 mantissa bits before P @ V
    def tf32(x):
        return (x.view(torch.int32) & ~0x1FFF).view(torch.float32)

    s = (q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
    lse = torch.logsumexp(s, dim=-1)
    return av.Output(tf32(torch.exp(s - lse.unsqueeze(-1))) @ tf32(v), lse=lse)


def test_the_accumulation_term_is_acc_u_sqrt_n_u_relative_to_the_reference_not_to_the_scale_floor():
    mags = {"out": 0.5, "acc:out": 8192}
    base, grown = tolerance_for("out", "float32", scale_floor=0.5), tolerance_for("out", "float32", **floors_of(mags, "out"))
    acc = ACC_NORM_U * UNIT_ROUNDOFF["float32"] * math.sqrt(8192)
    assert grown.norm == base.norm and grown.acc_norm == pytest.approx(acc)
    assert grown.norm_at(10.0, 10.0) == pytest.approx(base.norm + acc)  # the reference above its scale floor
    assert grown.norm_at(0.1, 5.0) == pytest.approx(base.norm + acc / 50)  # the floor's denominator: a 50th of it
    ref = torch.tensor([0.0, 1.0, 10.0], dtype=torch.float64)
    assert torch.allclose(grown.allowed(ref, 0.5) - base.allowed(ref, 0.5), ACC_ELEM_U / ACC_NORM_U * acc * ref)
    assert tolerance_for("out", "float32", sides=2, **floors_of(mags, "out")).acc_norm == pytest.approx(2 * acc)
    assert tolerance_for("out", "float8_e4m3fn", **floors_of(mags, "out")).acc_norm == 0  # fp8: its calibrated rule
    assert accumulated_terms((2, 8, 5, 16), (2, 2, 300, 16)) == {"out": 300, "dq": 300, "dk": 20, "dv": 20,
                                                                 "dsinks": 10}  # the LSE: none (see below)
    # varlen: a row sums its own segment's keys, not the packed length
    assert accumulated_terms((1, 4, 60, 16), (1, 4, 90, 16), 25, 40) == {"out": 40, "dq": 40, "dk": 25, "dv": 25,
                                                                         "dsinks": 60}


def test_a_sequential_float32_kernel_passes_at_long_keys_without_a_baseline_to_lean_on():
    case = av.build_case(av.CaseRecipe(**LONG, seed=0))
    assert magnitudes(case)["acc:out"] == 8192
    varlen = av.build_case(av.CaseRecipe(len_q=30, len_k=50, head_dim=8, seqlens_q=[10, 20], seqlens_k=[35, 15]))
    assert magnitudes(varlen)["acc:out"] == 35 and magnitudes(varlen)["acc:dv"] == 20
    r = av.check(SEQUENTIAL, case, backward=False, baseline=False)
    assert r.passed, [(c.name, c.rel_l2, c.tol_norm) for c in r.comparisons]
    out = next(c for c in r.comparisons if c.name == "out")
    mags = magnitudes(case)
    const = tolerance_for("out", "float32", score_max=mags["S"], scale_floor=mags["out"]).norm
    assert out.rel_l2 > const  # the constant floor alone would fail this correct kernel


@pytest.mark.parametrize("v_mean", [0.0, 10.0])
@pytest.mark.parametrize("wrong", [BF16_ACC, tf32_pv], ids=lambda a: a.name)
def test_wrong_float32_answers_still_fail_at_the_same_length(wrong, v_mean):
    case = av.build_case(av.CaseRecipe(**{**LONG, "v_mean": v_mean}, seed=0))
    r = av.check(wrong, case, backward=False)
    assert r.status == "failed", [(c.name, c.rel_l2, c.tol_norm) for c in r.comparisons]


def _one_key_short(q, k, v, spec):
    """Attention over every key but the last: wrong by the weight of one key in 8,192."""
    s = (q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
    lse = torch.logsumexp(s[..., :-1].double(), dim=-1)
    p = torch.exp(s[..., :-1].double() - lse.unsqueeze(-1))
    return av.Output((p @ v[..., :-1, :].double()).float(), lse=lse.float())


SHORT = av.adapter("one-key-short", **CLAIMS)(_one_key_short)


def test_an_lse_one_key_short_still_fails_at_long_keys():
    """The LSE takes no accumulation term: a relative error e of the sum moves log(sum) by e absolutely, far inside its
    floor; a term relative to |lse| (~log Lk) let an LSE that left out one key of 8,192 pass (review, session 10)."""
    case = av.build_case(av.CaseRecipe(**LONG, seed=0))
    r = av.check(SHORT, case, backward=False)
    lse = next(c for c in r.comparisons if c.name == "lse")
    assert not lse.passed, (lse.rel_l2, lse.tol_norm)
    assert magnitudes(case).get("acc:lse", 0) == 0
