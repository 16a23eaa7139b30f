"""`sink_in_lse`: whether an adapter's returned LSE has the sink in its sum (docs/adapters.md, lse_conventions.py).

The contract's LSE has it (LSE = logsumexp(scores and sink), a keyless row's LSE = the sink; FA4's softmax.py). FlashMLA's
`attn_sink` does not (flash_mla_interface.py: "the final output will be scaled by exp(lse) / (exp(lse) +
exp(attn_sink)). Have no affect on the returned softmax_lse"). Before the claim such an adapter failed every LSE
comparison on a sink case; now `sink_in_lse=False` declares it: its LSE is held to the reference's without sinks
(a keyless row then has no key: -inf, +inf under keyless_lse="+inf"), its output still to the sink in the denominator,
and no gradient reaches the sink through its LSE. An LSE without the sink passes under False and fails under True; one
with the sink fails under False; an output ignoring the sink fails under False.
"""
from __future__ import annotations

import math

import pytest
import torch

import attnverify as av
from attnverify.adapters.naive import naive_serving
from attnverify.case import CaseRecipe, build_case
from attnverify.lse_conventions import expected_grads, expected_lse, sink_excluded
from attnverify.properties import get_property
from attnverify.properties.sinks import with_sinks
from attnverify.reference import reference_backward, reference_forward

BASE = dict(dtypes=("float32",), head_dims=(16,), causal=("none", "bottom_right"), lse=True, sinks=True,
            fully_masked="zeros", gqa=True, kv_cache=True, paged=True)


def _impl(lse_kind: str = "keys", out_kind: str = "sink", keyless: float = -math.inf):
    """naive with sinks; LSE over the keys only ("keys", FlashMLA's) or with the sink ("sink"); the output with the
    sink in its denominator ("sink") or without it ("no_sink": the sink ignored)."""
    def fn(q, k, v, spec):
        s = spec.replace(return_lse=True)
        with_sink = naive_serving(q, k, v, s)
        no_sink = naive_serving(q, k, v, s.replace(sinks=None)) if s.sinks is not None else with_sink
        out = with_sink.out if out_kind == "sink" else no_sink.out
        lse = no_sink.lse if lse_kind == "keys" else with_sink.lse
        lse = torch.where(torch.isneginf(lse.detach()), torch.full_like(lse, keyless), lse)
        return av.Output(out, lse=lse if spec.return_lse else None)
    return fn


def _adapter(name, claim, **kw):
    impl_kw = {k: kw.pop(k) for k in ("lse_kind", "out_kind", "keyless") if k in kw}
    claims = dict(BASE, **kw, **({"sink_in_lse": claim} if claim is not None else {}))
    return av.adapter(name, register=False, **claims)(_impl(**impl_kw))


KEYS_CLAIMED = _adapter("sinklse-keys", False, backward=True)
KEYS_UNCLAIMED = _adapter("sinklse-keys-unclaimed", None, backward=True)  # the default True: its LSE fails
SINK_CLAIMING_KEYS = _adapter("sinklse-sink-claims-keys", False, lse_kind="sink")
OUT_IGNORES_SINK = _adapter("sinklse-out-ignores-sink", False, out_kind="no_sink")
KEYS_PLUS_INF = _adapter("sinklse-keys-plus-inf", False, keyless=math.inf, keyless_lse="+inf")
KEYS_MINUS_INF_CLAIMING_PLUS = _adapter("sinklse-keys-minus-claims-plus", False, keyless_lse="+inf")

# bottom-right causal with Lq > Lk: query rows 0..2 see no key (LSE = the sink in the contract); finite sinks of 2.0
RECIPE = dict(batch=1, heads_q=2, heads_kv=1, len_q=6, len_k=3, head_dim=16, dtype="float32", causal="bottom_right",
              return_lse=True, seed=3)
SINKS = {"sinks": {"kind": "normal", "level": 2.0, "seed": 1}}


def _case(**kw):
    return with_sinks(build_case(CaseRecipe(**dict(RECIPE, **kw))), dict(SINKS))


def test_the_claim_validates_and_names_the_fix():
    for bad in (dict(BASE, sinks=False), dict(BASE, lse=False)):
        with pytest.raises(ValueError, match=r"sink_in_lse=\.\.\.\): .*claim sinks=True and lse=True too"):
            av.adapter("x", register=False, **dict(bad, sink_in_lse=False))(lambda q, k, v, s: q)
    with pytest.raises(ValueError, match=r"sink_in_lse=\.\.\.\): a claim that is on or off"):
        av.adapter("x", register=False, **dict(BASE, sink_in_lse="no"))(lambda q, k, v, s: q)
    assert av.adapter("x", register=False, **BASE)(lambda q, k, v, s: q).claims.sink_in_lse is True
    assert "sink_in_lse=False" in KEYS_CLAIMED.claims.summary()
    assert "sink_in_lse" not in KEYS_UNCLAIMED.claims.summary()


def test_expected_lse_is_the_reference_without_sinks_only_where_claimed():
    case = _case()
    q, k, v, s = case.q, case.k, case.v, case.spec
    with_sink = reference_forward(q, k, v, s).lse
    keys = reference_forward(q, k, v, s.replace(sinks=None)).lse
    assert not sink_excluded(KEYS_UNCLAIMED.claims, s) and sink_excluded(KEYS_CLAIMED.claims, s)
    assert not sink_excluded(KEYS_CLAIMED.claims, s.replace(sinks=None))
    assert torch.equal(expected_lse(KEYS_UNCLAIMED.claims, q, k, v, s, with_sink), with_sink)
    assert torch.equal(expected_lse(KEYS_CLAIMED.claims, q, k, v, s, with_sink), keys)
    assert bool(torch.isneginf(keys[..., :3]).all()) and bool(torch.isfinite(with_sink).all())
    plus = expected_lse(KEYS_PLUS_INF.claims, q, k, v, s, with_sink)
    assert bool(torch.isposinf(plus[..., :3]).all()) and torch.equal(plus[..., 3:], keys[..., 3:])


def test_expected_grads_leave_the_sink_out_of_the_lse_term():
    """Under False the LSE term is the sink-less reference's: dsinks only through the output (-sum P_sink D), and the
    whole matches autograd through a float64 eager computation of that convention."""
    case = _case(len_q=4, len_k=5, causal="none")
    q, k, v = (t.double().requires_grad_(True) for t in (case.q, case.k, case.v))
    s = case.spec
    sinks = s.sinks.double().clone().requires_grad_(True)
    gen = torch.Generator().manual_seed(0)
    d_out = torch.randn(1, 2, 4, 16, generator=gen, dtype=torch.float64)
    d_lse = torch.randn(1, 2, 4, generator=gen, dtype=torch.float64)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    sc = q @ kk.transpose(-1, -2) * s.resolved_scale(16)
    lse_keys = torch.logsumexp(sc, -1)
    lse_all = torch.logaddexp(lse_keys, sinks[None, :, None])
    out = torch.exp(sc - lse_all[..., None]) @ vv
    gq, gk, gv, gs = torch.autograd.grad((out * d_out).sum() + (lse_keys * d_lse).sum(), (q, k, v, sinks))
    g = expected_grads(KEYS_CLAIMED.claims, case.q, case.k, case.v, s, d_out, d_lse)
    for name, got, want in (("dq", g.dq, gq), ("dk", g.dk, gk), ("dv", g.dv, gv), ("dsinks", g.dsinks, gs)):
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-12), name
    g_true = expected_grads(KEYS_UNCLAIMED.claims, case.q, case.k, case.v, s, d_out, d_lse)
    assert torch.equal(g_true.dsinks, reference_backward(case.q, case.k, case.v, s, d_out, d_lse).dsinks)
    assert not torch.allclose(g_true.dsinks, g.dsinks)  # the convention matters to the gradient


def test_check_holds_the_lse_to_the_declared_convention():
    case = _case()
    ok = av.check(KEYS_CLAIMED, case, backward=True)  # out, LSE, dQ/dK/dV with dLSE through the keys-only LSE
    assert ok.status == "passed", ok.message()
    assert any("sink_in_lse=False" in n for n in ok.notes), ok.notes
    unclaimed = av.check(KEYS_UNCLAIMED, case, backward=False)
    assert unclaimed.status == "failed" and [c.name for c in unclaimed.failing()] == ["lse"], unclaimed.message()
    flipped = av.check(SINK_CLAIMING_KEYS, case)
    assert flipped.status == "failed" and [c.name for c in flipped.failing()] == ["lse"], flipped.message()
    ignores = av.check(OUT_IGNORES_SINK, case)  # the claim is about the LSE: the output keeps the sink
    assert ignores.status == "failed" and [c.name for c in ignores.failing()] == ["out"], ignores.message()
    plus = av.check(KEYS_PLUS_INF, case)
    assert plus.status == "passed", plus.message()
    minus = av.check(KEYS_MINUS_INF_CLAIMING_PLUS, case)
    assert minus.status == "failed" and [c.name for c in minus.failing()] == ["lse"], minus.message()


def _garbage_on_keyless_rows(fn, value):
    """fn with the output of query rows 0..2 (keyless in RECIPE) set to `value`."""
    def g(q, k, v, spec):
        o = fn(q, k, v, spec)
        out = o.out.clone()
        out[:, :, :3] = value
        return av.Output(out, lse=o.lse)
    return g


@pytest.mark.parametrize("fm", ["nan", "unsupported"])
def test_keyless_rows_of_a_sink_less_lse_under_each_fully_masked_declaration(fm):
    """sink_in_lse=False with fully_masked "nan" or "unsupported" (only the wide claim-set fuzz drew these before): a
    keyless row's LSE over its keys is NaN (or -inf) under "nan" (log 0 declared NaN), not judged under "unsupported"; its
    output is 0 under both (the sink alone in its denominator, a zero value row): the sink makes the row not masked."""
    case = _case()
    ok = _adapter(f"keys-{fm}", False, fully_masked=fm, keyless=math.nan if fm == "nan" else 123.0)
    res = av.check(ok, case, backward=False)
    assert res.status == "passed", res.message()
    if fm == "nan":  # -inf is as good as NaN for such an LSE (check's rule); a number there is not
        assert av.check(_adapter("keys-nan-says-minus-inf", False, fully_masked="nan"), case).status == "passed"
        wrong = _adapter("keys-nan-says-a-number", False, fully_masked="nan", keyless=0.5)
        bad = av.check(wrong, case, backward=False)
        assert bad.status == "failed" and [c.name for c in bad.failing()] == ["lse"], bad.message()
    for value in (math.nan, 0.5):  # the output of a keyless row is still judged: 0
        wrong = av.adapter(f"keys-{fm}-garbage", register=False, **dict(BASE, fully_masked=fm, sink_in_lse=False))(
            _garbage_on_keyless_rows(_impl(keyless=math.nan if fm == "nan" else 123.0), value))
        bad = av.check(wrong, case, backward=False)
        assert bad.status == "failed" and "out" in [c.name for c in bad.failing()], bad.message()


WRONGS = ((KEYS_UNCLAIMED, "lse"), (SINK_CLAIMING_KEYS, "lse"), (OUT_IGNORES_SINK, "out"))


@pytest.mark.parametrize("prop, recipe, wrongs", [
    ("sinks_match_reference", {}, WRONGS),  # through check; with backward also dsinks (judge_dsinks)
    ("sink_as_extra_key", {}, WRONGS),
    # rows 0..2 keyless: out 0 and the keyless LSE instead of LSE = sink. An output ignoring the sink is 0 there too,
    # and sinks of -inf are no sink either way: that bug is the other properties' to see
    ("sink_limits", {}, WRONGS[:2]),
    # batch 0 (1 cached key, 4 queries, bottom-right): rows 0..2 keyless
    ("sinks_paged", dict(batch=2, len_q=4, len_k=3, cache_lens=[1, 3], page_size=8, num_pages=2), WRONGS),
], ids=["sinks_match_reference", "sink_as_extra_key", "sink_limits", "sinks_paged"])
def test_sink_properties_follow_the_claim(prop, recipe, wrongs):
    p = get_property(prop)
    drawn = {"recipe": CaseRecipe(**dict(RECIPE, **recipe)).to_dict(), **SINKS}
    res = p.run_example(KEYS_CLAIMED, dict(drawn))
    assert res.status == "passed", res.message
    for wrong, part in wrongs:
        res = p.run_example(wrong, dict(drawn))
        assert res.status == "failed" and part in res.message, (wrong.name, res.message)


def test_sink_limits_under_false_still_judges_keyless_rows():
    """LSE = sink is vacuous under False; what holds instead: out 0 and the keyless LSE of the declared convention."""
    p = get_property("sink_limits")
    drawn = {"recipe": CaseRecipe(**RECIPE).to_dict(), **SINKS}
    assert p.run_example(KEYS_PLUS_INF, dict(drawn)).status == "passed"
    res = p.run_example(KEYS_MINUS_INF_CLAIMING_PLUS, dict(drawn))
    assert res.status == "failed" and "lse[no visible key, sink left out]" in res.message, res.message


def test_dsinks_of_a_row_far_below_its_sink_is_judged_against_a_baseline_in_the_same_convention():
    """Found by the wide claim-set fuzz: a row shifted 120 below its sink has dsinks = -sum P_sink D ~ -3e-53 under
    sink_in_lse=False (no dLSE term), which float32 flushes to 0; naive's baseline was taken with its dLSE term (O(1),
    represented), so the bound stayed tight and a correct kernel failed. The baseline now leaves dLSE out as well."""
    drawn = {"recipe": CaseRecipe(len_q=1, len_k=1, head_dim=16, dtype="float32", q_std=0.5, k_std=0.5,
                                  row_shift=-120.0, return_lse=True, seed=0).to_dict(),
             "sinks": {"kind": "normal", "level": 0.5, "seed": 0}}
    res = get_property("sinks_match_reference").run_example(KEYS_CLAIMED, drawn)
    assert res.status == "passed", res.message


def _scale_doubled_keys_lse(q, k, v, spec):
    """FlashMLA's LSE convention (keys only), with the softmax scale doubled (a bug in out and LSE alike)."""
    return _impl("keys")(q, k, v, spec.replace(scale=2 * spec.resolved_scale(q.shape[-1])))


@pytest.mark.parametrize("keyless", ["-inf", "+inf"])
def test_diagnosis_reads_the_lse_in_the_declared_convention(keyless):
    """The diagnosis fits the adapter's LSE against alternatives in the contract's convention: an adapter declaring
    sink_in_lse=False (and keyless_lse) with a doubled scale is diagnosed as that, not left unexplained because its
    keys-only LSE fits no alternative (nor named "sinks ignored", which its LSE alone would fit)."""
    from attnverify.diagnose import diagnose_result

    fn = _scale_doubled_keys_lse
    if keyless == "+inf":
        def fn(q, k, v, spec):
            o = _scale_doubled_keys_lse(q, k, v, spec)
            return av.Output(o.out, lse=torch.where(torch.isneginf(o.lse), torch.full_like(o.lse, math.inf), o.lse))
    a = av.adapter(f"sinklse-scale2-{keyless}", register=False, **dict(BASE, sink_in_lse=False, keyless_lse=keyless))(fn)
    res = av.check(a, _case())
    assert res.status == "failed" and {c.name for c in res.failing()} >= {"out", "lse"}, res.message()
    d = diagnose_result(res, adapter=a)
    assert "scale doubled" in d.summary, (d.summary, [(e.key, e.fits) for e in d.explanations])
    ignores = av.check(OUT_IGNORES_SINK, _case())
    assert "sinks ignored" in diagnose_result(ignores, adapter=OUT_IGNORES_SINK).summary
