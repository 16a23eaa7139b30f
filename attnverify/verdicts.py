"""From Comparison records to a verdict: the one home of the rules every check and property shares.

    severity(comparisons)            worst error as a multiple of its tolerance (>1 fails); 1e30 for "infinite"
    bitwise_equal(a, b)              same shape and the same bits (NaN where NaN), nothing else
    bitwise_difference(a, b)         None when bitwise equal, else "in N element(s), max difference X"
    keyless_lse_expected(lse, mode)  the reference's LSE in an adapter's declared keyless_lse convention
    compare_pairs(pairs, ...)        {name: (got, expected)} -> Comparisons with the check's tolerances
    comparison_verdict(comps, ...)   (passed, severity, message) of a property that compared pairs

Pure functions of tensors and records: no pytest, no adapter calls.
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch

from .compare import Comparison, compare
from .tolerances import floors_of, tolerance_for

INFINITE_SEVERITY = 1e30  # what an infinite or NaN severity is reported as (hypothesis.target needs a float)
OUTPUT_KINDS = ("out", "lse", "dq", "dk", "dv")


def comparison_severity(c: Comparison) -> float:
    """One comparison's error as a multiple of its tolerance: norm-wise, and element-wise where bounded."""
    r = c.rel_l2 / c.tol_norm if c.tol_norm > 0 else (math.inf if c.rel_l2 > 0 else 0.0)
    if c.allowed_at_worst:
        r = max(r, c.max_abs / c.allowed_at_worst)
    return r


def severity(comparisons: Iterable[Comparison], *, error: bool = False) -> float:
    """The worst comparison's severity (0 for none); `error` (the adapter raised) is infinitely severe.
    Infinite or NaN severities are reported as INFINITE_SEVERITY."""
    worst = math.inf if error else 0.0
    for c in comparisons:
        r = comparison_severity(c)
        worst = max(worst, r if math.isfinite(r) else math.inf)
    return worst if math.isfinite(worst) else INFINITE_SEVERITY


_BYTE_FLOATS = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, and the same values bit for bit, NaN where the other has NaN."""
    if a.shape != b.shape:
        return False
    if a.dtype == b.dtype and a.dtype in _BYTE_FLOATS:  # fp8: no arithmetic on the CPU; compare the bits
        return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
    if a.dtype == b.dtype and torch.equal(a, b):  # no NaN and equal: one pass, one host round trip (issue 25)
        return True
    return bool(torch.equal(torch.nan_to_num(a, nan=1.2345), torch.nan_to_num(b, nan=1.2345))) and bool(
        torch.equal(torch.isnan(a), torch.isnan(b))
    )


def bitwise_difference(a, b) -> Optional[str]:
    """None when `a` and `b` are bitwise equal (or either is not a tensor), else where they differ, as
    "in N element(s), max difference X" (to follow "<what> differs from <what>")."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or bitwise_equal(a, b):
        return None
    if a.shape != b.shape:
        return f"in shape: {tuple(b.shape)} instead of {tuple(a.shape)}"
    x, y = a.detach().double(), b.detach().double()
    differ = ~((x == y) | (torch.isnan(x) & torch.isnan(y)))  # NaN where the other has NaN is no difference
    d = torch.nan_to_num((x - y).abs()[differ], nan=math.inf)  # NaN against a number: infinitely far
    return f"in {int(differ.sum())} element(s), max difference {float(d.max()):.3g}"


def keyless_lse_expected(expected, keyless_lse: str = "-inf"):
    """An expected LSE in the convention an adapter declares for rows with no visible key (`keyless_lse`).

    In the reference an LSE is -inf exactly on such rows (a row with a finite sink has LSE = the sink: not keyless);
    under keyless_lse="+inf" (FlashMLA, FA2/FA3's stored softmax_lse) those rows are expected +inf instead, so a -inf
    there fails as a +inf does under the default. Finite values (and a float64 value that only rounds to -inf in
    float32) are left alone. Every place that puts the reference's LSE on the expected side of a comparison with an
    adapter's applies it, with that adapter's claim (a baseline's naive keeps -inf); a pair of the adapter against
    itself needs none (the same convention on both sides)."""
    if keyless_lse == "-inf" or not isinstance(expected, torch.Tensor):
        return expected
    return torch.where(torch.isneginf(expected), torch.full_like(expected, math.inf), expected)


def compare_pairs(
    pairs: Mapping[str, Tuple[Any, Any]],
    dtype: str,
    *,
    score_max: float,
    scale_floors: Mapping[str, float],
    baseline: Optional[Mapping[str, Tuple[float, float]]] = None,
    missing: str = "fail",
    sides: Union[int, Mapping[str, int]] = 1,
) -> List[Comparison]:
    """Compare each (got, expected) pair of a property with the check's tolerances.

    A pair's name is "<output>[:label]" (out, lse, dq, dk, dv; any other output is judged like out); LSE is
    judged at float32. `baseline`: name -> (rel_l2, max_abs) of the same-dtype eager implementation under
    the same change, widening the bound. `scale_floors`: magnitudes.magnitudes(case). `missing`: an expected
    value that is not a tensor "fail"s the pair or is "skip"ped. `sides=2`: both values of a pair are rounded
    results (tolerance_for's sides); a mapping gives it per pair name (absent: 1)."""
    if missing not in ("fail", "skip"):
        raise ValueError(f"compare_pairs(missing={missing!r}): expected 'fail' or 'skip'")
    comps: List[Comparison] = []
    for n, (got, exp) in pairs.items():
        kind = re.split(r"[:\[ ]", n, maxsplit=1)[0]  # "lse:shift", "lse[request 2]" and "lse" are LSEs
        kind = kind if kind in OUTPUT_KINDS else "out"
        b = (baseline or {}).get(n) or (None, None)
        tol = tolerance_for(kind, "float32" if kind == "lse" else dtype, baseline_rel_l2=b[0], baseline_max_abs=b[1],
                            score_max=score_max, **floors_of(scale_floors, kind),
                            sides=sides.get(n, 1) if isinstance(sides, Mapping) else sides)
        if not isinstance(exp, torch.Tensor):
            if missing == "skip":
                continue
            c = compare(n, None, torch.zeros(1, dtype=torch.float64), tol)
            c.problems = [f"{n}: the adapter returned nothing to compare"]
        else:
            c = compare(n, got, exp.detach().double(), tol)
        c.name = n
        comps.append(c)
    return comps


def comparison_verdict(comps: List[Comparison], header: str, doc: str = "",
                       params: Optional[Dict[str, Any]] = None) -> Tuple[bool, float, str]:
    """(passed, severity, message) of a property that compared pairs; the message (empty when passed) is
    the header, the property's doc, every failing comparison's paragraph and the parameters."""
    failing = [c for c in comps if not c.passed]
    msg = ""
    if failing:
        msg = "\n".join([header] + ([doc] if doc else []) + [c.message() for c in failing]
                        + ([f"parameters: {params}"] if params else []))
    return not failing, severity(comps), msg
