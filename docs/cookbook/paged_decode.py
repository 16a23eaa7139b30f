"""Recipe: a paged decode kernel with KV-cache append and split-KV (flash-attn's `flash_attn_with_kvcache`)."""
import torch

import attnverify as av

try:
    from flash_attn import flash_attn_with_kvcache  # the real kernel: CUDA, fp16/bf16
except ImportError:  # where it is missing: the plain-torch stand-in beside this file (same signature)
    from _standins import flash_attn_with_kvcache


def _refuses(spec: av.Spec):  # flash-attn 2: "We don't support Paged KV and leftpad_k running at the same time yet"
    if spec.cache_leftpad is not None and spec.block_table is not None:
        return "flash-attn 2 takes cache_leftpad with a contiguous cache only, not with a block_table"
    return None


@av.adapter(
    "paged-decode",
    dtypes=("float16", "bfloat16"), devices=("cuda",), head_dims=lambda d: d % 8 == 0 and d <= 256,
    causal=("none", "bottom_right"), window=True, softcap=True, alibi=True, gqa=True, lse=True,
    kv_cache=True,  # a contiguous cache (B_cache, S, Hkv, D) with cache_seqlens and cache_batch_idx
    paged=True, page_sizes=lambda p: p % 256 == 0,  # block_table; flash-attn 2: page_block_size % 256 == 0
    append=True,  # k_new / v_new written into the cache in place, then attended to
    cache_leftpad=True,  # the slot each batch's keys start at (contiguous caches only: see _refuses)
    num_splits=(1, 2, 4, 8),  # spec.num_splits=None leaves it to the kernel's heuristic (num_splits=0)
    refuses=lambda case: _refuses(case.spec),
)
def paged_decode(q, k, v, spec: av.Spec):
    if _refuses(spec):
        raise NotImplementedError(_refuses(spec))
    if spec.cache_seqlens is None:  # a plain call: one full cache row per batch
        k_cache, v_cache = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        lens = torch.full((q.shape[0],), k.shape[2], dtype=torch.int32, device=q.device)
        k_new = v_new = None
    else:  # k and v are the caches themselves, (N, S, Hkv, D): never copy them, the append is in place
        k_cache, v_cache, lens = k, v, spec.cache_seqlens
        k_new = None if spec.k_new is None else spec.k_new.transpose(1, 2).contiguous()
        v_new = None if spec.v_new is None else spec.v_new.transpose(1, 2).contiguous()
    res = flash_attn_with_kvcache(
        q.transpose(1, 2).contiguous(), k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lens,
        cache_batch_idx=spec.cache_batch_idx, cache_leftpad=spec.cache_leftpad, block_table=spec.block_table,
        softmax_scale=spec.scale,
        causal=spec.causal == "bottom_right", window_size=spec.window or (-1, -1), softcap=spec.softcap or 0.0,
        alibi_slopes=spec.alibi_slopes, num_splits=spec.num_splits or 0, return_softmax_lse=spec.return_lse,
    )
    if spec.return_lse:
        out, lse = res
        return av.Output(out.transpose(1, 2), lse=lse)
    return res.transpose(1, 2)
