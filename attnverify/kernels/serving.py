"""Host side of the bundled kernel's serving path: `paged_decode`, a flash_attn_with_kvcache-style call.

    out, lse = paged_decode(q, k_cache, v_cache, cache_seqlens, block_table=None, cache_batch_idx=None,
                            k_new=None, v_new=None, num_splits=None, scale=None, causal="none", window=None,
                            softcap=None, alibi_slopes=None, sinks=None, cache_leftpad=None)

q (B, Hq, Lq, D); caches (N, S, Hkv, D) / (N, S, Hkv, Dv) (a paged pool of N pages of S slots with
block_table (B, max_blocks) int32, or N cache rows of S slots, row cache_batch_idx[b] for batch b, default
b); cache_seqlens (B,) int; cache_leftpad (B,) int (flash_attn_with_kvcache's): batch b's cached keys are
slots cache_leftpad[b] .. cache_seqlens[b] - 1 (default 0 ..); k_new / v_new (B, Hkv, Lnew, D) are first written into the caches in place at
slots cache_seqlens[b] .. (a torch scatter, not a kernel) and then attended to. causal is "none",
"top_left" or "bottom_right" (over prefix + new keys), window (left, right) bottom-right aligned, -1
unbounded; sinks (Hq,) one logit per query head (a score over a zero value). Forward only, no autograd.
Returns out (B, Hq, Lq, Dv) in q's dtype and lse (B, Hq, Lq) float32 natural log (0 keys and no sink:
out 0, LSE -inf).

num_splits: 1 = one pass, k = every batch's keys in k chunks merged by LSE (kernels/combine.py), None =
each batch picks cdiv(its length, SPLIT_TARGET) splits, at most MAX_SPLITS, from its own length only (so
batching never changes a request's result); under the interpreter None is 1.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import combine, common, decode
from .launch import BIG, interpreting, triton_next_pow2

SPLIT_TARGET = 512  # keys per split when num_splits is None (GPU)
MAX_SPLITS = 64


def decode_tiles(dtype: torch.dtype, block_d: int, rows: int) -> Tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_stages) of the split-KV decode kernel for a head-dim tile `block_d` and `rows` query
    rows per kv head (group * Lq): 64 keys a tile, 2 stages. float32 runs its dots on the CUDA cores
    (input_precision="ieee") with its tiles in registers, and what does not fit spills to local memory, which a launch
    reserves for every thread the GPU can hold (132 SMs x 2,048 threads on an H100). The cubin Triton 3.9 builds for
    sm_90 (benchmarks/kernel_spills.py, 2026-12-05) needs 640 bytes of stack a thread at block_d 128 with 16 x 64 tiles
    (~170 MB a launch), 2,960 with 64 x 64 (~800 MB), 856 at block_d 64 with 64 x 64 and 432 with 32 x 64. Such
    launches failed with "Triton Error [CUDA]: out of memory" on GPUs other processes had filled: D = 160 on the H200
    (64 x 64 tiles, 2026-12-05) and D = 72-111 on an H100 shared by 11-14 processes (26 examples of the thorough run,
    shrunk to B = 1, Lq = 8). So float32 takes 16 x 16 tiles and 1 stage at block_d > 64 (no stack up to block_d 512)
    and 16 query rows a tile at block_d 64 (none); at block_d <= 32 it keeps bm x 64 (none at 64 x 64)."""
    bm = max(16, min(64, triton_next_pow2(rows)))
    if dtype == torch.float32 and block_d > 64:
        return 16, 16, 1
    if dtype == torch.float32 and block_d > 32:
        return 16, 64, 2
    return bm, 64, 2


def _bad(arg: str, why: str) -> ValueError:
    return ValueError(f"paged_decode({arg}=...): {why}")


def _ints(x, name: str, device, b: int, dims: int = 1) -> torch.Tensor:
    t = torch.as_tensor(x, device=device)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != dims or t.shape[0] != b:
        raise _bad(name, f"give an integer tensor with {dims} dim(s) and {b} rows (one per batch); got "
                         f"{t.dtype} {tuple(t.shape)}")
    return t.to(torch.int32)


def append_into_cache(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table=None, cache_batch_idx=None) -> None:
    """Write k_new / v_new (B, Hkv, Lnew, D) into the caches at slots cache_seqlens[b] .. of each batch
    (in place, one vectorised index_put per cache, no host sync)."""
    b, _, lnew, _ = k_new.shape
    if lnew == 0:
        return
    s = k_cache.shape[1]
    t = cache_seqlens.long()[:, None] + torch.arange(lnew, device=k_cache.device)[None, :]  # (B, Lnew)
    if block_table is not None:
        page = torch.gather(block_table.long(), 1, t // s)
        off = t % s
    else:
        rows = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(b, device=k_cache.device)
        page, off = rows[:, None].expand(b, lnew), t
    with torch.no_grad():
        k_cache.index_put_((page.reshape(-1), off.reshape(-1)), k_new.transpose(1, 2).reshape(b * lnew, *k_new.shape[1::2]).to(k_cache.dtype))
        v_cache.index_put_((page.reshape(-1), off.reshape(-1)), v_new.transpose(1, 2).reshape(b * lnew, *v_new.shape[1::2]).to(v_cache.dtype))


def _check(q, k_cache, v_cache, k_new, v_new, causal, validate_lengths, seqlens, table, rows, pads=None):
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise _bad("q", f"q must be (B, Hq, Lq, D) and the caches (N, S, Hkv, D); got {q.dim()}-D, "
                        f"{k_cache.dim()}-D, {v_cache.dim()}-D")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise _bad("q", f"q and the caches must share one dtype of float16, bfloat16, float32; got {q.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if k_cache.shape[3] != q.shape[3] or k_cache.shape[:3] != v_cache.shape[:3]:
        raise _bad("k_cache", f"k_cache {tuple(k_cache.shape)} must be (N, S, Hkv, D={q.shape[3]}) and v_cache "
                              f"{tuple(v_cache.shape)} (N, S, Hkv, Dv)")
    hq, hkv = q.shape[1], k_cache.shape[2]
    if hkv == 0 or hq % hkv:
        raise _bad("q", f"Hq={hq} is not a multiple of the caches' Hkv={hkv}")
    if (k_new is None) != (v_new is None):
        raise _bad("k_new", "give k_new and v_new together")
    if k_new is not None and (k_new.dim() != 4 or k_new.shape[:2] != (q.shape[0], hkv) or k_new.shape[3] != q.shape[3]
                              or v_new.shape[:3] != k_new.shape[:3] or v_new.shape[3] != v_cache.shape[3]):
        raise _bad("k_new", f"k_new {tuple(k_new.shape)} / v_new {tuple(v_new.shape)} must be (B, Hkv, Lnew, D) / "
                            f"(B, Hkv, Lnew, Dv) with B={q.shape[0]}, Hkv={hkv}")
    if causal not in ("none", "top_left", "bottom_right"):
        raise _bad("causal", f"{causal!r}: give 'none', 'top_left' or 'bottom_right'")
    if not validate_lengths:
        return
    if seqlens.numel() == 0:
        return
    n, s = k_cache.shape[0], k_cache.shape[1]
    need = seqlens.long() + (0 if k_new is None else k_new.shape[2])
    zero = need.new_zeros(())
    bad_pads = zero if pads is None else ((pads < 0) | (pads > seqlens)).any().long()
    if table is not None:
        pages_used = (need + s - 1) // s
        j = torch.arange(table.shape[1], device=table.device)[None, :]
        used = j < pages_used[:, None]
        if pads is not None:  # pages wholly inside the left padding are never read
            used &= j >= (pads.long() // s)[:, None]
        bad_where = (((table < 0) | (table >= n)) & used).any().long()
    else:
        bad_where = zero if rows is None else ((rows < 0) | (rows >= n)).any().long()
    # one read-back for every check (a device sync on a GPU), not one per check
    neg, most, pads_out, where_out = torch.stack([(seqlens < 0).any().long(), need.max(), bad_pads, bad_where]).tolist()
    if neg:
        raise _bad("cache_seqlens", "lengths must be >= 0")
    if pads_out:
        raise _bad("cache_leftpad", "each batch's start slot must lie in [0, cache_seqlens[b]]")
    if table is not None:
        if most > table.shape[1] * s:
            raise _bad("cache_seqlens", f"a batch needs {most} slots, its block table row holds "
                                        f"{table.shape[1]} pages of {s}")
        if where_out:
            raise _bad("block_table", f"a page a batch reads is outside the pool's {n} pages")
    else:
        if most > s:
            raise _bad("cache_seqlens", f"a batch needs {most} slots, a cache row holds {s}")
        if where_out:
            raise _bad("cache_batch_idx", f"a row is outside the cache's {n} rows")


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens,
                 block_table=None, cache_batch_idx=None, k_new=None, v_new=None, num_splits: Optional[int] = None,
                 scale: Optional[float] = None, causal: str = "none", window=None, softcap: Optional[float] = None,
                 alibi_slopes=None, sinks=None, cache_leftpad=None, *, block_n: Optional[int] = None, num_warps: Optional[int] = None,
                 num_stages: Optional[int] = None, validate_lengths: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. `validate_lengths=False` skips the checks that read the lengths back to the
    host (a sync per call); block_n / num_warps / num_stages override the tiles."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise _bad("q", f"q must be a (B, Hq, Lq, D) tensor; got {getattr(q, 'shape', type(q).__name__)}")
    b, hq, lq, d = q.shape
    seqlens = _ints(cache_seqlens, "cache_seqlens", q.device, b)
    table = None if block_table is None else _ints(block_table, "block_table", q.device, b, dims=2)
    rows = None if cache_batch_idx is None else _ints(cache_batch_idx, "cache_batch_idx", q.device, b)
    pads = None if cache_leftpad is None else _ints(cache_leftpad, "cache_leftpad", q.device, b)
    if table is not None and rows is not None:
        raise _bad("cache_batch_idx", "only for a contiguous cache: leave it out with a block_table")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise _bad("num_splits", f"{num_splits!r}: an int >= 1, or None for the kernel's choice")
    _check(q, k_cache, v_cache, k_new, v_new, causal, validate_lengths, seqlens, table, rows, pads)
    hkv, dv, page = k_cache.shape[2], v_cache.shape[3], k_cache.shape[1]
    if k_new is not None:
        append_into_cache(k_cache, v_cache, k_new, v_new, seqlens, table, rows)
    new_len = 0 if k_new is None else int(k_new.shape[2])
    row_is_batch = table is None and rows is None  # batch b reads cache row b: no table
    if table is None:  # one "page" per batch: its cache row
        table = rows[:, None] if rows is not None else seqlens[:, None]  # (the latter never read)
    out = torch.empty(b, hq, lq, dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(b, hq, lq, device=q.device, dtype=torch.float32)
    if b == 0 or hq == 0 or lq == 0:
        return out, lse
    sc = float(scale) if scale is not None else d ** -0.5
    cap_scale, cap_c2 = (sc / float(softcap), float(softcap) * common.LOG2E_F) if softcap is not None else (1.0, 1.0)
    win = tuple(window) if window is not None else (-1, -1)
    wl, wr = (BIG if w < 0 else int(w) for w in win)
    slopes, saz, sah = lse, 0, 0
    if alibi_slopes is not None:
        slopes = torch.as_tensor(alibi_slopes, device=q.device).to(torch.float32)
        saz, sah = (0, slopes.stride(0)) if slopes.dim() == 1 else slopes.stride()
    sink_t = lse
    if sinks is not None:
        sink_t = torch.as_tensor(sinks, device=q.device).to(torch.float32).reshape(-1).contiguous()
        if sink_t.numel() != hq:
            raise _bad("sinks", f"one logit per query head: ({hq},); got {tuple(torch.as_tensor(sinks).shape)}")
    interp = interpreting()
    group = hq // hkv
    bd, bdv = max(16, triton_next_pow2(d)), max(16, triton_next_pow2(dv))
    bm, bn, stages = decode_tiles(q.dtype, max(bd, bdv), group * lq)
    bn = block_n or bn
    if num_splits is None:
        capacity = table.shape[1] * page
        max_splits = 1 if interp else max(1, min(MAX_SPLITS, -(-capacity // SPLIT_TARGET)))
        splits = 0
    else:
        max_splits = splits = int(num_splits)
    direct = max_splits == 1
    if direct:  # the partial buffers are never touched (DIRECT): out and lse stand in, no allocation
        op, lp = out, lse
        op_strides, lp_strides = (0, 0, 0, 0, 0), (0, 0, 0, 0)
    else:
        op = torch.empty(b, hq, lq, max_splits, dv, device=q.device, dtype=torch.float32)
        lp = torch.empty(b, hq, lq, max_splits, device=q.device, dtype=torch.float32)
        op_strides, lp_strides = op.stride(), lp.stride()
    flags = dict(IS_CAUSAL=causal != "none", CAUSAL_BR=causal == "bottom_right", HAS_WINDOW=win != (-1, -1),
                 HAS_SOFTCAP=softcap is not None, HAS_ALIBI=alibi_slopes is not None, HAS_SINKS=sinks is not None, UPCAST=interp,
                 IEEE=q.dtype == torch.float32)
    grid = (b * hkv, -(-(group * lq) // bm), max_splits)  # host integer arithmetic: triton.cdiv is a JIT function
    decode._decode_partial[grid](
        q, k_cache, v_cache, out, lse, op, lp, seqlens, table, slopes, sink_t, seqlens if pads is None else pads,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *lse.stride(), *op_strides, *lp_strides,
        *table.stride(), saz, sah,
        hkv, group, lq, page, new_len, splits, max_splits, SPLIT_TARGET,
        sc, sc * common.LOG2E_F, cap_scale, cap_c2, wl, wr,
        d, dv, BLOCK_D=bd, BLOCK_DV=bdv, EVEN_D=d == bd, EVEN_DV=dv == bdv, BLOCK_M=bm, BLOCK_N=bn,
        DIRECT=direct, SPLIT_ALIGN=16, ROW_IS_BATCH=row_is_batch, HAS_LEFTPAD=pads is not None,
        num_warps=num_warps or 4, num_stages=num_stages or (1 if interp else stages), **flags,
    )
    if not direct:
        rows_n = b * hq * lq
        br = 16
        combine._combine[(-(-rows_n // br),)](
            op, lp, out, lse, sink_t, *op.stride(), *lp.stride(), *out.stride(), *lse.stride(),
            rows_n, hq, lq, max_splits, dv,
            BLOCK_R=br, BLOCK_S=max(2, triton_next_pow2(max_splits)), BLOCK_DV=bdv, EVEN_DV=dv == bdv,
            HAS_SINKS=sinks is not None, UPCAST=interp, num_warps=4,
        )
    return out, lse
