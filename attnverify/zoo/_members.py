"""The zoo's members: one deliberately wrong attention implementation each.

Every member claims what a real kernel of its kind claims (a FlashAttention-2-class fused kernel, a
Triton flash forward, a split-KV decode kernel, an eager masked-attention path, ...), so the
strategies draw the cases that can expose its bug, and nothing it did not promise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..adapters.base import Adapter, adapter
from ._eager import SPLIT_KV, attend, buggy_grad
from ._multi import multi_members
from ._precision import precision_members
from ._serving_members import serving_members
from ._fp8 import fp8_members
from ._sinks import mla_members, sink_members
from ._triton_wrong import BLOCK_M, BLOCK_N, triton_unavailable, zoo_flash_forward
from ..devices import cuda_present


@dataclass(frozen=True)
class ZooMember:
    name: str  # also the adapter's name (prefixed "zoo-")
    bug: str  # what is wrong, one line
    stands_for: str  # the real-world class of bug it stands for, one line
    adapter: Adapter
    expected: Tuple[str, ...]  # properties expected to catch it, in the order selftest tries them
    kind: str  # "triton" (a Triton kernel, interpreter on CPU) | "eager" | "autograd" (wrong backward) | "multi"
    fast: bool = False  # in `attnverify selftest --fast` (the CI subset)
    planted: tuple = ()  # multi-bug members (kind "multi"): one zoo._multi.PlantedBug per bug

    def unavailable_reason(self) -> Optional[str]:
        return self.adapter.unavailable_reason()


def _triton_devices() -> dict:
    """The Triton members' device: CUDA where there is one, else the CPU (interpreter); asked on first use."""
    return dict(devices=("cuda",) if cuda_present() else ("cpu",))


# A Triton FlashAttention-2 forward (tutorial-derived): half and fp32 inputs, power-of-two head
# dims, SDPA's top-left causal, GQA, LSE out, one fixed tile config, no masks, forward only
# (devices: _triton_devices).
TRITON = dict(
    dtypes=("float16", "bfloat16", "float32"), head_dims=(16, 32, 64, 128),
    max_seqlen=4096, causal=("none", "top_left"), gqa=True, lse=True, deterministic=True,
    tiles=(BLOCK_M, BLOCK_N), fully_masked="unsupported", memory="linear",
)
# A FlashAttention-2-class fused kernel (flash_attn_func): fp16/bf16, head dims multiple of 8 up to
# 256, bottom-right causal, sliding window, softcap, ALiBi, GQA/MQA, LSE, backward; rows that see
# no key give 0.
FLASH = dict(
    dtypes=("float16", "bfloat16"), devices=("cpu",), head_dims=lambda d: 8 <= d <= 256 and d % 8 == 0,
    max_seqlen=4096, causal=("none", "bottom_right"), window=True, softcap=True, alibi=True, gqa=True,
    backward=True, lse=True, fully_masked="zeros", tiles=(128, 64), memory="linear",
)
# Its varlen entry point (flash_attn_varlen_func): packed documents with cu_seqlens.
FLASH_VARLEN = dict(FLASH, varlen=True)
# A split-KV decode kernel (flash-decoding class): half inputs, head dims 64/128, short query
# blocks over long KV, GQA, bottom-right causal, LSE; KV split in chunks of SPLIT_KV keys.
DECODE = dict(
    dtypes=("float16", "bfloat16"), devices=("cpu",), head_dims=(64, 128), max_seqlen=4096,
    causal=("none", "bottom_right"), gqa=True, lse=True, fully_masked="zeros", tiles=(16, SPLIT_KV),
    memory="linear",
)
# An eager masked-attention path (HF-style `eager_attention_forward` / SDPA math): any float dtype,
# any head dim, masks (bool or additive), all causal alignments, GQA, Dv != D, backward by autograd.
EAGER = dict(
    dtypes=("float32", "float16", "bfloat16"), devices=("cpu",), head_dims=lambda d: 1 <= d <= 256,
    max_seqlen=4096, causal=("none", "top_left", "bottom_right"), attn_mask=True, gqa=True, dv_ne_d=True,
    backward=True, fully_masked="zeros",
)


def _triton_member(name, bug, **over):
    claims = dict(TRITON, **over)

    @adapter(f"zoo-{name}", register=False, availability=triton_unavailable,
             description=f"zoo (Triton): {bug}", deferred_claims=_triton_devices, **claims)
    def impl(q, k, v, spec):
        return zoo_flash_forward(q, k, v, spec, bug=bug)

    return impl


def _eager_member(name, bug, claims):
    @adapter(f"zoo-{name}", register=False, description=f"zoo (eager): {bug}", **claims)
    def impl(q, k, v, spec):
        return attend(q, k, v, spec, bug)

    return impl


def _grad_member(name, bug, claims):
    @adapter(f"zoo-{name}", register=False, description=f"zoo (backward): {bug}", **claims)
    def impl(q, k, v, spec):
        return buggy_grad(q, k, v, spec, bug)

    return impl


def _inplace_adapter():
    @adapter("zoo-inplace-q-prescale", register=False, description="zoo (eager): scales the caller's q in place",
             dtypes=("float16", "bfloat16", "float32"), devices=("cpu",), head_dims=lambda d: 1 <= d <= 256,
             causal=("none", "top_left"), gqa=True)
    def impl(q, k, v, spec):
        d = q.shape[-1]
        with torch.no_grad():
            q.mul_(spec.resolved_scale(d))  # "saves a buffer": pre-scales q in place
        return attend(q, k, v, spec.replace(scale=1.0))

    return impl


F = "forward_matches_reference"
G = "gradients_match_reference"


def _members():
    Z = ZooMember
    return [
        # --- Triton kernels (the interpreter on CPU) --------------------------------------------
        Z("triton-no-rescale", "online softmax: accumulator and row sum not rescaled by exp(m_old - m_new) when the max grows",
          "hand-written FlashAttention ports that drop the alpha correction (Triton-tutorial derivatives)",
          _triton_member("triton-no-rescale", "no_rescale"), (F,), "triton", fast=True),
        Z("triton-first-tile-max", "running max taken from the first key tile only; later tiles exponentiate against it",
          "max update hoisted out of the KV loop / computed on the first block only (overflow once a later tile towers)",
          _triton_member("triton-first-tile-max", "first_tile_max"), (F,), "triton"),
        Z("triton-pad-tail-zero", "keys past Lk in the last tile are loaded as 0 and scored 0 instead of -inf",
          "missing key-bounds mask on the last partial KV tile (seqlen_k not a multiple of BLOCK_N)",
          _triton_member("triton-pad-tail-zero", "pad_zero"), (F,), "triton", fast=True),
        Z("triton-causal-diag-excluded", "causal bound j < i instead of j <= i: a query never sees its own key",
          "strict < for <= in the causal mask (row 0 sees nothing and turns NaN)",
          _triton_member("triton-causal-diag-excluded", "diag_excluded"), (F, "causal_alignment"), "triton"),
        Z("triton-lse-base2", "LSE returned in base-2 units (m2 + log2 l), never multiplied by ln 2",
          "exp2-based kernels exporting their internal base-2 statistics as the LSE (the tutorial's M)",
          _triton_member("triton-lse-base2", "lse_base2"), ("lse_matches_reference",), "triton"),
        Z("triton-unwritten-tail", "grid Lq // BLOCK_M instead of cdiv: the last partial query tile is never computed",
          "launch grid rounding down: output rows left unwritten (garbage from torch.empty; zeros here)",
          _triton_member("triton-unwritten-tail", "unwritten_rows"), (F,), "triton"),
        # --- forward semantics (eager engine standing in for a fused kernel) ----------------------
        Z("split-kv-equal-weights", f"split-KV combine averages the per-split softmax outputs ({SPLIT_KV} keys a split) with equal weights",
          "flash-decoding combine step that ignores the per-split LSE (per-tile softmax averaged)",
          _eager_member("split-kv-equal-weights", "split_kv_equal_weights", DECODE), (F,), "eager", fast=True),
        Z("gqa-interleaved", "query head h reads KV head h % Hkv instead of h // (Hq / Hkv)",
          "GQA/MQA head mapping done with repeat() where repeat_interleave() was meant",
          _eager_member("gqa-interleaved", "gqa_interleaved", FLASH), ("gqa_equals_repeated_kv", F), "eager", fast=True),
        Z("batch-kv-stride", "the batch stride is missing from the K/V offset: every batch reads batch 0's K and V",
          "batch/head cross-talk from a wrong pointer stride (correct at B = 1, wrong for every other batch)",
          _eager_member("batch-kv-stride", "batch_kv_from_batch0", FLASH), ("batch_head_independence", F), "eager"),
        Z("scale-missing", "scores are q.k with no softmax scale at all",
          "softmax scale never applied (the 1/sqrt(d) factor forgotten)",
          _eager_member("scale-missing", "scale_missing", FLASH), (F,), "eager"),
        Z("scale-twice", "the scale is applied twice (scale^2)",
          "a wrapper pre-scales q and the kernel scales the scores again",
          _eager_member("scale-twice", "scale_twice", FLASH), (F,), "eager"),
        Z("scale-ignored", "a custom scale is ignored; 1/sqrt(D) is always used",
          "softmax_scale argument dropped on the way to the kernel (only the default ever tested)",
          _eager_member("scale-ignored", "scale_ignored", FLASH), (F,), "eager"),
        Z("softcap-before-scale", "softcap applied to the raw q.k, before the softmax scale",
          "Gemma-2 logit soft-capping placed on the wrong side of the scale",
          _eager_member("softcap-before-scale", "softcap_before_scale", FLASH), (F,), "eager"),
        Z("alibi-sign", "ALiBi bias added (+slope * distance) instead of subtracted",
          "ALiBi sign convention flipped between libraries",
          _eager_member("alibi-sign", "alibi_sign", FLASH), (F,), "eager"),
        Z("alibi-top-left", "ALiBi distance |i - j| instead of |i + Lk - Lq - j| (wrong when Lq != Lk)",
          "ALiBi aligned top-left while causal is bottom-right (decode / chunked prefill positions)",
          _eager_member("alibi-top-left", "alibi_top_left", FLASH), (F,), "eager"),
        Z("causal-top-left", "declares bottom-right causal but masks top-left (j <= i) when Lq != Lk",
          "causal alignment confusion: SDPA's is_causal / flash-attn < 2.1 (top-left) vs flash-attn >= 2.1 (bottom-right)",
          _eager_member("causal-top-left", "causal_top_left", FLASH), ("causal_alignment", F), "eager", fast=True),
        Z("window-off-by-one", "sliding-window left bound exclusive: one key too few on the left",
          "window size counted including the query itself (local / sliding-window attention off by one)",
          _eager_member("window-off-by-one", "window_off_by_one", FLASH), (F,), "eager"),
        Z("varlen-leak", "cu_seqlens_k end used inclusively: a packed document also sees the next one's first key",
          "varlen boundary off by one (packed documents leaking into each other)",
          _eager_member("varlen-leak", "varlen_leak", FLASH_VARLEN), (F,), "eager"),
        Z("pv-half-accumulate", "P @ V summed key by key in a half-precision (fp16/bf16) accumulator",
          "CUDA-core decode kernels accumulating the output in half / half2 registers instead of fp32",
          _eager_member("pv-half-accumulate", "pv_half_accumulate", DECODE), (F,), "eager"),
        Z("decode-drops-last-key", "the Lq = 1 fast path never reads the newest key",
          "decode kernel reading cache_seqlens - 1 keys (the token just appended to the KV cache ignored)",
          _eager_member("decode-drops-last-key", "decode_drops_last_key", DECODE), (F,), "eager"),
        Z("hd-trunc-128", "head dims above 128: q.k uses only the first 128 dims",
          "large head dims dispatched to a kernel instantiated for <= 128 (silent truncation)",
          _eager_member("hd-trunc-128", "hd_trunc_128", FLASH), (F,), "eager"),
        Z("fm-nan", "rows with no visible key come out NaN although zeros are declared",
          "softmax over an all -inf row (eager attention, SDPA math before torch 2.5)",
          _eager_member("fm-nan", "fm_nan", EAGER), ("fully_masked_rows", F), "eager", fast=True),
        Z("fm-mean-v", "masked scores set to finfo.min: a row with no visible key becomes mean(V)",
          "finite mask value (finfo.min / -1e4 / -65504) in eager masked attention",
          _eager_member("fm-mean-v", "fm_mean_v", EAGER), ("fully_masked_rows", F), "eager"),
        Z("fm-unmasked", "a row with no visible key attends to every key",
          "the 'unmask unattended rows' work-around for NaN rows, leaking into the output",
          _eager_member("fm-unmasked", "fm_unmasked", EAGER), ("fully_masked_rows", F), "eager"),
        Z("exp-no-max", "exp(s) without subtracting the row max: overflow above ~88, underflow below ~-103",
          "naive softmax in a fused kernel (no max subtraction)",
          _eager_member("exp-no-max", "exp_no_max", FLASH), (F, "row_shift_invariance"), "eager"),
        Z("dropout-no-rescale", "kept probabilities are not divided by (1 - p)",
          "dropout without the inverted-dropout rescale",
          _eager_member("dropout-no-rescale", "dropout_no_rescale", dict(FLASH, dropout=True)), ("dropout",), "eager"),
        Z("inplace-q-prescale", "multiplies the caller's q by the scale in place",
          "in-place pre-scaling of inputs to save a buffer (the caller's tensor changes)",
          _inplace_adapter(), ("inputs_unmodified",), "eager", fast=True),
        # --- backward ------------------------------------------------------------------------------
        Z("bwd-dk-missing-scale", "dK = dS^T Q without the softmax scale",
          "scale folded into Q for the forward and forgotten in the dK epilogue",
          _grad_member("bwd-dk-missing-scale", "dk_missing_scale", FLASH), (G,), "autograd", fast=True),
        Z("bwd-dv-gqa-last-head", "GQA backward: dV of a KV head is the last query head's, not the group sum",
          "dK/dV of grouped heads written per query head without the reduction (last writer wins)",
          _grad_member("bwd-dv-gqa-last-head", "dv_gqa_last_head", FLASH), (G, "gqa_equals_repeated_kv"), "autograd"),
        Z("bwd-always-causal", "the backward applies a causal mask even when the forward had causal='none'",
          "causal flag not saved on ctx and not passed to the backward kernel",
          _grad_member("bwd-always-causal", "bwd_always_causal", FLASH), (G,), "autograd"),
        Z("bwd-dq-atomic-order", "claims deterministic=True, but dQ is summed over key tiles in a random order",
          "deterministic mode that still accumulates dQ with atomics (bitwise run-to-run differences)",
          _grad_member("bwd-dq-atomic-order", "dq_atomic_order", dict(FLASH, softcap=False, deterministic=True)),
          ("determinism",), "autograd"),
    ] + precision_members(Z, adapter, FLASH)  # the precision class (issue 20): zoo/_precision.py


ZOO = (_members() + serving_members() + multi_members(ZooMember, FLASH) + sink_members() + mla_members()
       + fp8_members())
