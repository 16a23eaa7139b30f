"""How well an alternative explains what the adapter returned: relative L2 over the elements finite in both,
and the count of elements whose NaN/Inf pattern differs."""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from .engine import F64


def as_f64(t) -> Optional[torch.Tensor]:
    if not isinstance(t, torch.Tensor):
        return None
    return t.detach().to("cpu", F64)


def residual(obs: torch.Tensor, alt: torch.Tensor) -> Tuple[float, int]:
    """(relative L2 over elements finite in both, number of elements whose NaN/Inf pattern differs)."""
    if obs.shape != alt.shape:
        if obs.numel() != alt.numel():
            return math.inf, max(obs.numel(), alt.numel())
        obs = obs.reshape(alt.shape)
    fo, fa = torch.isfinite(obs), torch.isfinite(alt)
    same_nf = (torch.isnan(obs) & torch.isnan(alt)) | (torch.isinf(obs) & torch.isinf(alt) & (torch.sign(obs) == torch.sign(alt)))
    bad_nf = int(((~fo | ~fa) & ~same_nf).sum())
    both = fo & fa
    d = torch.where(both, obs - alt, torch.zeros_like(alt))
    n = torch.where(both, alt, torch.zeros_like(alt)).norm()
    dn = float(d.norm())
    if float(n) == 0:
        return (0.0 if dn == 0 else math.inf), bad_nf
    return dn / float(n), bad_nf


def fit_score(obs: Dict[str, torch.Tensor], alt: Dict[str, torch.Tensor], names) -> Tuple[float, int]:
    worst, nf = 0.0, 0
    for n in names:
        r, b = residual(obs[n], alt[n])
        worst = max(worst, r)
        nf += b
    return worst, nf
