"""A plain-torch FlashInfer for the CPU: the documented signatures and semantics of flashinfer 0.6.18's entry points
that the `flashinfer` adapter calls, written from flashinfer's docstrings (decode.py, prefill.py, page.py,
attention/_core.py) and its sink reference (tests/test_helpers/sink_attention_reference.py), not from attnverify's
naive adapter or reference.

- the page layout is read as page.cuh's ``get_length`` reads it: request b owns pages
  ``indices[indptr[b]:indptr[b+1]]`` and ``(pages - 1) * page_size + last_page_len[b]`` keys (0 without pages);
  the docstrings' "1 <= kv_last_page_len <= page_size" and the dtypes (int32) are asserted;
- ``append_paged_kv_cache`` writes row r at ``positions[r]`` of request ``batch_indices[r]``, in place, and asserts
  the slot lies inside the layout ("the space for appended k/v has already been allocated");
- attention: float64 scores ``q.k * sm_scale``, ``cap * tanh(x / cap)``, causal = ``tril(diagonal=kv_len - qo_len)``,
  window_left: keys ``j >= i + kv_len - qo_len - window_left``; a sink is one more logit (unscaled) in the softmax
  with no value; the LSE is returned in base 2 (FlashInfer's default).
"""
from __future__ import annotations

import math
import types

import torch

LN2 = math.log(2.0)


def _attend(q, k, v, *, sm_scale, causal=False, window_left=-1, cap=None, mask=None, sink=None):
    """q (Lq, Hq, D), k (Lk, Hkv, D), v (Lk, Hkv, Dv) -> out (Lq, Hq, Dv) in q's dtype, LSE base 2 (Lq, Hq)."""
    lq, hq, _ = q.shape
    lk, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    qd, kd, vd = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("ihd,jhd->hij", qd, kd) * sm_scale  # (Hq, Lq, Lk)
    if cap:
        s = cap * torch.tanh(s / cap)
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        keep &= j <= i + (lk - lq)
    if window_left is not None and window_left >= 0:
        keep &= j >= i + (lk - lq) - window_left
    if mask is not None:
        keep &= mask.bool()
    s = s.masked_fill(~keep, -math.inf)
    if sink is not None:
        s = torch.cat([s, sink.double().view(hq, 1, 1).expand(hq, lq, 1)], dim=-1)
    m = s.amax(-1, keepdim=True) if s.shape[-1] else torch.full((hq, lq, 1), -math.inf, dtype=torch.float64)
    m0 = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m0)
    den = p.sum(-1, keepdim=True)
    p_keys = p[..., :lk]
    # a value row that P does not reach (P = 0: masked) adds nothing, NaN included, as in a kernel that skips it
    terms = p_keys[..., None] * vd.permute(1, 0, 2)[:, None]  # (Hq, Lq, Lk, Dv)
    pv = torch.where(p_keys[..., None] > 0, terms, torch.zeros_like(terms)).sum(-2)
    out = torch.where(den > 0, pv / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(pv))
    lse = torch.where(den > 0, m0 + torch.log(den), torch.full_like(den, -math.inf)).squeeze(-1)
    return out.transpose(0, 1).to(q.dtype), (lse / LN2).transpose(0, 1).float()


def _check_csr(indptr, indices, last, page_size):
    for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last)):
        assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
    ip = indptr.tolist()
    assert ip[0] == 0 and all(a <= b for a, b in zip(ip, ip[1:])) and ip[-1] == len(indices), ip
    for b, n in enumerate(last.tolist()):
        if ip[b + 1] > ip[b]:
            assert 1 <= n <= page_size, f"1 <= kv_last_page_len <= page_size: request {b} has {n}"


def _gather(pool, indptr, indices, last, b):
    ip, idx, page_size = indptr.tolist(), indices.tolist(), pool.shape[1]
    pages = idx[ip[b]:ip[b + 1]]
    if not pages:
        return pool[:0].reshape(0, *pool.shape[2:])
    n = (len(pages) - 1) * page_size + int(last[b])
    return torch.cat([pool[p] for p in pages])[:n]


class _PagedBase:
    def __init__(self, workspace, kv_layout="NHD", **kw):
        assert workspace.dtype == torch.uint8 and kv_layout == "NHD"
        self.ctor = kw

    def _run(self, q, paged_kv_cache, sink=None, sm_scale=None, return_lse=False):
        kc, vc = paged_kv_cache
        p = self.p
        assert kc.shape[1] == p["page_size"] and q.shape[0] == p["qo"][-1], (kc.shape, q.shape, p["qo"])
        out = q.new_zeros(q.shape[0], q.shape[1], vc.shape[-1])
        lse = torch.full((q.shape[0], q.shape[1]), -math.inf)
        for b in range(len(p["qo"]) - 1):
            q0, q1 = p["qo"][b], p["qo"][b + 1]
            if q1 == q0:
                continue
            kb = _gather(kc, p["indptr"], p["indices"], p["last"], b)
            vb = _gather(vc, p["indptr"], p["indices"], p["last"], b)
            out[q0:q1], lse[q0:q1] = _attend(q[q0:q1], kb, vb, sm_scale=sm_scale if sm_scale is not None else
                                             p["sm_scale"], causal=p["causal"], window_left=p["window_left"],
                                             cap=p["cap"], sink=sink)
        return (out, lse) if return_lse else out


class BatchDecodeWithPagedKVCacheWrapper(_PagedBase):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *, sm_scale=None,
             window_left=-1, logits_soft_cap=None, q_data_type=None, kv_data_type=None, **kw):
        _check_csr(indptr, indices, last_page_len, page_size)
        self.p = dict(qo=list(range(len(last_page_len) + 1)), indptr=indptr, indices=indices, last=last_page_len,
                      page_size=page_size, sm_scale=sm_scale or 1 / math.sqrt(head_dim), causal=False,
                      window_left=window_left, cap=logits_soft_cap)

    def run(self, q, paged_kv_cache, *, return_lse=False, **kw):
        assert q.dim() == 3  # [batch_size, num_qo_heads, head_dim]
        return self._run(q, paged_kv_cache, return_lse=return_lse)


class BatchPrefillWithPagedKVCacheWrapper(_PagedBase):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, causal=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, q_data_type="float16", kv_data_type=None, **kw):
        assert custom_mask is None and qo_indptr.dtype == torch.int32
        _check_csr(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        self.p = dict(qo=qo_indptr.tolist(), indptr=paged_kv_indptr, indices=paged_kv_indices,
                      last=paged_kv_last_page_len, page_size=page_size,
                      sm_scale=sm_scale or 1 / math.sqrt(head_dim_qk), causal=causal, window_left=window_left,
                      cap=logits_soft_cap)

    def run(self, q, paged_kv_cache, *args, return_lse=False, **kw):
        assert not args
        return self._run(q, paged_kv_cache, return_lse=return_lse)


class BatchAttentionWithAttentionSinkWrapper(BatchPrefillWithPagedKVCacheWrapper):
    """run(q, paged_kv_cache, sink, sm_scale): the jit additional args ["sink"] (float) and ["sm_scale"] (double);
    no logits transform in the AttentionSink variant, so logits_soft_cap is not applied."""

    def plan(self, *a, logits_soft_cap=None, window_left=-1, **kw):
        assert window_left == self.ctor.get("window_left", -1), "the wrapper is built for one window_left"
        super().plan(*a, window_left=window_left, **kw)
        self.p["cap"] = None

    def run(self, q, paged_kv_cache, sink, sm_scale, return_lse=False, **kw):
        assert sink.dtype == torch.float32 and sink.shape == (q.shape[1],), (sink.dtype, sink.shape)
        return self._run(q, paged_kv_cache, sink=sink, sm_scale=sm_scale, return_lse=return_lse)


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                          kv_last_page_len, kv_layout="NHD"):
    kc, vc = paged_kv_cache
    page_size = kc.shape[1]
    assert kv_layout == "NHD" and batch_indices.dtype == torch.int32 and positions.dtype == torch.int32
    _check_csr(kv_indptr, kv_indices, kv_last_page_len, page_size)
    ip, idx = kv_indptr.tolist(), kv_indices.tolist()
    for r, (b, pos) in enumerate(zip(batch_indices.tolist(), positions.tolist())):
        pages = ip[b + 1] - ip[b]
        length = (pages - 1) * page_size + int(kv_last_page_len[b]) if pages else 0
        assert 0 <= pos < length, f"row {r}: position {pos} outside request {b}'s {length} allocated slots"
        page = idx[ip[b] + pos // page_size]
        kc[page, pos % page_size] = append_key[r].to(kc.dtype)
        vc[page, pos % page_size] = append_value[r].to(vc.dtype)


def single_prefill_with_kv_cache(q, k, v, custom_mask=None, causal=False, kv_layout="NHD", sm_scale=None,
                                 window_left=-1, logits_soft_cap=None, return_lse=False, **kw):
    assert kv_layout == "NHD" and q.dim() == 3
    o, lse = _attend(q, k, v, sm_scale=sm_scale, causal=causal and custom_mask is None, window_left=window_left,
                     cap=logits_soft_cap, mask=custom_mask)
    return (o, lse) if return_lse else o


def single_decode_with_kv_cache(q, k, v, kv_layout="NHD", sm_scale=None, window_left=-1, logits_soft_cap=None,
                                return_lse=False, **kw):
    assert q.dim() == 2
    o, lse = _attend(q[None], k, v, sm_scale=sm_scale, window_left=window_left, cap=logits_soft_cap)
    return (o[0], lse[0]) if return_lse else o[0]


class BatchPrefillWithRaggedKVCacheWrapper:
    def __init__(self, workspace, kv_layout="NHD", **kw):
        assert kv_layout == "NHD"

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, custom_mask=None, causal=False,
             sm_scale=None, window_left=-1, logits_soft_cap=None, **kw):
        self.p = (qo_indptr.tolist(), kv_indptr.tolist(), custom_mask, causal, sm_scale, window_left, logits_soft_cap)

    def run(self, q, k, v, return_lse=False):
        qo, kv, mask, causal, sm, wl, cap = self.p
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        lse = torch.full((q.shape[0], q.shape[1]), -math.inf)
        off = 0
        for q0, q1, k0, k1 in zip(qo, qo[1:], kv, kv[1:]):
            mb = None
            if mask is not None:  # flattened, request by request
                mb = mask[off:off + (q1 - q0) * (k1 - k0)].view(q1 - q0, k1 - k0)
                off += (q1 - q0) * (k1 - k0)
            if q1 > q0:
                out[q0:q1], lse[q0:q1] = _attend(q[q0:q1], k[k0:k1], v[k0:k1], sm_scale=sm, causal=causal and mb is None,
                                                 window_left=wl, cap=cap, mask=mb)
        return (out, lse) if return_lse else out


def module() -> types.ModuleType:
    m = types.ModuleType("flashinfer")
    m.__version__ = "0.6.18+cpu-standin"
    for name in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
                 "BatchAttentionWithAttentionSinkWrapper", "append_paged_kv_cache", "single_prefill_with_kv_cache",
                 "single_decode_with_kv_cache", "BatchPrefillWithRaggedKVCacheWrapper"):
        setattr(m, name, globals()[name])
    return m
