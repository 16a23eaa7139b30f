"""Zoo members of the precision class: a FlashAttention-2-style kernel, right in every semantic detail,
that loses precision at one place (issue 20).

`flash_forward(q, k, v, spec, bug)` is an online softmax over key tiles of TILE keys, in base 2 as fused
kernels compute it: scores and statistics in float32, P rounded to the input dtype for the P @ V product
(float32 accumulation), the output rounded once at the end, the LSE in float32. `FlashPrecisionGrad`
runs that forward and a FlashAttention-2 backward (P recomputed from the LSE, D = rowsum(dO * O) from the
rounded output, dS rounded to the input dtype, dQ / dK accumulated over tiles in float32). Each bug
changes one of those roundings:

  pv_acc_half      the running output accumulated (and rescaled) in the input dtype, tile after tile
  rescale_half     the rescale factor exp2(m_old - m_new) rounded to the input dtype (accumulator and row sum)
  rowsum_half      the running row sum l kept in the input dtype
  exp2_approx      exp2 with a relative error of up to 2^-10 (exact at the integers, as a short polynomial is)
  scores_half      the scores rounded to the input dtype before the row max is subtracted
  lse_half         the LSE stored in the input dtype (an fp16/bf16 buffer) instead of float32
  ds_acc_half      (backward) dQ = sum_j dS_ij K_j and dK = sum_i dS_ij Q_i in a half accumulator, key by key
  delta_half       (backward) D = rowsum(dO * O) summed in the input dtype

Every semantic feature comes from the zoo's eager engine (`_eager.scores`, `_eager._bias_and_visibility`),
so these members differ from a correct kernel by rounding only.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..spec import Output, Spec
from ._eager import _bias_and_visibility, scores

PRECISION_MEMBERS = ("flash-pv-acc-half", "flash-rescale-half", "flash-rowsum-half", "flash-exp2-approx",
                     "flash-scores-half", "flash-lse-half", "flash-bwd-ds-acc-half", "flash-bwd-delta-half")
# The backward members are caught on the cases where their error grows while a correct kernel's does not (the
# corpus entries `backward-dominant-first-key-offset` and `backward-dominant-key-wide-head`,
# attnverify/strategies/_corpus.py): on plain inputs both sit inside the gradients' bound (8x naive, never below
# the constant floor), which correct kernels on tiny cases need (docs/tolerances.md).
BACKWARD_PRECISION_MEMBERS = ("flash-bwd-ds-acc-half", "flash-bwd-delta-half")

TILE = 16  # keys (forward) and queries (backward dK) per tile
LOG2E = 1.0 / math.log(2.0)
FORWARD_PRECISION_BUGS = ("pv_acc_half", "rescale_half", "rowsum_half", "exp2_approx", "scores_half", "lse_half")
BACKWARD_PRECISION_BUGS = ("ds_acc_half", "delta_half")


def _exp2(x: torch.Tensor, approx: bool) -> torch.Tensor:
    y = torch.exp2(x)
    if approx:  # relative error 2^-10 * sin(pi * frac(x)): exact at the integers, 2^-10 between them
        f = x - torch.floor(torch.nan_to_num(x, neginf=0.0))
        y = y * (1.0 + 2.0**-10 * torch.sin(math.pi * f).nan_to_num(0.0))
    return y


def _final_scores(q, k, spec: Spec):
    """(scores in float32 with bias and masking, -inf where hidden; index of the KV head per query head)."""
    b, hq, lq, _ = q.shape
    lk = k.shape[2]
    s, idx = scores(q, k, spec)
    bias, vis = _bias_and_visibility(spec, b, hq, lq, lk, q.device, None)
    if bias is not None:
        s = s + bias.to(s.dtype)
    if vis is not None:
        s = s.masked_fill(~vis.expand(b, hq, lq, lk), -math.inf)
    return s, idx


def flash_forward(q, k, v, spec: Spec, bug: Optional[str] = None):
    """(out in the input dtype, lse float32 (B, H, Lq)) by the tiled online softmax, with one bug or none."""
    if bug is not None and bug not in FORWARD_PRECISION_BUGS:
        raise ValueError(f"bug={bug!r}: one of {FORWARD_PRECISION_BUGS}")
    dt = q.dtype
    s, idx = _final_scores(q, k, spec)
    if bug == "scores_half":
        s = s.to(dt).float()  # the score tile converted to the input dtype before the max is subtracted
    s2 = s * LOG2E
    vv = v.index_select(1, idx).float()
    b, hq, lq, lk = s.shape
    m = torch.full((b, hq, lq, 1), -math.inf, device=q.device)
    l = torch.zeros((b, hq, lq, 1), device=q.device)
    acc = torch.zeros((b, hq, lq, vv.shape[-1]), device=q.device)
    approx = bug == "exp2_approx"
    for j0 in range(0, lk, TILE):
        st = s2[..., j0:j0 + TILE]
        m_new = torch.maximum(m, st.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        alpha = _exp2(m - m_safe, approx)  # 0 while nothing was seen
        p = _exp2(st - m_safe, approx)
        if bug == "rescale_half":
            alpha = alpha.to(dt).float()  # applied to the accumulator and the row sum alike
        l = l * alpha + p.sum(-1, keepdim=True)
        if bug == "rowsum_half":
            l = l.to(dt).float()
        pv = p.to(dt).float() @ vv[:, :, j0:j0 + TILE]
        acc = acc * alpha + pv
        if bug == "pv_acc_half":
            acc = acc.to(dt).float()
        m = m_new
    dead = l == 0
    out = torch.where(dead, torch.zeros_like(acc), acc / torch.where(dead, torch.ones_like(l), l))
    m0 = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    lse = torch.where(dead, torch.full_like(l, -math.inf), (m0 + torch.log2(l.clamp_min(1e-38))) / LOG2E)
    lse = lse.squeeze(-1)
    if bug == "lse_half":
        lse = lse.to(dt).float()
    return out.to(dt), lse


def _accumulate(parts, dt, half: bool):
    """Sum float32 tile products; in the input dtype (rounded after every tile) when `half`."""
    acc = None
    for t in parts:
        acc = t if acc is None else acc + t
        if half:
            acc = acc.to(dt).float()
    return acc


class FlashPrecisionGrad(torch.autograd.Function):
    """`flash_forward` (correct) and a FlashAttention-2 backward with one of BACKWARD_PRECISION_BUGS (or none)."""

    @staticmethod
    def forward(ctx, q, k, v, spec, bug):
        out, lse = flash_forward(q, k, v, spec)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.bug = spec, bug
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        spec, bug = ctx.spec, ctx.bug
        dt = q.dtype
        b, hq, lq, d = q.shape
        hkv, lk = k.shape[1], k.shape[2]
        g = hq // hkv
        s, idx = _final_scores(q, k, spec)
        live = torch.isfinite(lse).unsqueeze(-1)
        p = torch.where(live, torch.exp(s - torch.where(live, lse.unsqueeze(-1), torch.zeros_like(s[..., :1]))),
                        torch.zeros_like(s))
        p = p.nan_to_num(0.0)
        kk, vv = k.index_select(1, idx).float(), v.index_select(1, idx).float()
        do = d_out.to(dt).float()
        dv = p.to(dt).float().transpose(-1, -2) @ do
        dp = do @ vv.transpose(-1, -2)
        prod = do * out.float()
        if bug == "delta_half":  # rowsum(dO * O) in a half accumulator, one head-dim element at a time
            delta = torch.zeros(prod.shape[:-1] + (1,), dtype=dt, device=q.device)
            for i in range(prod.shape[-1]):
                delta = delta + prod[..., i:i + 1].to(dt)
            delta = delta.float()
        else:
            delta = prod.sum(-1, keepdim=True)
        if d_lse is not None:
            delta = delta - d_lse.float().unsqueeze(-1)
        ds = p * (dp - delta)
        if spec.softcap is not None:  # through the cap: d(c tanh(x / c)) / dx = 1 - tanh^2
            sr, _ = scores(q, k, spec)
            ds = ds * (1.0 - (sr / spec.softcap) ** 2)
        ds = ds.to(dt).float()
        scale = spec.resolved_scale(d)
        half = bug == "ds_acc_half"
        if half:  # one key (query) at a time, as CUDA-core code does: outer products (exact in float32), not a GEMM call
            qf = q.float()
            dq = _accumulate([ds[..., j:j + 1] * kk[:, :, j:j + 1] for j in range(lk)], dt, True)
            dk = _accumulate([ds[:, :, i:i + 1].transpose(-1, -2) * qf[:, :, i:i + 1] for i in range(lq)], dt, True)
        else:
            dq = _accumulate([ds[..., j:j + TILE] @ kk[:, :, j:j + TILE] for j in range(0, lk, TILE)], dt, False)
            dk = _accumulate([ds[:, :, i:i + TILE].transpose(-1, -2) @ q[:, :, i:i + TILE].float()
                              for i in range(0, lq, TILE)], dt, False)
        dq = (dq * scale) if dq is not None else torch.zeros(q.shape, device=q.device)
        dk = (dk * scale) if dk is not None else torch.zeros(b, hq, lk, d, device=q.device)
        if g > 1:
            dk = dk.view(b, hkv, g, lk, d).sum(2)
            dv = dv.view(b, hkv, g, lk, dv.shape[-1]).sum(2)
        return dq.to(dt), dk.to(dt), dv.to(dt), None, None


def precision_attention(q, k, v, spec: Spec, bug: Optional[str] = None) -> Output:
    """The zoo adapters' body: a forward bug, a backward bug, or none (then a correct kernel)."""
    if bug in BACKWARD_PRECISION_BUGS or (bug is None and torch.is_grad_enabled()
                                          and any(t.requires_grad for t in (q, k, v))):
        out, lse = FlashPrecisionGrad.apply(q, k, v, spec, bug)
    elif bug is None or bug in FORWARD_PRECISION_BUGS:
        out, lse = flash_forward(q, k, v, spec, bug)
    else:
        raise ValueError(f"bug={bug!r}: one of {FORWARD_PRECISION_BUGS + BACKWARD_PRECISION_BUGS}")
    return Output(out, lse=lse if spec.return_lse else None)


# ---------------------------------------------------------------------------------------------------
# the members


def precision_members(ZooMember, adapter, claims: dict):
    """The precision class as ZooMember records (built by `_members`; `claims`: a FlashAttention-2-class
    fused kernel's). Forward members claim no backward; fp16-only where the bug is below bf16's rounding."""
    fwd = dict(claims, backward=False, tiles=(64, TILE))
    bwd = dict(claims, tiles=(64, TILE))
    F, L, G = "forward_matches_reference", "lse_matches_reference", "gradients_match_reference"
    spec_rows = [
        ("flash-pv-acc-half", "pv_acc_half", "the running output of the online softmax accumulated in the input dtype (rounded after every key tile)",
         "fused kernels keeping the O accumulator in half precision (half2 registers, an fp16 MMA accumulator)", fwd, (F,)),
        ("flash-rescale-half", "rescale_half", "the rescale factor exp2(m_old - m_new) rounded to the input dtype (applied to the accumulator and the row sum)",
         "the correction factor computed or stored in the operand dtype", fwd, (L, F)),
        ("flash-rowsum-half", "rowsum_half", "the running row sum l of the online softmax kept in the input dtype",
         "softmax statistics stored in the operand dtype between key tiles", fwd, (F, L)),
        ("flash-exp2-approx", "exp2_approx", "exp2 with a relative error of up to 2^-10 (exact at the integers)",
         "a half-precision exp2 (ex2.approx.f16) or a short polynomial in place of the float32 exp2", dict(fwd, dtypes=("float16",)), (L, F)),
        ("flash-scores-half", "scores_half", "the score tile converted to the input dtype before the row max is subtracted",
         "the S = QK^T accumulator cast to fp16/bf16 before the softmax (large logits lose their low bits)", fwd, (F,)),
        ("flash-lse-half", "lse_half", "the LSE stored in the input dtype instead of float32",
         "the softmax statistics written to an fp16/bf16 buffer (SPEC: the LSE is float32)", fwd, (L, F)),
        ("flash-bwd-ds-acc-half", "ds_acc_half",
         "backward: dQ = sum_j dS_ij K_j and dK = sum_i dS_ij Q_i summed key by key (query by query) in the input dtype",
         "a half-precision dQ accumulator (atomicAdd on fp16 dQ) instead of FlashAttention-2's float32 dq_accum", bwd, (G,)),
        ("flash-bwd-delta-half", "delta_half", "backward: D = rowsum(dO * O) summed in the input dtype",
         "the backward's preprocessing kernel reducing dO * O in half precision", bwd, (G,)),
    ]
    out = []
    for name, bug, what, stands, cl, expected in spec_rows:
        kind = "autograd" if bug in BACKWARD_PRECISION_BUGS else "eager"
        out.append(ZooMember(name, what, stands, _make(adapter, name, bug, what, cl), expected, kind))
    return out


def _make(adapter, name, bug, what, claims):
    @adapter(f"zoo-{name}", register=False, description=f"zoo (precision): {what}", **claims)
    def impl(q, k, v, spec):
        return precision_attention(q, k, v, spec, bug)

    return impl
