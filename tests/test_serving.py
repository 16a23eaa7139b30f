"""Serving-time attention (issue 22): KV caches (paged, contiguous, append), split-KV, the properties
paged_equals_contiguous, kv_cache_append, split_invariance, lse_merge, batch_invariance, and the zoo's
serving members -- each caught by the ci profile within 60 s on a CPU."""
from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

import attnverify as av
from attnverify.adapters.registry import get, resolve
from attnverify.case import CaseRecipe, build_case, load_case
from attnverify.properties import get_property
from attnverify.properties.driver import PropertySkipped, run_property
from attnverify.properties.serving import cache_problems
from attnverify.reference import reference_forward
from attnverify.reference.paged import cache_after
from attnverify.zoo import get_member
from attnverify.zoo._serving import SERVING_BUGS, serving_attend
from attnverify.zoo._serving_members import SERVING
from attnverify.zoo.selftest import run_member

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
NEW = ("paged_equals_contiguous", "kv_cache_append", "split_invariance", "lse_merge", "batch_invariance",
       "kv_cache_leftpad")
SERVING_MEMBERS = ("paged-page-off-by-one", "paged-partial-page-full", "paged-unused-page-read",
                   "paged-seqlens-minus-one", "append-wrong-slot", "append-not-written", "split-partials-bf16",
                   "split-merge-base2", "split-combine-stride", "leftpad-ignored", "leftpad-append-offset")


def _paged(**kw):
    d = dict(batch=2, heads_q=4, heads_kv=2, len_q=3, len_k=13, head_dim=16, cache_lens=[10, 4], paged=True,
             page_size=3, num_pages=12, block_table=[[5, 2, 9, 0, 7], [1, 11, 3, 4, 6]], new_len=3, garbage="nan",
             causal="bottom_right", return_lse=True)
    d.update(kw)
    return CaseRecipe(**d)


def _run(prop, adapter, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_property(get_property(prop), adapter, profile="ci", seed=0, database=None,
                            report_dir="reports/test", **kw)


# ------------------------------------------------------------------------------ bad input, by name


@pytest.mark.parametrize("kw, match", [
    (dict(block_table=torch.zeros(1, 1, dtype=torch.int32), page_size=4), "block_table.*cache_seqlens"),
    (dict(block_table=torch.zeros(1, 1, dtype=torch.int32), cache_seqlens=torch.ones(1, dtype=torch.int32)), "page_size"),
    (dict(cache_seqlens=torch.ones(1), k_new=torch.zeros(1, 1, 1, 4)), "k_new and v_new together"),
    (dict(k_new=torch.zeros(1, 1, 1, 4), v_new=torch.zeros(1, 1, 1, 4)), "k_new.*cache_seqlens"),
    (dict(num_splits=0), "num_splits"),
    (dict(cache_seqlens=torch.ones(1), block_table=torch.zeros(1, 1), page_size=2, cache_batch_idx=torch.zeros(1)),
     "cache_batch_idx"),
    (dict(cache_seqlens=torch.ones(1), attn_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool)), "attn_mask"),
])
def test_spec_rejects_bad_cache_fields_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        av.Spec(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(page_sizes=(16,)), "page_sizes.*paged=True"),
    (dict(paged=True, page_sizes=(0,)), "page_sizes"),
    (dict(append=True), "append.*kv_cache=True"),
    (dict(num_splits=(1, 0)), "num_splits"),
    (dict(num_splits="auto"), "num_splits"),
    (dict(paged="yes"), "paged"),
])
def test_adapter_rejects_bad_serving_claims_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        av.adapter("x", register=False, **kw)(lambda q, k, v, s: q)


def test_recipe_rejects_a_table_too_short():
    with pytest.raises(ValueError, match="block_table"):
        build_case(_paged(block_table=[[5, 2], [1, 11, 3, 4, 6]]))
    with pytest.raises(ValueError, match="batch 0 slot 6 needs table entry 2"):
        build_case(_paged(block_table=[[5, 2], [1, 11]]))


# ------------------------------------------------------------------------------ the reference's reading


def test_reference_gathers_pages_as_the_rules_say():
    """Page size 2, batch 0 on pages [3, 0] with 3 keys, batch 1 on page [2] with 1 key + 1 appended."""
    torch.manual_seed(0)
    k, v = torch.full((4, 2, 1, 4), math.nan, dtype=torch.float64), torch.full((4, 2, 1, 4), math.nan, dtype=torch.float64)
    keys = torch.randn(3, 4, dtype=torch.float64)
    vals = torch.randn(3, 4, dtype=torch.float64)
    k[3, 0, 0], k[3, 1, 0], k[0, 0, 0] = keys
    v[3, 0, 0], v[3, 1, 0], v[0, 0, 0] = vals
    k[2, 0, 0], v[2, 0, 0] = keys[0] * 2, vals[0] * 2
    k_new, v_new = torch.randn(2, 1, 1, 4, dtype=torch.float64), torch.randn(2, 1, 1, 4, dtype=torch.float64)
    spec = av.Spec(block_table=torch.tensor([[3, 0], [2, 1]], dtype=torch.int32), page_size=2,
                   cache_seqlens=torch.tensor([3, 1], dtype=torch.int32), k_new=k_new, v_new=v_new, return_lse=True)
    q = torch.randn(2, 1, 1, 4, dtype=torch.float64)
    r = reference_forward(q, k, v, spec)
    for b, (kb, vb) in enumerate([(torch.cat([keys, k_new[0, 0]]), torch.cat([vals, v_new[0, 0]])),
                                  (torch.stack([keys[0] * 2, k_new[1, 0, 0]]), torch.stack([vals[0] * 2, v_new[1, 0, 0]]))]):
        s = q[b, 0] @ kb.T / 2.0
        assert torch.allclose(r.out[b, 0], torch.softmax(s, -1) @ vb)
        assert torch.allclose(r.lse[b, 0], torch.logsumexp(s, -1))
    k2, _ = cache_after(k, v, spec)
    assert torch.equal(k2[0, 1, 0], k_new[0, 0, 0]) and torch.equal(k2[2, 1, 0], k_new[1, 0, 0])
    assert torch.isnan(k2[1]).all() and torch.isnan(k).sum() - torch.isnan(k2).sum() == 8  # two slots written


def test_cache_recipe_json_round_trip(tmp_path):
    r = _paged(dtype="float16", cache_batch_idx=None, num_splits=3)
    case = build_case(r)
    path = case.save(str(tmp_path / "c.json"))
    back = load_case(path)
    assert back.recipe == r and back.describe() == case.describe()
    for a, b in ((case.q, back.q), (case.k, back.k), (case.v, back.v), (case.spec.k_new, back.spec.k_new),
                 (case.spec.block_table, back.spec.block_table)):
        assert torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))
    assert back.spec.num_splits == 3 and back.spec.page_size == 3
    assert "block_table=[[5, 2, 9, 0, 7]" in case.describe() and "garbage=nan" in case.describe()


@pytest.mark.parametrize("recipe", [
    _paged(), _paged(dtype="float16", page_size=1, num_pages=40, block_table=[list(range(39, 26, -1)), list(range(13))]),
    CaseRecipe(batch=3, heads_q=2, heads_kv=1, len_q=2, len_k=20, head_dim=8, cache_lens=[18, 3, 0], new_len=2,
               page_size=21, num_pages=4, cache_batch_idx=[2, 0, 3], garbage="mixed", causal="bottom_right"),
], ids=["paged", "page1-f16", "contiguous-batch-idx"])
def test_naive_and_the_serving_engine_match_the_reference(recipe):
    case = build_case(recipe)
    ref = reference_forward(case.q, case.k, case.v, case.spec)
    k_exp, v_exp = cache_after(case.k, case.v, case.spec)
    for impl in (get("naive"), lambda q, k, v, s: serving_attend(q, k, v, s)):
        c = build_case(recipe)
        out = impl(c.q, c.k, c.v, c.spec)
        assert torch.allclose(out.out.double(), ref.out, atol=3e-3, rtol=3e-3)
        assert not cache_problems(c, k_exp, v_exp)


def test_naive_split_kv_matches_the_reference():
    q, k, v = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 50, 16), torch.randn(2, 2, 50, 16)
    for ns in (1, 2, 3, 8, 64):  # 64 > Lk: empty splits
        s = av.Spec(num_splits=ns, return_lse=True, causal="bottom_right")
        o, r = get("naive")(q, k, v, s), reference_forward(q, k, v, s)
        assert torch.allclose(o.out.double(), r.out, atol=1e-5) and torch.allclose(o.lse.double(), r.lse, atol=1e-5)


@pytest.mark.parametrize("bug", SERVING_BUGS)
def test_each_serving_bug_is_live(bug):
    r = _paged(len_q=1, new_len=1, len_k=11, heads_q=4, heads_kv=2, num_splits=3)  # float32: bf16 partials show
    if bug.startswith("leftpad"):
        r = _paged(len_q=1, new_len=1, len_k=8, heads_q=4, heads_kv=2, cache_leftpad=[3, 0])
    case = build_case(r)
    ref = reference_forward(case.q, case.k, case.v, case.spec)
    k_exp, v_exp = cache_after(case.k, case.v, case.spec)
    c = build_case(r)
    out = serving_attend(c.q, c.k, c.v, c.spec, bug).out.double()
    wrong_out = not torch.allclose(torch.nan_to_num(out, nan=1e9), ref.out, atol=1e-4, rtol=1e-4)
    assert wrong_out or cache_problems(c, k_exp, v_exp), bug


# ------------------------------------------------------------------------------ each check rejects a wrong answer


def test_cache_problems_name_missing_and_touched_slots():
    r = _paged()
    case = build_case(r)
    k_exp, v_exp = cache_after(case.k, case.v, case.spec)
    assert any("appended slot(s) do not hold" in p for p in cache_problems(case, k_exp, v_exp))  # nothing written
    c = build_case(r)
    get("naive")(c.q, c.k, c.v, c.spec)
    assert not cache_problems(c, k_exp, v_exp)
    c.k[8, 0] = 0.0  # a slot of no sequence
    assert any("outside the appended ones changed" in p for p in cache_problems(c, k_exp, v_exp))


def _naive_like(name, fn, **claims):
    base = dict(dtypes=("float16", "float32"), head_dims=lambda d: d <= 256, causal=("none", "bottom_right"),
                gqa=True, lse=True)
    base.update(claims)
    return av.adapter(name, register=False, **base)(fn)


def test_lse_merge_rejects_a_base2_lse_and_a_missing_scale():
    def base2(q, k, v, spec):
        o = get("naive")(q, k, v, spec)
        return av.Output(o.out, lse=o.lse / math.log(2))

    def unscaled(q, k, v, spec):  # LSE of the raw q.k (the scale forgotten in the statistic only)
        o = get("naive")(q, k, v, spec)
        return av.Output(o.out, lse=torch.logsumexp((q.float() @ k.float().transpose(-1, -2)), -1))

    for fn in (base2, unscaled):
        with pytest.raises(AssertionError, match="lse_merge failed"):
            _run("lse_merge", _naive_like(f"mine-{fn.__name__}", fn))
    _run("lse_merge", _naive_like("mine-ok", lambda q, k, v, s: get("naive")(q, k, v, s)))


def test_lse_merge_keeps_its_key_subsets_within_the_adapters_refuses():
    """The wide claim-set fuzz: lse_merge called an adapter on key subsets its `refuses` rejects. A user's kernel
    that takes only Lk >= 8 (and fails loudly on anything shorter) is never called on a shorter subset: those
    examples skip, saying why, and the others pass."""
    shorter = []

    def only_long(q, k, v, spec):
        if k.shape[2] < 8:
            shorter.append(k.shape[2])
            raise AssertionError(f"called with Lk={k.shape[2]} < 8")
        return get("naive")(q, k, v, spec)

    a = _naive_like("mine-long-keys", only_long,
                    refuses=lambda case: "needs Lk >= 8" if case.k.shape[2] < 8 else None)
    run = _run("lse_merge", a, max_examples=15)
    assert not shorter, shorter
    assert run.statuses.get("passed", 0) >= 1 and run.statuses.get("error", 0) == 0, run.statuses


def test_batch_invariance_rejects_batch_dependent_results():
    def first_len(q, k, v, spec):  # every request uses the first request's length
        s = spec.replace(cache_seqlens=spec.cache_seqlens[:1].expand(spec.cache_seqlens.shape[0]).contiguous())
        return get("naive")(q, k, v, s)

    def splits_by_batch(q, k, v, spec):  # the split heuristic depends on the batch size (deterministic otherwise)
        return get("naive")(q, k, v, spec.replace(num_splits=min(8, q.shape[0] * 2 - 1)))

    with pytest.raises(AssertionError, match="batch_invariance failed"):
        _run("batch_invariance", _naive_like("mine-first-len", first_len, paged=True))
    with pytest.raises(AssertionError, match="not bitwise identical"):
        _run("batch_invariance", _naive_like("mine-split-b", splits_by_batch, paged=True, deterministic=True,
                                             dtypes=("float32",)))


def test_paged_equals_contiguous_names_garbage_reaching_the_output():
    def whole_pages(q, k, v, spec):  # reads every slot of every page it touches
        s = spec.cache_seqlens
        if s is None:  # the contiguous call
            return get("naive")(q, k, v, spec)
        full = ((s + spec.page_size - 1) // spec.page_size) * spec.page_size
        return get("naive")(q, k, v, spec.replace(cache_seqlens=full.to(s.dtype)))

    with pytest.raises(AssertionError, match="garbage reached the output|MISMATCH"):
        _run("paged_equals_contiguous", _naive_like("mine-whole-pages", whole_pages, paged=True))


def test_unclaimed_serving_properties_skip_naming_the_claim():
    plain = av.adapter("mine-plain", register=False)(lambda q, k, v, s: get("naive")(q, k, v, s))
    want = {"paged_equals_contiguous": "does not claim paged", "kv_cache_append": "does not claim append",
            "split_invariance": "does not claim num_splits", "lse_merge": "does not claim lse",
            "batch_invariance": "does not claim paged or kv_cache"}
    for prop, why in want.items():
        reason = get_property(prop).skip_reason(plain)
        assert reason.startswith("mine-plain " + why) and "\n" not in reason
        with pytest.raises(PropertySkipped, match=why):
            _run(prop, plain)
    one = av.adapter("mine-one-split", register=False, num_splits=(1,))(lambda q, k, v, s: q)
    assert "single num_splits value" in get_property("split_invariance").skip_reason(one)


def test_page_size_claims_steer_the_draws():
    from attnverify.strategies._paged import page_size_choices

    big = av.adapter("mine-512", register=False, paged=True, page_sizes=(512,))(lambda q, k, v, s: q)
    assert page_size_choices(big.claims) == [512]
    assert get_property("paged_equals_contiguous").skip_reason(big) is None
    huge = av.adapter("mine-4096", register=False, paged=True, page_sizes=(4096,))(lambda q, k, v, s: q)
    for prop in ("paged_equals_contiguous", "batch_invariance"):
        assert "claims no page size" in get_property(prop).skip_reason(huge)
    odd = av.adapter("mine-odd", register=False, paged=True, page_sizes=lambda p: p % 2 == 1)(lambda q, k, v, s: q)
    assert page_size_choices(odd.claims) == [1, 3, 5, 7, 13]


# ------------------------------------------------------------------------------ correct adapters hold (ci profile)

# the float64 reference as a file adapter, loaded by its path as a user's would be (`--adapter FILE.py:ATTR`)
REFERENCE64 = resolve([os.path.join(os.path.dirname(__file__), "..", "benchmarks", "reference64.py:REFERENCE64")])[0]


@pytest.mark.parametrize("prop", NEW)
@pytest.mark.parametrize("who", ["naive", "reference64"])
def test_correct_adapters_hold_quick(who, prop):
    a = get("naive") if who == "naive" else REFERENCE64
    run = _run(prop, a, max_examples=8)
    assert run.examples >= 5 and run.statuses.get("passed", 0) >= 5


@pytest.mark.slow
@pytest.mark.parametrize("prop", NEW)
@pytest.mark.parametrize("who", ["naive", "reference64"])
def test_correct_adapters_hold_the_ci_profile(who, prop):
    a = get("naive") if who == "naive" else REFERENCE64
    run = _run(prop, a)
    assert run.examples >= 5 and run.statuses.get("passed", 0) >= 5


def test_serving_engine_without_bug_holds():
    ok = av.adapter("zoo-serving-ok", register=False, **SERVING)(lambda q, k, v, s: serving_attend(q, k, v, s))
    for prop in NEW:
        _run(prop, ok, max_examples=10)


# ------------------------------------------------------------------------------ the zoo's serving members


@pytest.mark.parametrize("name", SERVING_MEMBERS)
def test_serving_member_caught_by_the_ci_profile_within_60s(name):
    m = get_member(name)
    res = run_member(m, profile="ci", seed=0, diagnose=False)
    assert res.status == "caught" and res.caught_by in m.expected, (res.status, res.caught_by, res.reason)
    assert res.first_seconds < 60, f"{name}: first failure after {res.first_seconds:.1f} s"


@pytest.mark.slow
@pytest.mark.parametrize("name", SERVING_MEMBERS)
def test_serving_member_caught_without_corpus(name, tmp_path):
    m = get_member(name)
    with pytest.raises(AssertionError, match="attnverify repro"):
        run_property(get_property(m.expected[0]), m.adapter, profile="ci", seed=0, database=None, use_corpus=False,
                     report_dir=str(tmp_path))


def test_plugin_runs_the_serving_properties_for_a_conftest_paged_adapter(pytester):
    """A user's paged decode adapter (gathers its pages, attends with SDPA), claiming paged with page sizes 16
    and 3 only, no append and no num_splits: paged_equals_contiguous and batch_invariance run and pass, the
    others skip naming the claim."""
    pytester.makeconftest('''
import torch, attnverify as av

@av.adapter("mine-paged", dtypes=("float32",), head_dims=(16, 32, 64), causal=("none", "bottom_right"), gqa=True,
            paged=True, page_sizes=(3, 16))
def mine(q, k, v, spec):
    if spec.block_table is None:
        causal = spec.causal == "bottom_right" and q.shape[2] == k.shape[2]
        if spec.causal == "bottom_right" and not causal:
            L, M = q.shape[2], k.shape[2]
            mask = torch.ones(L, M, dtype=torch.bool).tril(M - L)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale, enable_gqa=True)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=spec.scale, enable_gqa=True)
    outs = []
    for b, n in enumerate(spec.cache_seqlens.tolist()):
        pages = spec.block_table[b, : -(-n // spec.page_size)].long()
        kb = k[pages].flatten(0, 1)[:n].transpose(0, 1)[None]
        vb = v[pages].flatten(0, 1)[:n].transpose(0, 1)[None]
        outs.append(mine.fn(q[b:b + 1], kb, vb, spec.replace(block_table=None, page_size=None, cache_seqlens=None)))
    return torch.cat(outs)
''')
    res = pytester.runpytest("--adapter=mine-paged", "-v", "-rs", "-k", " or ".join(NEW), "--attn-profile=ci",
                             "--attn-max-examples=6", "-p", "no:randomly")
    out = res.stdout.str()
    assert res.ret == 0, out
    res.stdout.fnmatch_lines(["*test_paged_equals_contiguous?mine-paged? PASSED*",
                              "*test_batch_invariance?mine-paged? PASSED*",
                              "*mine-paged does not claim append*", "*mine-paged does not claim num_splits*"])
    assert os.path.isdir(pytester.path / "reports")


# ------------------------------------------------------------------------------ the cookbook's paged decode recipe


def _recipe_here(monkeypatch):
    import dataclasses
    import importlib
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "docs" / "cookbook"))
    a = importlib.import_module("paged_decode").paged_decode
    if "cuda" in a.claims.devices and torch.cuda.is_available():
        return a
    # on a CPU: the stand-in, with the claims widened to the CPU and float32 (page sizes stay as written)
    return dataclasses.replace(a, name=a.name + "-on-cpu", claims=dataclasses.replace(
        a.claims, devices=("cpu",), dtypes=("float32",) + a.claims.dtypes))


def test_paged_decode_recipe_holds_the_serving_properties(monkeypatch):
    a = _recipe_here(monkeypatch)
    for prop in NEW:
        _run(prop, a, max_examples=4)
    case = build_case(_paged(page_size=256, num_pages=5, block_table=[[3], [1]], dtype="float32"))
    res = a(case.q, case.k, case.v, case.spec)  # the append lands in the caches it was given
    assert torch.isfinite(res.out).all() and torch.equal(case.k[3, 10:13], case.spec.k_new[0].transpose(0, 1))


def test_paged_decode_recipe_copying_its_caches_fails(monkeypatch):
    good = _recipe_here(monkeypatch)

    def copies(q, k, v, spec):  # "contiguous()" on the caches: the append lands in a copy
        return good.fn(q, k.clone(), v.clone(), spec)

    with pytest.raises(AssertionError, match="appended slot"):
        _run("kv_cache_append", av.Adapter("paged-decode-copies", copies, good.claims, refuses=good.refuses))
