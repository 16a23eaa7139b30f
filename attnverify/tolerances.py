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
all-equal row, a tiny case) can never fail a correct kernel.

Per-case rule (issue 20; `check` opts in by passing `rounding_rel_l2`): for half inputs the constant
u-floor of out is replaced by a floor that follows the case (dQ, dK, dV keep their constant floor and follow
the case only upwards: see GRADIENTS),

  norm-wise     rel_L2(x, ref)  <=  max(PER_CASE_FACTOR[o] * rel_L2(baseline, ref),
                                        ROUNDING_FACTOR[o] * rounding_rel_l2  +  NORM_U[o] * SCORE_U * u_acc * S)

where rounding_rel_l2 is the expected error of rounding the reference itself to the output dtype
(`expected_rounding`: sqrt(sum_i spacing(ref_i)^2 / 12), in the check's metric), and the LSE (float32
by SPEC, whatever the input dtype) is held to the float32 floor instead of the input dtype's. The
constant floors stay where the baseline says nothing: its error exactly 0 or not computable (dropout,
float64; fp8 has its own case-by-case rule, FP8_* below), float32 inputs (accumulation, not the final rounding, dominates there), and every
caller that does not pass rounding_rel_l2 (the properties that compare an adapter with itself). The constants were calibrated on
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
# Accumulation length. Each output is a sum over many terms (out over a row's keys, dQ over the keys, dK and dV over
# the queries that see a key). Summed in sequence (an FMA chain, as a GPU's IEEE float32 dot does it), n float32 terms
# of one sign err ~0.3 sqrt(n) u_acc relative to the sum: a key-by-key float32 kernel at mean(V) 10, norm-wise 0.32-0.35
# sqrt(n) u over 4,096 outputs (Lk = 2,048 and 8,192), up to 0.6 over 16 (numpy, Lk = 6,976), element-wise at most
# 1.45 sqrt(n) u |ref_i|; summed per 64-key tile and the tiles in sequence, ~10x less. Terms of mixed signs (mean(V)
# 0) keep their partial sums small and err far less. The wide types' constant floor (FLOOR_SCALE u) does not grow
# with n: on an H100 (2026-12-05) the bundled kernel's float32 decode (Lq = 1, Lk = 8,192) erred 1.76x and 1.14x the
# bound, where cuBLAS's naive summed more accurately than the kernel. So every bound gains u_acc sqrt(n) relative to
# the reference's own size, never to the scale floor: element-wise ACC_ELEM_U x that x |ref_i|, norm-wise ACC_NORM_U
# x that x ||ref|| / max(||ref||, s sqrt(n)) (u_acc: float32's, float64's for float64 inputs; fp8 keeps its own
# calibrated rule). The LSE takes none: a relative error e of the sum l moves log(l) by e absolutely, far inside
# its floor (a key-by-key kernel's LSE sat at 0.18 of it at Lk = 8,192).
ACC_NORM_U = 1.0
ACC_ELEM_U = 4.0
# Per-case rule (half inputs): the floor is this many times the expected error of rounding the
# reference itself to the output dtype. A correct kernel's error is that rounding plus the rounding
# of P (about as large on diffuse rows), so it sits near sqrt(2) x expected rounding; 3 leaves room for
# kernels that round P differently from the baseline (relative to the running max) and for few elements
# (measured: correct kernels at <= 1.9x it, fp16/bf16, CPU).
ROUNDING_FACTOR = {"out": 2.25, "lse": 3.0, "dq": 8.0, "dk": 8.0, "dv": 8.0}
# The baseline factor of the per-case rule. out: 1.5 (correct CPU kernels measured at <= 1.0x naive, naive
# itself at <= 1.9x the expected rounding; a P@V accumulated in fp16 per 16 keys sits at 2.1x naive and
# 3.0x the expected rounding at Lk = 200, the ci profile's longest). Gradients get 8: the CPU flash
# backward reached 2.6x naive (dV, bf16), and on the H200 (2026-12-04, ~740 cases each) sdpa-efficient's
# dQ reached 1.40x and sdpa-flash's 1.01x a bound of 4 (tiny cases: Lq = 1-2, D = 72-256), i.e. 5.6x.
PER_CASE_FACTOR = {"out": 1.5, "lse": 2.0, "dq": 8.0, "dk": 8.0, "dv": 8.0}
PER_CASE_DTYPES = ("float16", "bfloat16")
# The per-case rule of out needs this many judged elements: its factor (ROUNDING_FACTOR, from the realised error
# of correct kernels on thousands of cases) assumes the norm of many independent roundings, which concentrates
# near its expectation; the norm of a few does not. A model of a correct kernel (per element, two independent
# roundings of half a spacing each: the output's and P's), 200,000 draws per n: the 1e-5 quantile of ||error|| /
# expected rounding is 2.24 at n = 16 elements, 1.98 at 32, 1.84 at 64, 1.63 at 256, 1.51 at 1,024 (its limit is
# sqrt(2)). Measured: on the H200 (2026-12-05) sdpa-efficient bf16 erred 2.33x the expected rounding on
# `B=1 Hq=1 Lq=1 Lk=17 D=16 causal=bottom_right mask=bool` (16 elements; every element within its bound, one
# 1.05 ulp off), past the 2.25 of the rule: 1 of 1,200 cases. Below this count the constant floor (NORM_U u_S,
# always above 2.25x the expected rounding: a spacing is at most 2u of its value) is the bound.
PER_CASE_MIN_N = 64
# Gradients keep the constant floor (NORM_U u_S) under the per-case rule, which can only widen their bound:
# the bundled Triton backward (a correct FlashAttention-2 kernel, interpreter) erred 1.13x the per-case dQ bound
# on `B=2 Hq=2 Lq=1 Lk=2 D=96 fp16 causal=bottom_right q_std=k_std=6` (CPU calibration, 2026-12-04, 1 of 2,000
# Triton cases; 0.99 u, rel L2): with one query, two keys and a near one-hot softmax, dQ is a cancellation of two
# rounded terms, and neither the baseline's realised error nor the rounding of dQ itself says what a kernel that
# rounds elsewhere may err. Under the constant rule correct backward kernels reached 0.86 of it (sdpa-efficient
# dQ, H200, 21,273 cases of 2026-12-03).
GRADIENTS = ("dq", "dk", "dv")

# Accumulation is float32 even for half inputs; float32 inputs get a float32 LSE; an LSE is
# never more precise than float32 (SPEC: LSE is float32).
_LSE_FLOOR_DTYPE = "float32"

# fp8 inputs (attnverify/fp8.py; docs/tolerances.md "fp8"). The products of two fp8 numbers are exact, so the
# scores carry only the accumulator's rounding, and the output's error is that of P rounded to the fp8 dtype for
# P @ V (u = 2^-4 for e4m3, 2^-3 for e5m2, relative, per probability): out is held to NORM_U/ELEM_U x the fp8 u.
# The LSE never sees that rounding: it is held to the float32 floor (as the half dtypes' per-case rule has it).
# Scores: Hopper's fp8 tensor cores accumulate with ~14 mantissa bits (DeepSeek-V3 report, section 3.3.2), not
# float32's 24. Measured on the H200 (torch._scaled_mm, e4m3, D = 64..576, benchmarks/fp8_accumulation.py): the
# worst error of a q.k dot is 1.4-7.3 units of 2^-14 of sum |q_d k_d| (11.1-13.5 bits), so u_acc = 2^-11.
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
FP8_ACC_U = 2.0**-11
# fp8 out: the u-floors are tighter than the generic ones (which bound an adversarial P rounding, ~1.6 u with
# the scale floor) and the baseline (naive's fp8 path, which rounds P as FA3 does, relative to the row max) widens
# the bound case by case: norm-wise max(FP8_NORM_U * u_S, FP8_BASELINE_FACTOR * rel_L2(naive)), element-wise
# max(FP8_ELEM_U * u_S * (|ref| + s), FP8_BASELINE_FACTOR * max|naive - ref|). Calibrated on an FA3-like tiled
# kernel (P rounded relative to the running max of 128-key tiles): docs/tolerances.md, "fp8".
FP8_NORM_U = {"out": 0.5}
FP8_ELEM_U = {"out": 3.0}
FP8_BASELINE_FACTOR = {"out": 3.0}


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
    # the accumulation term (ACC_NORM_U, ACC_ELEM_U), relative to the reference's own size: element-wise acc_elem * |ref_i|, norm-wise
    # acc_norm * ||ref|| / (the norm's denominator); see norm_at
    acc_norm: float = 0.0
    acc_elem: float = 0.0

    def allowed(self, ref_abs: torch.Tensor, scale: float) -> torch.Tensor:
        s = max(scale, self.scale_floor)
        coef = self.elem_u * self.u
        if self.row_coef is not None:
            coef = self.row_coef.to(ref_abs.device, ref_abs.dtype)
            coef = coef.unsqueeze(-1) if ref_abs.dim() == coef.dim() + 1 else coef
        return torch.clamp(coef * (ref_abs + s) + self.acc_elem * ref_abs, min=self.elem_floor)

    def norm_at(self, ref_norm: float, denominator: float) -> float:
        """The norm-wise bound for a reference of norm `ref_norm` judged over `denominator` (>= ref_norm: the scale
        floor's): `norm`, plus the accumulation term in the share of the denominator the reference itself makes."""
        if not self.acc_norm or not denominator > 0:
            return self.norm
        return self.norm + self.acc_norm * min(1.0, ref_norm / denominator)

    def rows_at(self, row_score: torch.Tensor, loosen: float = 1.0) -> "Tolerance":
        """This tolerance with its element-wise bound set per query row from each row's own score bound
        `row_score` (B, H, Lq): one row lifted by an additive bias must not widen every other row's bound.
        The norm-wise bound stays the whole tensor's."""
        # elem_u * u of tolerance_for, per row
        elem = FP8_ELEM_U if self.dtype in FP8_DTYPES and self.output in FP8_ELEM_U else ELEM_U
        coef = elem[self.output] * _widened_u(self.output, self.dtype, _score_term(self.dtype, row_score.double())) * loosen
        return dataclasses.replace(self, row_coef=coef.cpu())


def per_case_applies(output: str, dtype, baseline_rel_l2, rounding_rel_l2, n: Optional[int] = None) -> bool:
    """Whether the per-case rule replaces the constant floor: half inputs (any input dtype but float64
    for the LSE), a rounding estimate given, a baseline error that is finite and not exactly 0, and (out) at
    least PER_CASE_MIN_N judged elements where their count `n` is known."""
    if rounding_rel_l2 is None or baseline_rel_l2 is None:
        return False
    if output == "out" and n is not None and int(n) < PER_CASE_MIN_N:
        return False
    b = float(baseline_rel_l2)
    if not (math.isfinite(b) and b > 0) or not math.isfinite(float(rounding_rel_l2)):
        return False
    name = dtype_name(dtype)
    return name in PER_CASE_DTYPES or (output == "lse" and name == "float32")


def _score_term(dtype, score_max):
    """SCORE_U * u_acc * S: an absolute score error of u_acc * S moves the softmax by as much (S may be a tensor)."""
    name = dtype_name(dtype)
    u_acc = FP8_ACC_U if name in FP8_DTYPES else UNIT_ROUNDOFF["float32" if name != "float64" else "float64"]
    return SCORE_U * u_acc * score_max


def _acc_term(dtype, terms) -> float:
    """u_acc * sqrt(terms): the scale of the relative error of summing `terms` values in sequence (0 for fp8, or
    without terms)."""
    name = dtype_name(dtype)
    if name in FP8_DTYPES or not terms or terms <= 1:
        return 0.0
    return UNIT_ROUNDOFF["float64" if name == "float64" else "float32"] * math.sqrt(float(terms))


def _widened_u(output: str, dtype, score) -> float:
    """FLOOR_SCALE widens the rounding of wide types' accumulation, not the score term: scaling both let
    float32 TF32-rounded scores pass at large |q||k| (tests/test_tolerances.py)."""
    name = dtype_name(dtype)
    if output == "lse" and name in FP8_DTYPES:
        name = _LSE_FLOOR_DTYPE
    return FLOOR_SCALE.get(name, 1.0) * unit_roundoff(dtype, output) + score


def dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def unit_roundoff(dtype, output: str = "out") -> float:
    name = dtype_name(dtype)
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"no tolerance for dtype {name!r}; known: {sorted(UNIT_ROUNDOFF)}")
    u = UNIT_ROUNDOFF[name]
    if output == "lse":
        # fp8: P's rounding never reaches the LSE (float32 scores of exact products): float32's unit roundoff
        u = UNIT_ROUNDOFF[_LSE_FLOOR_DTYPE] if name in FP8_DTYPES else max(u, UNIT_ROUNDOFF[_LSE_FLOOR_DTYPE])
    return u


def expected_rounding(ref: torch.Tensor, dtype, *, scale_floor: float = 0.0, ignore: Optional[torch.Tensor] = None) -> float:
    """Expected relative L2 error (the check's metric: the denominator never below scale_floor * sqrt(n))
    of rounding the float64 `ref` to `dtype`: sqrt(sum_i spacing(ref_i)^2 / 12) over the finite elements
    (not ignored), spacing being the dtype's gap at |ref_i| (its subnormal gap below the normal range).
    The expectation, not the realised rounding: a reference that happens to be representable (V constant)
    still admits the rounding a kernel's slightly different value meets."""
    name = dtype_name(dtype)
    if name not in UNIT_ROUNDOFF or name == "float64":
        return 0.0
    r = ref.detach().double()
    keep = torch.isfinite(r)
    if ignore is not None:
        keep = keep & ~ignore.to(r.device).expand_as(r)
    return rounding_from_terms(*(float(t) for t in rounding_terms(r, keep, name)), scale_floor)


def rounding_terms(r: torch.Tensor, keep: torch.Tensor, name: str):
    """expected_rounding's three sums as 0-dim tensors, no host round trip (attnverify.baseline_stats reads
    them with its other statistics at once): the elements kept, the norm of |r| over them, the norm of the
    dtype's gap at each."""
    a = torch.where(keep, r.abs(), 0.0)
    tiny = torch.finfo(getattr(torch, name)).tiny
    gap = 2.0 * UNIT_ROUNDOFF[name] * torch.pow(2.0, torch.floor(torch.log2(a.clamp_min(tiny))))
    return keep.sum(), a.norm(), torch.where(keep, gap, 0.0).norm()


def rounding_from_terms(n: float, a_norm: float, gap_norm: float, scale_floor: float = 0.0) -> float:
    """expected_rounding from rounding_terms' values (the denominator never below scale_floor * sqrt(n))."""
    if int(n) == 0:
        return 0.0
    den = max(a_norm, scale_floor * math.sqrt(int(n)))
    return gap_norm / math.sqrt(12.0) / den if den > 0 else 0.0


def floors_of(mags, output: str) -> dict:
    """tolerance_for's floors for `output` from magnitudes.magnitudes(case): its scale floor and its flush-to-zero
    floor ("ftz:<output>") and the number of terms it sums ("acc:<output>"), 0 where the dict has none."""
    return {"scale_floor": mags.get(output, 0.0), "ftz_floor": mags.get(f"ftz:{output}", 0.0),
            "acc_terms": mags.get(f"acc:{output}", 0)}


def tolerance_for(
    output: str,
    dtype,
    *,
    baseline_rel_l2: Optional[float] = None,
    baseline_max_abs: Optional[float] = None,
    score_max: float = 0.0,
    scale_floor: float = 0.0,
    loosen: float = 1.0,
    rounding_rel_l2: Optional[float] = None,
    judged_n: Optional[int] = None,
    ftz_floor: float = 0.0,
    sides: int = 1,
    acc_terms: int = 0,
) -> Tolerance:
    """The bound for one output. `loosen` (>= 1) is a user's explicit, reported widening.

    With `rounding_rel_l2` (expected_rounding of the reference, in the check's metric, as is
    `baseline_rel_l2` then) the per-case rule applies where the baseline is informative (see the module
    docstring); without it, the constant floors (every caller but `check`). `judged_n`: the number of elements
    the norm runs over (PER_CASE_MIN_N). `ftz_floor` (magnitudes.ftz_floors): an absolute error every element and
    the norm may reach, that of flushing float32 subnormal probabilities; it raises the element-wise floor and the
    scale floor (ftz_floor / norm: a norm-wise error up to ftz_floor * sqrt(n) passes). `sides=2`: both values
    compared carry an implementation's rounding (an adapter's output held to another of its own outputs), so their
    errors against the exact answer add up: the u-floors (norm and element-wise) are doubled, the baseline terms
    (the same pair computed by the baseline) are not. `acc_terms` (magnitudes' "acc:<output>"): how many terms the
    output sums; the bound gains u_acc * sqrt(acc_terms) relative to the reference's size, times ACC_NORM_U norm-wise
    and ACC_ELEM_U element-wise (doubled for two sides)."""
    if output not in OUTPUTS:
        raise ValueError(f"tolerance_for(output={output!r}): use one of {OUTPUTS}")
    if not loosen >= 1.0:
        raise ValueError(f"tolerance_for(loosen={loosen}): must be >= 1 (tolerances are never tightened below calibration)")
    u0 = unit_roundoff(dtype, output)
    score = 0.0
    if score_max and score_max == score_max:
        score = _score_term(dtype, float(score_max))
    u = u0 + score
    fp8_out = dtype_name(dtype) in FP8_DTYPES and output in FP8_NORM_U
    k = FP8_BASELINE_FACTOR[output] if fp8_out else BASELINE_FACTOR[output]
    fs = _widened_u(output, dtype, score) / u if math.isfinite(u) else 1.0
    if sides not in (1, 2):
        raise ValueError(f"tolerance_for(sides={sides!r}): 1 (against an exact value) or 2 (two rounded values)")
    fs *= sides
    norm = (FP8_NORM_U[output] if fp8_out else NORM_U[output]) * u * fs
    if per_case_applies(output, dtype, baseline_rel_l2, rounding_rel_l2, judged_n) and math.isfinite(u):
        if output == "lse":  # float32 by SPEC: the float32 floor, whatever the input dtype
            norm = NORM_U[output] * FLOOR_SCALE["float32"] * UNIT_ROUNDOFF["float32"] + NORM_U[output] * score
        elif output in GRADIENTS:  # never below the constant floor: see GRADIENTS
            norm = max(norm, ROUNDING_FACTOR[output] * float(rounding_rel_l2) + NORM_U[output] * score)
        else:
            norm = ROUNDING_FACTOR[output] * float(rounding_rel_l2) + NORM_U[output] * score
        norm = max(norm, PER_CASE_FACTOR[output] * float(baseline_rel_l2))
    elif baseline_rel_l2 is not None and baseline_rel_l2 == baseline_rel_l2:  # not NaN
        norm = max(norm, k * float(baseline_rel_l2))
    floor = 0.0
    if baseline_max_abs is not None and baseline_max_abs == baseline_max_abs:
        floor = k * float(baseline_max_abs)
    elem_u = FP8_ELEM_U[output] if fp8_out else ELEM_U[output]
    if ftz_floor > 0 and norm > 0:  # both sides may flush where both are rounded results
        floor = max(floor, sides * ftz_floor)
        scale_floor = max(scale_floor, sides * ftz_floor / (norm * loosen))
    acc = _acc_term(dtype, acc_terms) * sides * loosen
    return Tolerance(output, dtype_name(dtype), norm * loosen, elem_u * fs * loosen, u, floor * loosen, scale_floor,
                     acc_norm=ACC_NORM_U * acc, acc_elem=ACC_ELEM_U * acc)
