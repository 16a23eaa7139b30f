"""The `flashinfer` adapter's cache and sink paths (issues 22, 23) on the CPU.

FlashInfer needs a CUDA GPU and is not installed here, so:
- the pure translations (block_table -> kv_indptr / kv_indices / kv_last_page_len, append coordinates) are checked
  against known layouts and against the reference's own reading of a cache call, and a wrong translation fails;
- a plain-torch FlashInfer written from its docstrings (tests/_fake_flashinfer.py, not attnverify's naive) is put
  in sys.modules, and attnverify's serving and sink properties run end to end through the adapter's own code;
  glue that is wrong in the ways the zoo knows (last page read as full, append one slot late, a scaled sink) fails;
- the real library runs in the `gpu` test where it is installed (skipped here, saying why).
"""
from __future__ import annotations

import dataclasses
import sys
import warnings

import pytest
import torch

import _fake_flashinfer
from _judged import judged_on_the_real_library
from attnverify.adapters import flashinfer_layout as lay
from attnverify.adapters import flashinfer_paged
from attnverify.adapters.base import Adapter
from attnverify.adapters.registry import get
from attnverify.case import CaseRecipe, build_case
from attnverify.check import check
from attnverify.properties import get_property
from attnverify.properties.driver import run_property
from attnverify.properties.serving import cache_problems
from attnverify.reference import reference_forward
from attnverify.reference.paged import cache_after, cache_keys

FI = get("flashinfer")


def _on_cpu(a: Adapter) -> Adapter:
    """The adapter's own function, refusals and claims, widened to the CPU and float32 for the stand-in."""
    return Adapter(name="flashinfer-cpu", fn=a.fn, refuses=a.refuses,
                   claims=dataclasses.replace(a.claims, devices=("cpu",), dtypes=("float32",) + a.claims.dtypes,
                                              head_dims=(16, 32, 64)))


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer.module())
    return _on_cpu(FI)


# ----------------------------------------------------------------------------------------- the translations


def test_csr_of_a_scrambled_shared_table():
    # batch 0: 37 keys over pages 5, 2, 9 (partial last page: 5 slots); batch 1 shares page 5, 20 keys over 5, 11
    indptr, indices, last = lay.csr_from_block_table(torch.tensor([[5, 2, 9, 7], [5, 11, 3, 4]]), torch.tensor([37, 20]), 16)
    assert indptr.tolist() == [0, 3, 5] and indices.tolist() == [5, 2, 9, 5, 11] and last.tolist() == [5, 4]
    assert {t.dtype for t in (indptr, indices, last)} == {torch.int32}
    # a full last page is page_size, not 0; an empty request owns no page (page.py get_seq_lens reads 0 keys)
    indptr, indices, last = lay.csr_from_block_table(torch.tensor([[3, 1], [0, 2], [4, 5]]), torch.tensor([32, 0, 1]), 16)
    assert indptr.tolist() == [0, 2, 2, 3] and indices.tolist() == [3, 1, 4] and last.tolist() == [16, 0, 1]


def test_contiguous_cache_is_one_page_per_request_and_append_coords():
    assert lay.contiguous_table(3, None, "cpu").tolist() == [[0], [1], [2]]
    assert lay.contiguous_table(2, torch.tensor([4, 1]), "cpu").tolist() == [[4], [1]]
    bi, pos = lay.append_coords(torch.tensor([5, 0, 9]), 2)
    assert bi.tolist() == [0, 0, 1, 1, 2, 2] and pos.tolist() == [5, 6, 0, 1, 9, 10]
    assert lay.uniform_indptr(3, 4, "cpu").tolist() == [0, 4, 8, 12]
    indptr, indices, last = lay.rows_as_pages([3, 0, 2], "cpu")
    assert indptr.tolist() == [0, 3, 3, 5] and indices.tolist() == [0, 1, 2, 3, 4] and last.tolist() == [1, 0, 1]


@pytest.mark.parametrize("bad, match", [
    (dict(page_size=0), "page_size must be >= 1"),
    (dict(seq_lens=torch.tensor([40, 3])), "need up to 3 pages; block_table has 2 columns"),
    (dict(seq_lens=torch.tensor([-1, 3])), "seq_lens must be >= 0"),
    (dict(block_table=torch.tensor([1, 2])), "block_table must be"),
])
def test_bad_layouts_are_errors_naming_the_argument(bad, match):
    args = dict(block_table=torch.tensor([[0, 1], [2, 3]]), seq_lens=torch.tensor([3, 4]), page_size=16) | bad
    with pytest.raises(ValueError, match=match):
        lay.csr_from_block_table(**args)


def _cache_recipe(**kw):
    base = dict(batch=3, heads_q=4, heads_kv=2, len_q=1, len_k=41, head_dim=16, cache_lens=[41, 7, 16], paged=True,
                page_size=16, num_pages=12, block_table=[[7, 3, 11], [3, 0, 0], [5, 0, 0]], garbage="nan",
                dtype="float32", seed=5)
    return CaseRecipe(**{**base, **kw})


def _csr_keys(case, csr):
    return [_fake_flashinfer._gather(case.k, *csr, b) for b in range(case.q.shape[0])]


def _wrong_last_page_full(table, lens, page_size):
    indptr, indices, last = lay.csr_from_block_table(table, lens, page_size)
    return indptr, indices, torch.full_like(last, page_size)


@pytest.mark.parametrize("page_size, lens", [(16, [41, 7, 16]), (1, [5, 1, 3]), (5, [11, 5, 4]), (3, [9, 8, 1])])
def test_csr_reads_exactly_the_keys_the_reference_gathers(page_size, lens):
    """FlashInfer's reading of the CSR layout (page.cuh get_length, in the stand-in) gives the keys the reference
    gathers slot by slot from the block table; a translation that reads the last page as full does not."""
    pages = [max(1, -(-n // page_size)) for n in lens]
    pool = list(torch.randperm(sum(pages) * 3, generator=torch.Generator().manual_seed(page_size)).tolist())
    table, at = [], 0
    for p in pages:
        table.append(pool[at:at + p] + [0] * (max(pages) - p))
        at += p
    case = build_case(_cache_recipe(cache_lens=lens, page_size=page_size, num_pages=sum(pages) * 3, block_table=table,
                                    len_k=max(lens)))
    spec = case.spec
    want = [kb[0].transpose(0, 1) for kb, _ in cache_keys(case.k, case.v, spec)]  # (len, Hkv, D) per batch
    got = _csr_keys(case, lay.csr_from_block_table(spec.block_table, spec.cache_seqlens, page_size))
    for w, g in zip(want, got):
        assert torch.equal(w, g.to(w.dtype))
    wrong = _csr_keys(case, _wrong_last_page_full(spec.block_table, spec.cache_seqlens, page_size))
    assert any(w.shape != g.shape or not torch.equal(w, g.to(w.dtype)) for w, g in zip(want, wrong)) \
        or all(n % page_size == 0 for n in lens)


# ------------------------------------------------------------------------- the adapter through the stand-in


def _run(adapter, prop, n=6):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_property(get_property(prop), adapter, profile="ci", seed=0, database=None,
                            report_dir="reports/test", max_examples=n)


CACHE_CASES = [
    dict(),  # decode over a scrambled table, NaN in every unused slot
    # append then chunked prefill (the prefill wrapper); the new rows of batch 2 open its second page
    dict(len_q=3, causal="bottom_right", new_len=3, len_k=44, block_table=[[7, 3, 11], [4, 0, 0], [5, 9, 0]]),
    dict(len_q=1, new_len=1, len_k=42, window=(5, -1), softcap=2.0,  # decode with append, window, cap
         block_table=[[7, 3, 11], [4, 0, 0], [5, 9, 0]]),
    dict(paged=False, page_size=40, num_pages=4, block_table=None, cache_batch_idx=[2, 0, 1], cache_lens=[30, 5, 12],
         len_k=32, len_q=2, new_len=2, causal="bottom_right"),  # a contiguous cache: one page of size S per request
    dict(sinks={"kind": "mixed", "level": 2.0, "seed": 1}, len_q=2, causal="bottom_right"),  # sinks on pages
]


@pytest.mark.parametrize("i", range(len(CACHE_CASES)))
def test_cache_calls_match_the_reference_and_append_in_place(fake, i):
    case = build_case(_cache_recipe(return_lse=True, **CACHE_CASES[i]))
    if case.spec.k_new is None:
        res = check(fake, case)
        assert res.passed, res.message()[:2000]
        return
    ref = reference_forward(case.q, case.k, case.v, case.spec)
    k_exp, v_exp = cache_after(case.k, case.v, case.spec)
    res = fake(case.q, case.k, case.v, case.spec)  # the caches are passed through, not copied: the append lands
    assert (res.out.double() - ref.out).abs().max() < 1e-5
    assert (res.lse.double() - ref.lse).abs().max() < 1e-5
    assert not cache_problems(case, k_exp, v_exp)


PLAIN_SINK_CASES = [
    dict(batch=2, heads_q=4, heads_kv=2, len_q=5, len_k=9, head_dim=16, sinks={"kind": "normal", "level": 1.0, "seed": 2}),
    dict(batch=1, heads_q=2, heads_kv=1, len_q=12, len_k=15, head_dim=32, causal="bottom_right", window=(4, 0),
         seqlens_q=[5, 0, 7], seqlens_k=[6, 4, 5], sinks={"kind": "dominant", "level": 1.0, "seed": 3}),
    dict(batch=2, heads_q=2, heads_kv=2, len_q=1, len_k=20, head_dim=16, sinks={"kind": "neg_inf", "level": 1.0, "seed": 4}),
]


@pytest.mark.parametrize("i", range(len(PLAIN_SINK_CASES)))
def test_plain_calls_with_sinks_go_through_the_sink_wrapper(fake, i):
    case = build_case(CaseRecipe(dtype="float32", seed=9, return_lse=True, **PLAIN_SINK_CASES[i]))
    res = check(fake, case)
    assert res.passed, res.message()[:2000]


@pytest.mark.parametrize("prop", ["paged_equals_contiguous", "kv_cache_append", "batch_invariance",
                                  "sinks_match_reference", "sink_as_extra_key", "sinks_paged"])
def test_serving_and_sink_properties_pass_through_the_stand_in(fake, prop):
    run = _run(fake, prop)
    assert run.statuses.get("passed", 0) >= 3, run.statuses


def test_softcap_with_sinks_and_masks_on_cache_calls_are_refused():
    soft = build_case(CaseRecipe(batch=1, heads_q=2, heads_kv=2, len_q=3, len_k=5, head_dim=64, dtype="float16",
                                 softcap=3.0, sinks={"kind": "normal", "level": 1.0, "seed": 0}))
    assert "no logits transform" in FI.refuses(soft)
    assert FI.claims.paged and FI.claims.kv_cache and FI.claims.append and FI.claims.sinks
    assert not FI.claims.cache_leftpad and FI.claims.num_splits == ()


@pytest.mark.parametrize("wrong, prop, says", [
    ("last_page_full", "paged_equals_contiguous", "out: MISMATCH"),  # the partial last page's garbage reaches the output
    ("append_one_late", "kv_cache_append", "outside request"),  # new rows one slot late: past the allocated slots
    ("sink_scaled", "sinks_match_reference", "out: MISMATCH"),  # the sink multiplied by sm_scale like a score
])
def test_wrong_glue_is_caught(fake, monkeypatch, wrong, prop, says):
    if wrong == "last_page_full":
        monkeypatch.setattr(flashinfer_paged, "csr_from_block_table", _wrong_last_page_full)
    elif wrong == "append_one_late":
        monkeypatch.setattr(flashinfer_paged, "append_coords",
                            lambda lens, n: tuple(t + d for t, d in zip(lay.append_coords(lens, n), (0, 1))))
    else:
        real = _fake_flashinfer.BatchAttentionWithAttentionSinkWrapper.run
        monkeypatch.setattr(_fake_flashinfer.BatchAttentionWithAttentionSinkWrapper, "run",
                            lambda self, q, c, sink, sm, **kw: real(self, q, c, sink * sm, sm, **kw))
    with pytest.raises(AssertionError, match=says):
        _run(fake, prop, n=10)


# ---------------------------------------------------------------------------------------- the real library


@pytest.mark.gpu
@pytest.mark.parametrize("prop", ["paged_equals_contiguous", "kv_cache_append", "batch_invariance", "sinks_paged"])
def test_real_flashinfer_serving_properties(prop, tmp_path):
    judged_on_the_real_library(FI, prop, tmp_path, min_passed=3)
