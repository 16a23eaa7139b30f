"""flash-attn's KV-cache built-ins (`flash-attn-kvcache`: FA2's flash_attn_with_kvcache; `flash-attn3-kvcache`:
FA3's): the translation of a Spec into the library's arguments, the refusals, and the adapters' wiring end to end
-- attnverify's serving, fp8 and chunk properties run through each adapter with a plain-torch stand-in of the
library injected as the module (tests/_fake_flash_kvcache.py, written from the libraries' docstrings and argument
checks, independent of attnverify's naive and reference). Each wrong translation below (k_new not transposed,
leftpad dropped, one key short, the block table ignored, descales or the chunk dropped) is caught by a property.
Neither library is installed here or on the H200: the GPU tests skip, saying so."""
from __future__ import annotations

import dataclasses
import math
import sys
import warnings

import pytest
import torch

from _fake_flash_kvcache import fake_fa2, fake_fa3
from attnverify.adapters import flash_attn3_kvcache as fa3mod
from attnverify.adapters import flash_attn_kvcache as fa2mod
from attnverify.adapters.base import Adapter
from attnverify.adapters.registry import get
from attnverify.case import CaseRecipe, build_case
from attnverify.properties import get_property
from attnverify.properties.driver import run_property

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
SERVING = ("paged_equals_contiguous", "kv_cache_append", "split_invariance", "lse_merge", "batch_invariance",
           "kv_cache_leftpad")
FA3_ONLY = ("fp8_matches_reference", "descale_linearity", "chunked_matches_reference", "forward_matches_reference")
F8 = torch.float8_e4m3fn


@pytest.fixture
def fa2(monkeypatch):
    m = fake_fa2()
    monkeypatch.setitem(sys.modules, "flash_attn", m)
    return m


@pytest.fixture
def fa3(monkeypatch):
    m = fake_fa3()
    monkeypatch.setitem(sys.modules, "flash_attn_interface", m)
    return m


def _on_cpu(name):
    """The built-in's own function, claims and refusals, on the CPU with float32 added (the stand-ins' dtype)."""
    a = get(name)
    return Adapter(name=a.name + "-cpu", fn=a.fn, refuses=a.refuses, claims=dataclasses.replace(
        a.claims, devices=("cpu",), dtypes=tuple(dict.fromkeys(("float32",) + a.claims.dtypes))))


def _run(prop, adapter, n=3):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_property(get_property(prop), adapter, profile="ci", seed=0, database=None,
                            report_dir="reports/test", max_examples=n)


def _paged(**kw):
    d = dict(batch=2, heads_q=4, heads_kv=2, len_q=3, len_k=303, head_dim=16, cache_lens=[300, 40], paged=True,
             page_size=256, num_pages=5, block_table=[[3, 1], [4, 0]], new_len=3, garbage="nan",
             causal="bottom_right", return_lse=True)
    d.update(kw)
    return CaseRecipe(**d)


def _contiguous(**kw):
    d = dict(batch=3, heads_q=2, heads_kv=1, len_q=2, len_k=20, head_dim=8, cache_lens=[18, 3, 0], new_len=2,
             page_size=21, num_pages=4, cache_batch_idx=[2, 0, 3], cache_leftpad=[0, 1, 0], garbage="mixed",
             causal="bottom_right", return_lse=True)
    d.update(kw)
    return CaseRecipe(**d)


# ------------------------------------------------------------------------------ the translation, alone


def test_fa2_paged_append_call_passes_the_caches_and_int32_metadata(fa2):
    case = build_case(_paged(num_splits=5))
    s = case.spec
    q, kc, vc, kw = fa2mod.kvcache_args(case.q, case.k, case.v, s)
    assert kc is case.k and vc is case.v  # the caches themselves: the append must land in them
    assert q.shape == (2, 3, 4, 16) and torch.equal(q, case.q.transpose(1, 2)) and q.stride(-1) == 1
    bt = kw["block_table"]
    assert bt.dtype == torch.int32 and bt.shape == (2, 2) and bt.is_contiguous() and bt.tolist() == [[3, 1], [4, 0]]
    assert kw["cache_seqlens"].dtype == torch.int32 and kw["cache_seqlens"].tolist() == [300, 40]
    assert kw["k"].shape == (2, 3, 2, 16) and torch.equal(kw["k"], s.k_new.transpose(1, 2))  # (B, Lnew, Hkv, D)
    assert torch.equal(kw["v"], s.v_new.transpose(1, 2)) and kw["k"].stride(-1) == 1
    assert kw["num_splits"] == 5 and kw["causal"] is True and kw["cache_leftpad"] is None and "page_table" not in kw
    assert kw["softmax_scale"] == pytest.approx(0.25) and kw["return_softmax_lse"] is True
    assert fa2mod.kvcache_args(case.q, case.k, case.v, s.replace(num_splits=None))[3]["num_splits"] == 0  # heuristic


def test_fa2_contiguous_call_passes_batch_idx_and_leftpad_as_int32(fa2):
    case = build_case(_contiguous())
    s = case.spec.replace(cache_batch_idx=case.spec.cache_batch_idx.long())  # any int dtype in: int32 out
    _, kc, _, kw = fa2mod.kvcache_args(case.q, case.k, case.v, s)
    assert kc is case.k and kw["block_table"] is None
    for name, want in (("cache_batch_idx", [2, 0, 3]), ("cache_leftpad", [0, 1, 0]), ("cache_seqlens", [18, 3, 0])):
        assert kw[name].dtype == torch.int32 and kw[name].is_contiguous() and kw[name].tolist() == want, name


def test_plain_call_builds_a_cache_with_a_garbage_tail(fa2):
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    from attnverify.spec import Spec

    _, kc, vc, kw = fa2mod.kvcache_args(q, k, v, Spec(num_splits=3))
    assert kc.shape == (2, 7 + fa2mod.KV_PAD, 2, 16) and torch.equal(kc[:, :7], k.transpose(1, 2))
    assert (kc[:, 7:] == fa2mod.KV_GARBAGE).all() and (vc[:, 7:] == fa2mod.KV_GARBAGE).all()
    assert kw["cache_seqlens"].dtype == torch.int32 and kw["cache_seqlens"].tolist() == [7, 7] and kw["num_splits"] == 3


def test_the_adapters_hand_the_library_what_the_translation_says(fa2, fa3):
    case = build_case(_paged(num_splits=7))
    fa2mod.flash_attn2_kvcache.fn(case.q, case.k, case.v, case.spec)
    call = fa2.calls[-1]
    assert call["k_cache"] is case.k and call["num_splits"] == 7 and call["block_table"].dtype == torch.int32
    case = build_case(_paged(page_size=3, num_pages=300, block_table=[list(range(101)), list(range(101, 202))],
                             num_splits=256))
    fa3mod.flash_attn3_kvcache.fn(case.q, case.k, case.v, case.spec)
    call = fa3.calls[-1]
    assert call["page_table"].dtype == torch.int32 and call["page_table"].shape == (2, 101) and call["num_splits"] == 256
    assert call["k_cache"] is case.k and call["attention_chunk"] == 0 and call["k"].shape == (2, 3, 2, 16)


def test_fa3_passes_descales_as_float32_b_hkv_and_the_chunk():
    case = build_case(CaseRecipe(batch=2, heads_q=4, heads_kv=2, len_q=5, len_k=9, head_dim=16, dtype="float8_e4m3fn",
                                 descales="pow2", causal="bottom_right", seed=3))
    s = case.spec.replace(attention_chunk=4, q_descale=case.spec.q_descale.double())
    q, kc, vc, kw = fa3mod.fa3_kvcache_args(case.q, case.k, case.v, s)
    assert q.dtype == F8 and kc.dtype == F8 and kc.stride(-1) == 1 and vc.stride(-1) == 1  # V column-major: rows now
    for n in ("q_descale", "k_descale", "v_descale"):
        assert kw[n].dtype == torch.float32 and kw[n].shape == (2, 2), n
        assert torch.equal(kw[n], getattr(s, n).float()), n
    assert kw["attention_chunk"] == 4 and "block_table" not in kw


# ------------------------------------------------------------------------------ refusals (the libraries' words)


def test_fa2_refuses_what_flash_api_cpp_rejects():
    a = get("flash-attn-kvcache")
    assert a.claims.page_size_ok(256) and a.claims.page_size_ok(512) and not a.claims.page_size_ok(16)
    case = build_case(_paged(page_size=16, num_pages=40, block_table=[list(range(19)), list(range(19, 38))]))
    with pytest.raises(NotImplementedError, match="multiple of 256"):
        a.fn(case.q, case.k, case.v, case.spec)
    lp = build_case(_paged(cache_leftpad=[5, 0], len_k=298))
    assert "leftpad_k" in fa2mod.fa2_refusal(lp.q, lp.k, lp.spec)
    assert a.refuses(lp) and "num_splits > 128" in fa2mod.fa2_refusal(lp.q, lp.k, lp.spec.replace(num_splits=129))
    ok = build_case(_contiguous())
    assert fa2mod.fa2_refusal(ok.q, ok.k, ok.spec) is None  # leftpad on a contiguous cache is accepted


def test_fa3_accepts_any_page_size_and_leftpad_with_a_table_and_refuses_its_own_limits():
    a = get("flash-attn3-kvcache")
    assert all(a.claims.page_size_ok(p) for p in (1, 3, 7, 16, 256))
    lp = build_case(_paged(cache_leftpad=[5, 0], len_k=298, page_size=3, num_pages=300,
                           block_table=[list(range(101)), list(range(101, 202))]))
    assert fa3mod.fa3_refusal(lp.q, lp.k, lp.v, lp.spec) is None
    q, k = torch.zeros(1, 2, 3, 64), torch.zeros(1, 2, 3, 64)
    from attnverify.spec import Spec

    assert fa3mod.fa3_refusal(q, k, torch.zeros(1, 2, 3, 512), Spec()) is None  # Q/K <= 64 and V <= 512
    assert "(96, 128]" in fa3mod.fa3_refusal(torch.zeros(1, 2, 3, 128), k, torch.zeros(1, 2, 3, 64), Spec())
    assert "multiple of 16" in fa3mod.fa3_refusal(q[..., :8].to(F8), k[..., :8].to(F8), k[..., :8].to(F8), Spec())
    assert "256 not supported" in fa3mod.fa3_refusal(q, k, k, Spec(num_splits=257))


def test_the_stand_ins_reject_a_wrong_call_with_the_library_words(fa2, fa3):
    """The stand-ins' checks are what make a wrong translation fail loudly: they must fire."""
    case = build_case(_paged())
    q, kc, vc, kw = fa2mod.kvcache_args(case.q, case.k, case.v, case.spec)
    for change, match in ((dict(block_table=kw["block_table"].long()), "int32"),
                          (dict(cache_seqlens=kw["cache_seqlens"].long()), "int32"),
                          (dict(k=case.spec.k_new, v=case.spec.v_new), "seqlen_new"),
                          (dict(num_splits=129), "128")):
        with pytest.raises(RuntimeError, match=match):
            fa2.flash_attn_with_kvcache(q, kc, vc, **{**kw, **change})
    with pytest.raises(RuntimeError, match="divisible by 256"):
        fa2.flash_attn_with_kvcache(q, kc[:, :16], vc[:, :16], **kw)
    c8 = build_case(CaseRecipe(batch=2, heads_q=4, heads_kv=2, len_q=5, len_k=9, head_dim=16, dtype="float8_e4m3fn",
                               descales="pow2", seed=3))
    q8, k8, v8, kw8 = fa3mod.fa3_kvcache_args(c8.q, c8.k, c8.v, c8.spec)
    with pytest.raises(RuntimeError, match="b, h_k"):  # per query head instead of per kv head
        fa3.flash_attn_with_kvcache(q8, k8, v8, **{**kw8, "q_descale": torch.ones(2, 4)})


# ------------------------------------------------------------------------------ end to end through the stand-ins


@pytest.mark.parametrize("prop", SERVING)
def test_fa2_kvcache_holds_the_serving_properties_through_the_stand_in(fa2, prop):
    res = _run(prop, _on_cpu("flash-attn-kvcache"))
    assert res.statuses.get("passed", 0) >= 1 and set(res.statuses) <= {"passed", "skipped"}, res
    assert any(c["k_cache"].shape[1] % 256 == 0 and c["block_table"] is not None for c in fa2.calls) or \
        prop in ("split_invariance", "lse_merge", "kv_cache_leftpad")


@pytest.mark.parametrize("prop", SERVING + FA3_ONLY)
def test_fa3_kvcache_holds_its_properties_through_the_stand_in(fa3, prop):
    res = _run(prop, _on_cpu("flash-attn3-kvcache"))
    assert res.statuses.get("passed", 0) >= 1 and set(res.statuses) <= {"passed", "skipped"}, res
    if prop in ("fp8_matches_reference", "descale_linearity"):
        assert any(c["q"].dtype == F8 and c["k_descale"] is not None for c in fa3.calls)
    if prop == "chunked_matches_reference":
        assert any(c["attention_chunk"] > 0 for c in fa3.calls)


def _broken(kind):
    good = fa2mod.kvcache_args

    def args(q, k, v, spec, **kw):
        qb, kc, vc, a = good(q, k, v, spec, **kw)
        if spec.cache_seqlens is None:
            return qb, kc, vc, a
        if kind == "k_new_reshaped" and "k" in a:  # (B, Hkv, Lnew, D) read as (B, Lnew, Hkv, D) without transposing
            a["k"] = spec.k_new.reshape(a["k"].shape).contiguous()
        elif kind == "leftpad_dropped":
            a["cache_leftpad"] = None
        elif kind == "one_key_short":
            a["cache_seqlens"] = (a["cache_seqlens"] - 1).clamp(min=0)
        elif kind == "table_ignored":
            t = a.get("block_table", a.get("page_table"))
            if t is not None:
                a["block_table" if "block_table" in a else "page_table"] = torch.arange(
                    t.numel(), dtype=torch.int32).view(t.shape) % k.shape[0]
        return qb, kc, vc, a

    return args


@pytest.mark.parametrize("kind, prop", [
    ("k_new_reshaped", "kv_cache_append"), ("leftpad_dropped", "kv_cache_leftpad"),
    ("one_key_short", "paged_equals_contiguous"), ("table_ignored", "paged_equals_contiguous"),
])
def test_a_wrong_fa2_translation_fails_its_property(fa2, monkeypatch, kind, prop):
    monkeypatch.setattr(fa2mod, "kvcache_args", _broken(kind))
    with pytest.raises(AssertionError, match=f"{prop} failed for"):
        _run(prop, _on_cpu("flash-attn-kvcache"), n=6)


@pytest.mark.parametrize("kind, prop", [("descales_dropped", "descale_linearity"), ("chunk_dropped",
                                                                                     "chunked_matches_reference")])
def test_a_wrong_fa3_translation_fails_its_property(fa3, monkeypatch, kind, prop):
    good = fa3mod.fa3_kvcache_args

    def args(q, k, v, spec):
        qb, kc, vc, a = good(q, k, v, spec)
        for n in (("q_descale", "k_descale", "v_descale") if kind == "descales_dropped" else ()):
            a.pop(n, None)
        if kind == "chunk_dropped":
            a["attention_chunk"] = 0
        return qb, kc, vc, a

    monkeypatch.setattr(fa3mod, "fa3_kvcache_args", args)
    with pytest.raises(AssertionError, match=f"{prop} failed for"):
        _run(prop, _on_cpu("flash-attn3-kvcache"), n=6)


def test_fa3_fp8_output_comes_back_as_the_library_gives_it(fa3):
    case = build_case(CaseRecipe(batch=1, heads_q=2, heads_kv=1, len_q=3, len_k=6, head_dim=16, dtype="float8_e4m3fn",
                                 descales="amax", return_lse=True, seed=1))
    res = fa3mod.flash_attn3_kvcache.fn(case.q, case.k, case.v, case.spec)
    assert res.out.dtype == torch.bfloat16 and res.out.shape == (1, 2, 3, 16)  # "output must have dtype BF16"
    assert res.lse.dtype == torch.float32 and torch.isfinite(res.lse).all() and not math.isnan(res.out.float().sum())


# ------------------------------------------------------------------------------ the real libraries (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flash-attn-kvcache", "flash-attn3-kvcache"])
def test_the_real_library_holds_the_serving_properties(name):
    a = get(name)
    why = a.unavailable_reason()
    if why:
        pytest.skip(f"{name} unavailable here: {why}")
    for prop in SERVING + (FA3_ONLY if name == "flash-attn3-kvcache" else ()):
        res = _run(prop, a, n=4)
        assert res.statuses.get("passed", 0) >= 1, (prop, res)


# ------------------------------------------------------------------------------ through the plugin, narrower claims


def test_plugin_runs_fa3_kvcache_under_a_users_narrower_claims(pytester, fa3):
    """A user's conftest adapter around the built-in's function (FA3's stand-in injected as the library), claiming
    less than FA3 documents: causal only, page sizes 3 and 16, num_splits 1 and 3, e4m3 with descales, chunks, no
    append. The claimed properties run and pass; kv_cache_append skips naming the claim."""
    pytester.makeconftest('''
import attnverify as av
from attnverify.adapters.flash_attn3_kvcache import fa3_refusal, flash_attn3_kvcache

@av.adapter("mine-fa3", dtypes=("float32", "float8_e4m3fn"), head_dims=(16, 32), causal=("bottom_right",), gqa=True,
            lse=True, fully_masked="zeros", paged=True, page_sizes=(3, 16), num_splits=(1, 3), descales=True,
            attention_chunk=True, refuses=lambda case: fa3_refusal(case.q, case.k, case.v, case.spec))
def mine(q, k, v, spec):
    return flash_attn3_kvcache.fn(q, k, v, spec)
''')
    props = ("paged_equals_contiguous", "split_invariance", "fp8_matches_reference", "descale_linearity",
             "chunked_matches_reference", "kv_cache_append")
    res = pytester.runpytest("--adapter=mine-fa3", "-v", "-rs", "-k", " or ".join(props), "--attn-profile=ci",
                             "--attn-max-examples=4", "--attn-isolate=none", "--attn-seed=1", "-p", "no:randomly")
    out = res.stdout.str()
    assert res.ret == 0, out
    for line in [f"*test_{p}?mine-fa3? PASSED*" for p in props[:-1]] + ["*mine-fa3 does not claim append*"]:
        res.stdout.fnmatch_lines([line])
    # judged in this process (--attn-isolate=none): the calls the library saw stayed within the user's claims
    sizes = {c["k_cache"].shape[1] for c in fa3.calls if c["page_table"] is not None}
    assert sizes and sizes <= {3, 16}, sizes
    assert {1, 3} <= {c["num_splits"] for c in fa3.calls} <= {0, 1, 3}  # 0: a call without spec.num_splits
    assert any(c["q"].dtype == F8 and c["v_descale"] is not None for c in fa3.calls)
