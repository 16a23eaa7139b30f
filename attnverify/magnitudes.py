"""The case's magnitudes that tolerances are scaled by: S (a bound on |score|), each output's scale floor, and
the row level an additive bias (ALiBi, a float mask) can move a row's largest score to. Used by `check` and
by every property that judges against the reference."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .case import Case
from .fp8 import descaled
from .reference import reference_forward
from .paged import key_lengths
from .reference.paged import cache_keys, plain_spec
from .spec import Spec
from .visibility import segments


def magnitudes(case: Case) -> dict:
    """S (a bound on |score|) and floors for each tensor's scale from the inputs' magnitudes.

    dQ and dK are sums of P * (dP - delta) terms that cancel: their rounding is set by the size of
    the terms (scale * |dO| |V| sqrt(Dv) |K|), not by the (possibly zero) result.

    A KV-cache case (spec.cache_seqlens) is measured over the keys each batch attends to (its gathered prefix and
    k_new), each value the largest over the batches: the caches' other slots (unused pages, slots past
    cache_seqlens, left padding) hold garbage by design, NaN or 1e4-sized, and measured as part of the pool they
    widened every bound by their size (a scaled-by-0.9 output passed check on a paged case with huge garbage)."""
    if case.spec.cache_seqlens is not None:
        per_batch = [magnitudes(Case(case.q[b:b + 1], kb, vb, plain_spec(case.spec, b), seed=case.seed))
                     for b, (kb, vb) in enumerate(cache_keys(case.k, case.v, case.spec))]
        if per_batch:
            return {key: max(m[key] for m in per_batch) for key in per_batch[0]}
    q, k, v, _ = descaled(case.q.detach(), case.k.detach(), case.v.detach(), case.spec)  # float64, descales applied

    def fin(t):
        return torch.where(torch.isfinite(t), t, 0.0)

    q, k, v = fin(q), fin(k), fin(v)
    scale = case.spec.resolved_scale(q.shape[-1])
    # every statistic in one host round trip (issue 25: a GPU sync each); the same float64 values as
    # float(q.norm(dim=-1).max()) and the RMS float(t.norm() / sqrt(numel))
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    qn, kn, rms_q, rms_k, rms_v, q_max, k_max, v_max = torch.stack([
        q.norm(dim=-1).max() if q.numel() else zero, k.norm(dim=-1).max() if k.numel() else zero,
        *(t.norm() / math.sqrt(max(1, t.numel())) for t in (q, k, v)),
        *(t.abs().max() if t.numel() else zero for t in (q, k, v))]).tolist()
    S = abs(scale) * qn * kn
    if case.spec.softcap is not None:
        S = _capped_score_sensitivity(q, k, scale, case.spec.softcap)
    dp = rms_v * math.sqrt(v.shape[-1])  # |dP| for a unit-RMS upstream gradient
    return {
        "S": S,
        "out": 0.5 * rms_v,
        "dq": 0.25 * abs(scale) * dp * rms_k,
        # dK_j sums the cancelling terms of every query that sees key j: with Lq >> Lk (Lk = 1 gives
        # dK = 0 exactly) their rounding grows like sqrt(Lq / Lk)
        "dk": 0.25 * abs(scale) * dp * rms_q * math.sqrt(max(1.0, q.shape[2] / max(1, k.shape[2]))),
        "dv": 0.0,
        "lse": 1.0,
        **{f"acc:{o}": n for o, n in accumulated_terms(q.shape, k.shape, *_longest_segments(case.spec)).items()},
        **{f"ftz:{o}": f for o, f in ftz_floors(q.shape, k.shape, v.shape[-1], abs(scale), q_max, k_max, v_max,
                                                    dropout_p=float(case.spec.dropout_p or 0.0)).items()},
    }


def accumulated_terms(q_shape, k_shape, longest_q: Optional[int] = None, longest_k: Optional[int] = None) -> dict:
    """Per output, how many terms a kernel sums into one element (tolerances.ACC_NORM_U): out and dQ over a row's keys,
    dK and dV over the queries that see a key (Lq times the GQA group), dsinks over every row of a head; not the LSE
    (its sum's relative error moves it absolutely, far inside its floor). longest_q / longest_k: a varlen case's
    longest segments (its packed length spans all of them)."""
    lq, lk = longest_q or q_shape[2], longest_k or k_shape[2]
    rows = lq * max(1, q_shape[1] // max(1, k_shape[1]))
    return {"out": lk, "dq": lk, "dk": rows, "dv": rows, "dsinks": q_shape[0] * q_shape[2]}


def _longest_segments(spec: Spec) -> Tuple[Optional[int], Optional[int]]:
    """A varlen case's longest query and key segments ((None, None) for a dense case)."""
    if not spec.is_varlen:
        return None, None
    segs = segments(spec.cu_seqlens_q, spec.cu_seqlens_k)
    return max((q1 - q0 for q0, q1, _, _ in segs), default=0), max((k1 - k0 for _, _, k0, k1 in segs), default=0)


# float32's smallest normal number. A kernel that forms P in float32 with flush-to-zero arithmetic (the GPU's fast
# exp2, its matrix units) drops every probability below it. Measured on the H200 (2026-12-05, the thorough run):
# the bundled kernel's dV was 0 where the reference's was ~1e-41 (sinks_match_reference, float32, scores shifted by
# -100 under a sink: every P ~ e^-99), 86% of the elements "mismatched" by 1.5e-41; the interpreter keeps
# subnormals and passed the same case.
FTZ_TINY = 2.0 ** -126
UPSTREAM_MAX = 8.0  # |dO| and |dLSE| of check's standard-normal upstream gradients (P(|x| > 8) ~ 1e-15 per element)


def ftz_floors(q_shape, k_shape, head_dim_v: int, scale: float, q_max: float, k_max: float, v_max: float, *,
               dropout_p: float = 0.0) -> dict:
    """Per output, the largest absolute error of flush-to-zero arithmetic: every probability below FTZ_TINY dropped
    (each such term is below FTZ_TINY times its other factor), and every product, partial sum or stored result below
    FTZ_TINY dropped (each below FTZ_TINY itself), so each term counts max(its other factor, 1) times FTZ_TINY, plus
    the stored value's own FTZ_TINY. out_i = sum_j P_ij v_j / l_i with l_i >= 1 (max subtracted), the numerator's
    terms and l_i's (moving out_i by at most |out_i| <= max|v| times as much) both dropped; dV_j = sum_i P_ij dO_i over
    the queries of its kv head; dS_ij = P_ij (dP_ij - D_i) with |dP - D| <= 2 |dO| |v|_1 + |dLSE|, into dQ through
    scale * k and into dK through scale * q; dsinks_h = -sum P_sink (D - dLSE) over the batch's rows of head h;
    dropout's kept values scaled by 1 / (1 - p). ~1e-34 for unit inputs, far below any real tolerance: it only keeps
    results that float32 cannot hold from counting as errors."""
    b, lq, lk = q_shape[0], q_shape[2], k_shape[2]
    rows = lq * max(1, q_shape[1] // max(1, k_shape[1]))  # queries per key: Lq times the GQA group
    dpd = 2.0 * UPSTREAM_MAX * v_max * head_dim_v + UPSTREAM_MAX
    keep = 1.0 / max(1e-6, 1.0 - dropout_p)
    return {"out": keep * ((2 * lk + 1) * FTZ_TINY * max(v_max, 1.0)),
            "dv": keep * (rows + 1) * FTZ_TINY * UPSTREAM_MAX,
            "dq": keep * (lk + 1) * FTZ_TINY * max(scale * k_max * dpd, 1.0),
            "dk": keep * (rows + 1) * FTZ_TINY * max(scale * q_max * dpd, 1.0),
            "dsinks": (b * lq + 1) * FTZ_TINY * max(dpd, 1.0), "lse": 0.0}


def score_bound(case: Case, ref_lse: Optional[torch.Tensor] = None) -> float:
    """S for tolerance_for: magnitudes' S, raised to the row level where an additive bias is present
    (biased_row_level; the reference's LSE is computed here when it is not given)."""
    S = magnitudes(case)["S"]
    if not _additive_bias(case.spec):
        return S
    if ref_lse is None:
        ref_lse = reference_forward(case.q, case.k, case.v, case.spec).lse
    return max(S, biased_row_level(case, ref_lse))


def _additive_bias(spec: Spec) -> bool:
    """Whether a bias can move a row's level: ALiBi, or a float mask with a finite nonzero entry (a mask of
    0 and -inf only hides keys)."""
    if spec.alibi_slopes is not None:
        return True
    m = spec.attn_mask
    if m is None or m.dtype == torch.bool:
        return False
    fin = m[torch.isfinite(m)]
    return bool(fin.numel()) and bool((fin != 0).any())


def key_length(case: Case) -> int:
    """The most keys a row of the case attends to, before masks: Lk, or for a KV-cache case (whose k is the cache,
    (N, S, Hkv, D)) the longest batch's cached keys plus the appended ones."""
    if case.spec.cache_seqlens is None:
        return int(case.k.shape[2])
    return max(key_lengths(case.spec), default=0)


def row_levels(case: Case, ref_lse: torch.Tensor) -> Optional[torch.Tensor]:
    """Per query row (B, H, Lq, on the CPU): |lse| + log(Lk), a bound on |m| (see biased_row_level); 0 on
    rows without a finite LSE; None when no additive bias is present."""
    if not _additive_bias(case.spec):
        return None
    lse = ref_lse.detach().double().cpu()
    return torch.where(torch.isfinite(lse), lse.abs() + math.log(max(1, key_length(case))), torch.zeros_like(lse))


def biased_row_level(case: Case, ref_lse: torch.Tensor) -> float:
    """A bound on |m_i| (a row's largest score) where an additive bias (ALiBi, a float mask) moves it.

    P = exp(s - m) is rounded like u (|s| + |m|), and for the keys that carry the weight s ~ m, so its error
    grows with the row's level |m|, which scale |q| |k| (magnitudes' S) does not bound once a bias is
    added: a varlen ALiBi row whose visible keys all sit ~400 positions back has m ~ -185, and float64
    naive on the H200 differed from the float64 reference by 120 u there. m <= lse <= m + log(Lk), so
    |m| <= |lse| + log(Lk). 0 when no additive bias is present (S already bounds |m|)."""
    levels = row_levels(case, ref_lse)
    return 0.0 if levels is None or not levels.numel() else float(levels.max())


def _capped_score_sensitivity(q: torch.Tensor, k: torch.Tensor, scale: float, cap: float) -> float:
    """S for a softcapped case: max over (i, j) of scale |q_i| |k_j| sech^2(x_ij / cap), and at least cap.

    A capped score c tanh(x / c) is bounded by c, but the rounding of x = scale q.k (about u |q| |k|)
    is not: it passes through the cap's slope sech^2(x / c), which is ~1 wherever |x| << c. Bounding S
    by c alone judged fp32 kernels at large |q| |k| by a bound 100x below their rounding."""
    if q.numel() == 0 or k.numel() == 0:
        return float(cap)
    if k.shape[1] != q.shape[1] and q.shape[1] % k.shape[1] == 0:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    kt, kn = k.transpose(-1, -2), k.norm(dim=-1)[..., None, :]
    qn = q.norm(dim=-1)
    rows = max(1, (1 << 24) // max(1, q.shape[0] * q.shape[1] * k.shape[2]))  # bounded memory per chunk
    best = 0.0
    for i in range(0, q.shape[2], rows):
        y = (abs(scale) / cap) * (q[:, :, i:i + rows] @ kt).abs()
        e = torch.exp(-2.0 * y)
        sech2 = 4.0 * e / (1.0 + e) ** 2
        best = max(best, float((abs(scale) * qn[:, :, i:i + rows, None] * kn * sech2).max()))
    return max(float(cap), best)
