"""FlashInfer: single and batch prefill, single and batch decode, paged caches with append, sinks (no backward).

Importing this module imports no flashinfer and touches no GPU. Which FlashInfer entry point a
call reaches is decided by the call, so every entry point is exercised by the same
properties (the dispatch is fixed and documented, so a failure names its path in the case):

    a cache call (spec.cache_seqlens), Lq == 1  BatchDecodeWithPagedKVCacheWrapper on attnverify's pool, real table
    a cache call, Lq > 1                        BatchPrefillWithPagedKVCacheWrapper on attnverify's pool, real table
      (+ spec.k_new)                            append_paged_kv_cache first, in place
    any call with spec.sinks                    BatchAttentionWithAttentionSinkWrapper (plain calls: pages of size 1)
    varlen (cu_seqlens)                         BatchPrefillWithRaggedKVCacheWrapper.plan/run
    B == 1, Lq == 1, no attn_mask               single_decode_with_kv_cache
    B  > 1, Lq == 1, no attn_mask               BatchDecodeWithPagedKVCacheWrapper (keys copied to pages of 16)
    B == 1 otherwise                            single_prefill_with_kv_cache
    B  > 1 otherwise                            BatchPrefillWithRaggedKVCacheWrapper (uniform indptr)

The cache and sink paths, and the block_table -> (kv_indptr, kv_indices, kv_last_page_len) translation, are in
flashinfer_paged.py and flashinfer_layout.py.

Claims, from flashinfer 0.6.18's prefill.py, decode.py, page.py, attention/_core.py docstrings and source
(flashinfer-ai/flashinfer@fb28d72) -- not yet from a run:

- dtypes fp16/bf16 (fp8: flashinfer documents per-head scales of one request only; not claimed,
  docs/compatibility.md says why and what it would take); CUDA only;
  head dims 64, 128, 256 (the sizes FlashInfer's kernels are instantiated for, include/flashinfer/utils.cuh);
  Dv == D.
- causal: bottom-right ("mask = torch.tril(..., diagonal=(kv_len - qo_len))" is the docstring's
  equivalent of causal=True). Top-left is not a FlashInfer mode.
- window_left: "the left (inclusive) window size"; there is no right bound, so a window is claimed
  as (left, -1) without causal, or (left, anything) with bottom-right causal (which bounds the right).
- logits_soft_cap: cap * tanh(x / cap) on the scaled logits (not with sinks: the sink variant has no
  logits transform).
- custom_mask: boolean, True = keep, shape [qo_len, kv_len] per request -- one mask for all heads,
  so head-dependent masks and float masks are refused; with a custom mask `causal` is ignored
  ("only effective when custom_mask is not provided"), so mask + causal is refused; not with sinks (the
  AttentionSink variant's mask is the window alone).
- ALiBi (pos_encoding_mode="ALIBI") uses FlashInfer's built-in slopes and a signed, non-absolute
  distance: not SPEC's -slope*|i + Lk - Lq - j| with given slopes, so not claimed.
- GQA: num_qo_heads a multiple of num_kv_heads, grouped.
- LSE: returned in base 2 (FlashInfer's kernels fold log2(e) into the scale; issue #2113, PR #5257
  "lse_base='log2' (default)"); the adapter multiplies by ln 2 to give SPEC's natural-log LSE.
- paged / kv_cache / append: the NHD pool "[max_num_pages, page_size, num_kv_heads, head_dim]" is attnverify's
  (N, S, Hkv, D) cache; any page size (the wrappers take `page_size` as an argument; FlashInfer's tests use
  1, 5, 7, 8, 16, 64); a contiguous cache is one page of size S per request; no left padding (the page layout
  starts every request at slot 0 of its first page). num_splits: not claimed (`fixed_split_size` is a size in
  pages, not a split count).
- sinks: `BatchAttentionWithAttentionSinkWrapper` (flashinfer >= 0.4), per-head float32 logits joining the
  denominator as exp(sink) (flashinfer_paged.py quotes the kernel variant).
- fully-masked rows: not documented -> "unsupported" (those rows are ignored and never drawn).
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from ..spec import Output, Spec
from ._external import gpu_library_reason
from .base import adapter
from .flashinfer_paged import cache_call, lse_natural, plain_with_sinks, workspace

_PROBE = r"""
import torch
import flashinfer
ver = getattr(flashinfer, "__version__", "?")
for name in ("single_prefill_with_kv_cache", "single_decode_with_kv_cache",
             "BatchPrefillWithRaggedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper",
             "BatchPrefillWithPagedKVCacheWrapper", "append_paged_kv_cache", "BatchAttentionWithAttentionSinkWrapper"):
    if not hasattr(flashinfer, name):
        _done(False, f"flashinfer {ver} has no {name} (needs flashinfer-python >= 0.4)")
cap = torch.cuda.get_device_capability()
if cap < (8, 0):
    _done(False, f"flashinfer needs an sm80+ GPU for bf16 prefill; this one is sm{cap[0]}{cap[1]}")
_done(True, version=ver, capability=list(cap))
"""

_PAGE = 16
_INFO: dict = {}


def _available() -> Optional[str]:
    # the probe imports flashinfer but runs no kernel: the first call may JIT-compile for minutes
    return gpu_library_reason("flashinfer", "flashinfer", "pip install 'attnverify[flashinfer]' (flashinfer-python)",
                              _PROBE, info_sink=_INFO.setdefault("flashinfer", {}))


def _refuses(case) -> Optional[str]:
    s = case.spec
    if s.sinks is not None and s.softcap is not None:
        return "flashinfer's AttentionSink variant has no logits transform: logits_soft_cap is not applied with sinks"
    if s.attn_mask is not None and s.sinks is not None:
        return ("flashinfer's AttentionSink variant masks by the window only (its LOGITS_MASK has no custom-mask term, "
                "jit/attention/variants.py; the default variant's has, attention/variants.cuh)")
    if s.attn_mask is not None and s.cache_seqlens is not None:
        return "a mask with a cache call: attnverify's cache calls take none (attnverify/paged.py)"
    if s.window is not None:
        left, right = s.window
        if left < 0:
            return "flashinfer's window has only a left bound (window_left); (-1, right) is not expressible"
        if right >= 0 and s.causal != "bottom_right":
            return "flashinfer's window has no right bound; (left, right >= 0) needs bottom-right causal"
    m = s.attn_mask
    if m is not None:
        if m.dtype != torch.bool:
            return "flashinfer's custom_mask is boolean; additive float masks are not supported"
        if m.dim() >= 3 and m.shape[-3] != 1:
            return "flashinfer's custom_mask is one [qo_len, kv_len] mask per request, the same for all heads"
        if s.causal != "none":
            return "flashinfer ignores causal when a custom_mask is given"
        if s.window is not None:
            return "flashinfer's window with a custom_mask is not documented"
    return None


def _kwargs_for(fn, **kw):
    """Drop keywords an older flashinfer does not know (e.g. return_lse on single_decode)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kw
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kw
    return {k: v for k, v in kw.items() if k in params}


def _common(spec: Spec, d: int) -> dict:
    return dict(sm_scale=spec.resolved_scale(d), window_left=int(spec.window[0]) if spec.window is not None else -1,
                logits_soft_cap=float(spec.softcap) if spec.softcap is not None else None)


def _split(res, want_lse):
    if want_lse and isinstance(res, (tuple, list)):
        return res[0], res[1]
    return (res[0] if isinstance(res, (tuple, list)) else res), None


def _mask_for(spec: Spec, bi: int, lq: int, lk: int) -> Optional[torch.Tensor]:
    """Request `bi`'s [qo_len, kv_len] boolean mask (heads share it: refused otherwise)."""
    m = spec.attn_mask
    if m is None:
        return None
    m4 = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))
    return m4[bi if m4.shape[0] > 1 else 0, 0].expand(lq, lk).contiguous()


def _ragged(q, k, v, spec: Spec, qo_indptr, kv_indptr, mask_flat=None):
    import flashinfer

    hq, d = q.shape[-2], q.shape[-1]
    hkv = k.shape[-2]
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace(q.device), "NHD")
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, custom_mask=mask_flat, causal=spec.causal == "bottom_right",
           q_data_type=q.dtype, kv_data_type=k.dtype, **_common(spec, d))
    return _split(w.run(q, k, v, return_lse=bool(spec.return_lse)), spec.return_lse)


@adapter(
    "flashinfer",
    description="FlashInfer prefill/decode, paged caches with append, sinks (dispatch by call; inference only)",
    availability=_available,
    refuses=_refuses,
    dtypes=("float16", "bfloat16"),
    devices=("cuda",),
    head_dims=(64, 128, 256),
    max_seqlen=16384,
    causal=("none", "bottom_right"),
    window=True, softcap=True, alibi=False, attn_mask=True, gqa=True, varlen=True, dropout=False,
    backward=False, lse=True, dv_ne_d=False, fully_masked="unsupported", deterministic=False,
    memory="linear",
    kv_cache=True, paged=True, page_sizes=lambda p: p >= 1, append=True, sinks=True,
)
def flashinfer_attention(q, k, v, spec: Spec):
    """FlashInfer prefill/decode, chosen by the call (module docstring)."""
    import flashinfer

    if spec.cache_seqlens is not None:
        return cache_call(q, k, v, spec)
    if spec.sinks is not None:
        return plain_with_sinks(q, k, v, spec)

    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    dev = q.device
    # NHD per request: (L, H, D) views of the BHSD inputs, last dim contiguous
    qn, kn, vn = (t.transpose(1, 2) for t in (q, k, v))  # (B, L, H, D)
    want_lse = bool(spec.return_lse)
    if spec.is_varlen:
        cu_q = torch.as_tensor(spec.cu_seqlens_q, device=dev).to(torch.int32)
        cu_k = torch.as_tensor(spec.cu_seqlens_k, device=dev).to(torch.int32)
        out, lse = _ragged(qn[0], kn[0], vn[0], spec, cu_q, cu_k)
        out = out.transpose(0, 1).unsqueeze(0)
        lse = lse.transpose(0, 1).unsqueeze(0) if lse is not None else None
        return Output(out, lse=lse_natural(lse))
    if lq == 1 and spec.attn_mask is None:
        common = _common(spec, d)
        if b == 1:
            fn = flashinfer.single_decode_with_kv_cache
            res = fn(qn[0, 0], kn[0], vn[0], **_kwargs_for(fn, kv_layout="NHD", return_lse=want_lse, **common))
            o, lse = _split(res, want_lse)
            out = o.view(1, 1, hq, -1).transpose(1, 2)
            lse = lse.view(1, hq, 1) if lse is not None else None
            return Output(out, lse=lse_natural(lse))
        # batch decode over a paged cache: each request owns ceil(Lk / 16) pages
        pages = (lk + _PAGE - 1) // _PAGE
        k_cache = torch.zeros(b * pages, _PAGE, hkv, d, dtype=k.dtype, device=dev)
        v_cache = torch.zeros(b * pages, _PAGE, hkv, v.shape[-1], dtype=v.dtype, device=dev)
        k_cache.view(b, pages * _PAGE, hkv, d)[:, :lk] = kn
        v_cache.view(b, pages * _PAGE, hkv, v.shape[-1])[:, :lk] = vn
        indptr = torch.arange(0, (b + 1) * pages, pages, dtype=torch.int32, device=dev)
        indices = torch.arange(b * pages, dtype=torch.int32, device=dev)
        last = torch.full((b,), lk - (pages - 1) * _PAGE, dtype=torch.int32, device=dev)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace(dev), "NHD")
        w.plan(indptr, indices, last, hq, hkv, d, _PAGE,
               **_kwargs_for(w.plan, q_data_type=q.dtype, kv_data_type=k.dtype, **common))
        o, lse = _split(w.run(qn[:, 0].contiguous(), (k_cache, v_cache), return_lse=want_lse), want_lse)
        out = o.view(b, 1, hq, -1).transpose(1, 2)
        lse = lse.view(b, hq, 1) if lse is not None else None
        return Output(out, lse=lse_natural(lse))
    if b == 1:
        fn = flashinfer.single_prefill_with_kv_cache
        res = fn(qn[0], kn[0], vn[0], **_kwargs_for(
            fn, custom_mask=_mask_for(spec, 0, lq, lk), causal=spec.causal == "bottom_right", kv_layout="NHD",
            return_lse=want_lse, **_common(spec, d)))
        o, lse = _split(res, want_lse)
        out = o.transpose(0, 1).unsqueeze(0)
        lse = lse.transpose(0, 1).unsqueeze(0) if lse is not None else None
        return Output(out, lse=lse_natural(lse))
    # batch prefill: B requests of equal lengths, packed (the ragged layout)
    qo_indptr = torch.arange(0, (b + 1) * lq, lq, dtype=torch.int32, device=dev)
    kv_indptr = torch.arange(0, (b + 1) * lk, lk, dtype=torch.int32, device=dev)
    mask_flat = None
    if spec.attn_mask is not None:
        mask_flat = torch.cat([_mask_for(spec, i, lq, lk).reshape(-1) for i in range(b)])
    o, lse = _ragged(qn.reshape(b * lq, hq, d), kn.reshape(b * lk, hkv, d), vn.reshape(b * lk, hkv, v.shape[-1]),
                     spec, qo_indptr, kv_indptr, mask_flat)
    out = o.view(b, lq, hq, -1).transpose(1, 2)
    lse = lse.view(b, lq, hq).transpose(1, 2) if lse is not None else None
    return Output(out, lse=lse_natural(lse))


flashinfer = flashinfer_attention  # the registry name
