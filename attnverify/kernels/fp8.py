"""fp8 inputs with descales in the bundled forward kernel (host side): FA3's convention (attnverify/fp8.py).

q, k, v in float8_e4m3fn or float8_e5m2 (all three the same), `spec.q_descale`, `k_descale`, `v_descale` float32
(B, Hkv), any of them None (= 1). The kernel reads them from one float32 table (3, B, Hkv) (`descale_table`):
q_descale * k_descale joins the softmax scale, v_descale scales the normalised output; P is cast to V's fp8
dtype after the running max is subtracted and both dots take fp8 operands (the GPU's fp8 tensor cores, sm_89+;
the interpreter rounds P by hand, `common._round_fp8`). The output is bfloat16, as FA3's; forward only.
A call without fp8 and without descales launches the kernel exactly as before (no extra argument).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..fp8 import check_descale_shapes, is_fp8

FP8_MIN_TILE = 32  # an 8-bit tl.dot needs K >= 32: D is padded to it and BLOCK_N must reach it


def out_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if is_fp8(dtype) else dtype


def min_tile(dtype: torch.dtype) -> int:
    return FP8_MIN_TILE if is_fp8(dtype) else 16


def descale_table(q: torch.Tensor, spec, b: int, hkv: int) -> Optional[torch.Tensor]:
    """(3, B, Hkv) float32 on q's device: q's, k's and v's descales, 1 where one is None; None without descales."""
    if not getattr(spec, "has_descales", False):
        return None
    if spec.cache_seqlens is not None:
        raise NotImplementedError("triton attention: descales with a KV cache are not implemented")
    check_descale_shapes(spec, b, hkv, where="triton attention: spec")
    rows = [torch.ones(b, hkv, device=q.device) if d is None else d.detach().to(device=q.device, dtype=torch.float32)
            for d in (spec.q_descale, spec.k_descale, spec.v_descale)]
    return torch.stack(rows).contiguous()


def v_for_dot(v: torch.Tensor) -> torch.Tensor:
    """fp8 V on a GPU, column-major (FA3's layout): P @ V reduces over the keys, and Hopper's 8-bit wgmma reads its
    operands K-major only (PTX: the transposed shared-memory layouts are for 16-bit types), so the keys must be
    V's contiguous axis; a row-major V is copied once. Anything else is returned as it is."""
    if not is_fp8(v.dtype) or not v.is_cuda or v.stride(-2) == 1 or v.shape[-2] <= 1:
        return v
    return v.transpose(-1, -2).contiguous().transpose(-1, -2)


def launch_kwargs(p, dtype: torch.dtype, block_n: int) -> dict:
    """The forward kernel's extra arguments: {} for a call without descales (the plain kernel)."""
    if is_fp8(dtype) and block_n < FP8_MIN_TILE:
        raise ValueError(f"triton attention: fp8 inputs need block_n >= {FP8_MIN_TILE} (an 8-bit dot's K), got {block_n}")
    if p.descales is None:
        return {}
    return dict(DESC=p.descales, desc_n=p.descales.shape[1] * p.descales.shape[2], HAS_DESCALE=True)


def refuse_backward(dtype: torch.dtype, p) -> None:
    if is_fp8(dtype) or p.descales is not None:
        raise NotImplementedError("triton attention: fp8 inputs and descales are forward only (no backward)")
