"""A stranger's chunked-local-attention kernel (Llama 4's ``attention_chunk``), written the way vLLM's flash-attn fork and
FlashAttention-3 expose it, and its adapter, written from docs/adapters.md and docs/guide.md alone.

The kernel (plain torch, standing for a CUDA kernel) is ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False, window_size=(-1, -1), attention_chunk=0,
return_softmax_lse=False)``:

- ``q`` (total_q, nheads, d), ``k`` / ``v`` (total_k, nheads_k, d): packed documents, int32 ``cu_seqlens_*``;
- ``causal`` and ``window_size`` are bottom-right aligned per document (flash-attn >= 2.1): query ``i`` of a document
  with ``seqlen_q`` queries and ``seqlen_k`` keys sits at position ``p = i + seqlen_k - seqlen_q``;
- ``attention_chunk`` C > 0 (FA3's argument, vLLM's ``attention_chunk_size`` for Llama 4's local layers): the keys
  are cut into chunks of C from each document's first key, and a query sees only the keys of its own chunk
  (``j // C == p // C``), on top of causal and window; 0 is no chunking;
- a query that sees no key gets 0 (LSE -inf); ``return_softmax_lse``: LSE (nheads, total_q), float32, natural log;
- fp16 / bf16, head dims <= 256, GQA (nheads % nheads_k == 0); forward only (vLLM's fork is inference only).

``BUGS`` holds the mistakes a kernel author makes with the chunk; each has its adapter (``chunked_local_<bug>``) with
the claims of the right one.
"""

from __future__ import annotations

import torch

import attnverify as av

BUGS = (
    "boundary_off_by_one",  # the chunk's first key taken one early: a query also sees the previous chunk's last key
    "origin_top_left",  # the chunk counted from the query index i, not from its position i + seqlen_k - seqlen_q
    "origin_packed",  # the chunk counted from the packed position (cu_seqlens_k offset not subtracted)
    "last_partial_ignored",  # no chunk limit in the last chunk when it is partial (seqlen_k % C != 0)
)


def _visible(lq, lk, *, causal, window, chunk, key_offset=0, bug=None):
    """(lq, lk) bool: which keys each query of one document sees."""
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    p = i + (lk - lq)
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        ok &= j <= p
    left, right = window
    if left >= 0:
        ok &= j >= p - left
    if right >= 0:
        ok &= j <= p + right
    if chunk > 0:
        pc = i if bug == "origin_top_left" else p
        jc = j
        if bug == "origin_packed":
            pc, jc = pc + key_offset, j + key_offset
        start = torch.div(pc, chunk, rounding_mode="floor") * chunk
        if bug == "boundary_off_by_one":
            start = start - 1
        same = (jc >= start) & (jc < start + chunk)
        if bug == "last_partial_ignored" and lk % chunk:
            same |= (start >= lk // chunk * chunk)  # the tail chunk: left unlimited
        ok &= same
    return ok


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False, window_size=(-1, -1), attention_chunk=0, return_softmax_lse=False, *,
                           _bug=None):
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"flash_attn_varlen_func: fp16/bf16 only, one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"flash_attn_varlen_func: q (total_q, h, d), k and v (total_k, h_k, d); "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    hq, d = q.shape[1], q.shape[2]
    hk = k.shape[1]
    if k.shape[2] != d or v.shape[2] != d or d > 256:
        raise ValueError(f"flash_attn_varlen_func: head dims must match and be <= 256; got {d}, {k.shape[2]}, "
                         f"{v.shape[2]}")
    if hq % hk:
        raise ValueError(f"flash_attn_varlen_func: nheads {hq} is not a multiple of nheads_k {hk}")
    if attention_chunk < 0:
        raise ValueError(f"flash_attn_varlen_func: attention_chunk must be >= 0, got {attention_chunk}")
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    out = q.new_zeros(q.shape[0], hq, d)
    lse = torch.full((hq, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[s], cq[s + 1], ck[s], ck[s + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        ok = _visible(lq, lk, causal=causal, window=tuple(window_size), chunk=attention_chunk, key_offset=k0,
                      bug=_bug).to(q.device)
        qs = q[q0:q1].float().transpose(0, 1)  # (hq, lq, d)
        ks = k[k0:k1].float().transpose(0, 1).repeat_interleave(hq // hk, 0)
        vs = v[k0:k1].float().transpose(0, 1).repeat_interleave(hq // hk, 0)
        sc = (qs @ ks.transpose(-1, -2)) * scale
        sc = sc.masked_fill(~ok, float("-inf"))
        m = sc.amax(-1, keepdim=True) if lk else sc.new_full((hq, lq, 1), float("-inf"))
        live = m != float("-inf")  # a row with a visible key (a NaN or Inf score must propagate, not read as none)
        e = torch.exp(sc - torch.where(live, m, torch.zeros_like(m)))
        den = e.sum(-1, keepdim=True)
        o = torch.where(live, (e @ vs) / torch.where(live, den, torch.ones_like(den)), torch.zeros_like(den))
        out[q0:q1] = o.transpose(0, 1).to(q.dtype)
        lse[:, q0:q1] = torch.where(live, m + torch.log(den), m).squeeze(-1)
    return (out, lse) if return_softmax_lse else out


CLAIMS = dict(
    dtypes=("float16", "bfloat16"),
    devices=("cpu",),  # plain torch here; the real kernel is CUDA
    head_dims=lambda d: d <= 256,
    causal=("none", "bottom_right"),
    window=True,
    gqa=True,
    varlen=True,
    attention_chunk=True,
    lse=True,
    fully_masked="zeros",  # a query that sees no key: 0, LSE -inf
)


def _call(q, k, v, spec: av.Spec, bug=None):
    b, hq, lq, _ = q.shape
    lk = k.shape[2]
    if spec.is_varlen:
        cu_q, cu_k, max_q, max_k = spec.cu_seqlens_q, spec.cu_seqlens_k, spec.max_seqlen_q, spec.max_seqlen_k
    else:  # a padded batch is a pack of B documents of equal length
        cu_q = torch.arange(b + 1, dtype=torch.int32) * lq
        cu_k = torch.arange(b + 1, dtype=torch.int32) * lk
        max_q, max_k = lq, lk
    pack = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])  # noqa: E731 - (B, H, L, D) -> (B*L, H, D)
    res = flash_attn_varlen_func(
        pack(q), pack(k), pack(v), cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k,
        softmax_scale=spec.scale, causal=spec.causal == "bottom_right",
        window_size=spec.window if spec.window is not None else (-1, -1),
        attention_chunk=spec.attention_chunk or 0, return_softmax_lse=spec.return_lse, _bug=bug)
    out, lse = res if spec.return_lse else (res, None)
    out = out.reshape(b, lq, hq, -1).transpose(1, 2)
    if lse is None:
        return out
    return av.Output(out, lse=lse.reshape(hq, b, lq).transpose(0, 1))


@av.adapter("chunked-local", register=False, **CLAIMS)  # a file adapter: --adapter path.py:chunked_local
def chunked_local(q, k, v, spec: av.Spec):
    return _call(q, k, v, spec)


def _wrong(bug):
    return av.adapter(f"chunked-local-{bug.replace('_', '-')}", register=False, **CLAIMS)(
        lambda q, k, v, spec: _call(q, k, v, spec, bug))


chunked_local_boundary_off_by_one = _wrong("boundary_off_by_one")
chunked_local_origin_top_left = _wrong("origin_top_left")
chunked_local_origin_packed = _wrong("origin_packed")
chunked_local_last_partial_ignored = _wrong("last_partial_ignored")
