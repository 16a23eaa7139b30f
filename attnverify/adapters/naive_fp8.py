"""naive's fp8 softmax and P @ V, the way FA3 computes them (forward only): float32 scores, P = exp(s - m) with m
the row max of the keys' scores (a learnable sink joins the denominator, not the max), P rounded to the inputs'
fp8 dtype before the P @ V product, the product normalised by the float32 denominator exp(LSE - m)."""
from __future__ import annotations

import torch

from ._features import NEG_INF


def fp8_softmax_pv(s: torch.Tensor, v: torch.Tensor, keep_scale, p_dtype, has_sink: bool):
    """(out float32, lse float32) of float32 scores `s` (masked: -inf; a sink: the last column over a zero value
    row when `has_sink`) and float32 values `v`; P rounded to `p_dtype` after the max is subtracted."""
    keys, vals = (s[..., :-1], v[..., :-1, :]) if has_sink else (s, v)
    dead = torch.isneginf(s).all(dim=-1, keepdim=True)
    lse = torch.logsumexp(torch.where(dead, torch.zeros_like(s), s), dim=-1, keepdim=True)
    lse = torch.where(dead, torch.full_like(lse, NEG_INF), lse)
    m = keys.amax(dim=-1, keepdim=True) if keys.shape[-1] else torch.full_like(lse, NEG_INF)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(keys - m)  # in [0, 1]: 0 on masked keys
    if keep_scale is not None:
        p = p * (keep_scale[..., :-1] if has_sink else keep_scale)
    p8 = p.to(p_dtype).to(torch.float32)  # the P that an fp8 P @ V product sees
    norm = torch.where(torch.isfinite(lse), torch.exp(m - lse), torch.zeros_like(lse))  # 1 / sum, scaled by e^m
    out = torch.matmul(p8, vals) * norm
    return out, lse.squeeze(-1)
