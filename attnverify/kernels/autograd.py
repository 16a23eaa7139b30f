"""`torch.autograd.Function` over the Triton launchers, and the public `flash_attention` call."""
from __future__ import annotations

from typing import Optional

import torch

from . import launch


class FlashAttention(torch.autograd.Function):
    """(q, k, v, sinks) -> (out, lse); backward recomputes P from the saved LSE (dLSE supported). `sinks`
    is spec.sinks passed again as an input so that autograd routes its gradient (None without sinks)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, spec, tiles, bwd_tiles):
        bm, bn = tiles if tiles else (None, None)
        out, lse, prep = launch.forward(q, k, v, spec, block_m=bm, block_n=bn)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.prep, ctx.bwd_tiles, ctx.has_sinks = spec, prep, bwd_tiles, sinks is not None
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        bm, bn = ctx.bwd_tiles if ctx.bwd_tiles else (None, None)
        d_sinks = None
        if ctx.has_sinks and ctx.needs_input_grad[3]:
            d_sinks = torch.empty(ctx.prep.hq, device=q.device, dtype=torch.float32)
        dq, dk, dv = launch.backward(q, k, v, out, lse, d_out, d_lse, ctx.spec, block_m=bm, block_n=bn, prep=ctx.prep,
                                     d_sinks=d_sinks)
        if d_sinks is not None and ctx.spec.sinks.dtype != torch.float32:
            d_sinks = d_sinks.to(ctx.spec.sinks.dtype)
        return dq, dk, dv, d_sinks, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec, *,
                    tiles: Optional[tuple] = None, bwd_tiles: Optional[tuple] = None):
    """Attention in BHSD layout with SPEC semantics. Returns (out, lse); lse is float32 (B, Hq, Lq).

    `tiles=(BLOCK_M, BLOCK_N)` for the forward and `bwd_tiles` for the backward override the
    default configuration (the tile-partition property runs several). `spec.sinks` (float32 (Hq,)), when
    set, joins every row's denominator; its gradient flows when it requires grad.
    """
    return FlashAttention.apply(q, k, v, getattr(spec, "sinks", None), spec, tiles, bwd_tiles)
