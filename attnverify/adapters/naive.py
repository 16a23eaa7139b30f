"""`naive`: eager PyTorch attention in the input dtype with a float32 softmax.

It is the same-dtype baseline the tolerances are measured against, so it rounds exactly where a
flash kernel must: operands and P are in the input dtype, products accumulate in float32 (a
product of two fp16 or bf16 numbers is exact in float32, so `q.float() @ k.float().T` is what a
tensor core computes), the softmax is float32, and the output is rounded to the input dtype; in the
backward, dS is rounded to the input dtype before it multiplies K and Q (as in a flash kernel).
Rounding the scores themselves to fp16 would make the baseline (and so the tolerance) far worse
than any real kernel at large logits. It implements every SPEC feature, so it also stands in for
"a correct implementation" in tests.

fp8 inputs (attnverify/fp8.py) go the way FA3 takes them: q, k, v upcast to float32 with their descales,
scores and softmax in float32, P = exp(s - m) (m the row max of the scores, a sink not included) rounded to the
input's fp8 dtype before P @ V, normalised by the float32 denominator, out in bfloat16; forward only.
"""
from __future__ import annotations

import torch

from ..spec import Output, Spec
from ..fp8 import descaled, is_fp8
from ._features import NEG_INF, keep_mask, score_bias_and_visibility
from .naive_fp8 import fp8_softmax_pv
from .base import adapter


def naive_attention(q, k, v, spec: Spec, *, return_keep: bool = True):
    p_dtype = None
    if is_fp8(q.dtype):  # FA3's way: float32 with the descales, P rounded to fp8 for P @ V, out in bfloat16
        p_dtype = q.dtype
        q, k, v, spec = descaled(q, k, v, spec, torch.float32)
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = hq // hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    kk = _RepeatHeads.apply(k, g, acc) if g > 1 else k
    vv = _RepeatHeads.apply(v, g, acc) if g > 1 else v
    bias, vis = score_bias_and_visibility(spec, b, hq, lq, lk, q.device, dtype=acc)
    keep = keep_mask(spec, (b, hq, lq, lk), q.device)
    if not spec.is_varlen:
        out, lse = _attend(q, kk, vv, spec, acc, bias, vis, keep, p_dtype)
    else:
        # each segment on its own: a packed matmul would multiply other segments' NaN/Inf keys and
        # values by zero probabilities (0 x NaN = NaN) in the forward and in every gradient
        cq = torch.as_tensor(spec.cu_seqlens_q).tolist()
        ck = torch.as_tensor(spec.cu_seqlens_k).tolist()
        outs, lses, pos = [], [], 0
        for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
            if q0 > pos:  # query rows between segments see nothing
                outs.append(q.new_zeros(b, hq, q0 - pos, vv.shape[-1]))
                lses.append(torch.full((b, hq, q0 - pos), NEG_INF, dtype=acc, device=q.device))
            sub = [_rows_cols(t, q0, q1, k0, k1) for t in (bias, vis, keep)]
            o, l = _attend(q[:, :, q0:q1], kk[:, :, k0:k1], vv[:, :, k0:k1], spec, acc, *sub, p_dtype)
            outs.append(o)
            lses.append(l)
            pos = q1
        if pos < lq:
            outs.append(q.new_zeros(b, hq, lq - pos, vv.shape[-1]))
            lses.append(torch.full((b, hq, lq - pos), NEG_INF, dtype=acc, device=q.device))
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
    if p_dtype is not None:
        out = out.to(torch.bfloat16)
    return Output(out, lse=lse if spec.return_lse else None, dropout_mask=keep if return_keep else None)


class _RepeatHeads(torch.autograd.Function):
    """K or V repeated to the g query heads of its group, in `acc`. Backward: each query head's share of dK / dV
    is rounded to the input dtype's precision and the g shares are summed, as FlashAttention-2's interface does
    for GQA (dk_expanded in the input dtype, summed per group) -- the rounding the calibrated bounds were measured
    with. A share beyond the dtype's range keeps its value at the dtype's precision instead of becoming inf:
    repeated in fp16 and then upcast, one query head's share of dK above 65504 made dK inf where the exact sum
    fits (benchmarks/repro_naive_gqa_dk_overflow.py); the sum is rounded to the input dtype once, and is inf only
    where the exact dK is beyond the range too."""

    @staticmethod
    def forward(ctx, x, g, acc):
        ctx.dtype, ctx.g = x.dtype, g
        return x.to(acc).repeat_interleave(g, dim=1)

    @staticmethod
    def backward(ctx, grad):
        shares = _round_unbounded(grad, ctx.dtype)
        b, hq = shares.shape[:2]
        return shares.view(b, hq // ctx.g, ctx.g, *shares.shape[2:]).sum(2).to(ctx.dtype), None, None


def _round_unbounded(x, dtype):
    """x rounded to `dtype`'s precision, in x's dtype; values beyond dtype's range rounded at the same relative
    precision (scaled by a power of two, exact) instead of overflowing to inf."""
    if x.dtype == dtype:
        return x
    big = x.abs() > torch.finfo(dtype).max / 2
    if not bool(big.any()):
        return x.to(dtype).to(x.dtype)
    k = 2.0 ** 16  # fp16 (max 65504) is the narrow one: a share up to 4e9 keeps 11 bits
    return torch.where(big, (x / k).to(dtype).to(x.dtype) * k, x.to(dtype).to(x.dtype))


class _SoftmaxPV(torch.autograd.Function):
    """(out, lse): out = round(softmax(s) [* keep/(1-p)]) @ v in the accumulation dtype, rounded to
    `dtype`; lse = logsumexp(s), -inf on fully-masked rows (which give out 0 and zero gradients).

    Its backward is a flash kernel's, rounding where a fused kernel must: D = rowsum(dO * O) from the
    *rounded* output O (as FlashAttention-2's preprocessing computes it from the stored output), the
    LSE's gradient folded into it (d lse / d s = P), and dS = P * (dP - D + dLSE) rounded to the input
    dtype before it multiplies K and Q. Where those sums cancel (one query row over a concentrated
    softmax), a fused kernel's dQ/dK carry that rounding; a baseline more exact than any fused kernel
    would give a bound that fails correct ones."""

    @staticmethod
    def forward(ctx, s, v, keep_scale, dtype):
        dead = torch.isneginf(s).all(dim=-1, keepdim=True)
        lse = torch.logsumexp(s.masked_fill(dead, 0.0), dim=-1, keepdim=True).masked_fill(dead, 0.0)
        p = torch.exp(s - lse)  # exactly 0 on fully-masked rows (never -inf - -inf)
        pk = p if keep_scale is None else p * keep_scale
        pr = pk.to(dtype).to(s.dtype)  # P rounded as a kernel feeds it to the P@V matmul
        out = torch.matmul(pr, v).to(dtype)
        ctx.dtype = dtype
        ctx.save_for_backward(p, pr, v, out, keep_scale)
        return out, lse.masked_fill(dead, NEG_INF).squeeze(-1)

    @staticmethod
    def backward(ctx, g, g_lse):
        p, pr, v, out, keep_scale = ctx.saved_tensors
        g = g.to(p.dtype)
        dv = torch.matmul(pr.transpose(-1, -2), g)
        dp = torch.matmul(g, v.transpose(-1, -2))  # fp32: dP of large |V| would overflow fp16
        if keep_scale is not None:
            dp = dp * keep_scale
        d = (g * out.to(p.dtype)).sum(dim=-1, keepdim=True) - g_lse.to(p.dtype).unsqueeze(-1)
        ds = p * (dp - d)
        if ctx.dtype != ds.dtype:
            ds = ds.to(ctx.dtype).to(ds.dtype)
        return ds, dv, None, None


def _rows_cols(t, q0, q1, k0, k1):
    """t[..., q0:q1, k0:k1], leaving broadcast (size-1) dimensions whole."""
    if t is None:
        return None
    rows = slice(None) if t.shape[-2] == 1 else slice(q0, q1)
    cols = slice(None) if t.shape[-1] == 1 else slice(k0, k1)
    return t[..., rows, cols]


def _attend(q, kk, vv, spec: Spec, acc, bias, vis, keep, p_dtype=None):
    """Dense attention of q against kk/vv (already repeated for GQA): returns (out in q.dtype, lse in acc)."""
    lk = kk.shape[2]
    if lk == 0 and spec.sinks is None:  # nothing to attend to: a fully-masked block
        # an empty sum keeps q and v in the graph (zero gradients) without touching their values
        link = q[..., :0].sum() + vv[..., :0].sum()
        return (q.new_zeros(*q.shape[:-1], vv.shape[-1]) + link.to(q.dtype),
                torch.full(q.shape[:-1], NEG_INF, dtype=acc, device=q.device))
    s = torch.matmul(q.to(acc), kk.to(acc).transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
    if spec.softcap is not None:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    if bias is not None:
        s = s + bias
    if vis is not None:
        s = s.masked_fill(~vis, NEG_INF)
    keep_scale = None if keep is None else keep.to(acc) / (1.0 - spec.dropout_p)
    vv = vv.to(acc)
    if spec.sinks is not None:  # the sink: one more score column (per head) over a zero value row
        sink = spec.sinks.to(device=s.device, dtype=acc).reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        s = torch.cat([s, sink], dim=-1)
        vv = torch.cat([vv, vv.new_zeros(*vv.shape[:-2], 1, vv.shape[-1])], dim=-2)
        if keep_scale is not None:  # the sink is never dropped (it has no value to drop)
            keep_scale = torch.cat([keep_scale, keep_scale.new_ones(*keep_scale.shape[:-1], 1)], dim=-1)
    if p_dtype is not None:
        return fp8_softmax_pv(s, vv, keep_scale, p_dtype, spec.sinks is not None)
    return _SoftmaxPV.apply(s, vv, keep_scale, q.dtype)


@adapter(
    "naive",
    dtypes=("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"),
    devices=("cpu", "cuda"),
    head_dims=lambda d: 1 <= d <= 512,
    max_seqlen=8192,
    causal=("none", "top_left", "bottom_right"),
    window=True, softcap=True, alibi=True, attn_mask=True, gqa=True, varlen=True, dropout=True,
    backward=True, lse=True, dv_ne_d=True, fully_masked="zeros", deterministic=True,
    memory="quadratic", kv_cache=True, paged=True, page_sizes=lambda p: p >= 1, append=True,
    cache_leftpad=True, num_splits=(1, 2, 3, 4, 5, 8, 16, 32), sinks=True, attention_chunk=True, descales=True,
    description="eager PyTorch, input dtype, float32 softmax (the same-dtype baseline)",
)
def naive(q, k, v, spec: Spec):
    return naive_serving(q, k, v, spec)


def naive_serving(q, k, v, spec: Spec):
    """naive_attention, with KV caches and num_splits (adapters/naive_serving.py)."""
    from .naive_serving import cache_attention, split_attention

    if spec.cache_seqlens is not None:
        return cache_attention(q, k, v, spec, naive_serving)
    if (spec.num_splits is not None and spec.num_splits > 1 and not spec.is_varlen and spec.dropout_p == 0
            and spec.sinks is None):  # (with sinks: one pass; the sink joins the denominator once)
        return split_attention(q, k, v, spec, spec.num_splits)
    return naive_attention(q, k, v, spec.replace(num_splits=None) if spec.num_splits else spec)
