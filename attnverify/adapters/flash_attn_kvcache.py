"""`flash-attn-kvcache`: FlashAttention-2's `flash_attn.flash_attn_with_kvcache`, serving calls and all.

A cache call (`spec.cache_seqlens` set; docs/adapters.md recipe 6, attnverify/paged.py) goes straight through:
`k` and `v` *are* the caches (N, S, Hkv, D) and are passed without a copy, so the library's in-place append
lands in the caller's tensors. A plain call is served over a cache built from k / v with 64 rows of 3e4 past
`cache_seqlens`, so a kernel that reads past it shows up as a wrong answer. The translation (`kvcache_args`) is
a pure function of (q, k, v, spec), shared with `flash-attn3-kvcache` (flash_attn3_kvcache.py) and tested alone.

What it relies on, quoted from flash-attn 2.8 (`flash_attn/flash_attn_interface.py`, `flash_attn_with_kvcache`
docstring, and `csrc/flash_attn/flash_api.cpp`, `mha_fwd_kvcache`; Dao-AILab/flash-attention@0251105):

- kv_cache: "k_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim) if there's no block_table";
  "cache_seqlens: int, or (batch_size,), dtype torch.int32. The sequence lengths of the KV cache.";
  "cache_batch_idx: (batch_size,), dtype torch.int32. The indices used to index into the KV cache. If None, we
  assume that the batch indices are [0, 1, 2, ..., batch_size - 1]." -> `spec.cache_batch_idx` as int32.
- paged, page_sizes: "or (num_blocks, page_block_size, nheads_k, headdim) if there's a block_table (i.e. paged KV
  cache) page_block_size must be a multiple of 256."; "block_table [optional]: (batch_size,
  max_num_blocks_per_seq), dtype torch.int32." -> `page_sizes=lambda p: p % 256 == 0`; other page sizes are
  refused here with the kernel's words ("Paged KV cache block size must be divisible by 256").
- append: "If k and v are not None, k_cache and v_cache will be updated *inplace* with the new values from k and
  v"; "k [optional]: (batch_size, seqlen_new, nheads_k, headdim). If not None, we concatenate k with k_cache,
  starting at the indices specified by cache_seqlens." -> `spec.k_new` (B, Hkv, Lnew, D) passed as (B, Lnew,
  Hkv, D). flash_api.cpp: "If key is supplied, it must have seqlen <= the seqlen of the KV cache" (refused).
- cache_leftpad: "cache_leftpad: (batch_size,), dtype torch.int32. The index that the KV cache starts. If None,
  assume 0."; flash_api.cpp: "We don't support Paged KV and leftpad_k running at the same time yet" (refused).
- num_splits: "num_splits: int. If > 1, split the key/value into this many chunks along the sequence. If
  num_splits == 1, we don't split the key/value. If num_splits == 0, we use a heuristic to automatically
  determine the number of splits." -> `spec.num_splits=None` is 0; flash_api.cpp: "num_splits > 128 not
  supported", so any 1..128 is accepted; the claim lists the values drawn.
- forward only: "Note: Does not support backward pass."; the LSE: "softmax_lse [optional, if
  return_softmax_lse=True]: (batch_size, nheads, seqlen)" (natural log; +inf on a row with no key, reported -inf).
- masks, softcap, ALiBi, GQA, fully-masked rows: as `flash-attn` (flash_attn.py's docstring); causal and
  window_size are bottom-right over each batch's cache_seqlens[b] (+ Lnew) keys.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..spec import Output, Spec
from ._external import bshd, last_dim_contiguous
from .base import adapter
from .flash_attn import _alibi, _fa2_available, _lse_out, _window

KV_PAD = 64  # extra cache rows past cache_seqlens on a plain call
KV_GARBAGE = 3e4
FA2_MAX_SPLITS = 128  # flash_api.cpp: "num_splits > 128 not supported"
FA2_PAGE_MULTIPLE = 256  # "page_block_size must be a multiple of 256"
FA2_SPLITS = (1, 2, 3, 4, 5, 7, 8, 16, 32, 64, 128)  # drawn from 1..128, all accepted


def _int32(t, device) -> Optional[torch.Tensor]:
    if t is None:
        return None
    return torch.as_tensor(t, device=device).to(torch.int32).contiguous()


def kvcache_args(q, k, v, spec: Spec, *, table_name: str = "block_table"):
    """(q, k_cache, v_cache, kwargs) for flash_attn_with_kvcache of FA2 (table_name "block_table") or FA3
    ("page_table"): BSHD q; on a cache call the caches as they are and the serving fields as the library's
    int32 / (B, Lnew, Hkv, D) arguments; on a plain call a contiguous cache with a garbage tail."""
    d = q.shape[-1]
    kw = dict(softmax_scale=spec.resolved_scale(d), causal=spec.causal == "bottom_right", window_size=_window(spec),
              softcap=float(spec.softcap or 0.0), num_splits=0 if spec.num_splits is None else int(spec.num_splits),
              return_softmax_lse=bool(spec.return_lse))
    qb = last_dim_contiguous(bshd(q))
    if spec.cache_seqlens is None:
        b, hkv, lk = k.shape[0], k.shape[1], k.shape[2]
        # the cache: (B, Lk + pad, Hkv, D), contiguous (asserted by the function), tail = garbage
        k_cache = torch.full((b, lk + KV_PAD, hkv, d), KV_GARBAGE, device=k.device).to(k.dtype)
        v_cache = torch.full((b, lk + KV_PAD, hkv, v.shape[-1]), KV_GARBAGE, device=v.device).to(v.dtype)
        k_cache[:, :lk] = bshd(k)
        v_cache[:, :lk] = bshd(v)
        kw["cache_seqlens"] = torch.full((b,), lk, dtype=torch.int32, device=q.device)
        return qb, k_cache, v_cache, kw
    kw["cache_seqlens"] = _int32(spec.cache_seqlens, q.device)
    kw["cache_batch_idx"] = _int32(spec.cache_batch_idx, q.device)
    kw["cache_leftpad"] = _int32(spec.cache_leftpad, q.device)
    kw[table_name] = _int32(spec.block_table, q.device)
    if spec.k_new is not None:  # (B, Hkv, Lnew, D) -> (B, Lnew, Hkv, D), the library's layout
        kw["k"] = last_dim_contiguous(bshd(spec.k_new))
        kw["v"] = last_dim_contiguous(bshd(spec.v_new))
    return qb, k, v, kw  # the caches themselves: never a copy (the append is in place)


def cache_capacity(k, spec: Spec) -> int:
    """The keys a batch can address: the cache's S, or max_blocks * page size when paged (flash_api.cpp's seqlen_k)."""
    if spec.block_table is not None:
        return int(torch.as_tensor(spec.block_table).shape[1]) * int(k.shape[1])
    return int(k.shape[1])


def fa2_refusal(q, k, spec: Spec) -> Optional[str]:
    """Why flash-attn 2 rejects this call (its own words), or None."""
    if spec.num_splits is not None and spec.num_splits > FA2_MAX_SPLITS:
        return f"flash-attn 2 refuses num_splits={spec.num_splits} ('num_splits > 128 not supported')"
    if spec.cache_seqlens is None:
        return None
    if spec.block_table is not None and k.shape[1] % FA2_PAGE_MULTIPLE:
        return (f"flash-attn 2 refuses a paged cache of page size {k.shape[1]} ('page_block_size must be a multiple of "
                f"256'; flash_api.cpp: 'Paged KV cache block size must be divisible by 256')")
    if spec.cache_leftpad is not None and spec.block_table is not None:
        return "flash-attn 2 refuses cache_leftpad with a block_table ('We don't support Paged KV and leftpad_k running at the same time yet')"
    if spec.k_new is not None and q.shape[2] > cache_capacity(k, spec):
        return "flash-attn 2 refuses Lq longer than the cache with an append ('If key is supplied, it must have seqlen <= the seqlen of the KV cache')"
    return None


@adapter(
    "flash-attn-kvcache",
    description="flash-attn 2: flash_attn_with_kvcache (paged / contiguous caches, append, cache_leftpad, num_splits)",
    availability=_fa2_available,
    refuses=lambda case: fa2_refusal(case.q, case.k, case.spec),
    dtypes=("float16", "bfloat16"),
    devices=("cuda",),
    head_dims=lambda d: 1 <= d <= 256,
    max_seqlen=16384,
    causal=("none", "bottom_right"),
    window=True, softcap=True, alibi=True, attn_mask=False, gqa=True, varlen=False, dropout=False,
    backward=False,  # "Note: Does not support backward pass."
    lse=True, dv_ne_d=False, fully_masked="zeros", deterministic=True,
    tiles=(64, 128),
    memory="linear",
    kv_cache=True, paged=True, page_sizes=lambda p: p % FA2_PAGE_MULTIPLE == 0, append=True, cache_leftpad=True,
    num_splits=FA2_SPLITS,
)
def flash_attn2_kvcache(q, k, v, spec: Spec):
    """flash-attn 2: flash_attn_with_kvcache; a cache call passes the caches through, a plain call builds one."""
    why = fa2_refusal(q, k, spec)
    if why:
        raise NotImplementedError(why)
    from flash_attn import flash_attn_with_kvcache

    qb, k_cache, v_cache, kw = kvcache_args(q, k, v, spec)
    res = flash_attn_with_kvcache(qb, k_cache, v_cache, alibi_slopes=_alibi(spec, q.device), **kw)
    out, lse = res if spec.return_lse else (res, None)
    return Output(out.transpose(1, 2), lse=_lse_out(lse))
