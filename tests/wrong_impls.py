"""Deliberately wrong attention implementations, one bug each, and the property expected to catch it.

Most are a tiled (BLOCK_M x BLOCK_N = 16 x 16) online-softmax forward in float32 with one bug
switched on; gradients flow through autograd. Each is an unregistered adapter claiming what a
typical fused kernel claims. `WRONG` maps a name to (adapter, property names that must catch it).
"""
from __future__ import annotations

import math

import torch

from attnverify.adapters._features import score_bias_and_visibility
from attnverify.adapters.base import adapter
from attnverify.adapters.naive import naive_attention
from attnverify.spec import Output, Spec

BM, BN = 16, 16

CLAIMS = dict(
    dtypes=("float32", "float16", "bfloat16"), devices=("cpu",), head_dims=lambda d: 1 <= d <= 256,
    max_seqlen=4096, causal=("none", "top_left", "bottom_right"), attn_mask=True, gqa=True, backward=True,
    lse=True, dv_ne_d=True, fully_masked="zeros", deterministic=True, tiles=(BM, BN), register=False,
)


def tiled(q, k, v, spec: Spec, *, rescale=True, first_tile_max=False, pad_zero=False, sentinel=-math.inf,
          no_max=False, lse_base2=False, gqa_interleaved=False, unwritten_tail=False, trunc128=False,
          ignore_scale=False, decode_bug=False, batch_crosstalk=False, noise=False):
    b, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    idx = torch.arange(hq, device=q.device) % hkv if gqa_interleaved else torch.arange(hq, device=q.device) // g
    kk, vv = k[:, idx].float(), v[:, idx].float()
    if batch_crosstalk and b > 1:
        vv = vv.clone()
        vv[1:] = vv[:1]  # every batch reads batch 0's values
    qf = q.float()
    if trunc128 and d > 128:
        qf, kk = qf[..., :128], kk[..., :128]
    scale = 1.0 / math.sqrt(d) if ignore_scale else spec.resolved_scale(d)
    s = torch.matmul(qf, kk.transpose(-1, -2)) * scale
    if spec.softcap is not None:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    bias, vis = score_bias_and_visibility(spec, b, hq, lq, lk, q.device)
    if bias is not None:
        s = s + bias
    if vis is not None:
        s = s.masked_fill(~vis, sentinel)
    if decode_bug and lq == 1 and lk > 1:
        s = s.clone()
        s[..., -1] = -math.inf  # the decode path drops the newest key
    npad = (-lk) % BN
    if npad:
        s = torch.cat([s, torch.full((b, hq, lq, npad), 0.0 if pad_zero else -math.inf, device=s.device)], -1)
        vv = torch.cat([vv, torch.zeros(b, hq, npad, dv, device=vv.device)], 2)
    m = torch.full((b, hq, lq, 1), -math.inf, device=q.device)
    l = torch.zeros(b, hq, lq, 1, device=q.device)
    acc = torch.zeros(b, hq, lq, dv, device=q.device)
    order = list(range(0, lk + npad, BN))
    if noise:
        order = [order[i] for i in torch.randperm(len(order)).tolist()]
    for j0 in order:
        st = s[..., j0:j0 + BN]
        if no_max:
            p = torch.exp(st)
            l = l + p.sum(-1, keepdim=True)
            acc = acc + p @ vv[:, :, j0:j0 + BN]
            continue
        if first_tile_max and j0 > 0:
            m_new = m
        else:
            m_new = torch.maximum(m, st.amax(-1, keepdim=True))
        live = m_new > -math.inf
        m_safe = torch.where(live, m_new, torch.zeros_like(m_new))
        alpha = torch.where(live, torch.exp(m - m_safe), torch.ones_like(m)) if rescale else torch.ones_like(m)
        p = torch.exp(st - m_safe)
        l = alpha * l + p.sum(-1, keepdim=True)
        acc = alpha * acc + p @ vv[:, :, j0:j0 + BN]
        m = m_new
    if no_max:
        m = torch.zeros_like(m)
    safe_l = torch.where(l > 0, l, torch.ones_like(l))
    out = torch.where(l > 0, acc / safe_l, torch.zeros_like(acc))
    lse = torch.where(l > 0, (m + torch.log(safe_l)), torch.full_like(l, -math.inf)).squeeze(-1)
    if lse_base2:
        lse = lse / math.log(2.0)
    if unwritten_tail and lq % BM and lq > BM:
        keep = torch.arange(lq, device=q.device) < (lq // BM) * BM
        out = out * keep[:, None]  # rows of the last partial query tile never written (stay 0)
    return Output(out.to(q.dtype), lse=lse if spec.return_lse else None)


def _mk(name, **bug):
    @adapter(f"wrong-{name}", description=f"wrong: {name}", **CLAIMS)
    def impl(q, k, v, spec):
        return tiled(q, k, v, spec, **bug)

    return impl


@adapter("wrong-zeros", **CLAIMS)
def zeros(q, k, v, spec):
    return Output(torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype) + 0 * q.sum() * 0,
                  lse=torch.zeros(q.shape[:3]) if spec.return_lse else None)


@adapter("wrong-mean-v", **CLAIMS)
def mean_v(q, k, v, spec):
    g = q.shape[1] // k.shape[1]
    out = v.repeat_interleave(g, 1).mean(2, keepdim=True).expand(*q.shape[:3], v.shape[-1]) + 0 * q.sum()
    return Output(out, lse=None)


class _GradBug(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec, mode):
        ctx.save_for_backward(q, k, v)
        ctx.spec, ctx.mode = spec, mode
        with torch.no_grad():
            return naive_attention(q, k, v, spec.replace(return_lse=False)).out

    @staticmethod
    def backward(ctx, go):
        q, k, v = ctx.saved_tensors
        spec, mode = ctx.spec, ctx.mode
        g = q.shape[1] // k.shape[1]
        with torch.enable_grad():
            q2 = q.detach().requires_grad_(True)
            if mode == "dv_not_summed":
                kr = k.detach().repeat_interleave(g, 1).requires_grad_(True)
                vr = v.detach().repeat_interleave(g, 1).requires_grad_(True)
                o = naive_attention(q2, kr, vr, spec.replace(return_lse=False)).out
                dq, dk, dv = torch.autograd.grad(o, [q2, kr, vr], go)
                b, _, l, d = dk.shape
                dk = dk.reshape(b, -1, g, l, d).sum(2)
                dv = dv.reshape(b, -1, g, l, dv.shape[-1])[:, :, 0]  # only the first head of each group
                return dq, dk, dv, None, None
            k2, v2 = k.detach().requires_grad_(True), v.detach().requires_grad_(True)
            o = naive_attention(q2, k2, v2, spec.replace(return_lse=False)).out
            dq, dk, dv = torch.autograd.grad(o, [q2, k2, v2], go)
        return dq, dk * 1.5, dv, None, None


@adapter("wrong-dk-factor", **CLAIMS)
def dk_factor(q, k, v, spec):
    return _GradBug.apply(q, k, v, spec, "dk_factor")


@adapter("wrong-dv-not-summed-gqa", **CLAIMS)
def dv_not_summed(q, k, v, spec):
    return _GradBug.apply(q, k, v, spec, "dv_not_summed")


@adapter("wrong-inplace", **CLAIMS)
def inplace(q, k, v, spec):
    out = naive_attention(q, k, v, spec)
    with torch.no_grad():
        q.mul_(1.0001)  # "pre-scales" the caller's q in place
    return out


WRONG = {
    "zeros": (zeros, ("forward_matches_reference",)),
    "mean_v": (mean_v, ("forward_matches_reference",)),
    "no_rescale": (_mk("no-rescale", rescale=False), ("forward_matches_reference",)),
    "first_tile_max": (_mk("first-tile-max", first_tile_max=True), ("forward_matches_reference",)),
    "pad_zero": (_mk("pad-zero", pad_zero=True), ("forward_matches_reference",)),
    "sentinel_1e4": (_mk("sentinel-1e4", sentinel=-1e4), ("forward_matches_reference",)),
    "gqa_interleaved": (_mk("gqa-interleaved", gqa_interleaved=True), ("forward_matches_reference",)),
    "scale_ignored": (_mk("scale-ignored", ignore_scale=True), ("forward_matches_reference",)),
    "dk_factor": (dk_factor, ("gradients_match_reference",)),
    "dv_not_summed_gqa": (dv_not_summed, ("gradients_match_reference",)),
    "batch_crosstalk": (_mk("batch-crosstalk", batch_crosstalk=True), ("forward_matches_reference",)),
    "exp_no_max": (_mk("exp-no-max", no_max=True), ("forward_matches_reference",)),
    "lse_base2": (_mk("lse-base2", lse_base2=True), ("lse_matches_reference",)),
    "wrong_lq1": (_mk("lq1", decode_bug=True), ("forward_matches_reference",)),
    "trunc_hd128": (_mk("trunc-hd128", trunc128=True), ("forward_matches_reference",)),
    "unwritten_tail": (_mk("unwritten-tail", unwritten_tail=True), ("forward_matches_reference",)),
    "inplace": (inplace, ("inputs_unmodified",)),
    "nondeterministic": (_mk("nondeterministic", noise=True), ("determinism",)),
}
