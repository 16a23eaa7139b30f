"""The online-softmax model of the flash algorithm, over an arbitrary partition of the keys.

State per query row: running max m, running sum l of exp(s - m), accumulator a of exp(s - m) * v.
For each key tile: m_new = max(m, max(s_tile)); both l and a are rescaled by exp(m - m_new)
before the tile's terms are added; the output is a / l. A tile with no eligible key (all -inf)
leaves the state untouched, and `-inf - -inf` is never formed.

Used by the tests (it must equal the exact reference for every partition) and by diagnosis
(variants of the update explain wrong kernels).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


@dataclass
class OnlineState:
    m: torch.Tensor  # (..., 1) running max (-inf before any eligible key)
    l: torch.Tensor  # (..., 1) running sum of exp(s - m)
    a: torch.Tensor  # (..., Dv) accumulator

    def output(self) -> torch.Tensor:
        """a / l; 0 where no key was eligible (l == 0). Not `l > 0`: a NaN sum (a NaN input) stays NaN."""
        live = self.l != 0
        return torch.where(live, self.a / torch.where(live, self.l, torch.ones_like(self.l)), torch.zeros_like(self.a))

    def lse(self) -> torch.Tensor:
        return (self.m + torch.log(self.l)).squeeze(-1)


def _check_bounds(bounds: Sequence[int], lk: int) -> list:
    b = [int(x) for x in bounds]
    if not b or b[0] != 0 or b[-1] != lk or any(y <= x for x, y in zip(b, b[1:])):
        raise ValueError(
            f"online_softmax: tile_bounds={list(bounds)} must rise strictly from 0 to Lk={lk}, e.g. [0, 64, {lk}]"
        )
    return b


def online_softmax(
    scores: torch.Tensor,
    values: torch.Tensor,
    tile_bounds: Optional[Sequence[int]] = None,
    *,
    rescale: bool = True,
    update: Optional[Callable[[OnlineState, torch.Tensor, torch.Tensor], OnlineState]] = None,
) -> OnlineState:
    """Run the online softmax over key tiles.

    scores: (..., Lq, Lk) final scores (masked = -inf); values: (..., Lk, Dv).
    tile_bounds: [0, b1, ..., Lk]; default one tile. `rescale=False` models the classic bug of
    forgetting exp(m - m_new); `update` replaces the whole per-tile step (for diagnosis).
    """
    lk = scores.shape[-1]
    bounds = _check_bounds(tile_bounds if tile_bounds is not None else [0, lk], lk) if lk else [0]
    shape = scores.shape[:-1]
    dt = torch.promote_types(scores.dtype, values.dtype)
    st = OnlineState(
        m=torch.full((*shape, 1), -math.inf, dtype=dt, device=scores.device),
        l=torch.zeros((*shape, 1), dtype=dt, device=scores.device),
        a=torch.zeros((*shape, values.shape[-1]), dtype=dt, device=scores.device),
    )
    for j0, j1 in zip(bounds, bounds[1:]):
        s = scores[..., j0:j1].to(dt)
        v = values[..., j0:j1, :].to(dt)
        st = update(st, s, v) if update is not None else _step(st, s, v, rescale)
    return st


def _step(st: OnlineState, s: torch.Tensor, v: torch.Tensor, rescale: bool) -> OnlineState:
    m_new = torch.maximum(st.m, s.amax(-1, keepdim=True))
    live = m_new > -math.inf  # rows that have seen an eligible key so far
    m_safe = torch.where(live, m_new, torch.zeros_like(m_new))
    alpha = torch.where(live, torch.exp(st.m - m_safe), torch.ones_like(m_new)) if rescale else torch.ones_like(m_new)
    p = torch.exp(s - m_safe)  # masked (-inf) -> 0
    l = alpha * st.l + p.sum(-1, keepdim=True)
    a = alpha * st.a + torch.matmul(p, v)
    return OnlineState(m=m_new, l=l, a=a)
