"""FlashInfer's paged wrappers behind the `flashinfer` adapter: cache calls (paged or contiguous, with append)
and every call with sinks. Imports flashinfer only when called.

- A cache call (``spec.cache_seqlens``; docs/adapters.md recipe 6) passes attnverify's caches ``(N, S, Hkv, D)``
  **as they are** (FlashInfer's NHD page pool ``[max_num_pages, page_size, num_kv_heads, head_dim]``; never
  copied, so an append is seen) with the CSR page layout of attnverify.adapters.flashinfer_layout built from
  ``spec.block_table`` (a contiguous cache: one page of size S per request, at row ``cache_batch_idx[b]``).
  ``spec.k_new`` / ``spec.v_new`` are first written with ``flashinfer.append_paged_kv_cache`` (the layout
  already counts them, as its docstring requires), then the keys are attended to:
  ``BatchDecodeWithPagedKVCacheWrapper`` when Lq == 1, ``BatchPrefillWithPagedKVCacheWrapper`` otherwise
  (``causal=True`` is the docstring's ``tril(..., diagonal=kv_len - qo_len)``: bottom-right).
- Sinks: ``BatchAttentionWithAttentionSinkWrapper`` (flashinfer >= 0.4, attention/_core.py: "Wrapper for
  prefill and decode attention with paged KV-cache that adds support for attention sinks"), called as
  flashinfer's own tests call it, ``run(q, paged_kv_cache, sink, sm_scale)``. Its kernel variant
  (jit/attention/variants.py ``AttentionSink``) starts the online softmax from ``m = sink, d = 1`` in natural-log
  units (``params.sink[qo_head_idx] * log2e``), i.e. the denominator gains ``exp(sink)`` -- attnverify's
  convention -- and its reference (tests/test_helpers/sink_attention_reference.py) appends the unscaled sink to
  the scaled logits before the softmax. The variant has no logits transform, so soft-capping is not applied
  with sinks (refused). A plain call with sinks is served through the same wrapper over a pool of pages of size
  1 (its keys, packed). The decode wrapper's own ``run(sinks=...)`` is not used: in flashinfer 0.6.18 its
  CUDA-core path (the default, ``use_tensor_cores=False``) does not pass ``sinks`` to the kernel.
"""
from __future__ import annotations

import math

import torch

from ..spec import Output, Spec
from .flashinfer_layout import append_coords, contiguous_table, csr_from_block_table, rows_as_pages, uniform_indptr

_WORKSPACE: dict = {}


def workspace(device) -> torch.Tensor:
    """FlashInfer's float workspace ("The recommended size is 128MB"; "Must be initialized to 0")."""
    key = str(device)
    if key not in _WORKSPACE:
        _WORKSPACE[key] = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=device)
    return _WORKSPACE[key]


def lse_natural(lse):
    """FlashInfer's LSE is base 2 (kernels fold log2(e) into the scale): natural log for attnverify."""
    return None if lse is None else lse.float() * math.log(2.0)


def _window_left(spec: Spec) -> int:
    return int(spec.window[0]) if spec.window is not None else -1


def _split(res, want_lse):
    if isinstance(res, (tuple, list)):
        return res[0], (res[1] if want_lse else None)
    return res, None


def paged_attend(qr, caches, qo_indptr, csr, page_size: int, spec: Spec, *, decode: bool):
    """Attention of the ragged queries `qr` (nnz, Hq, D) over the pages `csr` of `caches` (k, v pools, NHD).
    Returns (out (nnz, Hq, Dv), lse base 2 (nnz, Hq) or None)."""
    import flashinfer

    k_pool, v_pool = caches
    hq, d = qr.shape[1], qr.shape[2]
    hkv, dv = k_pool.shape[2], v_pool.shape[-1]
    indptr, indices, last = (t.to(qr.device) for t in csr)
    want_lse = bool(spec.return_lse)
    scale = spec.resolved_scale(d)
    dtypes = dict(q_data_type=qr.dtype, kv_data_type=k_pool.dtype)
    if spec.sinks is not None:
        w = flashinfer.BatchAttentionWithAttentionSinkWrapper(
            workspace(qr.device), "NHD", head_dim_qk=d, head_dim_vo=dv, window_left=_window_left(spec), **dtypes)
        w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, page_size, causal=spec.causal == "bottom_right",
               window_left=_window_left(spec), **dtypes)
        sinks = spec.sinks.detach().to(device=qr.device, dtype=torch.float32).contiguous()
        return _split(w.run(qr, caches, sinks, scale, return_lse=want_lse), want_lse)
    common = dict(sm_scale=scale, window_left=_window_left(spec),
                  logits_soft_cap=float(spec.softcap) if spec.softcap is not None else None)
    if decode:  # one query per request: the decode wrapper (causal is moot for Lq == 1)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace(qr.device), "NHD")
        w.plan(indptr, indices, last, hq, hkv, d, page_size, **dtypes, **common)
        return _split(w.run(qr, caches, return_lse=want_lse), want_lse)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace(qr.device), "NHD")
    w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, page_size, causal=spec.causal == "bottom_right",
           **dtypes, **common)
    return _split(w.run(qr, caches, return_lse=want_lse), want_lse)


def _ragged_rows(t, dtype):
    """BHSD (B, Hkv, Lnew, D) -> FlashInfer's ragged append rows (B * Lnew, Hkv, D), batch by batch."""
    return t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], t.shape[1], t.shape[3]).to(dtype).contiguous()


def cache_call(q, k, v, spec: Spec) -> Output:
    """A cache call: k and v are the page pools (N, S, Hkv, D) themselves (written in place by an append)."""
    import flashinfer

    b, hq, lq, d = q.shape
    page = k.shape[1]
    new = 0 if spec.k_new is None else int(spec.k_new.shape[2])
    table = spec.block_table if spec.block_table is not None else contiguous_table(b, spec.cache_batch_idx, q.device)
    cached = torch.as_tensor(spec.cache_seqlens, device=q.device).long()
    csr = tuple(t.to(q.device) for t in csr_from_block_table(torch.as_tensor(table, device=q.device), cached + new,
                                                                page))
    if new:
        bi, pos = append_coords(cached, new)
        flashinfer.append_paged_kv_cache(_ragged_rows(spec.k_new, k.dtype), _ragged_rows(spec.v_new, v.dtype), bi, pos,
                                         (k, v), csr[1], csr[0], csr[2], kv_layout="NHD")
    qr = q.transpose(1, 2).reshape(b * lq, hq, d)
    out, lse = paged_attend(qr, (k, v), uniform_indptr(b, lq, q.device), csr, page, spec, decode=lq == 1)
    out = out.view(b, lq, hq, -1).transpose(1, 2)
    lse = lse.view(b, lq, hq).transpose(1, 2) if lse is not None else None
    return Output(out, lse=lse_natural(lse))


def plain_with_sinks(q, k, v, spec: Spec) -> Output:
    """A plain (BHSD or varlen) call with sinks, through the sink wrapper over its keys as pages of size 1."""
    b, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    dev = q.device
    if spec.is_varlen:
        cu_q = torch.as_tensor(spec.cu_seqlens_q, device=dev).int()
        cu_k = torch.as_tensor(spec.cu_seqlens_k, device=dev).long()
        qo_indptr, seg_k = cu_q, (cu_k[1:] - cu_k[:-1]).tolist()
    else:
        qo_indptr, seg_k = uniform_indptr(b, lq, dev), [lk] * b
    k_pool = k.transpose(1, 2).reshape(b * lk, 1, hkv, d)  # (pages, page_size 1, Hkv, D), request by request
    v_pool = v.transpose(1, 2).reshape(b * lk, 1, hkv, dv)
    qr = q.transpose(1, 2).reshape(b * lq, hq, d)
    out, lse = paged_attend(qr, (k_pool, v_pool), qo_indptr, rows_as_pages(seg_k, dev), 1, spec, decode=False)
    out = out.view(b, lq, hq, -1).transpose(1, 2)
    lse = lse.view(b, lq, hq).transpose(1, 2) if lse is not None else None
    return Output(out, lse=lse_natural(lse))
