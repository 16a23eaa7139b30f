"""attnverify's cache calls in FlashInfer's page layout: pure translations, no flashinfer, no GPU.

FlashInfer's paged wrappers (`BatchDecodeWithPagedKVCacheWrapper.plan`, `BatchPrefillWithPagedKVCacheWrapper.plan`,
`append_paged_kv_cache`; flashinfer 0.6.18 decode.py, prefill.py, page.py) describe a batch's pages in CSR form:

- ``indptr`` int32 ``[batch_size + 1]``: request b owns ``indices[indptr[b]:indptr[b + 1]]``;
- ``indices`` int32 ``[indptr[-1]]``: "The page indices of the paged kv cache", in key order;
- ``last_page_len`` int32 ``[batch_size]``: "The number of entries in the last page of each request", so
  request b has ``(indptr[b+1] - indptr[b] - 1) * page_size + last_page_len[b]`` keys (page.cuh
  ``get_length``: 0 for a request without pages; ``get_seq_lens`` in page.py clamps the page count at 0, so
  an empty request is given ``last_page_len = 0``, which both read as 0 keys).

attnverify's cache call (docs/adapters.md, recipe 6) holds the same information as a block table: the keys of
batch b are slots ``0 .. cache_seqlens[b] - 1`` of pages ``block_table[b, 0], block_table[b, 1], ...``. A
contiguous cache ``(N, S, Hkv, D)`` read at row ``cache_batch_idx[b]`` is the paged case with one page of
size S per request. An append (``spec.k_new``) lands at slots ``cache_seqlens[b] ..`` of the pages; FlashInfer
"assumes that the space for appended k/v has already been allocated, which means kv_indices, kv_indptr,
kv_last_page_len has incorporated appended k/v" (append_paged_kv_cache), and takes one (batch index, position)
pair per appended row (``get_batch_indices_positions``: "the rightmost column index of each row" -- positions
count from the request's first slot).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

Csr = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (indptr, indices, last_page_len), int32


def csr_from_block_table(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> Csr:
    """(indptr, indices, last_page_len) of requests whose keys are the first `seq_lens[b]` slots of the pages
    `block_table[b, :]` (`page_size` slots each). Table entries past a request's last page are not read."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    table = torch.as_tensor(block_table).long()
    lens = torch.as_tensor(seq_lens).long().to(table.device)
    if table.dim() != 2 or lens.dim() != 1 or table.shape[0] != lens.shape[0]:
        raise ValueError(f"block_table must be (B, max_blocks) and seq_lens (B,); got {tuple(table.shape)} and "
                         f"{tuple(lens.shape)}")
    if (lens < 0).any():
        raise ValueError(f"seq_lens must be >= 0, got {lens.tolist()}")
    pages = (lens + page_size - 1) // page_size  # ceil: a partial last page is a page
    if (pages > table.shape[1]).any():
        raise ValueError(f"seq_lens {lens.tolist()} need up to {int(pages.max())} pages; block_table has "
                         f"{table.shape[1]} columns")
    indptr = torch.zeros(len(lens) + 1, dtype=torch.long, device=table.device)
    indptr[1:] = torch.cumsum(pages, 0)
    keep = torch.arange(table.shape[1], device=table.device)[None, :] < pages[:, None]
    indices = table[keep]  # row-major: request 0's pages in order, then request 1's, ...
    last = torch.where(lens > 0, (lens - 1) % page_size + 1, torch.zeros_like(lens))
    return indptr.int(), indices.int(), last.int()


def contiguous_table(batch: int, cache_batch_idx: Optional[torch.Tensor], device) -> torch.Tensor:
    """The block table of a contiguous cache (N, S, Hkv, D) seen as N pages of size S: batch b's only page is
    cache row `cache_batch_idx[b]` (default b)."""
    if cache_batch_idx is None:
        rows = torch.arange(batch, device=device)
    else:
        rows = torch.as_tensor(cache_batch_idx, device=device).long()
    return rows.view(batch, 1).int()


def append_coords(cache_seqlens: torch.Tensor, new_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(batch_indices, positions) int32 of the `B * new_len` appended rows, ragged in batch order: row
    `b * new_len + i` goes to request b at slot `cache_seqlens[b] + i` (the slot after its cached keys)."""
    lens = torch.as_tensor(cache_seqlens).long()
    b = lens.shape[0]
    batch_indices = torch.arange(b, device=lens.device).repeat_interleave(new_len)
    positions = (lens[:, None] + torch.arange(new_len, device=lens.device)[None, :]).reshape(-1)
    return batch_indices.int(), positions.int()


def uniform_indptr(batch: int, length: int, device) -> torch.Tensor:
    """indptr of `batch` requests of `length` rows each (qo_indptr of a BHSD query)."""
    return (torch.arange(batch + 1, device=device) * length).int()


def rows_as_pages(seg_lens, device) -> Csr:
    """Packed keys (total, Hkv, D) as a pool of pages of size 1: request b's keys are rows
    `sum(seg_lens[:b]) ..` (a plain or varlen call served by a paged wrapper)."""
    lens = torch.as_tensor(list(seg_lens), dtype=torch.long, device=device)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.long, device=device)
    indptr[1:] = torch.cumsum(lens, 0)
    indices = torch.arange(int(indptr[-1]), device=device)
    return indptr.int(), indices.int(), (lens > 0).int()
