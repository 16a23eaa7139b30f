"""flash-attn4's serving calls: KV caches (paged and contiguous), num_splits and learnable sinks.

The translation from attnverify's serving Spec (attnverify/paged.py, docs/adapters.md recipe 6 and "Sinks")
to FlashAttention-4's public functions, and the claims it supports, all read from the code of flash-attn-4
4.0.0b36 (flash_attn/cute/interface.py unless named otherwise). This module imports no library; the
adapter (flash_attn4.py) imports flash_attn.cute when called and hands its functions in.

What FA4 takes, per GPU generation (`generation_limits`; the adapter's probe admits SM90 only, so the
claims below are SM90's and a call on another generation is refused at call time, never decided at import):

- paged KV: `flash_attn_varlen_func(..., page_table=...)` only (flash_attn_func has no page_table).
  `_flash_attn_fwd`: "assert cu_seqlens_k is None, 'page_table is not supported with cu_seqlens_k'",
  "assert page_table.dtype == torch.int32", "assert page_table.stride(-1) == 1", "assert page_table.shape
  == (batch_size, max_num_pages_per_seq)", and for k and v "assert k is None or k.shape == (num_pages,
  page_size, num_head_kv, head_dim)": attnverify's pool layout (N, S, Hkv, D) as it is. q may be batched
  (B, Lq, Hq, D) ("q: (total_q, nheads, hdim) or (batch, seqlen_q, nheads, hdim)"), so no cu_seqlens_q.
  Without seqused_k a sequence would be `seqlen_k_static` = num_pages * page_size keys
  (seqlen_info.py `SeqlenInfoQK.create`: "seqlen_k = mSeqUsedK[batch_idx]" if given, else the static
  length): the adapter always passes seqused_k = cache_seqlens (int32, contiguous: "cu_seqlens_q,
  cu_seqlens_k, seqused_q, seqused_k must be int32 ... must be contiguous").
- irregular head dims with non-TMA pages: refused. flash_fwd_sm90.py `FlashAttentionForwardSm90.__init__` (line 66
  of 4.0.0b36, as the H200 run's traceback shows): "assert self.use_tma_KV or not (self.check_hdim_oob or
  self.check_hdim_v_oob), 'Paged KV does not support irregular head dim'", with `self.use_tma_KV = not
  paged_kv_non_tma` and, in flash_fwd.py `FlashAttentionForwardBase.__init__`, "hdim_multiple_of = 16",
  `tile_hdim = ceil(head_dim / 16) * 16`, `check_hdim_oob = head_dim != tile_hdim` (the same for head_dim_v). So
  on SM90 a paged call raises when D or Dv is not a multiple of 16 (of the claimed multiples of 8: 8, 24, 40,
  ..., 248) and page_size != tile_n; a page of exactly one key tile (TMA) takes any head dim. Measured: the H200
  run of 2026-12-05 raised it at D = 40, page size 1 (paged_equals_contiguous, batch_invariance, sinks_paged).
  -> `irregular_head_dim` (asked by the adapter's `refuses` and again at call time).
- page sizes on SM90: any. The forward is built with `paged_kv_non_tma=page_size not in [None, tile_n]`:
  a page of exactly one key tile loads by TMA, any other size through `PagedKVManager` (paged_kv.py,
  cp.async row by row, `divmod(row_idx + self.leftpad_k, self.page_size_divmod)`, rows at or past
  seqlen_k not loaded: "row_valid = tXc0X[0, m, 0][0] < seqlenk_row_limit"). No page-size assert on SM90
  (SM80: "paged KV not supported on SM 8.0"; SM120: "Paged KV not supported on SM 12.0 in this PR").
  -> page_sizes: every size >= 1.
- the TMA page path reads a partial last page whole, which FA4 documents (flash_attn_varlen_func's
  docstring): "When pages load by TMA (a page holds whole key tiles), a tile loads every row of its block,
  including rows past seqused_k in a sequence's last, partially used page. Their scores are masked, but
  P = 0 times a NaN V row is still NaN, so those rows must be finite (their values do not matter). Pages
  a sequence does not use may hold anything, including NaN". attnverify's contract lets every unused slot
  hold garbage: with NaN there and page_size == tile_n (`sm90_tile_n`, from `_tile_size_fwd_sm90`: 128
  for D <= 64, 64 < D <= 96 causal or windowed, 96 < D <= 128, 128 < D <= 192 with Dv <= 128 and no
  window; 64 for D > 192 with a window; 144, 112, 96 or 80 otherwise, sizes attnverify does not draw) the
  output is NaN. Declared as a known finding of paged_equals_contiguous, narrowed to page sizes 64 and 128
  and NaN garbage, not strict: documented by FA4, not yet measured (flash_attn4.py `_SERVING_FINDINGS`).
- contiguous caches (kv_cache): FA4 has no cache_batch_idx and no flash_attn_with_kvcache. A cache
  (N, S, Hkv, D) whose rows are the batch (N == B, no cache_batch_idx) goes to flash_attn_varlen_func as
  batched k/v ("k: ... or (batch, seqlen_k, nheads_k, hdim)") with seqused_k; otherwise the adapter
  gathers the batch's rows (`k[cache_batch_idx]`, a copy) first, so both calls of batch_invariance take
  the same kernel path. Predicted, not declared: the non-paged TMA load bounds a tile by the tensor (S
  slots), not by seqused_k (seqlen_info.py `offset_batch_K` with ragged=False is `mK[batch_idx]`), so a
  NaN in a slot past cache_seqlens inside a sequence's last key tile may reach its output as in F17.
- append (k_new / v_new) and cache_leftpad: not claimed. Neither public function takes new keys or a
  left padding (`_flash_attn_fwd`'s parameters; `leftpad_k` appears only in `get_scheduler_metadata`,
  and the SM90 forward builds its PagedKVManager with "0,  # leftpad_k").
- num_splits: SM90 accepts 1 only: `_flash_attn_fwd` asserts "SplitKV not supported on SM 9.0" when
  `num_splits > 1`, and `num_splits < 1` asks `num_splits_heuristic`, which may pick more than 1 (and
  then trips the assert), so `spec.num_splits=None` is passed as FA4's default 1, never 0. -> num_splits
  = (1,): split_invariance then skips (one value), batch_invariance draws 1. SM100 splits
  (`FlashAttentionForwardSm100(is_split_kv=...)` + `_flash_attn_fwd_combine`, "assert num_splits <= 256");
  SM120: "SM120 forward only supports num_splits=1".
- sinks: `learnable_sink` on both functions, "assert learnable_sink.shape == (num_head,)", "learnable_sink
  must be float16, bfloat16, or float32": spec.sinks (float32 (Hq,)) is passed as it is, a leaf the
  suite made, so its gradient reaches spec.sinks through FA4's autograd Functions (FlashAttnFunc.backward
  returns dsink in learnable_sink's position). softmax.py `apply_learnable_sink`: "one extra softmax column
  per Q head with logit `sink_val` (natural-log units, not multiplied by softmax_scale) and no value vector
  ... A fully masked row ... giving O = 0 and lse = sink. Backward: dsink[h] = -sum_rows exp(sink[h] -
  lse[row,h]) * dpsum[row,h]" -- attnverify's convention (dpsum = D - dLSE, flash_bwd_preprocess.py). The
  SM90 backward: "assert arch // 10 in [9, 10, 11], 'Learnable sink backward is supported on SM90 and
  SM100/SM110'"; dsink is reduced in the dQ postprocess (`LearnableSinkBwdTensors(dpsum, lse,
  learnable_sink, dsink)`), varlen included. With seqlen_k == 0 the forward fills "lse == sink". A sink of
  -inf on a row without keys: `Softmax.finalize` gets row_sum = exp2(NaN), "if row_sum is zero or nan"
  -> LSE -inf, output 0 (no sink). Predicted here first, then measured on the H200 (2026-12-05, F37, declared in
  flash_attn4.py): finalize adds exp2(sink * LOG2_E - row_max_scaled) in float32 against the keys' max, so a sink
  more than 88.72 above every score overflows (LSE +inf; the output, scaled by 1/inf, is 0, which is right).
- the LSE: "return_lse: ... The returned LSE supports taking gradient" (`_flash_attn_fwd` docstring; the
  backward takes `dlse`), so the adapter returns it attached: the sink's gradient has a dLSE term.
- MLA `qv` and fp8 descales: SM100 only, not claimed. "assert arch // 10 in [10, 11], 'only support
  Blackwell arch with qv'" and "FP8 is only supported on SM100 (compute capability 10.x) for FA4 CuTe."
  (and the public functions take no descales: only `_flash_attn_fwd` has q_descale/k_descale/v_descale).
- paged or cache calls with a gradient: refused. FlashAttnVarlenFunc.backward calls `_flash_attn_bwd`
  without the page_table (it is not saved), so the backward would read the page pool as batched keys;
  attnverify's serving properties call forward only.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from ..spec import Output, Spec


def _any_page(size: int) -> bool:
    """FA4's SM90 forward takes every page size (TMA for a page of one key tile, cp.async otherwise)."""
    return size >= 1


# the serving claims of the adapter; they are SM90's (the probe admits SM90 only: flash_attn4.py)
SM90_SERVING_CLAIMS = dict(kv_cache=True, paged=True, page_sizes=_any_page, num_splits=(1,), sinks=True)


def sm90_tile_n(d: int, dv: int, causal: bool, local: bool) -> int:
    """The key tile of FA4's SM90 forward (`_tile_size_fwd_sm90`'s n_block_size); a paged call whose page size
    equals it loads pages by TMA. `causal`/`local` as `_resolve_causal_local_window` leaves them (a window,
    with or without causal, is local)."""
    if d <= 64 or 96 < d <= 128:
        return 128
    if d <= 96:
        return 128 if (causal or local) else 144
    if d <= 192:
        return 96 if local else (128 if dv <= 128 else 112)
    return 64 if local else 80


def resolved_causal_local(spec: Spec) -> Tuple[bool, bool]:
    """(causal, local) as FA4's `_resolve_causal_local_window` leaves them for the adapter's arguments (causal =
    bottom-right, each -1 side of the window passed as None): causal sets right = 0; a window whose left is
    unbounded and right is 0 is plain causal; any other bounded side is local (causal off)."""
    left, right = (None, None) if spec.window is None else tuple(None if int(w) < 0 else int(w) for w in spec.window)
    causal = spec.causal == "bottom_right"
    if causal:
        right = 0
    if left is None and right is None:
        return causal, False
    if left is None and right == 0:
        return True, False
    return False, True


IRREGULAR_HEAD_DIM = "Paged KV does not support irregular head dim"


def irregular_head_dim(d: int, dv: int, page_size: int, spec: Spec) -> Optional[str]:
    """Why FA4's SM90 forward refuses this paged call (None when it takes it): a head dim that is not a multiple of
    16 with pages not loaded by TMA (page_size != the key tile), flash_fwd_sm90.py's assert (module docstring)."""
    if d % 16 == 0 and dv % 16 == 0:
        return None
    tile_n = sm90_tile_n(d, dv, *resolved_causal_local(spec))
    if page_size == tile_n:
        return None
    return (f"flash-attn4 on SM90 asserts '{IRREGULAR_HEAD_DIM}' (flash_fwd_sm90.py: use_tma_KV or not "
            f"check_hdim_oob): D={d}" + (f" Dv={dv}" if dv != d else "") + " is not a multiple of 16 and page_size="
            f"{page_size} is not the key tile {tile_n} (only such pages load by TMA)")


def generation_limits(capability: Tuple[int, int]) -> Dict[str, object]:
    """What FA4 4.0.0b36's forward accepts on a GPU of this compute capability (interface.py): the largest
    num_splits (None: any), whether page_table, qv (MLA) and fp8 with descales are taken."""
    major = int(capability[0])
    if major == 9:
        return dict(max_splits=1, paged=True, qv=False, fp8=False, sink_backward=True)
    if major in (10, 11):
        return dict(max_splits=256, paged=True, qv=True, fp8=True, sink_backward=True)
    if major == 12:
        return dict(max_splits=1, paged=False, qv=False, fp8=False, sink_backward=False)
    if major == 8:
        return dict(max_splits=1, paged=False, qv=False, fp8=False, sink_backward=False)
    raise ValueError(f"capability={tuple(capability)}: FlashAttention-4 supports compute capability 8.x-12.x "
                     f"(interface.py: 'Unsupported compute capability')")


def num_splits_arg(spec: Spec, capability: Tuple[int, int] = (9, 0)) -> int:
    """spec.num_splits as FA4's `num_splits`: None -> 1 (FA4's default; 0 would ask its heuristic, which may
    split, and SM90 refuses splits); a value this generation refuses raises NotImplementedError."""
    if spec.num_splits is None:
        return 1
    ns = int(spec.num_splits)
    top = generation_limits(capability)["max_splits"]
    if ns > top:
        raise NotImplementedError(f"flash-attn4 on sm{capability[0]}{capability[1]} takes num_splits <= {top} "
                                  f"(interface.py: 'SplitKV not supported on SM 9.0'); got {ns}")
    return ns


def sink_arg(spec: Spec, device) -> Optional[torch.Tensor]:
    """spec.sinks as FA4's `learnable_sink`: (Hq,) float32 on the device, the suite's own tensor (its grad)."""
    if spec.sinks is None:
        return None
    s = spec.sinks
    return s if s.device == torch.device(device) else s.to(device)


def refuse_cache_call(q, k, v, spec: Spec) -> Optional[str]:
    """Why FA4 cannot take this cache call (None when it can): what its public functions lack."""
    if spec.k_new is not None:
        return "flash-attn4 has no KV-cache append: flash_attn_func / flash_attn_varlen_func take no k_new/v_new"
    if spec.cache_leftpad is not None:
        return "flash-attn4's forward takes no left padding (leftpad_k is only in get_scheduler_metadata)"
    if spec.block_table is not None:
        why = irregular_head_dim(int(q.shape[-1]), int(v.shape[-1]), int(k.shape[1]), spec)
        if why:
            return why
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return ("flash-attn4's varlen backward is not given the page_table (FlashAttnVarlenFunc.backward): cache "
                "calls are forward only")
    return None


def paged_args(spec: Spec, device) -> dict:
    """page_table and seqused_k of a paged call: int32, contiguous, on the device (FA4 asserts each)."""
    table = torch.as_tensor(spec.block_table, device=device).to(torch.int32).contiguous()
    used = torch.as_tensor(spec.cache_seqlens, device=device).to(torch.int32).contiguous()
    return dict(page_table=table, seqused_k=used)


def contiguous_caches(k: torch.Tensor, v: torch.Tensor, spec: Spec, batch: int):
    """(k, v, seqused_k) of a contiguous-cache call as FA4's batched varlen call takes them: the caches as they
    are when their rows are the batch, else batch b's row cache_batch_idx[b] (default b) gathered (a copy)."""
    used = torch.as_tensor(spec.cache_seqlens, device=k.device).to(torch.int32).contiguous()
    if spec.cache_batch_idx is None and k.shape[0] == batch:
        return k, v, used
    idx = (torch.arange(batch, device=k.device) if spec.cache_batch_idx is None
           else torch.as_tensor(spec.cache_batch_idx, device=k.device).long())
    return k.index_select(0, idx), v.index_select(0, idx), used


def cache_call(varlen_fn: Callable, q, k, v, spec: Spec, kw: dict) -> Output:
    """A KV-cache call (spec.cache_seqlens set) through FA4's flash_attn_varlen_func: q BHSD (B, Hq, Lq, D),
    k and v the caches (N, S, Hkv, D) as attnverify passes them; `kw` the common keywords (scale, causal,
    window, softcap, learnable_sink, num_splits, return_lse, deterministic)."""
    why = refuse_cache_call(q, k, v, spec)
    if why:
        raise NotImplementedError(why)
    qb = q.transpose(1, 2)  # (B, Lq, Hq, D): batched q, no cu_seqlens_q
    if spec.block_table is not None:
        out, lse = varlen_fn(qb, k, v, **paged_args(spec, q.device), **kw)
    else:
        kc, vc, used = contiguous_caches(k, v, spec, q.shape[0])
        out, lse = varlen_fn(qb, kc, vc, seqused_k=used, **kw)
    return Output(out.transpose(1, 2), lse=lse if spec.return_lse else None)
