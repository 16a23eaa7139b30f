"""The `triton` adapter's serving calls: KV caches (paged or contiguous), append, and num_splits, through the
bundled kernel's split-KV decode path (attnverify.kernels.serving.paged_decode, forward only).

- a cache call (spec.cache_seqlens) goes to paged_decode as it is: the caches are passed without a copy,
  so an append (a torch index_put_, not a kernel) lands in the caller's tensors;
- a plain call with spec.num_splits (not varlen, no gradient needed) is the same kernel over a contiguous
  "cache" that is a strided view of k and v (B, Lk, Hkv, D): one row per batch, no copy;
- everything else is left to the FlashAttention-2 kernels (`wants_serving` says which).
"""
from __future__ import annotations

import torch

from ..spec import Output, Spec


def wants_serving(q, k, v, spec: Spec) -> bool:
    if spec.cache_seqlens is not None:
        return True
    if spec.num_splits is None or spec.is_varlen:
        return False
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return not needs_grad  # the decode path is forward only; the answer must not depend on num_splits


def serve(q, k, v, spec: Spec) -> Output:
    from ..kernels.serving import paged_decode

    if spec.attention_chunk is not None:
        raise NotImplementedError("triton's decode path does not implement attention_chunk")
    common = dict(sinks=spec.sinks, num_splits=spec.num_splits, scale=spec.scale, causal=spec.causal, window=spec.window,
                  softcap=spec.softcap, alibi_slopes=spec.alibi_slopes)
    if spec.cache_seqlens is not None:
        out, lse = paged_decode(q, k, v, spec.cache_seqlens, block_table=spec.block_table,
                                cache_batch_idx=spec.cache_batch_idx, k_new=spec.k_new, v_new=spec.v_new,
                                cache_leftpad=spec.cache_leftpad, **common)
    else:
        b, lk = q.shape[0], k.shape[2]
        if lk == 0:
            out = q.new_zeros(*q.shape[:3], v.shape[-1])
            lse = torch.full(q.shape[:3], float("-inf"), device=q.device, dtype=torch.float32)
            if spec.sinks is not None:  # no key: the sink alone (docs/adapters.md, "Sinks")
                lse = spec.sinks.detach().to(lse).view(1, -1, 1).expand_as(lse).contiguous()
        else:
            lens = torch.full((b,), lk, dtype=torch.int32, device=q.device)
            out, lse = paged_decode(q, k.transpose(1, 2), v.transpose(1, 2), lens, **common)
    return Output(out, lse=lse if spec.return_lse else None)
