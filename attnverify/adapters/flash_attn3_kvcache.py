"""`flash-attn3-kvcache`: FlashAttention-3's `flash_attn_interface.flash_attn_with_kvcache` (hopper/ build).

A separate built-in from `flash-attn3` (flash_attn_func / flash_attn_varlen_func, forward and backward) because
the serving features are forward only: the kvcache call "Does not support backward pass", and the FA3 backward
asserts "FA3 backward does not support attention_chunk" -- a chunk or fp8 claim on `flash-attn3` would put them
under its backward claim. The translation is flash_attn_kvcache.kvcache_args (cache calls pass the caches through,
no copy; plain calls get a cache with a garbage tail), plus FA3's own arguments below.

Quoted from FA3 (`hopper/flash_attn_interface.py` `flash_attn_with_kvcache`, `hopper/flash_api.cpp` `mha_fwd`,
`hopper/test_flash_attn.py`; Dao-AILab/flash-attention@0251105):

- paged, page_sizes: "k_cache: ... or (num_blocks, page_block_size, nheads_k, headdim) if there's a page_table
  (i.e. paged KV cache) page_block_size can be arbitrary (e.g, 1, 2, 3, 64, etc.)"; "page_table [optional]:
  (batch_size, max_num_blocks_per_seq), dtype torch.int32." -> `page_table=spec.block_table`, any page size.
- append: "If k and v are not None, k_cache and v_cache will be updated *inplace* with the new values from k and
  v"; "k [optional]: (batch_size, seqlen_new, nheads_k, headdim)"; mha_fwd: "If k_new is supplied, it must have
  seqlen <= the seqlen of the KV cache" (refused).
- kv_cache, cache_leftpad: "cache_seqlens: int, or (batch_size,), dtype torch.int32", "cache_batch_idx:
  (batch_size,), dtype torch.int32", "cache_leftpad: (batch_size,), dtype torch.int32. The index that the KV
  cache starts. If None, assume 0." -- with a page table too (hopper/test_flash_attn.py's test_flash_attn_kvcache
  crosses has_leftpad with page_size in [None, 1, 4, 128]; FA2's refusal of that pair is not in FA3).
- num_splits: "If > 1, split the key/value into this many chunks along the sequence. If num_splits == 1, we don't
  split the key/value. If num_splits == 0, we use a heuristic"; mha_fwd: "num_splits > 256 not supported".
- fp8 with descales (forward only): mha_fwd "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type"
  (e4m3 only: e5m2 is not claimed), "q_descale_,  // (b, h_k), not (b, h)", "k_descale_,  // (b, h_k)",
  "v_descale_,  // (b, h_k)"; "For FP8 input, output must have dtype BF16"; fp8 head dims "head_size should be a
  multiple of 16"; the tests' reference multiplies each input by its descale (`q * q_descale` repeated over the
  GQA group), which is attnverify's convention. `spec.q_descale` etc. go through as float32 (B, Hkv).
- attention_chunk (forward): mask.h keeps keys from round_down(i + seqlen_k - seqlen_q, chunk) for `chunk`
  keys (on top of causal / window_size), i.e. j // C == p // C, docs/adapters.md's chunked local attention.
- dv_ne_d: mha_fwd "If V headdim is different from Q/K dim, we only support Q/K headdim in (128, 192] and V headdim
  in (96, 128], or (Q/K <= 64 and V <= 512)" and "Only Hopper supports different V headdim"; other pairs refused,
  and fp8 with Dv != D too (the tests run fp8 only with `dv_vals = [d]`).
- not claimed: `qv` (the MLA absorbed form S = q k^T + qv v^T: attnverify's Spec has no qv; its MLA is K/V views
  of one latent, docs/adapters.md), `pack_gqa` (a speed knob, left to FA3's heuristic: None), rotary, sinks
  (no sink argument in hopper/), varlen q (`cu_seqlens_q` of the kvcache call is not wired), ALiBi (no argument).
- LSE natural log, +inf on an empty row (reported -inf); "If the row of the mask is all zero, the output will be
  zero."; flash_attn_func's docstring: "The forward pass is always deterministic."
"""
from __future__ import annotations

from typing import Optional

import torch

from ..spec import Output, Spec
from .base import adapter
from .flash_attn import _fa3, _fa3_available, _lse_out
from .flash_attn_kvcache import cache_capacity, kvcache_args

FA3_MAX_SPLITS = 256  # mha_fwd: "num_splits > 256 not supported"
FA3_SPLITS = (1, 2, 3, 4, 5, 7, 8, 16, 32, 64, 128, 256)  # drawn from 1..256, all accepted


def fa3_dims_ok(d: int, dv: int) -> bool:
    """mha_fwd's head-dim pairs: equal, (128, 192] x (96, 128], or Q/K <= 64 with V <= 512 (Hopper)."""
    return dv == d or (128 < d <= 192 and 96 < dv <= 128) or (d <= 64 and dv <= 512)


def fa3_refusal(q, k, v, spec: Spec) -> Optional[str]:
    """Why FA3's flash_attn_with_kvcache rejects this call (its own words), or None."""
    d, dv = q.shape[-1], v.shape[-1]
    fp8 = q.dtype == torch.float8_e4m3fn
    if spec.num_splits is not None and spec.num_splits > FA3_MAX_SPLITS:
        return f"FA3 refuses num_splits={spec.num_splits} ('num_splits > 256 not supported')"
    if fp8 and (d % 16 or dv % 16):
        return f"FA3 refuses fp8 with head dims {d}/{dv} ('head_size should be a multiple of 16')"
    if dv % 8:
        return f"FA3 refuses V head dim {dv} ('head_size_v should be a multiple of 8')"
    if not fa3_dims_ok(d, dv):
        return (f"FA3 refuses head dims {d}/{dv} ('we only support Q/K headdim in (128, 192] and V headdim in (96, 128], "
                "or (Q/K <= 64 and V <= 512)')")
    if fp8 and dv != d:
        return "fp8 with Dv != D is not claimed (hopper/test_flash_attn.py runs fp8 only with dv == d)"
    if spec.cache_seqlens is not None and spec.k_new is not None and q.shape[2] > cache_capacity(k, spec):
        return "FA3 refuses Lq longer than the cache with an append ('If k_new is supplied, it must have seqlen <= the seqlen of the KV cache')"
    return None


def fa3_kvcache_args(q, k, v, spec: Spec):
    """(q, k_cache, v_cache, kwargs) for FA3's flash_attn_with_kvcache: the FA2 translation with `page_table`,
    plus attention_chunk and the fp8 descales as float32 (B, Hkv)."""
    qb, k_cache, v_cache, kw = kvcache_args(q, k, v, spec, table_name="page_table")
    kw["attention_chunk"] = int(spec.attention_chunk or 0)
    for name in ("q_descale", "k_descale", "v_descale"):
        t = getattr(spec, name)
        if t is not None:
            kw[name] = torch.as_tensor(t, device=q.device).to(torch.float32)
    return qb, k_cache, v_cache, kw


@adapter(
    "flash-attn3-kvcache",
    description="FlashAttention-3 (hopper build): flash_attn_with_kvcache (paged, append, leftpad, num_splits, fp8, chunks)",
    availability=_fa3_available,
    refuses=lambda case: fa3_refusal(case.q, case.k, case.v, case.spec),
    dtypes=("float16", "bfloat16", "float8_e4m3fn"),
    devices=("cuda",),
    head_dims=lambda d: d % 8 == 0 and 8 <= d <= 256,
    max_seqlen=16384,
    causal=("none", "bottom_right"),
    window=True, softcap=True, alibi=False, attn_mask=False, gqa=True, varlen=False, dropout=False,
    backward=False,  # "Note: Does not support backward pass."
    lse=True, dv_ne_d=True, fully_masked="zeros", deterministic=True,
    tiles=(128, 128),  # sm90 forward tile of hdim 64/128 without causal (hopper/tile_size.h)
    memory="linear",
    kv_cache=True, paged=True, page_sizes=lambda p: p >= 1, append=True, cache_leftpad=True, num_splits=FA3_SPLITS,
    attention_chunk=True, descales=True,
)
def flash_attn3_kvcache(q, k, v, spec: Spec):
    """FlashAttention-3: flash_attn_with_kvcache; a cache call passes the caches through, a plain call builds one."""
    why = fa3_refusal(q, k, v, spec)
    if why:
        raise NotImplementedError(why)
    qb, k_cache, v_cache, kw = fa3_kvcache_args(q, k, v, spec)
    res = _fa3().flash_attn_with_kvcache(qb, k_cache, v_cache, **kw)
    out, lse = (res[0], res[1]) if spec.return_lse else (res, None)  # (out, softmax_lse, *accumulators)
    return Output(out.transpose(1, 2), lse=_lse_out(lse))
