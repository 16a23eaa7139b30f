"""`naive`'s serving paths: KV caches (paged or contiguous), append, and split-KV with an LSE merge.

The adapter side of attnverify/paged.py's rules, written apart from the reference's reading of them: the
pages of a batch are gathered with one vectorised index, an append is a scatter into the caches, and
num_splits cuts the keys into contiguous chunks whose float32 partials (out, LSE) are merged by their
natural-log LSE -- the flash-decoding combine, without rounding the partials.
"""
from __future__ import annotations

import torch

from ..spec import Output, Spec
from ._features import NEG_INF, score_bias_and_visibility


def _slot_index(spec: Spec, b: int, start: int, count: int, page: int, device):
    """(cache rows or pages, offsets) of batch b's slots start .. start + count - 1."""
    t = torch.arange(start, start + count, device=device)
    if spec.block_table is not None:
        table = torch.as_tensor(spec.block_table, device=device).long()
        return table[b, t // page], t % page
    row = int(spec.cache_batch_idx[b]) if spec.cache_batch_idx is not None else b
    return torch.full_like(t, row), t


def append_in_place(k, v, spec: Spec) -> None:
    """Write k_new/v_new (B, Hkv, Lnew, D) into the caches at slot cache_seqlens[b] of each batch."""
    if spec.k_new is None:
        return
    lnew = spec.k_new.shape[2]
    for b, c in enumerate(torch.as_tensor(spec.cache_seqlens).tolist()):
        rows, offs = _slot_index(spec, b, int(c), lnew, k.shape[1], k.device)
        with torch.no_grad():
            k[rows, offs] = spec.k_new[b].transpose(0, 1).to(k.dtype)
            v[rows, offs] = spec.v_new[b].transpose(0, 1).to(v.dtype)


def gather(k, v, spec: Spec, b: int, length: int, start: int = 0):
    """Batch b's `length` keys and values from slot `start` on, (1, Hkv, length, D)."""
    rows, offs = _slot_index(spec, b, start, length, k.shape[1], k.device)
    return k[rows, offs].transpose(0, 1).unsqueeze(0), v[rows, offs].transpose(0, 1).unsqueeze(0)


def split_attention(q, k, v, spec: Spec, splits: int) -> Output:
    """Attention with the keys cut in `splits` contiguous chunks, merged by LSE (BHSD inputs, no varlen)."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = hq // hkv
    kk = k.repeat_interleave(g, dim=1) if g > 1 else k
    vv = v.repeat_interleave(g, dim=1) if g > 1 else v
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = torch.matmul(q.to(acc), kk.to(acc).transpose(-1, -2)) * spec.resolved_scale(d)
    if spec.softcap is not None:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    bias, vis = score_bias_and_visibility(spec, b, hq, lq, lk, q.device, dtype=acc)
    if bias is not None:
        s = s + bias
    if vis is not None:
        s = s.masked_fill(~vis, NEG_INF)
    outs, lses = [], []
    for cols in torch.arange(lk, device=q.device).tensor_split(splits):
        sc, vc = s[..., cols], vv[:, :, cols].to(acc)
        m = sc.amax(dim=-1, keepdim=True) if cols.numel() else torch.full((*sc.shape[:-1], 1), NEG_INF, dtype=acc, device=q.device)
        dead = torch.isneginf(m)
        p = torch.exp(sc - m.masked_fill(dead, 0.0))
        l = p.sum(dim=-1, keepdim=True)
        # P rounded to the input dtype as a kernel feeds it to its P @ V matmul; partials stay in acc
        o = torch.matmul(p.to(q.dtype).to(acc), vc) / l.masked_fill(dead, 1.0)
        outs.append(o)
        lses.append((m + torch.log(l)).masked_fill(dead, NEG_INF))
    lse_all = torch.cat(lses, dim=-1)  # (B, H, Lq, splits)
    lse = torch.logsumexp(lse_all, dim=-1, keepdim=True)
    w = torch.exp(lse_all - lse.masked_fill(torch.isneginf(lse), 0.0)).masked_fill(torch.isneginf(lse_all), 0.0)
    out = sum(w[..., i:i + 1] * o for i, o in enumerate(outs))
    return Output(out.to(q.dtype), lse=lse.squeeze(-1) if spec.return_lse else None)


def cache_attention(q, k, v, spec: Spec, dense) -> Output:
    """A cache call: append in place, then per batch `dense(q_b, k_b, v_b, spec_b)` over its gathered keys."""
    append_in_place(k, v, spec)
    new = 0 if spec.k_new is None else spec.k_new.shape[2]
    outs, lses = [], []
    lens = torch.as_tensor(spec.cache_seqlens).tolist()
    pads = [0] * len(lens) if spec.cache_leftpad is None else torch.as_tensor(spec.cache_leftpad).tolist()
    for b, (c, pad) in enumerate(zip(lens, pads)):
        kb, vb = gather(k, v, spec, b, int(c) - int(pad) + new, start=int(pad))
        slopes = spec.alibi_slopes
        if isinstance(slopes, torch.Tensor) and slopes.dim() == 2:
            slopes = slopes[b:b + 1]
        sb = spec.replace(block_table=None, page_size=None, cache_seqlens=None, cache_batch_idx=None, k_new=None,
                          v_new=None, cache_leftpad=None, alibi_slopes=slopes)
        r = dense(q[b:b + 1], kb, vb, sb)
        outs.append(r.out)
        lses.append(r.lse)
    lse = torch.cat(lses) if spec.return_lse else None
    return Output(torch.cat(outs), lse=lse)
