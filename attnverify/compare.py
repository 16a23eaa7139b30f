"""Tensors -> Comparison records. Never raises for a wrong answer; knows nothing of pytest.

Metrics per output: max abs error, relative L2 error, max error in ulps of the dtype at the
reference's scale, mismatched count and fraction, the worst index. NaN/Inf in either direction is
a mismatch, except where both sides are NaN or the same infinity at the same place.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import List, Optional, Tuple

import torch

from .callable_module import make_callable
from .timesplit import timed
from .tolerances import Tolerance


@dataclass
class Comparison:
    name: str  # out, lse, dq, dk, dv (or a property's own label)
    passed: bool
    shape: Tuple[int, ...]
    numel: int
    max_abs: float
    rel_l2: float
    max_ulps: float
    mismatched: int
    worst_index: Optional[Tuple[int, ...]]
    worst_actual: Optional[float]
    worst_expected: Optional[float]
    allowed_at_worst: Optional[float]
    tol_norm: float
    tol_elem_u: float
    nonfinite_mismatches: int = 0
    judged: Optional[int] = None  # elements compared (not excluded by `ignore`); None: all of them
    note: str = ""
    problems: List[str] = field(default_factory=list)

    @property
    def mismatch_fraction(self) -> float:
        return self.mismatched / self.numel if self.numel else 0.0

    def to_dict(self) -> dict:
        # dataclasses.asdict's result without its deep copy of every leaf (numbers, strings, tuples of ints)
        d = {name: getattr(self, name) for name in _FIELDS}
        d["problems"] = list(self.problems)
        d["mismatch_fraction"] = self.mismatch_fraction
        return d

    def message(self) -> str:
        """A torch.testing-style paragraph for this output."""
        if self.passed:
            return f"{self.name}: ok (rel L2 {self.rel_l2:.2e} <= {self.tol_norm:.2e}, max abs {self.max_abs:.2e})"
        lines = [f"{self.name}: MISMATCH"]
        lines += [f"  {p}" for p in self.problems]
        pct = 100.0 * self.mismatch_fraction
        lines.append(f"  Mismatched elements: {self.mismatched} / {self.numel} ({pct:.1f}%)")
        if self.worst_index is not None:
            lines.append(
                f"  Greatest absolute difference: {self.max_abs:.3g} at index {self.worst_index} "
                f"(got {self.worst_actual:.6g}, expected {self.worst_expected:.6g}; up to {self.allowed_at_worst:.3g} allowed)"
            )
        lines.append(f"  Relative L2 error: {self.rel_l2:.3g} (up to {self.tol_norm:.3g} allowed)")
        lines.append(f"  Greatest error in ulps at the reference's scale: {self.max_ulps:.1f}")
        return "\n".join(lines)


_FIELDS = tuple(f.name for f in fields(Comparison))


def _work_device(actual) -> torch.device:
    """Where to compare: in float64 on the adapter's GPU when its output lives there. On one CPU thread
    a big case's comparison took longer than the per-example timeout (H200 thorough run: gqa cases with
    78M-element gradients timed out at 60 s, most of it in compare)."""
    if isinstance(actual, torch.Tensor) and actual.device.type == "cuda":
        return actual.device
    return torch.device("cpu")


def _nonfinite_agree(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    both_nan = torch.isnan(a) & torch.isnan(e)
    same_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    return both_nan | same_inf


@timed("compare")
def compare(name: str, actual, expected: torch.Tensor, tol: Tolerance, *, ignore: Optional[torch.Tensor] = None) -> Comparison:
    """Compare `actual` (any dtype/device) with the float64 `expected`.

    `ignore` (bool, broadcastable) marks elements excluded by a declared convention.
    """
    problems: List[str] = []
    dev = _work_device(actual)
    exp = expected.detach().to(dev, torch.float64)
    if actual is None:
        return _missing(name, exp, tol, "the adapter returned nothing for this output")
    if not isinstance(actual, torch.Tensor):
        return _missing(name, exp, tol, f"expected a tensor, got {type(actual).__name__}")
    shape_ok = tuple(actual.shape) == tuple(exp.shape)
    if not shape_ok:
        if actual.numel() == exp.numel():  # a failure (the contract's shape), its values still shown
            problems.append(f"shape {tuple(actual.shape)} instead of {tuple(exp.shape)}: the contract's shape is "
                            f"required (values compared after a reshape)")
            actual = actual.reshape(exp.shape)
        else:
            return _missing(name, exp, tol, f"shape {tuple(actual.shape)}, expected {tuple(exp.shape)}")
    act_dtype = actual.dtype
    act = actual.detach().to(dev, torch.float64)
    # Two host round trips in all (issue 25: one float() each was a GPU synchronisation, a dozen per output):
    # the reference's norm and count, which the element-wise bound needs, then every statistic at once.
    # The same float64 operations on the same elements as one float() each: the same numbers.
    over = None
    if act_dtype.is_floating_point and act_dtype != torch.float64:
        # a value beyond the dtype's range rounds to +-inf: then inf is the right answer
        over = torch.isfinite(exp) & (exp.abs() > torch.finfo(act_dtype).max)
        exp = torch.where(over, exp.sign() * math.inf, exp)
    fin_e, fin_a = torch.isfinite(exp), torch.isfinite(act)
    both = fin_e & fin_a
    nonfin_bad = ~both & ~_nonfinite_agree(act, exp)
    judged_e = fin_e
    if ignore is not None:  # elements a declared convention excludes (else every element is judged)
        keep = ~ignore.to(dev).expand_as(exp)
        both, nonfin_bad, judged_e = both & keep, nonfin_bad & keep, fin_e & keep
    diff = torch.where(both, (act - exp).abs(), 0.0)
    ref_fin = torch.where(judged_e, exp, 0.0)
    ref_norm_raw, n_fin = torch.stack([ref_fin.norm(), judged_e.sum().to(torch.float64)]).tolist()
    n_fin = int(n_fin)
    scale = ref_norm_raw / math.sqrt(n_fin) if n_fin else 0.0
    allowed = tol.allowed(ref_fin.abs(), scale)
    bad = (diff > allowed) | nonfin_bad
    mismatched_t = bad.sum()
    parts = [diff.norm(), mismatched_t, nonfin_bad.sum(), torch.zeros(()) if over is None else over.sum()]
    numel = exp.numel()
    if numel:
        # worst element: a non-finite disagreement beats any finite error; else the largest excess over the bound
        score = torch.where(mismatched_t > 0,
                            torch.where(nonfin_bad, torch.full_like(diff, math.inf), diff / allowed.clamp_min(1e-300)),
                            diff)
        flat = torch.argmax(torch.nan_to_num(score, nan=math.inf)).view(1)
        ulp = _ulp(ref_fin.abs().clamp_min(max(scale, tol.scale_floor)), tol.u)
        parts += [(diff / ulp).max(), diff.max(), flat] + [t.reshape(-1).index_select(0, flat) for t in (act, exp, allowed)]
    vals = torch.cat([p.to(dev, torch.float64).reshape(-1) for p in parts]).tolist()
    err_norm, mismatched, nonfin, n_over = vals[0], int(vals[1]), int(vals[2]), int(vals[3])
    worst = None
    max_ulps = max_abs = 0.0
    if numel:
        max_ulps, max_abs = vals[4], vals[5]
        worst = _unravel(int(vals[6]), exp.shape)
    if n_over:
        problems.append(f"{n_over} reference value(s) beyond the range of {act_dtype}: inf expected there")
    # the norm-wise denominator never drops below the tensor's scale floor: a reference of exact
    # zeros (dQ when one key is visible) is judged against the size of the terms that cancel
    ref_norm = max(ref_norm_raw, tol.scale_floor * math.sqrt(max(n_fin, 1)))
    rel = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else math.inf)
    if nonfin:
        rel = math.inf if not math.isnan(rel) else rel
        problems.append(f"{nonfin} non-finite value(s) where the reference differs (NaN/Inf)")
    bound = tol.norm_at(ref_norm_raw, ref_norm)
    passed = mismatched == 0 and rel <= bound and shape_ok
    if rel > bound and mismatched == 0:
        problems.append("every element is within its bound but the norm-wise error is not")
    return Comparison(
        name=name,
        passed=bool(passed),
        shape=tuple(exp.shape),
        numel=numel,
        max_abs=max_abs,
        rel_l2=float(rel),
        max_ulps=max_ulps,
        mismatched=mismatched,
        worst_index=worst,
        worst_actual=vals[7] if worst is not None else None,
        worst_expected=vals[8] if worst is not None else None,
        allowed_at_worst=vals[9] if worst is not None else None,
        tol_norm=bound,
        tol_elem_u=tol.elem_u,
        nonfinite_mismatches=nonfin,
        judged=numel if ignore is None else int(keep.sum()),
        problems=problems,
    )


def _ulp(mag: torch.Tensor, u: float) -> torch.Tensor:
    """Spacing of the dtype's numbers at magnitude `mag` (2u * 2^floor(log2 mag)), never 0."""
    e = torch.floor(torch.log2(mag.clamp_min(1e-300)))
    return torch.clamp(2.0 * u * torch.pow(2.0, e), min=1e-300)


def _unravel(flat: int, shape) -> Tuple[int, ...]:
    # unravelled here: torch.unravel_index's first call imports sympy (2.7 s in every new judging process)
    index = []
    for n in reversed(shape):
        flat, i = divmod(flat, n)
        index.append(i)
    return tuple(reversed(index))


def _missing(name: str, exp: torch.Tensor, tol: Tolerance, why: str) -> Comparison:
    return Comparison(
        name=name, passed=False, shape=tuple(exp.shape), numel=exp.numel(), max_abs=math.inf, rel_l2=math.inf,
        max_ulps=math.inf, mismatched=exp.numel(), worst_index=None, worst_actual=None, worst_expected=None,
        allowed_at_worst=None, tol_norm=tol.norm, tol_elem_u=tol.elem_u, problems=[why],
    )


@timed("compare")
def error_stats(actual, expected: torch.Tensor) -> Tuple[float, float]:
    """(relative L2, max abs) of a baseline against the reference, over elements finite in both."""
    if actual is None or not isinstance(actual, torch.Tensor) or tuple(actual.shape) != tuple(expected.shape):
        return (float("nan"), float("nan"))
    dev = _work_device(actual)
    a = actual.detach().to(dev, torch.float64)
    e = expected.detach().to(dev, torch.float64)
    fin = torch.isfinite(a) & torch.isfinite(e)
    d = torch.where(fin, (a - e).abs(), torch.zeros_like(e))
    n = float(torch.where(fin, e, torch.zeros_like(e)).norm())
    return (float(d.norm()) / n if n > 0 else 0.0, float(d.max()) if d.numel() else 0.0)


make_callable(__name__, compare)  # av.compare(...) calls compare(); the module stays the module
