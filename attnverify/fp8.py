"""fp8 inputs with descales (issue 23; FA3's convention, docs/adapters.md): the one home of the rules.

An fp8 element stands for `element * descale[b, kv head]`, descales being float32 `(B, Hkv)` (a query head h
reads its kv head's factor, h // (Hq // Hkv)); a descale left out is 1. So

    S = (q * q_descale) (k * k_descale)^T * scale,   out = softmax(S) @ (v * v_descale)

The float64 reference applies exactly this (`descaled`); fp8 calls are forward only (no fp8 library has a
backward); the output may be in any floating dtype (FA3 returns bfloat16).

Recipes (case.py) quantize like a serving stack: x8 = saturate(x / descale) in the fp8 dtype, so the values the
inputs stand for stay those drawn, whatever descale is drawn (`quantize`, `draw_descales`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")
# how a recipe draws descales: per (batch, kv head) amax / fp8 max (a serving stack's), random powers of two,
# random non-powers (log-uniform), one factor for every (b, h), or none (all 1, passed as None)
DESCALE_KINDS = ("amax", "pow2", "random", "uniform")


def is_fp8(dtype) -> bool:
    return str(dtype).replace("torch.", "") in FP8_DTYPES


def fp8_max(dtype) -> float:
    return float(torch.finfo(getattr(torch, str(dtype).replace("torch.", ""))).max)


def validate_descales(spec) -> None:
    """Spec-level checks (shapes against the tensors: check_descale_shapes). Errors name the argument."""
    for name in DESCALE_NAMES:
        d = getattr(spec, name)
        if d is None:
            continue
        if not isinstance(d, torch.Tensor) or d.dim() != 2 or not d.is_floating_point() or is_fp8(d.dtype):
            raise ValueError(f"Spec({name}=...): expected a float32 tensor of shape (B, Hkv), one factor per batch and kv "
                             f"head (FA3's convention), got {type(d).__name__}{tuple(getattr(d, 'shape', ()))}"
                             + (f" {d.dtype}" if isinstance(d, torch.Tensor) else ""))
        bad = ~(torch.isfinite(d) & (d > 0))
        if bool(bad.any()):
            raise ValueError(f"Spec({name}=...): every descale must be finite and > 0 (it multiplies the stored values); "
                             f"got {d[bad].flatten()[:4].tolist()} at {bad.nonzero()[:4].tolist()}")


def check_descale_shapes(spec, b: int, hkv: int, where: str = "spec") -> None:
    for name in DESCALE_NAMES:
        d = getattr(spec, name)
        if d is not None and tuple(d.shape) != (b, hkv):
            raise ValueError(f"{where}.{name} has shape {tuple(d.shape)}; expected (B, Hkv) = ({b}, {hkv}): one factor "
                             f"per batch entry and kv head, float32 (FA3's q_descale/k_descale/v_descale)")


def _per_head(d: Optional[torch.Tensor], heads: int, dtype, device) -> Optional[torch.Tensor]:
    """(B, Hkv) -> (B, heads, 1, 1) in `dtype` (a kv head's factor repeated over its query heads)."""
    if d is None:
        return None
    d = d.to(device=device, dtype=dtype)
    g = heads // d.shape[1]
    return (d.repeat_interleave(g, dim=1) if g > 1 else d)[:, :, None, None]


def descaled(q, k, v, spec, dtype=torch.float64) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
    """q, k, v upcast to `dtype` and multiplied by their descales; the spec without descales."""
    if not spec.has_descales:
        return q.to(dtype), k.to(dtype), v.to(dtype), spec
    if spec.cache_seqlens is not None:
        raise ValueError("spec.q_descale/k_descale/v_descale with a KV cache (cache_seqlens) are not part of the "
                         "semantics yet: give descales to a plain (B, H, L, D) call")
    check_descale_shapes(spec, q.shape[0], k.shape[1])
    out = []
    for t, d in ((q, spec.q_descale), (k, spec.k_descale), (v, spec.v_descale)):
        x = t.to(dtype)
        f = _per_head(d, t.shape[1], dtype, t.device)
        out.append(x if f is None else x * f)
    return (*out, spec.replace(q_descale=None, k_descale=None, v_descale=None))


def quantize(x: torch.Tensor, descale: Optional[torch.Tensor], dtype: str) -> torch.Tensor:
    """x (float64, B x H x L x D) stored in fp8 `dtype` as saturate(x / descale[b, h // g])."""
    if descale is not None:
        x = x / _per_head(descale.double(), x.shape[1], torch.float64, x.device)
    m = fp8_max(dtype)
    x = torch.where(torch.isnan(x), x, x.clamp(-m, m))  # saturate: what a serving stack's quantizer does
    return x.to(getattr(torch, dtype))


def draw_descales(kind: str, x: torch.Tensor, hkv: int, dtype: str, gen: torch.Generator) -> torch.Tensor:
    """(B, Hkv) float32 descales for the float64 tensor x (B, H, L, D) of a recipe, by `kind` (DESCALE_KINDS)."""
    b = x.shape[0]
    if kind == "amax":  # per (b, kv head): amax over the group's heads / fp8 max, as a serving quantizer sets it
        a = x.abs().nan_to_num(0.0, 0.0, 0.0)
        a = a.reshape(b, hkv, -1).amax(dim=-1) if a.numel() else torch.ones(b, hkv, dtype=torch.float64)
        d = torch.where(a > 0, a / fp8_max(dtype), torch.ones_like(a))
    elif kind == "pow2":
        d = torch.pow(2.0, torch.randint(-7, 4, (b, hkv), generator=gen).double())
    elif kind == "random":  # log-uniform in [2^-8, 2^3], not powers of two
        d = torch.pow(2.0, torch.rand(b, hkv, generator=gen, dtype=torch.float64) * 11.0 - 8.0)
    elif kind == "uniform":
        d = torch.full((b, hkv), float(2.0 ** (float(torch.rand(1, generator=gen)) * 6.0 - 4.0)), dtype=torch.float64)
    else:
        raise ValueError(f"CaseRecipe(descales={kind!r}): use one of {DESCALE_KINDS} or None")
    return d.to(torch.float32)


__all__ = ["FP8_DTYPES", "DESCALE_NAMES", "DESCALE_KINDS", "is_fp8", "fp8_max", "validate_descales",
           "check_descale_shapes", "descaled", "quantize", "draw_descales"]
