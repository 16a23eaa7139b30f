"""The zoo's serving members: a paged/contiguous KV-cache decode kernel with append and split-KV
(zoo/_serving.py), each with one bug of the kind serving kernels shipped."""
from __future__ import annotations

from ..adapters.base import adapter
from ._serving import SPLIT_KEYS, serving_attend

# A split-KV paged decode kernel (flash_attn_with_kvcache / flashinfer decode class): half inputs, head dims
# multiple of 8 up to 256, bottom-right causal, GQA, LSE, paged (any page size) and contiguous caches with
# cache_batch_idx, k_new/v_new appended in place, num_splits chosen by the caller (else SPLIT_KEYS per split).
SERVING = dict(
    dtypes=("float16", "bfloat16"), devices=("cpu",), head_dims=lambda d: 8 <= d <= 256 and d % 8 == 0,
    max_seqlen=4096, causal=("none", "bottom_right"), gqa=True, lse=True, fully_masked="zeros",
    kv_cache=True, paged=True, append=True, cache_leftpad=True, num_splits=(1, 2, 3, 4, 8), memory="linear",
)
PAGED, APPEND, SPLIT, LEFTPAD = "paged_equals_contiguous", "kv_cache_append", "split_invariance", "kv_cache_leftpad"


def _member(name, bug):
    @adapter(f"zoo-{name}", register=False, description=f"zoo (serving): {bug}", **SERVING)
    def impl(q, k, v, spec):
        return serving_attend(q, k, v, spec, bug)

    return impl


def serving_members():
    from ._members import ZooMember as Z

    return [
        Z("paged-page-off-by-one", "the physical page number read is block_table[b, j] + 1",
          "page index arithmetic off by one in a paged-KV gather (neighbouring page read)",
          _member("paged-page-off-by-one", "page_off_by_one"), (PAGED,), "eager"),
        Z("paged-partial-page-full", "the last, partial page is read whole: slots past cache_seqlens are attended",
          "sequence length rounded up to whole pages (no length mask inside the last page)",
          _member("paged-partial-page-full", "partial_page_full"), (PAGED,), "eager", fast=True),
        Z("paged-unused-page-read", "one block-table entry past a sequence's last page is read as keys",
          "page loop bound from the padded block-table width, not from the sequence's page count",
          _member("paged-unused-page-read", "unused_page_read"), (PAGED,), "eager"),
        Z("paged-seqlens-minus-one", "a paged call attends to cache_seqlens[b] - 1 keys",
          "cache_seqlens taken as the index of the last key rather than the count (newest cached token lost)",
          _member("paged-seqlens-minus-one", "seqlens_minus_one"), (PAGED,), "eager"),
        Z("append-wrong-slot", "k_new/v_new written one slot past cache_seqlens[b], and the keys read from there",
          "KV-cache append to the wrong place (a wrong cache batch or sequence stride / offset)",
          _member("append-wrong-slot", "append_wrong_slot"), (APPEND,), "eager", fast=True),
        Z("append-not-written", "attends to k_new/v_new but never stores them in the cache",
          "in-place KV-cache update skipped (output right, the next step reads a stale cache)",
          _member("append-not-written", "append_not_written"), (APPEND,), "eager"),
        Z("split-partials-bf16", "split-KV partial outputs rounded to bfloat16 before the LSE merge",
          "split-KV partial results stored in a low-precision workspace before the combine",
          _member("split-partials-bf16", "split_partials_bf16"), (SPLIT, "forward_matches_reference"), "eager"),
        Z("split-merge-base2", "split-KV merge weights 2^(lse_i - lse) over natural-log partial LSEs",
          "an LSE kept in base 2 across a merge (exp2 kernels combining natural-log statistics)",
          _member("split-merge-base2", "merge_base2"), (SPLIT, "forward_matches_reference"), "eager"),
        Z("split-combine-stride", "split-KV combine reads the partials with the split index as the innermost stride",
          "a split-KV combine kernel with the wrong partial-output stride",
          _member("split-combine-stride", "split_combine_stride"), (SPLIT, "forward_matches_reference"), "eager"),
        Z("leftpad-ignored", "cache_leftpad taken for the key count only: cache_seqlens - cache_leftpad keys read "
          "from slot 0, the padding included, the newest keys lost",
          "a left-padded KV cache read from its first slot (the start offset leftpad_k not applied to the key pointer)",
          _member("leftpad-ignored", "leftpad_ignored"), (LEFTPAD,), "eager"),
        Z("leftpad-append-offset", "k_new/v_new written (and read) at cache_seqlens[b] + cache_leftpad[b]",
          "a KV-cache append into a left-padded cache placed after leftpad + cache_seqlens (the padding counted twice)",
          _member("leftpad-append-offset", "leftpad_append_offset"), (LEFTPAD,), "eager"),
    ]


__all__ = ["serving_members", "SERVING", "SPLIT_KEYS"]
