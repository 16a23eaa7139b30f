"""NVIDIA Transformer Engine: `transformer_engine.pytorch.DotProductAttention`.

Importing this module imports no Transformer Engine and touches no GPU. TE picks its own backend
(FlashAttention, cuDNN fused attention or its unfused PyTorch path, steered by NVTE_FLASH_ATTN /
NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN); the adapter tests DotProductAttention as a user gets it.
One module is built per (heads, kv groups, head dims, dropout, scale, format) and reused.

Claims, from the DotProductAttention docstring (transformer_engine/pytorch/attention/
dot_product_attention/dot_product_attention.py, TE 1.x - 2.x) -- not yet from a run:

- qkv_format "bshd" (a view of the BHSD inputs; TE reads the strides) and "thd" for varlen with
  cu_seqlens_q / cu_seqlens_kv and a "padding*" mask type.
- attn_mask_type: "causal" ("align the diagonal line to the top left corner") for top-left,
  "causal_bottom_right" for bottom-right, "arbitrary" for a boolean mask -- whose convention is the
  opposite of SPEC's: "A True value means the corresponding position is masked out", so the adapter
  passes ~mask. A float mask goes in as core_attention_bias ("post_scale_bias", added after scaling).
- window_size (left, right): "[i + seqlen_k - seqlen_q - window_size[0], i + seqlen_k - seqlen_q +
  window_size[1]] inclusive", -1 unbounded: SPEC's window. With "causal" (top-left) TE aligns the
  window top-left instead (bottom_right_diagonal defaults to False there): refused.
- ALiBi: core_attention_bias_type="alibi" with alibi_slopes [H] or [B, H]; the diagonal is aligned
  bottom-right except for the top-left causal types, so top-left causal + ALiBi with Lq != Lk is refused.
  The docstring says "It adds a bias of (-alibi_slope * (i + seqlen_k - seqlen_q - j))" (signed), but with
  given slopes every backend computes SPEC's absolute distance: the unfused and fused backends build the bias
  in `dot_product_attention/utils.py` `get_alibi` (`bias = bias.abs().mul(-1)`; the fused backend turns
  "alibi" with slopes into that "post_scale_bias"), and the flash backend passes the slopes to flash-attn,
  whose bias is -slope * |i + seqlen_k - seqlen_q - j| (TE 2.20.0.dev0, NVIDIA/TransformerEngine@d0067d0).
- Sinks: softmax_type="learnable" (TE >= 2.9): "Softmax(S)_{:,h,:,i} = exp(S_{:,h,:,i}) / (exp(alpha_h) +
  sum_j exp(S_{:,h,:,j})) where alpha is a learnable parameter of shape [h]" -- attnverify's sinks; the unfused
  backend (backends.py) appends `softmax_offset` as one more column of the scaled, biased scores before the
  masked softmax and drops it before dropout, so the sink is unscaled and never dropped, as in SPEC. The
  module's parameter `softmax_offset` is replaced by `spec.sinks` for the call (torch.func.functional_call), so
  the sink's gradient reaches `spec.sinks`. A TE older than 2.9 (no softmax_type) is refused sink cases.
- GQA: num_gqa_groups = Hkv. Dropout: attention_dropout (module in training mode); no keep-mask is
  returned, so it is checked statistically. No LSE output, no softcap.
- dtypes fp16/bf16; head dims multiples of 8 up to 256 (the fused and flash backends' limits);
  Dv != D claimed: kv_channels=(d, dv), "if not [the same], kv_channels should be a tuple of two integers"
  (TE 2.20 docstring); a backend that does not take it is TE's to skip, or a finding.
- fully-masked rows: undocumented -> "unsupported". deterministic: no (fused backward may use atomics).
"""
from __future__ import annotations

import importlib.metadata
from typing import Optional

import torch

from ..spec import Spec
from ._external import bshd, gpu_library_reason, last_dim_contiguous, varlen_args
from .base import adapter

_PROBE = r"""
import torch
import transformer_engine
import transformer_engine.pytorch as te
ver = getattr(transformer_engine, "__version__", "?")
dpa = te.DotProductAttention(num_attention_heads=2, kv_channels=64, qkv_format="bshd", attn_mask_type="causal")
q = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
out = dpa(q, q, q)
torch.cuda.synchronize()
if not torch.isfinite(out).all():
    _done(False, "DotProductAttention returned non-finite values on a tiny probe input")
_done(True, version=ver)
"""

_MODULES: dict = {}
_INFO: dict = {}


def _available() -> Optional[str]:
    return gpu_library_reason("te", "transformer_engine",
                              "pip install transformer_engine[pytorch] (built for your CUDA and torch)",
                              _PROBE, info_sink=_INFO.setdefault("te", {}))


def _te_version() -> Optional[tuple]:
    """The installed Transformer Engine's (major, minor) from its package metadata (no import, no GPU), or None."""
    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            parts = importlib.metadata.version(dist).split(".")
            return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
        except (importlib.metadata.PackageNotFoundError, ValueError, IndexError):
            continue
    return None


def _refuses(case) -> Optional[str]:
    s = case.spec
    if s.sinks is not None:
        ver = _te_version()
        if ver is not None and ver < (2, 9):
            return f"Transformer Engine {ver[0]}.{ver[1]} has no softmax_type='learnable' (sinks need TE >= 2.9)"
    lq, lk = case.q.shape[2], case.k.shape[2]
    if s.causal == "top_left" and s.window is not None:
        return "Transformer Engine aligns the window top-left under the top-left 'causal' mask type"
    if s.causal == "top_left" and s.alibi_slopes is not None and lq != lk:
        return "Transformer Engine aligns ALiBi top-left under the top-left 'causal' mask type"
    m = s.attn_mask
    if m is not None:
        if m.dtype == torch.bool and s.causal != "none":
            return "Transformer Engine's 'arbitrary' mask type does not combine with causal"
        if m.dtype == torch.bool and s.window is not None:
            return "Transformer Engine's 'arbitrary' mask type does not combine with a window"
        if s.alibi_slopes is not None:
            return "Transformer Engine takes one core_attention_bias_type: ALiBi or a float mask, not both"
    return None


def _module(hq, hkv, d, dv, p, scale, fmt, sinks=False):
    key = (hq, hkv, d, dv, float(p), float(scale), fmt, sinks)
    mod = _MODULES.get(key)
    if mod is None:
        import transformer_engine.pytorch as te

        extra = dict(softmax_type="learnable") if sinks else {}
        mod = te.DotProductAttention(num_attention_heads=hq, kv_channels=d if d == dv else (d, dv),
                                     num_gqa_groups=hkv, attention_dropout=float(p), qkv_format=fmt,
                                     attn_mask_type="no_mask", softmax_scale=float(scale), **extra)
        _MODULES[key] = mod
    mod.train(p > 0)  # TE applies attention_dropout only in training mode
    return mod


def _call(mod, alpha, args, kwargs):
    """The module called, with its parameter `softmax_offset` replaced by `alpha` when there are sinks."""
    if alpha is None:
        return mod(*args, **kwargs)
    return torch.func.functional_call(mod, {"softmax_offset": alpha}, args, kwargs)


def _mask_type(spec: Spec) -> str:
    base = {"none": "", "top_left": "causal", "bottom_right": "causal_bottom_right"}[spec.causal]
    if spec.is_varlen:
        return "padding" + ("_" + base if base else "")
    if spec.attn_mask is not None and spec.attn_mask.dtype == torch.bool:
        return "arbitrary"
    return base or "no_mask"


@adapter(
    "te",
    description="Transformer Engine DotProductAttention (TE picks flash / cuDNN fused / unfused)",
    availability=_available,
    refuses=_refuses,
    dtypes=("float16", "bfloat16"),
    devices=("cuda",),
    head_dims=lambda d: d % 8 == 0 and 8 <= d <= 256,
    max_seqlen=16384,
    causal=("none", "top_left", "bottom_right"),
    window=True, softcap=False, alibi=True, attn_mask=True, gqa=True, varlen=True, dropout=True,
    backward=True, lse=False, dv_ne_d=True, fully_masked="unsupported", deterministic=False,
    memory="linear", sinks=True,
)
def te(q, k, v, spec: Spec):
    """Transformer Engine DotProductAttention."""
    b, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    fmt = "thd" if spec.is_varlen else "bshd"
    mod = _module(hq, hkv, d, dv, spec.dropout_p, spec.resolved_scale(d), fmt, sinks=spec.sinks is not None)
    # the module's learnable alpha is spec.sinks for this call (its gradient reaches spec.sinks)
    alpha = None if spec.sinks is None else spec.sinks.to(device=q.device, dtype=torch.float32)
    kw = dict(attn_mask_type=_mask_type(spec), qkv_format=fmt)
    if spec.window is not None:
        kw["window_size"] = tuple(int(x) for x in spec.window)
    if spec.alibi_slopes is not None:
        kw["core_attention_bias_type"] = "alibi"
        kw["alibi_slopes"] = torch.as_tensor(spec.alibi_slopes, device=q.device).float().contiguous()
    m = spec.attn_mask
    if m is not None:
        m4 = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))
        if m.dtype == torch.bool:
            kw["attention_mask"] = ~m4  # TE: True = masked out
        else:
            kw["core_attention_bias_type"] = "post_scale_bias"
            kw["core_attention_bias"] = m4.to(q.dtype).expand(m4.shape[0], m4.shape[1], lq, lk).contiguous()
    if spec.dropout_p > 0:
        torch.manual_seed(int(spec.seed or 0))
    if spec.is_varlen:
        cu_q, cu_k, mq, mk = varlen_args(spec, q.device)
        tq, tk, tv = (last_dim_contiguous(t[0].transpose(0, 1)) for t in (q, k, v))  # (T, H, D)
        vkw = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=mq, max_seqlen_kv=mk, **kw)
        out = _call(mod, alpha, (tq, tk, tv), vkw)
        return out.view(lq, hq, dv).transpose(0, 1).unsqueeze(0)
    out = _call(mod, alpha, (bshd(q), bshd(k), bshd(v)), kw)  # (B, Sq, H * Dv)
    return out.view(b, lq, hq, dv).transpose(1, 2)
