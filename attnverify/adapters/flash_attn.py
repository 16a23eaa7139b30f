"""flash-attn (Dao-AILab): FlashAttention-2 (`flash_attn`) and FlashAttention-3 (`flash_attn_interface`).

The flash-attn built-ins, each importing its library only when called (this module imports none of them):

- `flash-attn`: `flash_attn.flash_attn_func` (padded batch) and `flash_attn.flash_attn_varlen_func`
  (packed documents, `spec.cu_seqlens_*`), forward and backward through their autograd Functions.
- `flash-attn-kvcache`: `flash_attn.flash_attn_with_kvcache` (inference; paged and contiguous caches, append,
  cache_leftpad, num_splits): its own module, flash_attn_kvcache.py (FA3's is flash_attn3_kvcache.py).
- `flash-attn3`: FlashAttention-3's `flash_attn_interface.flash_attn_func` / `flash_attn_varlen_func`
  (Hopper build of the same repository, `hopper/`).

Claims, all from the libraries' docstrings and argument checks (flash_attn_interface.py and
csrc/flash_attn/flash_api.cpp of flash-attn 2.6-2.8; hopper/flash_attn_interface.py and
hopper/flash_api.cpp of FA3), not yet from a run -- docs/compatibility.md records the H200 status:

- dtypes fp16/bf16 only; CUDA only (sm80+ for FA2, sm90 for FA3).
- head dims: FA2 any D <= 256 (the Python wrapper pads D to a multiple of 8 itself); Dv must equal D.
  FA3 D % 8 == 0 and D <= 256 (no padding in its wrapper); Dv != D only for a few pairs, not claimed.
- causal: bottom-right only ("If causal=True, the causal mask is aligned to the bottom right corner");
  top-left with Lq != Lk is not expressible without building a mask, so it is not claimed.
- window_size (left, right): "[i + seqlen_k - seqlen_q - window_size[0], i + seqlen_k - seqlen_q +
  window_size[1]] inclusive", -1 = infinite: exactly attnverify's convention. With causal=True the
  kernel sets right = 0, which is what causal AND window means, so they combine.
- softcap (FA2 >= 2.6, FA3): "Anything > 0 activates softcapping"; FA2 refuses softcap with dropout
  ("Softcapping does not support dropout for now"), so that combination is refused here.
- alibi_slopes (nheads,) or (batch, nheads) fp32, bias -slope * |i + seqlen_k - seqlen_q - j|: FA2 only.
- GQA: "head 0, 1, 2 of Q will attention to head 0 of K, V" -- grouped, as in SPEC.md.
- dropout (FA2): `return_attn_probs=True` returns S_dmask whose sign "encodes the dropout pattern
  (negative means that location was dropped)": the adapter returns that keep-mask for an exact check.
- LSE: `softmax_lse` (natural log, fp32). For a row with no visible key FA2/FA3 store +inf (so that
  the backward's exp(s - lse) is 0); the adapter reports those as -inf, SPEC's convention.
- fully-masked rows: "If the row of the mask is all zero, the output will be zero." -> zeros.
- deterministic: "The forward pass is always deterministic"; the adapter passes deterministic=True
  for the backward, so the claim covers both.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..spec import Output, Spec
from ._external import (bshd, dist_version, gpu_library_reason, last_dim_contiguous, segments, varlen_args,
                        version_tuple)
from .base import adapter

_FA2_PROBE = r"""
import torch
import flash_attn
from flash_attn import flash_attn_func
cap = torch.cuda.get_device_capability()
if cap < (8, 0):
    _done(False, f"flash-attn 2 needs an sm80+ GPU; this one is sm{cap[0]}{cap[1]}")
q = torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.float16)
out = flash_attn_func(q, q, q, causal=True)
torch.cuda.synchronize()
if not torch.isfinite(out).all():
    _done(False, "flash_attn_func returned non-finite values on a tiny probe input")
_done(True, version=getattr(flash_attn, "__version__", "?"), capability=list(cap))
"""

_FA3_PROBE = r"""
import torch
try:
    import flash_attn_interface as fa3
except ImportError:
    from flash_attn_3 import flash_attn_interface as fa3
cap = torch.cuda.get_device_capability()
q = torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.float16)
res = fa3.flash_attn_func(q, q, q, causal=True)
out = res[0] if isinstance(res, tuple) else res
torch.cuda.synchronize()
if not torch.isfinite(out).all():
    _done(False, "flash_attn_interface.flash_attn_func returned non-finite values on a tiny probe input")
_done(True, capability=list(cap))
"""

_INFO: dict = {}


def _fa2_available() -> Optional[str]:
    def version_ok():
        v = dist_version("flash-attn") or dist_version("flash_attn")
        if v and version_tuple(v) < (2, 6):
            return f"flash-attn {v} is older than 2.6 (no softcap argument); pip install 'flash-attn>=2.6'"
        return None

    return gpu_library_reason(
        "flash-attn", "flash_attn",
        "pip install 'attnverify[flash-attn]' -- PyPI has only the sdist: build it or bring a prebuilt wheel",
        _FA2_PROBE, info_sink=_INFO.setdefault("flash-attn", {}), extra_check=version_ok)


def _fa3_module_name() -> Optional[str]:
    import importlib.util

    for name in ("flash_attn_interface", "flash_attn_3"):
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


def _fa3_available() -> Optional[str]:
    name = _fa3_module_name() or "flash_attn_interface"
    return gpu_library_reason(
        "flash-attn3", name,
        "FlashAttention-3 is built from the hopper/ directory of Dao-AILab/flash-attention "
        "(cd hopper && python setup.py install); it has no PyPI wheel",
        _FA3_PROBE, info_sink=_INFO.setdefault("flash-attn3", {}))


def _fa3():
    try:
        import flash_attn_interface as fa3  # hopper/ build
    except ImportError:
        from flash_attn_3 import flash_attn_interface as fa3  # newer packaging
    return fa3


# ----------------------------------------------------------------------------------- conversions


def _lse_out(lse: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """softmax_lse with FA's +inf (row saw no key) turned into SPEC's -inf."""
    if lse is None:
        return None
    lse = lse.detach().float()  # FA's softmax_lse carries no gradient (its backward ignores one)
    return torch.where(torch.isposinf(lse), torch.full_like(lse, -math.inf), lse)


def _window(spec: Spec):
    return tuple(spec.window) if spec.window is not None else (-1, -1)


def _alibi(spec: Spec, device):
    if spec.alibi_slopes is None:
        return None
    return torch.as_tensor(spec.alibi_slopes, device=device).float().contiguous()


def _packed(t: torch.Tensor) -> torch.Tensor:
    """(1, H, L, D) BHSD -> (L, H, D) view, the varlen layout."""
    return last_dim_contiguous(t[0].transpose(0, 1))


def _unpacked(t: torch.Tensor) -> torch.Tensor:
    """(L, H, D) -> (1, H, L, D) view."""
    return t.transpose(0, 1).unsqueeze(0)


def _keep_from_sdmask(s_dmask, spec: Spec, b, hq, lq, lk, device):
    """S_dmask sign -> bool keep-mask (B, Hq, Lq, Lk) in SPEC's layout."""
    if spec.is_varlen:
        keep = torch.ones(1, hq, lq, lk, dtype=torch.bool, device=device)
        for i, (q0, q1, k0, k1) in enumerate(segments(spec)):
            if q1 > q0 and k1 > k0:
                keep[0, :, q0:q1, k0:k1] = s_dmask[i, :, : q1 - q0, : k1 - k0] >= 0
        return keep
    return s_dmask[:, :, :lq, :lk] >= 0


def _seed(spec: Spec, device):
    if spec.dropout_p > 0:
        torch.manual_seed(int(spec.seed or 0))  # seeds the CUDA generators too


# --------------------------------------------------------------------------------------- FA2


def _fa2_refuses(case) -> Optional[str]:
    s = case.spec
    if s.softcap is not None and s.dropout_p > 0:
        return "flash-attn refuses softcap with dropout ('Softcapping does not support dropout for now')"
    return None


@adapter(
    "flash-attn",
    description="flash-attn 2: flash_attn_func / flash_attn_varlen_func (forward and backward)",
    availability=_fa2_available,
    refuses=_fa2_refuses,
    dtypes=("float16", "bfloat16"),
    devices=("cuda",),
    head_dims=lambda d: 1 <= d <= 256,
    max_seqlen=16384,
    causal=("none", "bottom_right"),
    window=True, softcap=True, alibi=True, attn_mask=False, gqa=True, varlen=True, dropout=True,
    backward=True, lse=True, dv_ne_d=False, fully_masked="zeros", deterministic=True,
    tiles=(128, 64),  # forward (kBlockM, kBlockN) of the common head dims on sm80/sm90 (flash_fwd_launch_template.h)
    memory="linear",
)
def flash_attn2(q, k, v, spec: Spec):
    """flash-attn 2: flash_attn_func / flash_attn_varlen_func."""
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    b, hq, lq, d = q.shape
    lk = k.shape[2]
    want_probs = bool(spec.return_lse or spec.dropout_p > 0)
    kw = dict(
        dropout_p=float(spec.dropout_p), softmax_scale=spec.resolved_scale(d), causal=spec.causal == "bottom_right",
        window_size=_window(spec), softcap=float(spec.softcap or 0.0), alibi_slopes=_alibi(spec, q.device),
        deterministic=True, return_attn_probs=want_probs,
    )
    _seed(spec, q.device)
    if spec.is_varlen:
        res = flash_attn_varlen_func(_packed(q), _packed(k), _packed(v), *varlen_args(spec, q.device), **kw)
        out, lse, s_dmask = (res if want_probs else (res, None, None))
        out = _unpacked(out)
        lse = lse.unsqueeze(0) if lse is not None else None  # (H, total) -> (1, H, total)
    else:
        res = flash_attn_func(bshd(q), bshd(k), bshd(v), **kw)
        out, lse, s_dmask = (res if want_probs else (res, None, None))
        out = out.transpose(1, 2)
    keep = None
    if spec.dropout_p > 0 and s_dmask is not None and s_dmask.numel():
        keep = _keep_from_sdmask(s_dmask, spec, b, hq, lq, lk, q.device)
    return Output(out, lse=_lse_out(lse) if spec.return_lse else None, dropout_mask=keep)


# --------------------------------------------------------------------------------------- FA3


@adapter(
    "flash-attn3",
    description="FlashAttention-3 (hopper build): flash_attn_interface.flash_attn_func / flash_attn_varlen_func",
    availability=_fa3_available,
    dtypes=("float16", "bfloat16"),
    devices=("cuda",),
    head_dims=lambda d: d % 8 == 0 and 8 <= d <= 256,
    max_seqlen=16384,
    causal=("none", "bottom_right"),
    window=True, softcap=True, alibi=False, attn_mask=False, gqa=True, varlen=True, dropout=False,
    backward=True, lse=True, dv_ne_d=False, fully_masked="zeros", deterministic=True,
    tiles=(128, 128),  # sm90 forward tile of hdim 64/128 without causal (hopper/tile_size.h)
    memory="linear",
)
def flash_attn3(q, k, v, spec: Spec):
    """FlashAttention-3: flash_attn_func / flash_attn_varlen_func of the hopper build."""
    fa3 = _fa3()
    d = q.shape[-1]
    kw = dict(softmax_scale=spec.resolved_scale(d), causal=spec.causal == "bottom_right", window_size=_window(spec),
              softcap=float(spec.softcap or 0.0), deterministic=True)
    import inspect

    fn = fa3.flash_attn_varlen_func if spec.is_varlen else fa3.flash_attn_func
    if "return_attn_probs" in inspect.signature(fn).parameters:
        kw["return_attn_probs"] = True  # newer FA3: (out, lse) only when asked; older: always
    if spec.is_varlen:
        res = fn(_packed(q), _packed(k), _packed(v), *varlen_args(spec, q.device), **kw)
        out, lse = (res[0], res[1]) if isinstance(res, tuple) else (res, None)
        out = _unpacked(out)
        lse = lse.unsqueeze(0) if lse is not None else None
    else:
        res = fn(bshd(q), bshd(k), bshd(v), **kw)
        out, lse = (res[0], res[1]) if isinstance(res, tuple) else (res, None)
        out = out.transpose(1, 2)
    return Output(out, lse=_lse_out(lse) if spec.return_lse else None)


# names used in registry.BUILTINS
flash_attn = flash_attn2


def __getattr__(name):  # `flash_attn.flash_attn_kvcache`, the name of before the kv-cache module
    if name == "flash_attn_kvcache":
        from .flash_attn_kvcache import flash_attn2_kvcache

        return flash_attn2_kvcache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
