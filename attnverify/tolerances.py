"""Per-dtype tolerances: the table as data and the rule that applies it (docs/tolerances.md).

The rule, for each output (out, lse, dq, dk, dv), with u the unit roundoff of the input dtype and
s the RMS of the reference tensor (its scale):

  norm-wise     rel_L2(x, ref)  <=  max(NORM_U[o] * u_S,  BASELINE_FACTOR[o] * rel_L2(baseline, ref))
  element-wise  |x_i - ref_i|   <=  max(ELEM_U[o] * u_S * (|ref_i| + s),  BASELINE_FACTOR[o] * max_i |baseline_i - ref_i|)

where u_S = u + SCORE_U * u_acc * S (wide types: FLOOR_SCALE * u + ..., see below): scores are formed in float32 (u_acc) and an absolute error of
u_acc * |s| in a score moves the softmax by as much, so a case whose scores reach S = 1000 cannot be
judged at u alone (S is bounded by scale * max|q_i| * max|k_j|). s is max(RMS(ref), a floor from
the inputs' magnitudes) so that a reference of exact zeros (Lk = 1 gives dQ = 0 by cancellation)
still admits the rounding of the terms that cancel.

`baseline` is the same-dtype eager implementation (`naive`) run on the very same inputs: a correct
kernel is about as accurate as it. The u-terms are floors, so a baseline error of exactly 0 (an
all-equal row, a tiny case) can never fail a correct kernel. The constants were calibrated on
thousands of random and adversarial cases (benchmarks/calibrate_tolerances.py) and are proven tight
by tests that must reject zeros, mean(V), a copy of V, uniform attention, shifted diagonals, ...
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

UNIT_ROUNDOFF = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
    "float8_e4m3fn": 2.0**-4,
    "float8_e5m2": 2.0**-3,
}

OUTPUTS = ("out", "lse", "dq", "dk", "dv")

# Floors, in units of u. Forward errors of correct kernels sit near 0.4-0.8 u (rel L2) and the
# worst element below ~8 u(|ref|+s); gradients carry a few more roundings (dS = P * (dP - delta)).
# Measured (docs/tolerances.md): out sits at 0.35-0.8 u (rel L2) for every correct backend, so a
# floor of 1.5 u still rejects P@V accumulated in fp16 at Lk = 4096 (3.6 u with mean(V) = 1).
# dQ/dK element-wise: fused backward kernels round dS to the input dtype before dS @ K; with a towering
# key (peaked softmax) single elements of dQ reached 3.2x a 16u bound on the H200 (sdpa-efficient bf16),
# hence 48u; the norm-wise floor stays tight.
NORM_U = {"out": 1.5, "lse": 4.0, "dq": 4.0, "dk": 4.0, "dv": 2.5}
ELEM_U = {"out": 8.0, "lse": 16.0, "dq": 48.0, "dk": 48.0, "dv": 12.0}
# A kernel may be this many times less accurate than the same-dtype baseline (flash-attn: 2 / 3).
# Gradients get 4 (not flash-attn's 3) because this baseline keeps scores in float32 and is so more
# accurate than flash-attn's fp16 reference; fused kernels round dS to the input dtype where the
# baseline does not (measured: sdpa-cudnn bf16 dK at 3.5x the baseline with scores near -1000).
BASELINE_FACTOR = {"out": 2.0, "lse": 2.0, "dq": 4.0, "dk": 4.0, "dv": 4.0}
# The u-floors in units of u suit half types, whose error is the final rounding (0.35-0.8 u). In
# float32 the final rounding is negligible and accumulation dominates: correct kernels measured at a
# median of 2-4 u (rel L2) on the CPU and the H200, so the floors scale up for wider types.
FLOOR_SCALE = {"float32": 4.0, "float64": 16.0}
# Coefficient of u_acc * S (largest |score|) in the effective unit roundoff.
SCORE_U = 4.0

# Accumulation is float32 even for half inputs; float32 inputs get a float32 LSE; an LSE is
# never more precise than float32 (SPEC: LSE is float32).
_LSE_FLOOR_DTYPE = "float32"


@dataclass(frozen=True)
class Tolerance:
    output: str
    dtype: str
    norm: float  # allowed relative L2 error
    elem_u: float  # element-wise coefficient (times u * (|ref| + s))
    u: float
    elem_floor: float  # the baseline term of the element-wise bound (absolute)
    scale_floor: float = 0.0  # lower bound for s, the tensor's scale, from the inputs' magnitudes
    # per query row (B, H, Lq): elem_u * u from each row's own score bound (rows_at), else None
    row_coef: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)

    def allowed(self, ref_abs: torch.Tensor, scale: float) -> torch.Tensor:
        s = max(scale, self.scale_floor)
        coef = self.elem_u * self.u
        if self.row_coef is not None:
            coef = self.row_coef.to(ref_abs.device, ref_abs.dtype)
            coef = coef.unsqueeze(-1) if ref_abs.dim() == coef.dim() + 1 else coef
        return torch.clamp(coef * (ref_abs + s), min=self.elem_floor)

    def rows_at(self, row_score: torch.Tensor, loosen: float = 1.0) -> "Tolerance":
        """This tolerance with its element-wise bound set per query row from each row's own score bound
        `row_score` (B, H, Lq): one row lifted by an additive bias must not widen every other row's bound.
        The norm-wise bound stays the whole tensor's."""
        # elem_u * u of tolerance_for, per row
        coef = ELEM_U[self.output] * _widened_u(self.output, self.dtype, _score_term(self.dtype, row_score.double())) * loosen
        return dataclasses.replace(self, row_coef=coef.cpu())


def _score_term(dtype, score_max):
    """SCORE_U * u_acc * S: an absolute score error of u_acc * S moves the softmax by as much (S may be a tensor)."""
    return SCORE_U * UNIT_ROUNDOFF["float32" if dtype_name(dtype) != "float64" else "float64"] * score_max


def _widened_u(output: str, dtype, score) -> float:
    """FLOOR_SCALE widens the rounding of wide types' accumulation, not the score term: scaling both let
    float32 TF32-rounded scores pass at large |q||k| (tests/test_tolerances.py)."""
    return FLOOR_SCALE.get(dtype_name(dtype), 1.0) * unit_roundoff(dtype, output) + score


def dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def unit_roundoff(dtype, output: str = "out") -> float:
    name = dtype_name(dtype)
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"no tolerance for dtype {name!r}; known: {sorted(UNIT_ROUNDOFF)}")
    u = UNIT_ROUNDOFF[name]
    if output == "lse":
        u = max(u, UNIT_ROUNDOFF[_LSE_FLOOR_DTYPE])
    return u


def tolerance_for(
    output: str,
    dtype,
    *,
    baseline_rel_l2: Optional[float] = None,
    baseline_max_abs: Optional[float] = None,
    score_max: float = 0.0,
    scale_floor: float = 0.0,
    loosen: float = 1.0,
) -> Tolerance:
    """The bound for one output. `loosen` (>= 1) is a user's explicit, reported widening."""
    if output not in OUTPUTS:
        raise ValueError(f"tolerance_for(output={output!r}): use one of {OUTPUTS}")
    if not loosen >= 1.0:
        raise ValueError(f"tolerance_for(loosen={loosen}): must be >= 1 (tolerances are never tightened below calibration)")
    u0 = unit_roundoff(dtype, output)
    score = 0.0
    if score_max and score_max == score_max:
        score = _score_term(dtype, float(score_max))
    u = u0 + score
    k = BASELINE_FACTOR[output]
    fs = _widened_u(output, dtype, score) / u if math.isfinite(u) else 1.0
    norm = NORM_U[output] * u * fs
    if baseline_rel_l2 is not None and baseline_rel_l2 == baseline_rel_l2:  # not NaN
        norm = max(norm, k * float(baseline_rel_l2))
    floor = 0.0
    if baseline_max_abs is not None and baseline_max_abs == baseline_max_abs:
        floor = k * float(baseline_max_abs)
    return Tolerance(output, dtype_name(dtype), norm * loosen, ELEM_U[output] * fs * loosen, u, floor * loosen, scale_floor)
