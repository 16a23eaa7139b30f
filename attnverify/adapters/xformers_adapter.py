"""xFormers: `xformers.ops.memory_efficient_attention` with its attention-bias classes.

Importing this module imports no xformers and touches no GPU. xformers dispatches each call to one
of its operators (cutlass, flash, flash3, ck, ...); the adapter lets it choose (`op=None`), so
what is tested is xformers as a user gets it.

Availability (attnverify.adapters._external): installed, a CUDA device present, and -- in a
separate process -- at least one forward operator whose `is_available()` is true and one tiny call
that succeeds. A wheel built for another torch/CUDA imports but loads no operator, and then every
call raises NotImplementedError("No operator found for `memory_efficient_attention_forward` ...");
that is reported as "unavailable: ..." (with xformers' own words), never as a failing kernel.

How each SPEC feature is expressed (class names and semantics from xformers/ops/fmha/attn_bias.py):

- layout: BMHK = BSHD, passed as views of the BHSD inputs (only the last dim must be contiguous).
- causal top-left: `LowerTriangularMask()`; with an attn_mask, `LowerTriangularMaskWithTensorBias`.
- causal bottom-right: `LowerTriangularFromBottomRightMask()`; with a window, its
  `make_local_attention(left + 1)` ("cannot attend a key ... at least window_size further").
  Its docstring: with more queries than keys "the forward pass is not defined" -> refused.
- window without causal: `LocalAttentionFromBottomRightMask(window_left, window_right)`:
  "q - window_left <= k + s <= q + window_right, s = num_queries - num_keys" -- SPEC's bottom-right
  window; -1 (unbounded) is passed as Lq + Lk, which no distance reaches.
- varlen: `BlockDiagonalMask.from_seqlens(q_seqlen, kv_seqlen)` and its `make_causal()` (top-left per
  block), `make_causal_from_bottomright()` (which rejects a block with more queries than keys:
  refused) and `make_local_attention_from_bottomright(left + 1)`.
- attn_mask: a tensor bias "added to Q @ K.t" (bool masks become 0 / -inf), in the query dtype, full
  (B, H, Lq, Lk) with its last dim padded to a multiple of 8 and sliced back, xformers' documented
  recipe for lengths that are not multiples of 8. Not combined with bottom-right causal or windows
  (no bias class holds both): refused.
- GQA. The memory_efficient_attention docstring (xformers 0.0.33 ops/fmha/__init__.py; 0.0.35 re-exports
  mslk.attention.fmha with the same text): ":EXPERIMENTAL: Using with Multi Query Attention (MQA) and Grouped
  Query Attention (GQA): MQA/GQA is an experimental feature supported only for the forward pass. If you have 16
  heads in query, and 2 in key/value, you can provide 5-dim tensors in the [B, M, G, H, K] format ... xFormers
  will not automatically broadcast the inputs, so you will need to broadcast it manually". So the adapter
  asks xformers for a GQA call only without gradients: the 5-D BMGHK layout, K/V expanded (stride 0) over the
  group. When any input requires grad it never calls the 5-D form: it calls the documented MHA form (BMHK,
  with a backward: `memory_efficient_attention_backward` "Computes the gradient of the attention") on K/V
  repeated to Hq heads, and autograd sums the copies' gradients back. The `gqa` and `backward` claims together
  are therefore xformers' MHA backward behind the adapter's repeat -- documented -- and never a claim that
  xformers' GQA has a backward (attnverify's claims are per feature, not per feature and direction).
- LSE: `memory_efficient_attention_forward_requires_grad` returns (out, lse); the adapter takes the
  LSE of that second call (natural log, fp32; sliced to Lq where xformers pads it).
- dropout: `p`; the keep-mask is not exposed, so it is checked statistically; seeded with torch.manual_seed.
- fully-masked rows: output 0, LSE -inf, zero gradients ("like the xformers kernels", the documented
  behaviour its SDPA fallback reproduces).
- deterministic: no ("This operator may be nondeterministic").
- dtypes fp16/bf16/fp32 ("datatype f16, bf16 and f32"); head dims multiples of 8 up to 256 (the
  kernels' alignment; wider dims reach only cutlass); Dv != D (cutlass SUPPORTS_DIFFERENT_VALUE_EMBED).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..spec import Output, Spec
from ._external import bshd, gpu_library_reason, segments
from .base import adapter

_PROBE = r"""
import torch
import xformers, xformers.ops as xops
from xformers.ops import fmha
ops = []
for mod_name in ("cutlass", "flash", "flash3", "ck", "cutlass_blackwell"):
    mod = getattr(fmha, mod_name, None)
    op = getattr(mod, "FwOp", None) if mod is not None else None
    if op is None:
        continue
    try:
        ok = bool(op.is_available())
    except Exception:
        ok = False
    ops.append((mod_name, ok))
if not any(ok for _, ok in ops):
    _done(False, f"xformers {xformers.__version__} imports, but none of its attention operators loaded "
                 f"({', '.join(n for n, _ in ops) or 'no operator modules'}): a wheel built for another torch/CUDA?")
q = torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.float16)
try:
    out = xops.memory_efficient_attention(q, q, q)
    torch.cuda.synchronize()
except NotImplementedError as e:
    _done(False, "xformers loads, but memory_efficient_attention raises NotImplementedError: "
                 + (str(e).strip().splitlines() or [""])[0][:300])
_done(True, version=xformers.__version__, operators=[n for n, ok in ops if ok])
"""

_INFO: dict = {}


def _available() -> Optional[str]:
    return gpu_library_reason("xformers", "xformers", "pip install 'attnverify[xformers]' (a wheel built for your torch)",
                              _PROBE, info_sink=_INFO.setdefault("xformers", {}))


def _seg_lens(spec: Spec):
    segs = segments(spec)
    return [q1 - q0 for q0, q1, _, _ in segs], [k1 - k0 for _, _, k0, k1 in segs]


def _refuses(case) -> Optional[str]:
    s = case.spec
    lq, lk = case.q.shape[2], case.k.shape[2]
    if s.causal == "bottom_right":
        if s.is_varlen:
            ql, kl = _seg_lens(s)
            if any(a > b for a, b in zip(ql, kl)):
                return "xformers' BlockDiagonalCausalFromBottomRightMask rejects a block with more queries than keys"
        elif lq > lk:
            return "xformers' bottom-right causal mask with more queries than keys is undefined (attn_bias.py docstring)"
    if s.window is not None:
        if s.causal == "top_left":
            return "xformers has no bias class for top-left causal with a window"
        if s.is_varlen and s.causal != "bottom_right":
            return "xformers has no block-diagonal local-attention bias without bottom-right causal"
    if s.attn_mask is not None and (s.causal == "bottom_right" or s.window is not None):
        return "xformers has no bias class combining a tensor bias with bottom-right causal or a window"
    if s.return_lse and s.dropout_p > 0:
        return "xformers returns the LSE only from the API without dropout"
    return None


def _tensor_bias(spec: Spec, b, hq, lq, lk, dtype, device) -> torch.Tensor:
    """attn_mask -> additive bias (B, Hq, Lq, Lk) in `dtype`, last dim storage padded to a multiple of 8."""
    m = spec.attn_mask.to(device)
    if m.dtype == torch.bool:
        add = torch.zeros(m.shape, dtype=dtype, device=device).masked_fill(~m, -math.inf)
    else:
        add = m.to(dtype)
    pad = (lk + 7) // 8 * 8
    store = torch.empty(b, hq, lq, pad, dtype=dtype, device=device)
    bias = store[..., :lk]
    bias.copy_(add.expand(b, hq, lq, lk))
    return bias


def _attn_bias(spec: Spec, q, k):
    from xformers.ops import fmha

    ab = fmha.attn_bias
    b, hq, lq, _ = q.shape
    lk = k.shape[2]
    win = spec.window
    if spec.is_varlen:
        ql, kl = _seg_lens(spec)
        bd = ab.BlockDiagonalMask.from_seqlens(ql, kl, device=q.device) if _accepts_device(ab.BlockDiagonalMask.from_seqlens) \
            else ab.BlockDiagonalMask.from_seqlens(ql, kl)
        if spec.causal == "top_left":
            return bd.make_causal()
        if spec.causal == "bottom_right":
            if win is not None and win[0] >= 0:
                return bd.make_local_attention_from_bottomright(win[0] + 1)
            return bd.make_causal_from_bottomright()
        return bd
    tensor = _tensor_bias(spec, b, hq, lq, lk, q.dtype, q.device) if spec.attn_mask is not None else None
    if spec.causal == "top_left":
        return ab.LowerTriangularMask().add_bias(tensor) if tensor is not None else ab.LowerTriangularMask()
    if spec.causal == "bottom_right":
        br = ab.LowerTriangularFromBottomRightMask()
        if win is not None and win[0] >= 0:
            return br.make_local_attention(win[0] + 1)
        return br
    if win is not None:
        big = lq + lk
        return ab.LocalAttentionFromBottomRightMask(window_left=win[0] if win[0] >= 0 else big,
                                                    window_right=win[1] if win[1] >= 0 else big)
    return tensor


def _accepts_device(fn) -> bool:
    import inspect

    try:
        return "device" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _grouped(bias, hkv, g):
    """A (B, Hq, Lq, Lk) tensor bias as (B, Hkv, g, Lq, Lk) for the BMGHK layout."""
    if isinstance(bias, torch.Tensor):
        return bias.unflatten(1, (hkv, g))
    inner = getattr(bias, "_bias", None)
    if isinstance(inner, torch.Tensor) and inner.dim() == 4:
        from xformers.ops import fmha

        return fmha.attn_bias.LowerTriangularMaskWithTensorBias(inner.unflatten(1, (hkv, g)))
    return bias


def _lse_to_bhs(lse: torch.Tensor, spec: Spec, b, hq, lq) -> torch.Tensor:
    lse = lse.detach().float()
    if lse.dim() == 4:  # BMGHK: (B, G, H, M)
        lse = lse.flatten(1, 2)
    if spec.is_varlen and lse.shape[0] != 1:  # older kernels: one row per sequence, padded to the longest
        out = torch.full((1, hq, lq), -math.inf, device=lse.device)
        for i, (q0, q1, _, _) in enumerate(segments(spec)):
            out[0, :, q0:q1] = lse[i, :, : q1 - q0]
        return out
    return lse[..., :lq]


@adapter(
    "xformers",
    description="xformers.ops.memory_efficient_attention with attn_bias classes (xformers picks the operator)",
    availability=_available,
    refuses=_refuses,
    dtypes=("float16", "bfloat16", "float32"),
    devices=("cuda",),
    head_dims=lambda d: d % 8 == 0 and 8 <= d <= 256,
    max_seqlen=16384,
    causal=("none", "top_left", "bottom_right"),
    window=True, softcap=False, alibi=False, attn_mask=True, gqa=True, varlen=True, dropout=True,
    backward=True, lse=True, dv_ne_d=True, fully_masked="zeros", deterministic=False,
    tiles=(64, 64),  # cutlass forward kQueriesPerBlock x kKeysPerBlock for sm80+ fp16 (kernel_forward.h)
    memory="linear",
)
def xformers(q, k, v, spec: Spec):
    """xformers.ops.memory_efficient_attention."""
    import xformers.ops as xops

    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    bias = _attn_bias(spec, q, k)
    scale = spec.resolved_scale(d)
    needs_grad = any(t.requires_grad for t in (q, k, v))
    qq, kk, vv = bshd(q), bshd(k), bshd(v)
    five_d = g > 1 and not needs_grad
    if g > 1 and needs_grad:  # BMGHK is forward-only: give the backward plain BMHK with K/V repeated
        kk, vv = bshd(k.repeat_interleave(g, 1)), bshd(v.repeat_interleave(g, 1))
    elif five_d:  # (B, M, G, H, K): q split per group, K/V expanded (stride 0) over the group
        qq = qq.unflatten(2, (hkv, g))
        kk = kk.unsqueeze(3).expand(b, k.shape[2], hkv, g, d)
        vv = vv.unsqueeze(3).expand(b, v.shape[2], hkv, g, v.shape[3])
        bias = _grouped(bias, hkv, g)
    if spec.dropout_p > 0:
        torch.manual_seed(int(spec.seed or 0))
    out = xops.memory_efficient_attention(qq, kk, vv, attn_bias=bias, p=float(spec.dropout_p), scale=scale)
    out = out.flatten(2, 3) if five_d else out
    lse = None
    if spec.return_lse:
        with torch.no_grad():
            _, lse = xops.memory_efficient_attention_forward_requires_grad(
                qq.detach(), kk.detach(), vv.detach(), attn_bias=bias, p=0.0, scale=scale)
        lse = _lse_to_bhs(lse, spec, b, hq, lq)
    return Output(out.transpose(1, 2), lse=lse)
