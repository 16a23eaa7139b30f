"""Multi-bug zoo members: two or three independent bugs in one implementation.

A real kernel rarely has one bug. Each member here plants several, each showing only where its own
features are present, so `attnverify selftest` can count distinct bugs planted against distinct bugs
found (the attribution and the continued search of attnverify.attribution / properties.driver):

- `pad_tail`: keys past Lk up to the next multiple of the key block are read (zero keys, zero values:
  score 0, weight exp(0 - max)) when Lk is not a multiple of the block; needs Lk % block != 0;
- `batch_rows`: the output of batch b > 0 is written at batch b - 1's rows (the last batch's rows
  stay zero); needs B >= 2;
- `scale_ignored`: a custom softmax scale never reaches the kernel; needs a custom scale;
- `causal_top_left`: bottom-right causal masked top-left; needs causal and Lq != Lk;
- `gqa_interleaved` (the eager engine's bug): query head h reads KV head h % Hkv;
- backward `always_causal`: the backward applies the causal mask although the forward had none;
  needs the backward (and a row that the causal mask cuts);
- backward `dk_missing_scale`: dK without the softmax scale; needs the backward.

`PlantedBug.needs` is the attribution each bug must get, exactly (the labels of attnverify.attribution).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..spec import Output, Spec
from ._eager import attend

BLOCK = 64  # the key block of the pad_tail bug (claimed as the adapter's key tile)
SPEC_BUGS = ("scale_ignored", "causal_top_left")
OUT_BUGS = ("pad_tail", "batch_rows")
BWD_BUGS = ("always_causal", "dk_missing_scale")


@dataclass(frozen=True)
class PlantedBug:
    name: str
    what: str
    needs: Tuple[str, ...]  # attribution labels the found bug must carry (all of them)


def _spec_bugs(q, k, spec: Spec, bugs) -> Spec:
    if "scale_ignored" in bugs and spec.scale is not None:
        spec = spec.replace(scale=None)  # the softmax_scale argument is dropped on the way to the kernel
    if "causal_top_left" in bugs and spec.causal == "bottom_right":
        spec = spec.replace(causal="top_left")  # the kernel knows SDPA's alignment only
    return spec


def forward(q, k, v, spec: Spec, bugs: Tuple[str, ...], core: Optional[str] = None) -> Output:
    """The eager engine with one core bug (or none), then the spec and output bugs; differentiable."""
    s = _spec_bugs(q, k, spec, bugs)
    res = attend(q, k, v, s.replace(return_lse=True), core)
    out, lse = res.out, res.lse
    lk = k.shape[2]
    if "pad_tail" in bugs and lk % BLOCK:
        n_pad = BLOCK - lk % BLOCK
        # the n_pad keys past Lk are loaded as zeros: each scores 0 and adds exp(0) to the row sum
        lse32 = lse.float()
        live = torch.isfinite(lse32)
        total = torch.logaddexp(torch.where(live, lse32, torch.full_like(lse32, -math.inf)),
                                torch.full_like(lse32, math.log(n_pad)))
        w = torch.where(live, torch.exp(lse32 - total), torch.zeros_like(lse32))
        out = (out.float() * w.unsqueeze(-1)).to(out.dtype)
        lse = torch.where(live, total, lse32)
    if "batch_rows" in bugs and q.shape[0] > 1:
        # the output's batch offset is one batch short: batch b lands in batch b - 1's rows
        out = torch.cat([out[1:], torch.zeros_like(out[:1])], 0)
        lse = torch.cat([lse[1:], torch.full_like(lse[:1], 0.0)], 0)
    return Output(out, lse=lse.float() if spec.return_lse else None)


class _MultiGrad(torch.autograd.Function):
    """The buggy forward; a backward recomputed through it, with the backward bug."""

    @staticmethod
    def forward(ctx, q, k, v, spec, bugs, core):
        ctx.save_for_backward(q, k, v)
        ctx.spec, ctx.bugs, ctx.core = spec, bugs, core
        with torch.no_grad():
            return forward(q, k, v, spec.replace(return_lse=False), bugs, core).out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v = ctx.saved_tensors
        spec, bugs = ctx.spec.replace(return_lse=False), ctx.bugs
        if "always_causal" in bugs and spec.causal == "none":
            spec = spec.replace(causal="bottom_right")  # the causal flag is not saved for the backward
        with torch.enable_grad():
            q2, k2, v2 = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = forward(q2, k2, v2, spec, bugs, ctx.core).out
            dq, dk, dv = torch.autograd.grad(out, (q2, k2, v2), d_out)
        if "dk_missing_scale" in bugs:
            dk = dk / spec.resolved_scale(q.shape[-1])
        return dq, dk, dv, None, None, None


def multi_attend(q, k, v, spec: Spec, bugs: Tuple[str, ...], core: Optional[str] = None) -> Output:
    for b in bugs:
        if b not in SPEC_BUGS + OUT_BUGS + BWD_BUGS:
            raise ValueError(f"bug={b!r}: one of {SPEC_BUGS + OUT_BUGS + BWD_BUGS}")
    if any(b in BWD_BUGS for b in bugs) and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        lse = None
        if spec.return_lse:
            with torch.no_grad():
                lse = forward(q, k, v, spec, bugs, core).lse
        return Output(_MultiGrad.apply(q, k, v, spec, bugs, core), lse=lse)
    return forward(q, k, v, spec, bugs, core)


def _member_adapter(name: str, bugs: Tuple[str, ...], core: Optional[str], claims: dict, what: str):
    from ..adapters.base import adapter

    @adapter(f"zoo-{name}", register=False, description=f"zoo (several bugs): {what}", **claims)
    def impl(q, k, v, spec):
        return multi_attend(q, k, v, spec, bugs, core)

    return impl


def multi_members(Z, flash: dict):
    """The multi-bug members, as `ZooMember`s (Z) over a FlashAttention-2-class claim set."""
    key_tile = f"Lk not a multiple of {BLOCK}"
    fwd_only = dict(flash, backward=False)
    pad = PlantedBug("pad_tail", f"keys past Lk read up to the next multiple of {BLOCK} when Lk is not one",
                     (key_tile,))
    rows = PlantedBug("batch_rows", "batch b > 0 written at batch b - 1's rows", ("B >= 2",))
    caus = PlantedBug("always_causal", "the backward applies the causal mask although the forward had none",
                      ("the backward",))
    # Hkv < Hq implies Hq >= 2, which the attribution does not list beside it (attribution.IMPLIED)
    gqa = PlantedBug("gqa_interleaved", "query head h reads KV head h % Hkv", ("Hkv < Hq (GQA)",))
    scale = PlantedBug("scale_ignored", "a custom softmax scale is ignored", ("a custom scale",))
    tl = PlantedBug("causal_top_left", "bottom-right causal masked top-left", ("causal=bottom_right", "Lq != Lk"))
    dk = PlantedBug("dk_missing_scale", "dK without the softmax scale", ("the backward",))
    specs = [
        ("multi-tail-batch-bwd", (pad, rows, caus), None, dict(flash, tiles=(128, BLOCK)),
         "a third-party Triton flash kernel: reads past N when N % 64 != 0, writes batch b > 0 at the wrong "
         "rows, and its backward always applies the causal mask", False),
        ("multi-gqa-scale", (gqa, scale), "gqa_interleaved", fwd_only,
         "a decode kernel wrapper: GQA heads mapped with repeat() and the softmax_scale argument dropped", False),
        ("multi-causal-dk", (tl, dk), None, flash,
         "a fused kernel: causal aligned top-left although bottom-right is declared, and dK missing the scale",
         False),
    ]
    out = []
    for name, planted, core, claims, what, fast in specs:
        # the eager engine materialises the Lq x Lk scores: claiming the flash set's memory="linear" would
        # plant one more bug (memory_scaling's) than the member says it has
        claims = dict(claims, memory="quadratic")
        bugs = tuple(p.name for p in planted if p.name != core)
        a = _member_adapter(name, bugs, core, claims, what)
        expected = ("forward_matches_reference",) + (("gradients_match_reference",) if claims.get("backward") else ())
        out.append(Z(name, "; ".join(p.what for p in planted), what, a, expected, "multi", fast=fast,
                     planted=tuple(planted)))
    return out
