"""The float64 reference as a file adapter, written the way a user writes one (issues 22 and 23: "naive and the
reference pass the thorough profile of the new properties"). It claims what attnverify.reference computes: float64
inputs, paged and appended KV caches, left padding, sinks, chunked local attention, splits (one pass: it has no
split path, so split_invariance holds bitwise), forward only.

    python -m attnverify run --adapter benchmarks/reference64.py:REFERENCE64 --profile thorough --device cuda \
        -k "paged_equals_contiguous or kv_cache_append or ..."

tests/test_serving.py loads it by this path too.
"""
from __future__ import annotations

import attnverify as av
from attnverify.reference import reference_forward
from attnverify.reference.paged import cache_after


def _reference(q, k, v, spec):
    """reference_forward; with new keys it first appends them into the caches in place, as flash_attn_with_kvcache
    does (the written slots then hold the values the reference reads from k_new)."""
    if spec.k_new is not None:
        k2, v2 = cache_after(k, v, spec)
        k.copy_(k2)
        v.copy_(v2)
    r = reference_forward(q, k, v, spec)
    return av.Output(r.out.to(q.dtype), lse=r.lse if spec.return_lse else None)


REFERENCE64 = av.adapter(
    "reference64", register=False, dtypes=("float64",), devices=("cpu", "cuda"), head_dims=lambda d: d <= 256,
    max_seqlen=8192, causal=("none", "bottom_right", "top_left"), gqa=True, lse=True, softcap=True, window=True,
    alibi=True, dv_ne_d=True, kv_cache=True, paged=True, append=True, cache_leftpad=True, num_splits=(1, 2, 4),
    page_sizes=lambda p: p >= 1, sinks=True, attention_chunk=True, varlen=True, deterministic=True,
    description="attnverify's float64 reference as a file adapter (benchmarks/reference64.py)",
)(_reference)
