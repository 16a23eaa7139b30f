"""The eager (PyTorch) engine of the zoo: a correct attention with one named bug switched on.

`attend(q, k, v, spec, bug=None)` computes attention the way a fused kernel does (scores, softmax
statistics and the P @ V products in float32; P and the output rounded to the input dtype), with
every SPEC feature (GQA, scale, softcap, ALiBi, causal alignments, windows, masks, varlen, dropout,
LSE). With `bug=None` it agrees with the float64 reference within the tolerances (tests/test_zoo.py
holds it to that on the features each member claims); each `bug` changes exactly one thing, at the
place a real kernel gets it wrong. It is written independently of `attnverify.adapters.naive` so
that a zoo member is never "naive plus a patch".

The backward members (`BuggyGrad`) run this forward and a deliberately wrong backward.
"""
from __future__ import annotations

import math
import random
from typing import Optional

import torch

from ..spec import Output, Spec
from ..visibility import row_key_indices, visible

FORWARD_BUGS = (
    "gqa_interleaved", "batch_kv_from_batch0", "scale_missing", "scale_twice", "scale_ignored",
    "softcap_before_scale", "alibi_sign", "alibi_top_left", "causal_top_left", "window_off_by_one",
    "varlen_leak", "decode_drops_last_key", "hd_trunc_128", "fm_nan", "fm_mean_v", "fm_unmasked",
    "exp_no_max", "split_kv_equal_weights", "dropout_no_rescale", "pv_half_accumulate",
)
SPLIT_KV = 32  # keys per split of the split-KV (flash-decoding) member


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _positional(lq: int, lk: int, spec: Spec, device, bug: Optional[str]) -> Optional[torch.Tensor]:
    """(Lq, Lk) visibility from causal and window (bottom-right aligned window), with the bug."""
    causal = spec.causal
    if bug == "causal_top_left" and causal == "bottom_right":
        causal = "top_left"  # the kernel knows only SDPA's alignment
    if causal == "none" and spec.window is None and not (bug == "decode_drops_last_key" and lq == 1):
        return None
    i, j, diag = row_key_indices(lq, lk, device)
    vis = visible(i, j, diag, causal, spec.window)
    if bug == "window_off_by_one" and spec.window is not None and spec.window[0] >= 0:
        vis &= j != diag - spec.window[0]  # j > diag - left: the left bound one too narrow
    if bug == "decode_drops_last_key" and lq == 1 and lk > 1:
        vis &= j < lk - 1  # the decode path uses cache_seqlens - 1 keys: the newest key is never read
    return vis


def _alibi_distance(lq: int, lk: int, device, bug: Optional[str]) -> torch.Tensor:
    i = torch.arange(lq, device=device, dtype=torch.float32)[:, None]
    j = torch.arange(lk, device=device, dtype=torch.float32)[None, :]
    if bug == "alibi_top_left":
        return (i - j).abs()
    return (i + (lk - lq) - j).abs()


def _slopes(spec: Spec, b: int, hq: int, device) -> torch.Tensor:
    s = torch.as_tensor(spec.alibi_slopes, device=device).float()
    return s.view(1, hq, 1, 1) if s.dim() == 1 else s.view(b, hq, 1, 1)


def _bias_and_visibility(spec: Spec, b: int, hq: int, lq: int, lk: int, device, bug: Optional[str]):
    """(bias (B|1, Hq|1, Lq, Lk) float32 or None, visibility bool broadcastable or None)."""
    bias = None
    sign = 1.0 if bug == "alibi_sign" else -1.0
    if spec.is_varlen:
        cq = torch.as_tensor(spec.cu_seqlens_q).tolist()
        ck = torch.as_tensor(spec.cu_seqlens_k).tolist()
        vis = torch.zeros(lq, lk, dtype=torch.bool, device=device)
        dist = torch.zeros(lq, lk, device=device) if spec.alibi_slopes is not None else None
        inner = spec.replace(cu_seqlens_q=None, cu_seqlens_k=None)
        for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
            if bug == "varlen_leak":
                k1 = min(k1 + 1, lk)  # cu_seqlens_k[i + 1] used as an inclusive end
            if q1 > q0 and k1 > k0:
                pv = _positional(q1 - q0, k1 - k0, inner, device, bug)
                vis[q0:q1, k0:k1] = True if pv is None else pv
                if dist is not None:
                    dist[q0:q1, k0:k1] = _alibi_distance(q1 - q0, k1 - k0, device, bug)
        if dist is not None:
            bias = sign * _slopes(spec, b, hq, device) * dist
    else:
        vis = _positional(lq, lk, spec, device, bug)
        if spec.alibi_slopes is not None:
            bias = sign * _slopes(spec, b, hq, device) * _alibi_distance(lq, lk, device, bug)
    if spec.attn_mask is not None:
        m = spec.attn_mask.to(device)
        if m.dtype == torch.bool:
            vis = m if vis is None else (vis & m)
        else:
            bias = m.float() if bias is None else bias + m.float()
    return bias, vis


def _keep_mask(spec: Spec, shape, device) -> Optional[torch.Tensor]:
    if spec.dropout_p <= 0:
        return None
    gen = torch.Generator(device="cpu").manual_seed(int(spec.seed or 0))
    return (torch.rand(shape, generator=gen) >= spec.dropout_p).to(device)


def scores(q, k, spec: Spec, bug: Optional[str] = None):
    """Final scores (B, Hq, Lq, Lk) in float32 (before masking) and the expanded K index map."""
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    acc = _acc_dtype(q)
    if bug == "gqa_interleaved":
        # repeat() where repeat_interleave() was meant: K repeated g times (g * Hkv heads, which for Hq not a
        # multiple of Hkv does not match q: the call raises, as the repeat() it stands for does)
        idx = torch.arange(g * hkv, device=q.device) % hkv
    else:
        idx = torch.arange(hq, device=q.device) // g
    kk = k.index_select(1, idx)
    if bug == "batch_kv_from_batch0" and b > 1:
        kk = kk[:1].expand(b, *kk.shape[1:])  # the batch stride of K/V is missing from the offset
    qf, kf = q.to(acc), kk.to(acc)
    if bug == "hd_trunc_128" and d > 128:
        qf, kf = qf[..., :128], kf[..., :128]  # only the first 128 dims of q.k are ever loaded
    scale = spec.resolved_scale(d)
    if bug == "scale_missing":
        scale = 1.0
    elif bug == "scale_twice":
        scale = scale * scale  # pre-scaled q, and the kernel scales again
    elif bug == "scale_ignored":
        scale = 1.0 / math.sqrt(d)  # the softmax_scale argument never reaches the kernel
    qk = torch.matmul(qf, kf.transpose(-1, -2))
    if spec.softcap is not None:
        c = spec.softcap
        if bug == "softcap_before_scale":
            s = scale * (c * torch.tanh(qk / c))
        else:
            s = c * torch.tanh(qk * scale / c)
    else:
        s = qk * scale
    return s, idx


def attend(q, k, v, spec: Spec, bug: Optional[str] = None, *, return_p: bool = False):
    """Attention with one bug (or none). Returns an `Output`; with return_p also P (float32)."""
    if bug is not None and bug not in FORWARD_BUGS:
        raise ValueError(f"bug={bug!r}: one of {FORWARD_BUGS}")
    b, hq, lq, d = q.shape
    lk, dv = k.shape[2], v.shape[3]
    acc = _acc_dtype(q)
    s, idx = scores(q, k, spec, bug)
    vv = v.index_select(1, idx)
    if bug == "batch_kv_from_batch0" and b > 1:
        vv = vv[:1].expand(b, *vv.shape[1:])
    vv = vv.to(acc)
    bias, vis = _bias_and_visibility(spec, b, hq, lq, lk, q.device, bug)
    s_raw = s
    if bias is not None:
        s = s + bias.to(acc)
    if vis is not None:
        vis = vis.expand(b, hq, lq, lk)
    if bug == "fm_unmasked":
        # "unmask unattended": a row with no visible key gets its mask row cleared and attends to
        # every key with its raw scores (the work-around for SDPA's NaN rows, applied to the output)
        hidden = torch.isneginf(s) if vis is None else (~vis | torch.isneginf(s))
        dead = hidden.all(-1, keepdim=True)
        if bool(dead.any()):
            s = torch.where(dead, s_raw.expand_as(s), s)
            vis = None if vis is None else (vis | dead)
    if bug == "fm_mean_v":
        lowest = torch.finfo(acc).min  # HF-style finite mask value instead of -inf
        if vis is not None:
            s = s.masked_fill(~vis, lowest)
        s = s.clamp_min(lowest)
    elif vis is not None:
        s = s.masked_fill(~vis, -math.inf)

    if bug == "split_kv_equal_weights" and lk > SPLIT_KV:
        return _split_kv(s, vv, q, spec, lq, lk)
    if bug == "exp_no_max":
        e = torch.exp(s)  # no max subtraction: overflows above ~88, underflows below ~-103
        l = e.sum(-1, keepdim=True)
        dead = torch.isneginf(s).all(-1, keepdim=True)  # rows that see no key: 0, as declared
        p = torch.where(dead, torch.zeros_like(e), e / torch.where(dead, torch.ones_like(l), l))
        lse = torch.log(l).squeeze(-1)
    elif bug in ("fm_nan", "fm_mean_v"):
        p = torch.softmax(s, dim=-1)  # all -inf -> NaN; all finfo.min -> uniform, i.e. mean(V)
        lse = torch.logsumexp(s, dim=-1)
    else:
        dead = torch.isneginf(s).all(-1, keepdim=True)
        lse = torch.logsumexp(s.masked_fill(dead, 0.0), dim=-1, keepdim=True)
        p = torch.exp(s - lse).masked_fill(dead, 0.0)
        lse = lse.masked_fill(dead, -math.inf).squeeze(-1)
    keep = _keep_mask(spec, (b, hq, lq, lk), q.device)
    pd = p
    if keep is not None:
        pd = p * keep if bug == "dropout_no_rescale" else p * keep / (1.0 - spec.dropout_p)
    if bug == "pv_half_accumulate" and q.dtype in (torch.float16, torch.bfloat16):
        # a CUDA-core decode kernel: one key at a time, products summed in a half (half2) accumulator
        ph, vh = pd.to(q.dtype), vv.to(q.dtype)
        o = torch.zeros(b, hq, lq, dv, dtype=q.dtype, device=q.device)
        for j in range(lk):
            o = o + ph[..., j:j + 1] * vh[:, :, j:j + 1, :]
        out = o
    else:
        out = torch.matmul(pd.to(q.dtype).to(acc), vv).to(q.dtype)
    res = Output(out, lse=lse.float() if spec.return_lse else None)
    return (res, p) if return_p else res


def _split_kv(s, vv, q, spec, lq, lk):
    """Flash-decoding: per split a normalised partial output and its LSE, then a combine step."""
    outs, lses = [], []
    for j0 in range(0, lk, SPLIT_KV):
        sj = s[..., j0:j0 + SPLIT_KV]
        dead = torch.isneginf(sj).all(-1, keepdim=True)
        lj = torch.logsumexp(sj.masked_fill(dead, 0.0), dim=-1, keepdim=True)
        pj = torch.exp(sj - lj).masked_fill(dead, 0.0)
        outs.append(torch.matmul(pj.to(q.dtype).to(vv.dtype), vv[:, :, j0:j0 + SPLIT_KV]))
        lses.append(lj.masked_fill(dead, -math.inf))
    o = torch.stack(outs, 0)
    ls = torch.stack(lses, 0)
    live = (~torch.isneginf(ls)).to(o.dtype)
    # BUG: the splits are averaged with equal weights; the combine must weight split i by exp(lse_i - lse)
    out = (o * live).sum(0) / live.sum(0).clamp_min(1.0)
    lse = torch.logsumexp(ls, 0).squeeze(-1)
    return Output(out.to(q.dtype), lse=lse.float() if spec.return_lse else None)


# ---------------------------------------------------------------------------------------------------
# backward bugs

BACKWARD_BUGS = ("dk_missing_scale", "dv_gqa_last_head", "bwd_always_causal", "dq_atomic_order")
DQ_TILE = 16
_sysrand = random.SystemRandom()  # the order atomics land in: not reproducible by any seed


class BuggyGrad(torch.autograd.Function):
    """Correct forward (`attend`), wrong backward (one of BACKWARD_BUGS)."""

    @staticmethod
    def forward(ctx, q, k, v, spec, bug):
        ctx.save_for_backward(q, k, v)
        ctx.spec, ctx.bug = spec, bug
        with torch.no_grad():
            return attend(q, k, v, spec.replace(return_lse=False)).out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v = ctx.saved_tensors
        spec, bug = ctx.spec, ctx.bug
        b, hq, lq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        bspec = spec.replace(return_lse=False)
        if bug == "bwd_always_causal" and spec.causal == "none":
            bspec = bspec.replace(causal="bottom_right")  # the causal flag is not passed to the backward
        with torch.enable_grad():
            q2, k2, v2 = (t.detach().requires_grad_(True) for t in (q, k, v))
            if bug == "dv_gqa_last_head" and g > 1:
                kr = k2.repeat_interleave(g, 1)
                vr = v2.detach().repeat_interleave(g, 1).requires_grad_(True)
                out = attend(q2, kr, vr, bspec).out
                dq, dk, dvr = torch.autograd.grad(out, (q2, k2, vr), d_out)
                dv = dvr.reshape(b, hkv, g, *dvr.shape[2:])[:, :, -1]  # last writer wins, no group sum
                return dq, dk, dv, None, None
            if bug == "dq_atomic_order":
                res, p = attend(q2, k2, v2, bspec, return_p=True)
                dq_ok, dk, dv = torch.autograd.grad(res.out, (q2, k2, v2), d_out)
                dq = _dq_by_tiles(q, k, v, spec, p.detach(), res.out.detach(), d_out).to(dq_ok.dtype)
                return dq, dk, dv, None, None
            out = attend(q2, k2, v2, bspec).out
            dq, dk, dv = torch.autograd.grad(out, (q2, k2, v2), d_out)
        if bug == "dk_missing_scale":
            dk = dk / spec.resolved_scale(d)  # dK = dS^T Q without the softmax scale
        return dq, dk, dv, None, None


def _dq_by_tiles(q, k, v, spec, p, out, d_out):
    """dQ = scale * dS @ K accumulated over key tiles in whatever order the 'atomics' land."""
    hq, d = q.shape[1], q.shape[3]
    g = hq // k.shape[1]
    kk = k.repeat_interleave(g, 1).float()
    vv = v.repeat_interleave(g, 1).float()
    do = d_out.float()
    dp = torch.matmul(do, vv.transpose(-1, -2))
    delta = (do * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    lk = k.shape[2]
    parts = [torch.matmul(ds[..., j:j + DQ_TILE], kk[:, :, j:j + DQ_TILE]) for j in range(0, lk, DQ_TILE)]
    _sysrand.shuffle(parts)
    dq = torch.zeros_like(parts[0]) if parts else torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for t in parts:
        dq = dq + t
    return dq * spec.resolved_scale(d)


def buggy_grad(q, k, v, spec: Spec, bug: str) -> Output:
    if bug not in BACKWARD_BUGS:
        raise ValueError(f"bug={bug!r}: one of {BACKWARD_BUGS}")
    return Output(BuggyGrad.apply(q, k, v, spec, bug))
