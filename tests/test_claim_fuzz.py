"""The suite fuzzes its own claim handling (issue 18): claim sets drawn over every keyword of
@av.adapter, a correct implementation that raises on anything unclaimed, every property with a small
budget: no error, no failure, skips that say why; the same claim sets on wrong implementations still fail
where their property runs. A fast slice here, a wide one marked slow."""
import warnings

import pytest

import attnverify as av
from attnverify.case import CaseRecipe, build_case
from attnverify.properties import PROPERTIES, get_property, run_property
from attnverify.zoo.claimsets import (BUGS, UnclaimedCall, claim_sets, describe, fuzz_claims, run_claim_set,
                                      strict_adapter, wrong_problems)

from _old_claim_handling import OldKvPermutationInvariance, OldNonfiniteInputsPropagate

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CPU_PROPERTIES = [p for p in PROPERTIES if p.name not in ("non_default_stream", "cuda_graph_replay")]


@pytest.mark.parametrize("shard", range(4))
def test_claim_sets_fast_slice_no_error_no_false_failure(shard, tmp_path):
    problems = fuzz_claims(CPU_PROPERTIES, seed=1000 + shard, n=2, max_examples=3, report_dir=str(tmp_path))
    assert not problems, "\n\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(8))
def test_claim_sets_wide_slice_no_error_no_false_failure(shard, tmp_path):
    problems = fuzz_claims(PROPERTIES, seed=2000 + shard, n=3, max_examples=5, wide=True, report_dir=str(tmp_path))
    assert not problems, "\n\n".join(problems)


@pytest.mark.parametrize("bug", ["scale_twice", "inplace_q_prescale", "causal_top_left", "fm_nan"])
def test_the_same_claim_sets_on_a_wrong_implementation_still_fail(bug, tmp_path):
    caught = []
    problems = fuzz_claims([get_property(BUGS[bug])], seed=3000, n=6, max_examples=10, bug=bug,
                           check=wrong_problems(bug, caught), report_dir=str(tmp_path))
    assert not problems, "\n\n".join(problems)
    assert caught, f"no drawn claim set let {BUGS[bug]} run on {bug}: the check proved nothing"


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_wide_claim_sets_on_a_wrong_implementation_still_fail(bug, tmp_path):
    caught = []
    problems = fuzz_claims([get_property(BUGS[bug])], seed=4000, n=15, max_examples=20, bug=bug, wide=True,
                           check=wrong_problems(bug, caught), report_dir=str(tmp_path))
    assert not problems, "\n\n".join(problems)
    assert caught


def test_the_fuzz_finds_the_causal_only_error_of_the_old_properties(tmp_path):
    """Before issue 18 both properties forced causal=('none',): InvalidArgument for causal-only adapters
    (tests/_old_claim_handling.py keeps them verbatim). The fuzz, with the fast slice's settings, finds it."""
    old = [OldKvPermutationInvariance(), OldNonfiniteInputsPropagate()]
    problems = fuzz_claims(old, seed=1000, n=8, max_examples=2, report_dir=str(tmp_path))
    hits = [p for p in problems if "InvalidArgument: causal=('none',)" in p and "claims only causal=" in p]
    assert hits, problems
    assert {"kv_permutation_invariance", "nonfinite_inputs_propagate"} <= {p.split(":")[0] for p in hits}
    assert any('"causal": ["top_left"]' in p or '"causal": ["bottom_right"]' in p for p in hits)
    # the same claim sets pass with the properties of today
    for p in hits[:2]:
        desc = eval(p.split("claim set: ")[1].replace("true", "True").replace("false", "False").replace("null", "None"))
        rows = run_claim_set(desc, [get_property("kv_permutation_invariance"), get_property("nonfinite_inputs_propagate")],
                             max_examples=3, report_dir=str(tmp_path))
        assert all(r["outcome"] in ("passed", "skipped", "xpass") for r in rows), rows


def test_the_strict_wrapper_raises_on_anything_unclaimed():
    desc = {"dtypes": ["bfloat16"], "devices": ["cpu"], "head_dims": [48], "max_seqlen": 32, "causal": ["top_left"],
            "window": False, "softcap": False, "alibi": False, "attn_mask": False, "gqa": False, "varlen": False,
            "dropout": False, "backward": False, "lse": False, "dv_ne_d": False, "deterministic": False,
            "fully_masked": "unsupported", "tiles": None, "memory": "quadratic", "refuses": "odd_length", "known": None}
    a = strict_adapter(desc)
    ok = build_case(CaseRecipe(len_q=8, len_k=8, head_dim=48, dtype="bfloat16", causal="top_left"))
    assert a(ok.q, ok.k, ok.v, ok.spec).out.shape == (1, 1, 8, 48)
    for kw in (dict(dtype="float32"), dict(head_dim=32), dict(causal="none"), dict(len_q=9), dict(len_k=40, len_q=40)):
        c = build_case(CaseRecipe(**{**dict(len_q=8, len_k=8, head_dim=48, dtype="bfloat16", causal="top_left"), **kw}))
        with pytest.raises(UnclaimedCall, match="called outside its claims"):
            a(c.q, c.k, c.v, c.spec)


def test_claim_sets_cover_every_keyword_of_adapter():
    """Every keyword of @av.adapter's claims is drawn, with the values the issue lists."""
    import dataclasses

    from hypothesis import HealthCheck, given, settings

    from attnverify.adapters.base import Claims

    seen = []

    @settings(max_examples=300, database=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(claim_sets(wide=True))
    def collect(desc):
        seen.append(desc)

    collect()
    keys = set().union(*seen)
    assert {f.name for f in dataclasses.fields(Claims)} <= keys | {"head_dims"}
    assert {"refuses", "known"} <= keys
    assert any(d["dtypes"] == ["float16"] for d in seen) and any(d["dtypes"] == ["bfloat16"] for d in seen)
    assert any(isinstance(d["head_dims"], list) and len(d["head_dims"]) == 1 for d in seen)
    assert any(isinstance(d["head_dims"], str) for d in seen)
    assert any(d["max_seqlen"] == 1 for d in seen) and any(d["max_seqlen"] <= 64 for d in seen)
    assert any(d["causal"] == ["bottom_right"] for d in seen) and any(d["causal"] == ["top_left"] for d in seen)
    assert any("none" not in d["causal"] and len(d["causal"]) == 2 for d in seen)
    for f in ("window", "softcap", "alibi", "attn_mask", "gqa", "varlen", "dropout", "backward", "lse", "dv_ne_d",
              "deterministic"):
        assert {d[f] for d in seen} == {True, False}, f
    assert {d["fully_masked"] for d in seen} == {"zeros", "nan", "unsupported"}
    assert {d["keyless_lse"] for d in seen} == {"-inf", "+inf"}
    assert all(d["fully_masked"] == "zeros" and d["lse"] for d in seen if d["keyless_lse"] == "+inf")
    assert {d["sink_in_lse"] for d in seen if d["sinks"] and d["lse"]} == {True, False}
    assert all(d["sink_in_lse"] for d in seen if not (d["sinks"] and d["lse"]))
    assert {d["memory"] for d in seen} == {"quadratic", "linear"}
    assert any(d["tiles"] for d in seen) and any(d["tiles"] is None for d in seen)
    assert {d["refuses"] for d in seen} >= {"odd_length", "head_dim_above_32", "bottom_right_lq_gt_lk", "unaligned_pointer"}
    assert any(d["known"] and d["known"]["match"] for d in seen) and any(d["known"] and not d["known"]["match"] for d in seen)
    # fp8 (issue 23) and cache_leftpad (issue 22) are drawn, each both ways, and only where the claims allow them
    fp8 = [sorted(x for x in d["dtypes"] if x.startswith("float8")) for d in seen]
    assert {tuple(x) for x in fp8} == {(), ("float8_e4m3fn",), ("float8_e5m2",), ("float8_e4m3fn", "float8_e5m2")}
    assert {d["descales"] for d in seen if any(x.startswith("float8") for x in d["dtypes"])} == {True, False}
    assert not any(d["descales"] for d in seen if not any(x.startswith("float8") for x in d["dtypes"]))
    assert {d["cache_leftpad"] for d in seen if d["kv_cache"]} == {True, False}
    assert not any(d["cache_leftpad"] for d in seen if not d["kv_cache"])
    for d in seen[:40]:  # every drawn claim set is one @av.adapter accepts
        strict_adapter(d)
    assert describe(seen[0])


def test_a_property_whose_draws_are_all_refused_skips_with_the_reason(tmp_path):
    """The Unsatisfiable path: an adapter whose `refuses` turns down every case (corpus and generation)."""
    import attnverify as av
    from attnverify.adapters.naive import naive_attention
    from attnverify.properties.driver import PropertySkipped, run_property

    a = av.adapter("refuses-all", register=False, causal=("top_left",),
                   refuses=lambda case: "refuses every shape (fixture)")(naive_attention)
    for name in ("forward_matches_reference", "kv_permutation_invariance", "nonfinite_inputs_propagate"):
        p = get_property(name)
        with pytest.raises(PropertySkipped) as ei:
            run_property(p, a, profile="ci", seed=0, max_examples=3, database=None, report_dir=str(tmp_path))
        assert "refuses every shape (fixture)" in str(ei.value) and "\n" not in str(ei.value), (p.name, str(ei.value))


def test_the_correct_implementation_serves_the_cache_claims(tmp_path):
    """The wide slice draws kv_cache / append claims: the correct implementation under the strict wrapper must be
    naive's whole path (a cache call gathers each batch entry's keys), not its dense attention, which raised
    'The size of tensor a (2) must match the size of tensor b (3)' on the corpus's cache of 3 rows for 2 entries."""
    desc = {"dtypes": ["float32"], "devices": ["cpu"], "head_dims": [8], "max_seqlen": 128,
            "causal": ["none", "bottom_right"], "window": False, "softcap": False, "alibi": False, "attn_mask": False,
            "gqa": False, "varlen": False, "dropout": False, "backward": False, "lse": False, "dv_ne_d": False,
            "deterministic": True, "fully_masked": "zeros", "tiles": None, "memory": "quadratic", "refuses": None,
            "known": None, "kv_cache": True, "append": True}
    rows = run_claim_set(desc, [get_property("kv_cache_append")], max_examples=2, report_dir=str(tmp_path))
    assert [r["outcome"] for r in rows] == ["passed"], rows


def test_a_linear_memory_claim_set_serves_causal_cache_calls(tmp_path):
    """The claim set the wide slice drew (with an fp8 dtype beside bfloat16) before the strict wrapper's row
    chunking (memory="linear") was kept to plain calls: kv_cache_append and batch_invariance raised
    'Spec(cache_seqlens=...): a KV-cache call does not combine with cu_seqlens, attn_mask or dropout' inside
    Spec.replace, where the chunking turned a bottom-right causal cache call into a bool attn_mask. No property
    built that call: the fuzz's own adapter did. Here the adapter is called directly too, against naive's cache
    path (the call a user's kernel with these claims receives)."""
    import torch

    from attnverify.adapters.naive import naive_serving

    desc = {"dtypes": ["bfloat16"], "devices": ["cpu"], "head_dims": [64, 8], "max_seqlen": 27,
            "causal": ["bottom_right"], "window": True, "softcap": True, "alibi": False, "attn_mask": True,
            "gqa": True, "varlen": True, "dropout": False, "backward": True, "lse": True, "dv_ne_d": True,
            "deterministic": True, "fully_masked": "nan", "tiles": [128, 32], "memory": "linear", "refuses": None,
            "known": None, "kv_cache": True, "append": True}
    a = strict_adapter(desc)
    r = CaseRecipe(batch=2, heads_q=2, heads_kv=2, len_q=3, len_k=7, head_dim=8, dtype="bfloat16",
                   causal="bottom_right", return_lse=True, cache_lens=[4, 2], new_len=3, page_size=9, num_pages=3)
    c = build_case(r)
    got = a(c.q, c.k.clone(), c.v.clone(), c.spec)
    exp = naive_serving(c.q, c.k.clone(), c.v.clone(), c.spec)
    assert torch.equal(got.out, exp.out) and torch.equal(got.lse, exp.lse)
    rows = run_claim_set(desc, [get_property("kv_cache_append"), get_property("batch_invariance")], max_examples=3,
                         report_dir=str(tmp_path))
    assert [r["outcome"] for r in rows] == ["passed", "passed"], rows


def test_a_claim_set_with_keyless_lse_plus_inf_passes_and_its_wrong_kernel_fails(tmp_path):
    """keyless_lse='+inf' drawn by the fuzz: the strict wrapper returns +inf on keyless rows, as the claim says, and
    passes the properties that read those rows; the zoo's fm_nan engine (NaN there) still fails fully_masked_rows."""
    desc = {"dtypes": ["float32"], "devices": ["cpu"], "head_dims": [16], "max_seqlen": 16,
            "causal": ["none", "bottom_right"], "window": False, "softcap": False, "alibi": False, "attn_mask": True,
            "gqa": False, "varlen": False, "dropout": False, "backward": True, "lse": True, "dv_ne_d": False,
            "deterministic": False, "fully_masked": "zeros", "keyless_lse": "+inf", "tiles": None,
            "memory": "quadratic", "refuses": None, "known": None}
    a = strict_adapter(desc)
    assert a.claims.keyless_lse == "+inf"
    props = [get_property(n) for n in ("fully_masked_rows", "lse_matches_reference", "row_shift_invariance")]
    rows = run_claim_set(desc, props, max_examples=5, report_dir=str(tmp_path))
    assert [r["outcome"] for r in rows] == ["passed"] * 3, rows
    rows = run_claim_set(desc, props[:1], max_examples=5, bug="fm_nan", report_dir=str(tmp_path))
    assert rows[0]["outcome"] == "failed", rows


def test_a_claim_set_with_sink_in_lse_false_passes_and_its_wrong_kernel_fails(tmp_path):
    """sink_in_lse=False drawn by the fuzz: the strict wrapper returns the LSE over the visible keys (FlashMLA's
    attn_sink), as the claim says, and passes the sink properties that read the LSE (dsinks included: backward); the
    wrapper of the default convention under a claim of False fails."""
    desc = {"dtypes": ["float32"], "devices": ["cpu"], "head_dims": [16], "max_seqlen": 16,
            "causal": ["none", "bottom_right"], "window": False, "softcap": False, "alibi": False, "attn_mask": False,
            "gqa": True, "varlen": False, "dropout": False, "backward": True, "lse": True, "dv_ne_d": False,
            "deterministic": False, "fully_masked": "zeros", "keyless_lse": "-inf", "tiles": None,
            "memory": "quadratic", "refuses": None, "known": None, "sinks": True, "sink_in_lse": False}
    a = strict_adapter(desc)
    assert a.claims.sink_in_lse is False
    props = [get_property(n) for n in ("sinks_match_reference", "sink_as_extra_key", "sink_limits")]
    rows = run_claim_set(desc, props, max_examples=5, report_dir=str(tmp_path))
    assert [r["outcome"] for r in rows] == ["passed"] * 3, rows
    rows = run_claim_set({**desc, "sink_in_lse": True}, props[:1], max_examples=5, report_dir=str(tmp_path))
    assert rows[0]["outcome"] == "passed", rows  # the wrapper follows the claim either way
    # the wrapper of the default (the sink in the LSE) under a claim of False: the LSE (and dQ/dK) fail
    with_sink = strict_adapter({**desc, "sink_in_lse": True})
    wrong = av.adapter("claimfuzz-sink-lse-mismatch", register=False, dtypes=("float32",), devices=("cpu",),
                       head_dims=(16,), max_seqlen=16, causal=("none", "bottom_right"), gqa=True, backward=True,
                       lse=True, fully_masked="zeros", sinks=True, sink_in_lse=False)(
        lambda q, k, v, spec: with_sink(q, k, v, spec))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(AssertionError, match="lse"):
            run_property(props[0], wrong, profile="ci", seed=1, max_examples=10, database=None,
                         report_dir=str(tmp_path))
