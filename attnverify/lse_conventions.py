"""The reference's LSE, and the gradient through it, in the conventions an adapter declares for the LSE it returns.

    sink_excluded(claims, spec)                     True where a call has sinks and the adapter claims sink_in_lse=False
    expected_lse(claims, q, k, v, spec, ref_lse)    the expected LSE: sink_in_lse, then keyless_lse
    expected_grads(claims, q, k, v, spec, d_out, d_lse)  reference gradients with the LSE's term in that convention
    observed_lse(claims, spec, lse)                 an adapter's LSE back in the contract's convention (the diagnosis)

The one home of `sink_in_lse` (docs/adapters.md). The contract's LSE has the sink in its sum (LSE = logsumexp(scores
and sink), a row with no visible key LSE = the sink: FA4's convention). FlashMLA's flash_mla_interface.py says of
`attn_sink`: "the final output will be scaled by exp(lse) / (exp(lse) + exp(attn_sink)). Have no affect on the returned
softmax_lse": the output still has the sink in its denominator, the returned LSE is over the visible keys only. An
adapter declaring that (sink_in_lse=False) is held to the reference's LSE of the same call without its sinks, whose
rows with no visible key are keyless rows (-inf, or what fully_masked / keyless_lse declare for them); through that LSE
no gradient reaches the sinks. Every place that puts the reference's LSE of a sink case beside an adapter's applies
these; a pair of the adapter against itself needs none (the same convention on both sides).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .reference import ReferenceGrads, reference_backward, reference_forward
from .spec import Spec
from .verdicts import keyless_lse_expected


def sink_excluded(claims, spec: Spec) -> bool:
    """Whether the call's expected LSE leaves its sinks out: the call has sinks and the adapter claims sink_in_lse=False."""
    return spec.sinks is not None and not getattr(claims, "sink_in_lse", True)


def expected_lse(claims, q, k, v, spec: Spec, ref_lse: torch.Tensor, dropout_mask=None) -> torch.Tensor:
    """`ref_lse` (the reference's LSE of the call, the sink in its sum) in the adapter's declared conventions.

    Under sink_in_lse=False the reference's LSE of the same call without sinks: a row with no visible key has none
    (log 0 = -inf), which is NaN under fully_masked="nan" and +inf under keyless_lse="+inf"; its output is still 0
    (the sink alone in its denominator). Then keyless_lse (verdicts.keyless_lse_expected) as for any call."""
    lse = ref_lse
    if sink_excluded(claims, spec):
        lse = reference_forward(q, k, v, spec.replace(sinks=None), dropout_mask=dropout_mask).lse
        if getattr(claims, "fully_masked", "zeros") == "nan":
            lse = torch.where(torch.isneginf(lse), torch.full_like(lse, math.nan), lse)
    return keyless_lse_expected(lse, getattr(claims, "keyless_lse", "-inf"))


def expected_grads(claims, q, k, v, spec: Spec, d_out, d_lse: Optional[torch.Tensor] = None, *,
                   dropout_mask=None) -> ReferenceGrads:
    """Gradients of <out, d_out> + <lse, d_lse> (float64) with the LSE the adapter declares: under sink_in_lse=False
    that LSE is over the visible keys only, so its term is the reference's without sinks (its dQ/dK, no dV and no
    dsinks), while <out, d_out>'s keeps the sink in the denominator (dsinks = -sum_i P_sink,i D_i)."""
    if d_lse is None or not sink_excluded(claims, spec):
        return reference_backward(q, k, v, spec, d_out, d_lse, dropout_mask=dropout_mask)
    g_out = reference_backward(q, k, v, spec, d_out, None, dropout_mask=dropout_mask)
    g_lse = reference_backward(q, k, v, spec.replace(sinks=None), torch.zeros_like(d_out), d_lse,
                               dropout_mask=dropout_mask)
    return ReferenceGrads(g_out.dq + g_lse.dq, g_out.dk + g_lse.dk, g_out.dv + g_lse.dv, g_out.dsinks)


def observed_lse(claims, spec: Spec, lse: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """An adapter's LSE (B, H, Lq) in the contract's convention, float64 on the CPU: what the diagnosis fits against
    the reference and its alternatives, which are all in that convention. keyless_lse="+inf": +inf read as -inf
    (log 0); sink_in_lse=False: the sink added back, logaddexp(lse, sink_h) (exact: the LSE over the keys and the sink).
    Without them, the LSE as given. Otherwise an LSE left out of the sink would fit "sinks ignored" on every failure."""
    if not isinstance(lse, torch.Tensor):
        return lse
    lse = lse.detach().to("cpu", torch.float64)
    if getattr(claims, "keyless_lse", "-inf") == "+inf":
        lse = torch.where(torch.isposinf(lse), torch.full_like(lse, -math.inf), lse)
    if sink_excluded(claims, spec) and lse.dim() == 3:
        sinks = torch.as_tensor(spec.sinks).detach().to("cpu", torch.float64).view(1, -1, 1)
        lse = torch.logaddexp(lse, sinks.expand_as(lse))
    return lse


__all__ = ["sink_excluded", "expected_lse", "expected_grads", "observed_lse"]
