"""The bounds of a KV-cache case come from the keys it attends to, not from the caches' garbage (magnitudes over the
gathered prefix per batch): measured over the whole pool, the unused pages' 1e4-sized garbage widened every bound
by its size and a kernel whose output is 10% off passed `check` on a paged case."""
from __future__ import annotations

import pytest

import attnverify as av
from attnverify.adapters.registry import get
from attnverify.case import Case, CaseRecipe, build_case
from attnverify.magnitudes import magnitudes
from attnverify.reference.paged import cache_keys, plain_spec

CACHE = dict(len_q=4, head_dim=32, dtype="float32", seed=1, cache_lens=[40, 23], batch=2, len_k=40)
PAGED = dict(paged=True, page_size=16, num_pages=9, block_table=[[7, 2, 5], [4, 0, 8]])
CONTIG = dict(page_size=48, num_pages=3, cache_batch_idx=[2, 0])


def _scaled(factor):
    naive = get("naive")

    @av.adapter(f"scaled-{factor}", register=False, dtypes=("float32",), kv_cache=True, paged=True,
                page_sizes=lambda p: p >= 1, causal=("none", "bottom_right"))
    def scaled(q, k, v, spec):
        return naive(q, k, v, spec).out * factor

    return scaled


@pytest.mark.parametrize("layout", [PAGED, CONTIG], ids=["paged", "contiguous cache"])
@pytest.mark.parametrize("garbage", ["huge", "nan", "none"])
def test_a_wrong_output_fails_and_naive_passes_whatever_the_garbage(layout, garbage):
    case = build_case(CaseRecipe(**CACHE, **layout, garbage=garbage))
    assert av.check(get("naive"), case, backward=False).passed
    wrong = av.check(_scaled(0.9), case, backward=False)
    assert wrong.status == "failed", [(c.name, c.rel_l2, c.tol_norm) for c in wrong.comparisons]


def test_cache_magnitudes_are_the_largest_over_the_gathered_batches_and_ignore_garbage():
    clean = build_case(CaseRecipe(**CACHE, **PAGED, garbage="none"))
    dirty = build_case(CaseRecipe(**CACHE, **PAGED, garbage="huge"))
    assert magnitudes(dirty) == magnitudes(clean)
    per_batch = [magnitudes(Case(clean.q[b:b + 1], kb, vb, plain_spec(clean.spec, b)))
                 for b, (kb, vb) in enumerate(cache_keys(clean.k, clean.v, clean.spec))]
    for key, value in magnitudes(clean).items():
        assert value == max(m[key] for m in per_batch), key
    # the key length the flush floor counts is the batch's own (40 and 23 keys), not the pool's head count
    assert magnitudes(clean)["ftz:out"] == per_batch[0]["ftz:out"] > per_batch[1]["ftz:out"]


def test_the_key_length_of_a_cache_case_is_its_longest_batchs():
    from attnverify.magnitudes import key_length

    case = build_case(CaseRecipe(**CACHE, **PAGED))
    assert key_length(case) == 40 and case.k.shape[2] == 1  # the pool's third dim is its head count
    padded = build_case(CaseRecipe(len_q=3, head_dim=16, dtype="float32", batch=2, cache_lens=[30, 12],
                                   cache_leftpad=[5, 0], new_len=3, len_k=28, page_size=40, num_pages=2))
    assert key_length(padded) == 28  # max(30 - 5, 12 - 0) + 3
    plain = build_case(CaseRecipe(len_q=3, len_k=17, head_dim=16))
    assert key_length(plain) == 17

