"""Precision diagnosis: a failed check whose error is a few units of rounding, spread over the tensor, and
explained by no alternative semantics is a precision bug (an accumulator, an exp or a statistic kept in
too narrow a type), not a semantic one (issue 20).

    from attnverify.precision_diagnosis import precision_signature, with_precision
    sig = precision_signature(check_result)   # a diagnose.Signature or None
    d = with_precision(diagnosis, check_result)  # the Diagnosis, its summary naming precision where it fits

Pure functions of a CheckResult and a Diagnosis: no adapter calls, no I/O.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from .tolerances import UNIT_ROUNDOFF, dtype_name

# A precision bug errs by at most a few units of the input dtype's rounding (relative L2): half
# accumulation over thousands of keys reaches ~1-4 u, an fp16 LSE ~0.3 u. A semantic bug on the same
# case moves the answer by a visible fraction (a key more or less, a wrong scale): well above this.
PRECISION_MAX_U = 8.0
# dQ and dK are cancelling sums (P * (dP - D) terms): against them the roundings of the terms read as many u (a
# correct kernel is allowed 8x naive's error, tens of u with V's mean or a wide head). A gradient whose error is
# within this many times its own bound (what a correct kernel reaches on the case) is still a few roundings: a
# dQ summed key by key in fp16 errs 13-21 u at 2x the bound; a backward semantic bug (a key dropped, D left out,
# a wrong scale) is far outside it.
PRECISION_MAX_BOUND = 4.0
_GRADIENTS = ("dq", "dk", "dv")
_NUMERIC = ("out", "lse", "dq", "dk", "dv")
_WHERE = {"out": "the forward (P @ V accumulation, the rescale or the row sum)",
          "lse": "the softmax statistics (an exp approximation, a row sum or the LSE itself kept in a narrow type)",
          "dq": "the backward (dS, D = rowsum(dO * O) or the dQ/dK accumulation)",
          "dk": "the backward (dS, D = rowsum(dO * O) or the dQ/dK accumulation)",
          "dv": "the backward (the dV accumulation)"}
PRECISION_KEY = "precision"


def precision_signature(result):
    """A Signature naming precision when every failing numeric output of `result` errs by at most
    PRECISION_MAX_U units of the input dtype (relative L2; a gradient also within PRECISION_MAX_BOUND times its
    bound), finitely, with no element-wise NaN/Inf disagreement; None otherwise (or when nothing numeric failed)."""
    from .diagnose import Signature

    failing = [c for c in result.comparisons if not c.passed]
    numeric = [c for c in failing if c.name in _NUMERIC]
    if not numeric or len(numeric) != len(failing):
        return None
    name = dtype_name(result.case.dtype)
    u = UNIT_ROUNDOFF.get(name)
    if u is None or name == "float64":
        return None
    parts = []
    for c in numeric:
        if c.problems and any("shape" in p or "returned nothing" in p or "no gradient" in p for p in c.problems):
            return None
        if c.nonfinite_mismatches or not math.isfinite(c.rel_l2):
            return None
        if c.rel_l2 > PRECISION_MAX_U * u and not (c.name in _GRADIENTS and c.rel_l2 <= PRECISION_MAX_BOUND * c.tol_norm):
            return None
        ratio = c.rel_l2 / c.tol_norm if c.tol_norm > 0 else math.inf
        parts.append((c, ratio))
    worst, ratio = max(parts, key=lambda x: x[1])
    names = ", ".join(c.name for c, _ in parts)
    title = (f"precision, not semantics: {names} off by {worst.rel_l2 / u:.2g} u of {name} (rel L2 {worst.rel_l2:.2g}, "
             f"{ratio:.2g}x what a correct kernel reaches on this case): low-precision arithmetic in {_WHERE[worst.name]}")
    detail = "no alternative semantics explains it; the error is a few roundings of the input dtype"
    if any(c.name == "lse" for c, _ in parts):
        lse = next(c for c, _ in parts if c.name == "lse")
        if 0.05 * u <= lse.rel_l2 <= 1.5 * u:
            detail += f"; the LSE errs like a value rounded to {name} (SPEC: the LSE is float32)"
    return Signature(PRECISION_KEY, title, min(1.0, 1.0 / max(ratio, 1e-12)), detail)


def with_precision(diagnosis, result):
    """`diagnosis` with the precision signature first and as its summary, when no alternative semantics
    fits and the check's errors are of the precision kind; otherwise `diagnosis` unchanged."""
    if diagnosis.explained:
        return diagnosis
    if any(s.key in ("some_heads", "fully_masked_rows", "last_key_tile") for s in diagnosis.signatures):
        return diagnosis  # confined errors are semantic (a head, a masked row, a tile)
    sig: Optional[object] = precision_signature(result)
    if sig is None:
        return diagnosis
    sigs = list(diagnosis.signatures)
    if sigs and sigs[0].key == "grows_with_lk":  # already the more specific precision finding: it stays first
        return replace(diagnosis, summary=f"precision, not semantics: {sigs[0].title} ({sig.title.split(': ', 1)[1]})",
                       signatures=sigs[:1] + [sig] + sigs[1:])
    return replace(diagnosis, summary=sig.title, signatures=[sig] + sigs)
