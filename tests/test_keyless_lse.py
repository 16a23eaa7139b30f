"""`keyless_lse`: the LSE a row with no visible key returns under fully_masked="zeros" (docs/adapters.md).

FlashMLA returns out 0 and LSE +inf there (tests/ref.py: `lse[lonely_q_mask] = float("+inf")`; the split-KV combine
kernel: `global_lse = (sum_lse == 0.f || ...) ? INFINITY : ...`), the reference -inf. Before the claim a FlashMLA-like
adapter had to rewrite its LSE (or leave such rows unclaimed); now `keyless_lse="+inf"` declares it, and check() and
every property that compares an LSE with the reference's (through verdicts.keyless_lse_expected) hold the adapter to
it: +inf passes under "+inf" and fails under "-inf", -inf fails under "+inf", and the output must still be 0.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import attnverify as av
from attnverify.adapters.naive import naive_serving
from attnverify.case import CaseRecipe, build_case
from attnverify.properties import get_property, run_property
from attnverify.verdicts import keyless_lse_expected

BASE = dict(dtypes=("float32", "float16"), head_dims=(16, 32), causal=("none", "bottom_right"), lse=True,
            attn_mask=True, gqa=True, fully_masked="zeros", kv_cache=True, paged=True)


def _impl(lse_on_keyless: float, out_on_keyless: str = "zeros"):
    def fn(q, k, v, spec):
        res = naive_serving(q, k, v, spec.replace(return_lse=True))
        dead = torch.isneginf(res.lse)
        out = res.out
        if out_on_keyless == "mean_v" and spec.cache_seqlens is None:
            out = torch.where(dead.unsqueeze(-1), v.mean(2, keepdim=True).to(out.dtype).expand_as(out)
                              if v.shape[1] == q.shape[1] else out.new_ones(()), out)
        lse = torch.where(dead, torch.full_like(res.lse, lse_on_keyless), res.lse)
        return av.Output(out, lse=lse if spec.return_lse else None)
    return fn


def _adapter(name, claim, lse_on_keyless, out_on_keyless="zeros", **claims):
    kw = dict(BASE, **claims, **({"keyless_lse": claim} if claim is not None else {}))
    return av.adapter(name, register=False, **kw)(_impl(lse_on_keyless, out_on_keyless))


PLUS_AS_CLAIMED = _adapter("keyless-plus", "+inf", math.inf)
PLUS_UNCLAIMED = _adapter("keyless-plus-unclaimed", None, math.inf)
MINUS_CLAIMING_PLUS = _adapter("keyless-minus-claims-plus", "+inf", -math.inf)
MLA = dict(head_dims=(128, 192), dv_ne_d=True, kv_cache=False, paged=False)  # mla_latent_views: 192/128
MLA_PLUS = _adapter("mla-keyless-plus", "+inf", math.inf, **MLA)
MLA_PLUS_UNCLAIMED = _adapter("mla-keyless-plus-unclaimed", None, math.inf, **MLA)
MLA_MINUS_CLAIMING_PLUS = _adapter("mla-keyless-minus-claims-plus", "+inf", -math.inf, **MLA)
PLUS_MEAN_V = _adapter("keyless-plus-mean-v", "+inf", math.inf, out_on_keyless="mean_v")


def _keyless_case(**kw):
    """Row 2 of each head masked off (a bool mask): out 0, LSE -inf in the reference."""
    r = CaseRecipe(len_q=6, len_k=5, head_dim=16, dtype="float32", mask="bool_rows_off", masked_rows=(2,),
                   return_lse=True, seed=4, **kw)
    case = build_case(r)
    assert bool(torch.isneginf(av.reference.reference_forward(case.q, case.k, case.v, case.spec).lse).any())
    return case


def test_the_claim_validates_and_names_the_fix():
    with pytest.raises(ValueError, match=r"keyless_lse=\.\.\.\): 'inf': use one of \('-inf', '\+inf'\)"):
        av.adapter("x", register=False, **dict(BASE, keyless_lse="inf"))(lambda q, k, v, s: q)
    for bad in (dict(BASE, fully_masked="nan"), dict(BASE, fully_masked="unsupported"), dict(BASE, lse=False)):
        with pytest.raises(ValueError, match=r"keyless_lse=\.\.\.\): .*claim fully_masked='zeros' and lse=True too"):
            av.adapter("x", register=False, **dict(bad, keyless_lse="+inf"))(lambda q, k, v, s: q)
    assert av.adapter("x", register=False, **BASE)(lambda q, k, v, s: q).claims.keyless_lse == "-inf"
    assert "keyless_lse=+inf" in PLUS_AS_CLAIMED.claims.summary()


def test_expected_lse_follows_the_claim_and_leaves_finite_values():
    e = torch.tensor([1.5, -math.inf, math.inf, -1e39], dtype=torch.float64)
    assert torch.equal(keyless_lse_expected(e, "-inf"), e)
    assert torch.equal(keyless_lse_expected(e, "+inf"), torch.tensor([1.5, math.inf, math.inf, -1e39], dtype=torch.float64))


def test_check_holds_keyless_rows_to_the_declared_lse():
    case = _keyless_case()
    ok = av.check(PLUS_AS_CLAIMED, case)
    assert ok.status == "passed", ok.message()
    assert any("keyless_lse='+inf'" in n for n in ok.notes), ok.notes
    unclaimed = av.check(PLUS_UNCLAIMED, case)  # the same numbers under the default "-inf": the LSE fails
    assert unclaimed.status == "failed" and [c.name for c in unclaimed.failing()] == ["lse"], unclaimed.message()
    assert "got inf, expected -inf" in unclaimed.message(), unclaimed.message()
    flipped = av.check(MINUS_CLAIMING_PLUS, case)
    assert flipped.status == "failed" and [c.name for c in flipped.failing()] == ["lse"], flipped.message()
    assert "got -inf, expected inf" in flipped.message(), flipped.message()
    mean_v = av.check(PLUS_MEAN_V, case)  # the LSE as claimed does not excuse an output that is not 0
    assert mean_v.status == "failed" and [c.name for c in mean_v.failing()] == ["out"], mean_v.message()


def _run(prop, adapter, n=12):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_property(get_property(prop), adapter, profile="ci", seed=1, max_examples=n, database=None,
                            report_dir="reports/test")


@pytest.mark.parametrize("prop, right, wrongs", [
    ("fully_masked_rows", PLUS_AS_CLAIMED, (PLUS_UNCLAIMED, MINUS_CLAIMING_PLUS)),
    ("lse_matches_reference", PLUS_AS_CLAIMED, (PLUS_UNCLAIMED, MINUS_CLAIMING_PLUS)),
    ("mla_latent_views", MLA_PLUS, (MLA_PLUS_UNCLAIMED, MLA_MINUS_CLAIMING_PLUS)),
], ids=["fully_masked_rows", "lse_matches_reference", "mla_latent_views"])
def test_properties_that_read_keyless_lse_follow_the_claim(prop, right, wrongs):
    """fully_masked_rows and lse_matches_reference (through check), and mla_latent_views (through compare_pairs, the
    LSE against the reference's), whose cases leave rows keyless (masked rows, bottom-right causal with Lq > Lk).
    A property that compares the adapter with itself (paged_equals_contiguous against its own contiguous call) holds
    either way: the convention is the same on both sides."""
    run = _run(prop, right)
    assert run.statuses.get("passed", 0) >= 3, run.statuses
    for wrong in wrongs:
        with pytest.raises(AssertionError, match="lse"):
            _run(prop, wrong, n=30)


SERVE = dict(kv_cache=True, paged=False, append=True, sinks=True, attn_mask=False)  # extra-key case: the reference's


@pytest.mark.parametrize("prop, recipe, params", [
    # a contiguous cache of 1 and 3 keys plus one appended, 6 query rows bottom-right: 12 rows see no key
    ("kv_cache_append", dict(batch=2, heads_q=2, heads_kv=1, len_q=6, len_k=4, head_dim=16, dtype="float32",
                             causal="bottom_right", return_lse=True, cache_lens=[1, 3], new_len=1, page_size=8,
                             num_pages=2), {}),
    # sinks of -inf on every head: the extra-key call (the reference's: attn_mask is not claimed) has keyless rows
    ("sink_as_extra_key", dict(batch=1, heads_q=2, heads_kv=1, len_q=6, len_k=3, head_dim=16, dtype="float32",
                               causal="bottom_right", return_lse=True),
     {"sinks": {"kind": "neg_inf", "level": 1.0, "seed": 0}}),
], ids=["kv_cache_append", "sink_as_extra_key"])
def test_reference_lse_in_serving_and_sink_pairs_follows_the_claim(prop, recipe, params):
    """Where a property puts the reference's LSE beside the adapter's (serving.py, sinks.py), keyless rows are read in
    the adapter's claim; an adapter against itself is not touched (row_shift_invariance below)."""
    p = get_property(prop)
    drawn = {"recipe": CaseRecipe(**recipe).to_dict(), **params}
    right = _adapter(f"{prop}-plus", "+inf", math.inf, **SERVE)
    assert p.run_example(right, dict(drawn)).status == "passed"
    for wrong in (_adapter(f"{prop}-plus-unclaimed", None, math.inf, **SERVE),
                  _adapter(f"{prop}-minus-claims-plus", "+inf", -math.inf, **SERVE)):
        res = p.run_example(wrong, dict(drawn))
        assert res.status == "failed" and "lse" in res.message and "out: MISMATCH" not in res.message, res.message


def test_a_pair_of_the_adapter_against_itself_is_left_alone():
    """One convention on both sides: a metamorphic property does not judge the claim (lse_matches_reference and
    fully_masked_rows do), so a broken claim is one failure, not one per property."""
    r = CaseRecipe(len_q=6, len_k=5, head_dim=16, dtype="float32", mask="bool_rows_off", masked_rows=(2,),
                   return_lse=True, seed=4)
    res = get_property("row_shift_invariance").run_example(MINUS_CLAIMING_PLUS, {"recipe": r.to_dict(), "shift": 3.0})
    assert res.status == "passed", res.message
