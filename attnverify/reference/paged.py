"""The reference's reading of a KV-cache call (attnverify/paged.py has the rules): gather each batch's keys
slot by slot from the caches (from cache_leftpad[b] on), apply the append to a copy, and attend in float64.

Written without anything of the adapters: slot t of batch b is found by plain integer arithmetic.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

_F64 = torch.float64


def _ints(t) -> List[int]:
    return [int(x) for x in torch.as_tensor(t).reshape(-1).tolist()]


def slots(spec, b: int, count: int, n: int, s: int, start: int = 0) -> List[Tuple[int, int]]:
    """(page or cache row, offset) of batch b's slots start .. start + count - 1."""
    if spec.block_table is not None:
        row = _ints(torch.as_tensor(spec.block_table)[b])
        out = []
        for t in range(start, start + count):
            if t // s >= len(row):
                raise ValueError(f"reference: batch {b} needs block table entry {t // s}, the table has {len(row)}")
            page = row[t // s]
            if not 0 <= page < n:
                raise ValueError(f"reference: block_table[{b}, {t // s}] = {page} is not a page of the {n} in the cache")
            out.append((page, t % s))
        return out
    idx = _ints(spec.cache_batch_idx)[b] if spec.cache_batch_idx is not None else b
    if start + count > s or not 0 <= idx < n:
        raise ValueError(f"reference: batch {b} slots up to {start + count - 1} of cache row {idx} lie outside "
                         f"the cache ({n} x {s})")
    return [(idx, t) for t in range(start, start + count)]


def leftpads(spec) -> List[int]:
    """The slot each batch's cached keys start at (cache_leftpad, else 0)."""
    if spec.cache_leftpad is None:
        return [0] * len(_ints(spec.cache_seqlens))
    return _ints(spec.cache_leftpad)


def cache_after(k: torch.Tensor, v: torch.Tensor, spec) -> Tuple[torch.Tensor, torch.Tensor]:
    """The caches as they must be after the call: k_new/v_new at slots cache_seqlens[b].. of each batch,
    every other element as before (copies; the inputs are not touched)."""
    k2, v2 = k.detach().clone(), v.detach().clone()
    if spec.k_new is None:
        return k2, v2
    n, s = k.shape[0], k.shape[1]
    lnew = int(spec.k_new.shape[2])
    for b, c in enumerate(_ints(spec.cache_seqlens)):
        for i, (page, off) in enumerate(slots(spec, b, lnew, n, s, start=c)):
            k2[page, off] = spec.k_new[b, :, i, :].to(k2.dtype)
            v2[page, off] = spec.v_new[b, :, i, :].to(v2.dtype)
    return k2, v2


def cache_keys(k: torch.Tensor, v: torch.Tensor, spec) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per batch, the keys and values it attends to, (1, Hkv, L_b, D) each in the caches' dtype: the cached
    prefix (slots cache_leftpad[b] .. cache_seqlens[b] - 1) read from the caches as they are before the call,
    then k_new/v_new."""
    n, s = k.shape[0], k.shape[1]
    out = []
    for b, (c, pad) in enumerate(zip(_ints(spec.cache_seqlens), leftpads(spec))):
        if not 0 <= pad <= c:
            raise ValueError(f"reference: cache_leftpad[{b}] = {pad} must lie in [0, cache_seqlens[{b}] = {c}]")
        where = slots(spec, b, c - pad, n, s, start=pad)
        if where:
            pages = torch.tensor([p for p, _ in where], device=k.device)
            offs = torch.tensor([o for _, o in where], device=k.device)
            kb, vb = k[pages, offs], v[pages, offs]  # (L, Hkv, D)
        else:
            kb, vb = k.new_zeros(0, *k.shape[2:]), v.new_zeros(0, *v.shape[2:])
        kb, vb = kb.permute(1, 0, 2).unsqueeze(0), vb.permute(1, 0, 2).unsqueeze(0)
        if spec.k_new is not None:
            kb = torch.cat([kb, spec.k_new[b:b + 1].to(kb.dtype)], dim=2)
            vb = torch.cat([vb, spec.v_new[b:b + 1].to(vb.dtype)], dim=2)
        out.append((kb, vb))
    return out


def plain_spec(spec, b: int):
    """Batch b's call without the cache: the same semantics over its gathered keys."""
    slopes = spec.alibi_slopes
    if isinstance(slopes, torch.Tensor) and slopes.dim() == 2:
        slopes = slopes[b:b + 1]
    return spec.replace(block_table=None, page_size=None, cache_seqlens=None, cache_batch_idx=None, k_new=None,
                        v_new=None, cache_leftpad=None, num_splits=None, alibi_slopes=slopes)


def cache_forward(q, k, v, spec, dense_forward):
    """Exact attention of a cache call: `dense_forward(q_b, k_b, v_b, spec_b)` per batch, stacked."""
    from ._exact import ReferenceResult

    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"reference: caches must be (N, S, Hkv, D); got k{tuple(k.shape)} v{tuple(v.shape)}")
    outs, lses = [], []
    for b, (kb, vb) in enumerate(cache_keys(k, v, spec)):
        r = dense_forward(q[b:b + 1], kb, vb, plain_spec(spec, b))
        outs.append(r.out)
        lses.append(r.lse)
    if not outs:
        return ReferenceResult(torch.zeros(0, q.shape[1], q.shape[2], v.shape[-1], dtype=_F64),
                               torch.zeros(0, q.shape[1], q.shape[2], dtype=_F64))
    return ReferenceResult(torch.cat(outs), torch.cat(lses))
