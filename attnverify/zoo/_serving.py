"""The zoo's serving engine: a paged / contiguous KV-cache decode kernel with append and split-KV, and a
`bug=` switch for each serving-time bug of SERVING_BUGS. Without a bug it is correct (tests/test_serving.py).

Its own code, not naive's: slot t of batch b is read from page table[b, t // S] at t % S; keys are split in
chunks of SPLIT_KEYS (or spec.num_splits chunks) whose float32 partials are merged by their LSE.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..adapters.naive import NEG_INF, score_bias_and_visibility
from ..spec import Output, Spec

SERVING_BUGS = (
    "page_off_by_one", "partial_page_full", "unused_page_read", "seqlens_minus_one", "append_wrong_slot",
    "append_not_written", "split_partials_bf16", "merge_base2", "split_combine_stride", "leftpad_ignored",
    "leftpad_append_offset",
)
SPLIT_KEYS = 48  # keys per split when the call leaves num_splits to the kernel


def _where(spec: Spec, b: int, t: torch.Tensor, size: int, n: int, bug: Optional[str]):
    if spec.block_table is None:
        row = int(spec.cache_batch_idx[b]) if spec.cache_batch_idx is not None else b
        return torch.full_like(t, row), t
    table = torch.as_tensor(spec.block_table).long().to(t.device)
    page = table[b, t // size]
    if bug == "page_off_by_one":
        page = (page + 1) % n
    return page, t % size


def _pads(spec: Spec):
    lens = torch.as_tensor(spec.cache_seqlens).tolist()
    return [0] * len(lens) if spec.cache_leftpad is None else [int(p) for p in torch.as_tensor(spec.cache_leftpad).tolist()]


def _write(k, v, spec: Spec, bug: Optional[str]) -> None:
    if spec.k_new is None or bug == "append_not_written":
        return
    lnew = spec.k_new.shape[2]
    for b, (c, pad) in enumerate(zip(torch.as_tensor(spec.cache_seqlens).tolist(), _pads(spec))):
        start = int(c) + (1 if bug == "append_wrong_slot" else 0) + (pad if bug == "leftpad_append_offset" else 0)
        t = torch.arange(start, start + lnew, device=k.device)
        limit = k.shape[1] * (spec.block_table.shape[1] if spec.block_table is not None else 1)
        t = t.clamp(max=limit - 1)
        page, off = _where(spec, b, t, k.shape[1], k.shape[0], None)
        with torch.no_grad():
            k[page, off] = spec.k_new[b].transpose(0, 1).to(k.dtype)
            v[page, off] = spec.v_new[b].transpose(0, 1).to(v.dtype)


def _read(k, v, spec: Spec, b: int, length: int, bug: Optional[str], start: int = 0):
    size = k.shape[1]
    if spec.block_table is not None:
        width = spec.block_table.shape[1]
        if bug == "partial_page_full":
            length = min(-(-length // size) * size, width * size)
        elif bug == "unused_page_read":
            length = min((-(-length // size) + 1) * size, width * size)
    if bug == "seqlens_minus_one":
        length = max(0, length - 1)
    t = torch.arange(start, start + length, device=k.device)
    if bug == "leftpad_append_offset" and spec.k_new is not None and start:  # cached keys, then the misplaced new ones
        lnew = spec.k_new.shape[2]
        t = torch.cat([t[:length - lnew], t[length - lnew:] + start])
    limit = size * (spec.block_table.shape[1] if spec.block_table is not None else 1)
    page, off = _where(spec, b, t.clamp(max=limit - 1), size, k.shape[0], bug)
    return k[page, off].transpose(0, 1).unsqueeze(0), v[page, off].transpose(0, 1).unsqueeze(0)


def _split_attend(q, k, v, spec: Spec, splits: int, bug: Optional[str]):
    """(1, Hq, Lq, Dv) out and (1, Hq, Lq) LSE: float32 partials over `splits` key chunks, merged by LSE."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    kk, vv = k.repeat_interleave(hq // hkv, 1).float(), v.repeat_interleave(hq // hkv, 1).float()
    s = torch.matmul(q.float(), kk.transpose(-1, -2)) * spec.resolved_scale(d)
    if spec.softcap is not None:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    bias, vis = score_bias_and_visibility(spec, b, hq, lq, lk, q.device)
    s = s if bias is None else s + bias
    s = s if vis is None else s.masked_fill(~vis, NEG_INF)
    outs, lses = [], []
    for cols in torch.arange(lk, device=q.device).tensor_split(max(1, splits)):
        sc = s[..., cols]
        m = sc.amax(-1, keepdim=True) if cols.numel() else torch.full((b, hq, lq, 1), NEG_INF)
        dead = torch.isneginf(m)
        p = torch.exp(sc - m.masked_fill(dead, 0.0))
        l = p.sum(-1, keepdim=True)
        o = torch.matmul(p.to(q.dtype).float(), vv[:, :, cols]) / l.masked_fill(dead, 1.0)
        if bug == "split_partials_bf16":
            o = o.to(torch.bfloat16).float()
        outs.append(o)
        lses.append((m + torch.log(l)).masked_fill(dead, NEG_INF))
    part = torch.stack(outs)  # (splits, B, H, Lq, Dv), contiguous
    if bug == "split_combine_stride" and len(outs) > 1:
        n = len(outs)  # read as if the split index were the innermost row dimension
        part = part.reshape(b, hq, lq, n, -1).movedim(3, 0)
    lse_all = torch.cat(lses, -1)
    if bug == "merge_base2":  # partial LSEs are natural logs, merged as if they were base 2
        mx = lse_all.amax(-1, keepdim=True).masked_fill(torch.isneginf(lse_all.amax(-1, keepdim=True)), 0.0)
        w = torch.exp2(lse_all - mx)
        lse = mx + torch.log2(w.sum(-1, keepdim=True))
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
    else:
        lse = torch.logsumexp(lse_all, -1, keepdim=True)
        w = torch.exp(lse_all - lse.masked_fill(torch.isneginf(lse), 0.0)).masked_fill(torch.isneginf(lse_all), 0.0)
    out = (w.movedim(-1, 0).unsqueeze(-1) * part).sum(0)
    return out.to(q.dtype), lse.squeeze(-1)


def serving_attend(q, k, v, spec: Spec, bug: Optional[str] = None) -> Output:
    """A decode kernel with KV caches (or plain BHSD k/v) and split-KV; `bug` one of SERVING_BUGS or None."""
    if bug is not None and bug not in SERVING_BUGS:
        raise ValueError(f"bug={bug!r}: one of {SERVING_BUGS}")
    plain = spec.replace(block_table=None, page_size=None, cache_seqlens=None, cache_batch_idx=None, k_new=None,
                         v_new=None, num_splits=None, cache_leftpad=None)
    if spec.cache_seqlens is None:
        calls = [(q, k, v, plain)]
    else:
        _write(k, v, spec, bug)
        new = 0 if spec.k_new is None else spec.k_new.shape[2]
        calls = []
        for b, (c, pad) in enumerate(zip(torch.as_tensor(spec.cache_seqlens).tolist(), _pads(spec))):
            first = 0 if bug == "leftpad_ignored" else pad  # leftpad_ignored: the keys read from slot 0
            kb, vb = _read(k, v, spec, b, int(c) - pad + new, bug, start=first)
            if bug == "append_not_written" and new:  # attends to the new keys, never stores them
                kb = torch.cat([_read(k, v, spec, b, int(c) - pad, None, pad)[0], spec.k_new[b:b + 1].to(k.dtype)], 2)
                vb = torch.cat([_read(k, v, spec, b, int(c) - pad, None, pad)[1], spec.v_new[b:b + 1].to(v.dtype)], 2)
            slopes = spec.alibi_slopes
            if isinstance(slopes, torch.Tensor) and slopes.dim() == 2:
                slopes = slopes[b:b + 1]
            calls.append((q[b:b + 1], kb, vb, plain.replace(alibi_slopes=slopes)))
    outs, lses = [], []
    for qb, kb, vb, sb in calls:
        splits = spec.num_splits or max(1, -(-kb.shape[2] // SPLIT_KEYS))
        o, l = _split_attend(qb, kb, vb, sb, splits, bug)
        outs.append(o)
        lses.append(l)
    return Output(torch.cat(outs), lse=torch.cat(lses) if spec.return_lse else None)
