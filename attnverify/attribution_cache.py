"""Attribution's neighbours of a KV-cache case (attnverify.attribution): the batch neighbours keep one request per
batch entry (B -> 1 keeps the first; the B=2 stand-in repeats it, sharing its pages, never with an append, whose two
writes would collide), and a length neighbour, which a cache case cannot have (its lengths are its cache_lens), is
said to be so instead of surfacing the recipe's ValueError."""
from __future__ import annotations

import dataclasses
from typing import Optional


def fix_cache(new):
    """The recipe `new` with its per-request cache fields cut or repeated to `new.batch` (others as they are)."""
    lens = list(new.cache_lens) if new.cache_lens is not None else None
    if lens is None or len(lens) == new.batch or not lens or (new.batch > len(lens) and new.new_len):
        return new
    idx = [i % len(lens) for i in range(new.batch)]

    def pick(seq):
        return None if seq is None else tuple(seq[i] for i in idx)

    pads = pick(new.cache_leftpad)
    cut = pick(lens)
    len_k = max(c - p for c, p in zip(cut, pads or (0,) * len(cut))) + new.new_len
    return dataclasses.replace(new, cache_lens=cut, cache_leftpad=pads, block_table=pick(new.block_table),
                               cache_batch_idx=pick(new.cache_batch_idx), len_k=len_k)


def cache_why(r) -> Optional[str]:
    """Why a neighbour of a KV-cache case is none (its key length is not its cache_lens' own), else None."""
    if r.cache_lens is None or not r.cache_lens:
        return None
    pads = list(r.cache_leftpad) if r.cache_leftpad is not None else [0] * len(r.cache_lens)
    if r.len_k != max(c - p for c, p in zip(r.cache_lens, pads)) + r.new_len:
        return "a KV-cache case takes its key lengths from cache_lens: it has no such neighbour"
    return None
