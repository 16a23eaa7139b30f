"""Which keys a query row sees by position: causal alignment, sliding window, varlen segments.

The one home of the visibility rule for everything that is not the reference (eager adapters, the zoo of
wrong kernels, the diagnosis engine, test helpers); the float64 reference keeps its own, independent copy
on purpose, so that a mistake here cannot hide in both.

    visible(i, j, diag, causal, window)       the rule on index tensors (broadcast together)
    positional_visibility(lq, lk, causal, window)   (Lq, Lk) bool of one dense sequence, None = all visible
    varlen_visibility(cu_q, cu_k, lq, lk, causal, window)   (Lq, Lk) bool of a packed batch

Coordinates: i is the row's query index and j the key's index, both local to the row's sequence (segment);
diag = i + Lk - Lq is the row's bottom-right diagonal. causal "top_left" shows j <= i, "bottom_right"
j <= diag (`strict_diag`: < instead of <=, a classic bug). A window (left, right) shows
diag - left <= j <= diag + right, a negative bound meaning unbounded on that side. Chunked local attention
(`chunk`, Spec.attention_chunk, Llama 4) shows only j with j // chunk == diag // chunk (the query's own chunk
of the sequence, positions bottom-right aligned), on top of causal and window.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

CAUSAL_MODES = ("none", "top_left", "bottom_right")


def visible(i: torch.Tensor, j: torch.Tensor, diag: torch.Tensor, causal: str = "none",
            window: Optional[Tuple[int, int]] = None, *, strict_diag: bool = False,
            chunk: Optional[int] = None) -> torch.Tensor:
    """Bool visibility of key j from row i (tensors broadcast together; see the module's coordinates)."""
    if causal not in CAUSAL_MODES:
        raise ValueError(f"visible(causal={causal!r}): use one of {CAUSAL_MODES}")
    vis = torch.ones(_broadcast_shape(i.shape, j.shape, diag.shape), dtype=torch.bool, device=j.device)
    if causal == "top_left":
        vis &= (j < i) if strict_diag else (j <= i)
    elif causal == "bottom_right":
        vis &= (j < diag) if strict_diag else (j <= diag)
    if window is not None:
        left, right = window
        if left >= 0:
            vis &= j >= diag - left
        if right >= 0:
            vis &= j <= diag + right
    if chunk is not None:
        vis &= torch.div(j, chunk, rounding_mode="floor") == torch.div(diag, chunk, rounding_mode="floor")
    return vis


def _broadcast_shape(*shapes) -> Tuple[int, ...]:
    """torch.broadcast_shapes's result, in plain Python: torch's imports torch.fx's symbolic shapes and
    sympy on its first call (issue 25: 0.3 s of CPU here, 2.7 s in the H200 run's first causal example)."""
    n = max(len(s) for s in shapes)
    out = [1] * n
    for s in shapes:
        for k, d in enumerate(s, start=n - len(s)):
            if d != 1:
                if out[k] not in (1, d):
                    raise RuntimeError(f"shapes {[tuple(x) for x in shapes]} do not broadcast (dim {k}: {out[k]} vs {d})")
                out[k] = d
    return tuple(out)


def row_key_indices(lq: int, lk: int, device=None):
    """(i (Lq, 1), j (1, Lk), diag (Lq, 1)) of one dense sequence, as integer tensors."""
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return i, j, i + (lk - lq)


def positional_visibility(lq: int, lk: int, causal: str = "none", window: Optional[Tuple[int, int]] = None,
                          device=None, *, strict_diag: bool = False, chunk: Optional[int] = None) -> Optional[torch.Tensor]:
    """(Lq, Lk) bool of one dense sequence, or None when every key is visible."""
    if causal == "none" and window is None and chunk is None:
        return None
    return visible(*row_key_indices(lq, lk, device), causal, window, strict_diag=strict_diag, chunk=chunk)


def segments(cu_seqlens_q: Sequence[int], cu_seqlens_k: Sequence[int]):
    """[(q0, q1, k0, k1)] of a packed batch's segments from its cumulative lengths."""
    cq = [int(x) for x in torch.as_tensor(cu_seqlens_q).tolist()]
    ck = [int(x) for x in torch.as_tensor(cu_seqlens_k).tolist()]
    return list(zip(cq, cq[1:], ck, ck[1:]))


def varlen_visibility(cu_seqlens_q, cu_seqlens_k, lq: int, lk: int, causal: str = "none",
                      window: Optional[Tuple[int, int]] = None, device=None, *, chunk: Optional[int] = None) -> torch.Tensor:
    """(Lq, Lk) bool for a packed batch: segment n of queries sees segment n of keys (causal/window inside)."""
    vis = torch.zeros(lq, lk, dtype=torch.bool, device=device)
    for q0, q1, k0, k1 in segments(cu_seqlens_q, cu_seqlens_k):
        if q1 > q0 and k1 > k0:
            pv = positional_visibility(q1 - q0, k1 - k0, causal, window, device, chunk=chunk)
            vis[q0:q1, k0:k1] = True if pv is None else pv
    return vis
