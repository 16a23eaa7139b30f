"""`sink_dtype="input"`: an adapter whose library takes sink logits in the query's dtype (onnxruntime's
GroupQueryAttention: `head_sink` of type T) is given sinks representable there, so the rounding its interface forces is
not judged as its kernel's error; the claim blinds nothing else. Found on 2026-12-05: the main job failed ort-gqa's
sinks_match_reference on `B=1 Hq=1 Lq=1 Lk=1 D=64 float16` (1.15x the bound; 0.39 with the logit rounded first)."""
import math

import pytest
import torch

import attnverify as av
from attnverify.case import CaseRecipe, build_case
from attnverify.properties import get_property
from attnverify.sink_logits import for_adapter, make_sinks

# the main job's shrunk case and its drawn sinks
RECIPE = CaseRecipe(batch=1, heads_q=1, heads_kv=1, len_q=1, len_k=1, head_dim=64, dtype="float16", seed=0)
SINKS = {"kind": "normal", "level": 2.0, "seed": 255}


def _sink_attention(q, k, v, sinks):
    """A correct eager kernel with sinks (float32 scores and softmax, the output rounded once)."""
    s = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    sk = sinks.float().view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    p = torch.softmax(torch.cat([s, sk], dim=-1), dim=-1)[..., :-1]
    return (p @ v.float()).to(q.dtype)


def _half_sinks(q, k, v, spec):
    # the library's interface: sink logits in the query's dtype (as onnxruntime's head_sink)
    return _sink_attention(q, k, v, spec.sinks.to(q.dtype))


CLAIMS = dict(dtypes=("float16", "bfloat16", "float32"), devices=("cpu",), head_dims=(64,), sinks=True)
without_claim = av.adapter("half_sinks_unclaimed", register=False, **CLAIMS)(_half_sinks)
with_claim = av.adapter("half_sinks", register=False, sink_dtype="input", **CLAIMS)(_half_sinks)
ignores_sinks = av.adapter("half_sinks_ignored", register=False, sink_dtype="input", **CLAIMS)(
    lambda q, k, v, spec: _sink_attention(q, k, v, torch.full_like(spec.sinks, -math.inf)))


def _judge(adapter, recipe=RECIPE, sinks=SINKS):
    return get_property("sinks_match_reference").run_example(adapter, {"recipe": recipe.to_dict(), "sinks": dict(sinks)})


def test_a_half_sink_interface_fails_unclaimed_and_passes_claimed():
    unclaimed = _judge(without_claim)
    assert unclaimed.status == "failed" and "out" in unclaimed.message, unclaimed.message
    claimed = _judge(with_claim)
    assert claimed.status == "passed", claimed.message
    # the journaled case replays with the rounded logits: its recipe carries the dtype
    assert claimed.case["recipe"]["sinks"]["dtype"] == "float16"
    replayed = build_case(CaseRecipe.from_dict(claimed.case["recipe"]))
    assert replayed.spec.sinks.tolist() == replayed.spec.sinks.half().float().tolist()


def test_the_claim_blinds_nothing_else():
    for dt in ("float16", "bfloat16"):
        r = _judge(ignores_sinks, CaseRecipe(**{**RECIPE.__dict__, "dtype": dt, "len_k": 5}))
        assert r.status == "failed", (dt, r.message)


def test_only_half_calls_round_and_the_logits_round_once():
    assert for_adapter(with_claim, "float32", SINKS) == SINKS
    assert for_adapter(with_claim, "float8_e4m3fn", SINKS) == SINKS  # fp8: float32 logits (no -inf in e4m3fn)
    assert for_adapter(without_claim, "float16", SINKS) == SINKS
    d = for_adapter(with_claim, "bfloat16", SINKS)
    assert d == {**SINKS, "dtype": "bfloat16"} and SINKS.get("dtype") is None  # a copy, the draw untouched
    x, xr = make_sinks(8, SINKS), make_sinks(8, d)
    assert torch.equal(xr, x.bfloat16().float()) and not torch.equal(xr, x)
    inf = make_sinks(4, {"kind": "neg_inf", "level": 1.0, "seed": 0, "dtype": "float16"})
    assert torch.isneginf(inf).all()
    with pytest.raises(ValueError, match="sinks dtype='int8'"):
        make_sinks(4, {**SINKS, "dtype": "int8"})


@pytest.mark.parametrize("kw,fix", [
    (dict(sinks=True, sink_dtype="float16"), "use one of ('float32', 'input')"),
    (dict(sink_dtype="input"), "claim sinks=True too"),
])
def test_bad_sink_dtype_claims_name_the_argument_and_the_fix(kw, fix):
    with pytest.raises(ValueError) as e:
        av.adapter("stranger", register=False, **kw)(lambda q, k, v, spec: q)
    assert "sink_dtype" in str(e.value) and fix in str(e.value), str(e.value)
