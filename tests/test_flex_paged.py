"""`flex-paged`: PyTorch's paged flex attention (PagedAttention, private, torch >= 2.6) with real scrambled tables.

On the CPU the adapter's compiled flex_attention costs minutes of cold compiles per shape, so the fast tests
swap in eager flex_attention (the same PagedAttention bookkeeping, block-mask conversion and score_mod, the
unfused flex path); the slow test runs the serving properties through the compiled adapter as shipped.
"""
from __future__ import annotations

import re
import warnings

import pytest
import torch

import attnverify as av

from attnverify.adapters.registry import get
from attnverify.case import CaseRecipe, build_case
from attnverify.properties import get_property
from attnverify.properties.driver import run_property
from attnverify.properties.serving import cache_problems
from attnverify.reference import reference_forward
from attnverify.reference.paged import cache_after

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
FLEX_PAGED = get("flex-paged")
WHY_NOT = FLEX_PAGED.unavailable_reason()
needs_it = pytest.mark.skipif(WHY_NOT is not None, reason=f"flex-paged unavailable here: {WHY_NOT}")


def test_unavailable_on_old_torch_saying_why(monkeypatch):
    from attnverify.adapters import flex_paged

    monkeypatch.setattr(flex_paged.torch, "__version__", "2.5.1")
    assert "torch 2.6" in flex_paged._availability()


@pytest.fixture
def eager_flex(monkeypatch):
    """Eager flex_attention in place of the compiled one (the fast CPU path of these tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    from attnverify.adapters import flex

    monkeypatch.setitem(flex._STATE, "compiled", flex_attention)


def _recipe(garbage: str):
    # scrambled pages, sequence 1 shares sequence 0's first page, partial last pages, an append of 2, Lq = 2
    return CaseRecipe(batch=2, heads_q=4, heads_kv=2, len_q=2, len_k=39, head_dim=16, cache_lens=[37, 20], paged=True,
                      page_size=16, num_pages=12, block_table=[[5, 2, 9, 7], [5, 11, 3, 4]], new_len=2, garbage=garbage,
                      causal="bottom_right", dtype="float32", scale=0.5)


@needs_it
def test_scrambled_shared_pages_and_append_match_the_reference(eager_flex):
    case = build_case(_recipe("huge"))
    ref = reference_forward(case.q, case.k, case.v, case.spec)
    k_exp, v_exp = cache_after(case.k, case.v, case.spec)
    out = FLEX_PAGED(case.q, case.k, case.v, case.spec)
    assert (out.double() - ref.out).abs().max() < 1e-5
    assert not cache_problems(case, k_exp, v_exp)  # assign wrote k_new where the table says, nothing else


@needs_it
def test_a_plain_call_is_served_through_pages(eager_flex):
    q, k, v = (torch.randn(2, 2, n, 16) for n in (3, 37, 37))
    spec = av.Spec(causal="bottom_right")
    want = reference_forward(q, k, v, spec).out
    assert (FLEX_PAGED(q, k, v, spec).double() - want).abs().max() < 1e-5


@needs_it
def test_nan_in_a_partial_page_is_the_declared_finding_and_only_it(eager_flex):
    """The CPU finding: NaN past cache_seqlens in a sequence's last page reaches its output. The failure is
    classified as the declared finding; a wrong answer of another kind (a table ignored) is not."""
    case = build_case(_recipe("nan"))
    out = FLEX_PAGED(case.q, case.k, case.v, case.spec)
    assert torch.isnan(out).all()
    with warnings.catch_warnings(), pytest.raises(AssertionError) as e:
        warnings.simplefilter("ignore")
        run_property(get_property("paged_equals_contiguous"), FLEX_PAGED, profile="ci", seed=0, database=None,
                     report_dir="reports/test", max_examples=2)
    assert re.search(r"note: batch\(es\) \[[\d, ]+\] end inside a page: .* hold nan", str(e.value)), str(e.value)
    assert FLEX_PAGED.classify("paged_equals_contiguous", str(e.value))[0] == "known"
    other = ("[flex-paged] paged_equals_contiguous FAILED: B=1 ... garbage=none\nout: MISMATCH\n"
             "  3 of 16 element(s) beyond the bound")
    assert FLEX_PAGED.classify("paged_equals_contiguous", other)[0] == "failed"
    assert FLEX_PAGED.classify("batch_invariance", "out[request 1]: not bitwise identical (7 element(s) differ)")[0] \
        == "known"
    append = ("x garbage=nan in unused slots\nout: MISMATCH\n  2 non-finite value(s) where the reference differs\n"
              "note: batch(es) [0] end inside a page: the slots after their last key, in that page, hold nan")
    assert re.search(FLEX_PAGED.known_patterns["kv_cache_append"], append)
    for other in (append.replace("garbage=nan", "garbage=huge"),  # finite garbage: another failure
                  append.replace("note: batch(es) [0] end inside a page: the slots after their last key, in that "
                                 "page, hold nan", "note: every batch ends on a page boundary: no garbage shares a "
                                 "page with a key")):  # NaN from a page the call does not use: another failure
        assert not re.search(FLEX_PAGED.known_patterns["kv_cache_append"], other)


@pytest.mark.slow
@needs_it
@pytest.mark.parametrize("prop", ["paged_equals_contiguous", "kv_cache_append", "batch_invariance"])
def test_compiled_flex_paged_serving_properties(prop, tmp_path):
    """The adapter as shipped (compiled flex_attention): each property passes, or fails only with the
    declared finding."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            run = run_property(get_property(prop), FLEX_PAGED, profile="ci", seed=0, database=None,
                               report_dir=str(tmp_path), max_examples=6)
        except AssertionError as e:
            assert FLEX_PAGED.classify(prop, str(e))[0] == "known", str(e)[:3000]
            return
    assert run.statuses.get("passed", 0) >= 3
