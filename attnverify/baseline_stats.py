"""The baseline's statistics for one output in one pass: what check's per-case tolerance takes from the
same-dtype eager baseline (attnverify.check._baseline).

`baseline_stats(a, b, ...)` returns (rel_l2, max_abs, expected rounding, judged elements) with the very values of

    rel, mx = compare.error_stats(a, b)                      # a, b with the ignored rows zeroed
    rel = re-based on max(|b| over the finite, judged elements, floor * sqrt(n))   (when floor > 0)
    rounding = tolerances.expected_rounding(b, dtype, scale_floor=floor, ignore=ignored rows)

computed from one float64 copy of each tensor, shared masks and ONE host round trip instead of nine (issue
25: on a GPU each float() is a synchronisation; the three passes made 40-odd small operations per output).
The same float64 operations on the same elements, so the same numbers: tests/test_baseline_stats.py holds
it to the three functions bit for bit.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .compare import error_stats
from .tolerances import UNIT_ROUNDOFF, dtype_name, expected_rounding, rounding_from_terms, rounding_terms


def baseline_stats(a: torch.Tensor, b: torch.Tensor, out_dtype, *, floor: float = 0.0,
                   ignore: Optional[torch.Tensor] = None,
                   rounding: bool = True) -> Tuple[float, float, Optional[float], int]:
    """(rel_l2, max_abs, rounding, n) of the baseline `a` against the float64 reference `b` (both already zeroed
    where `ignore`, broadcastable to them, is True); `rounding=False` leaves the rounding out (None). n: the
    elements judged (finite in both, not ignored), which the per-case rule needs (tolerances.PER_CASE_MIN_N)."""
    if not isinstance(a, torch.Tensor) or tuple(a.shape) != tuple(b.shape) or not a.numel():
        return three_passes(a, b, out_dtype, floor, ignore, rounding)
    dev = a.device if a.device.type == "cuda" else torch.device("cpu")  # compare._work_device's rule
    x = a.detach().to(dev, torch.float64)
    e = b.detach().to(dev, torch.float64)
    fin_e = torch.isfinite(e)
    fin = torch.isfinite(x) & fin_e
    d = torch.where(fin, (x - e).abs(), 0.0)
    judged = fin if ignore is None else fin & ~ignore.to(dev).expand_as(e)
    parts = [d.norm(), torch.where(fin, e, 0.0).norm(), d.max(), judged.sum()]
    name = dtype_name(out_dtype)
    with_rounding = rounding and name in UNIT_ROUNDOFF and name != "float64"
    if with_rounding:  # expected_rounding's terms (one home: tolerances.rounding_terms)
        keep = fin_e if ignore is None else fin_e & ~ignore.to(dev).expand_as(e)
        parts += list(rounding_terms(e, keep, name))
    vals = torch.stack([p.to(torch.float64) for p in parts]).tolist()
    err, den_e, mx, n = vals[0], vals[1], vals[2], int(vals[3])
    rel = err / den_e if den_e > 0 else 0.0
    if floor > 0 and rel == rel:  # re-based on the check's denominator (the ignored elements are 0 in both: same err, same norm)
        den = max(den_e, floor * math.sqrt(max(n, 1)))
        rel = err / den if den > 0 else 0.0
    rnd: Optional[float] = None
    if rounding:
        rnd = rounding_from_terms(vals[4], vals[5], vals[6], floor) if with_rounding else 0.0
    return rel, mx, rnd, n


def three_passes(a, b, out_dtype, floor, ignore, rounding):
    """The definition (error_stats, the re-basing, expected_rounding): for what the one pass does not handle."""
    rel, mx = error_stats(a, b)
    n = 0
    if isinstance(a, torch.Tensor) and tuple(a.shape) == tuple(b.shape):
        e = b.detach().double()
        x = a.detach().double().to(e.device)
        fin = torch.isfinite(e) & torch.isfinite(x)
        if ignore is not None:
            fin = fin & ~ignore.to(e.device).expand_as(e)
        n = int(fin.sum())
        if floor > 0 and rel == rel:
            err = float(torch.where(fin, x - e, torch.zeros_like(e)).norm())
            den = max(float(torch.where(fin, e, torch.zeros_like(e)).norm()), floor * math.sqrt(max(n, 1)))
            rel = err / den if den > 0 else 0.0
    if not rounding:
        return rel, mx, None, n
    return rel, mx, expected_rounding(b, out_dtype, scale_floor=floor, ignore=ignore), n
