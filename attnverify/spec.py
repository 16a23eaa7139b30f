"""The call description every adapter receives (`Spec`) and what it may return (`Output`)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

CAUSAL_MODES = ("none", "top_left", "bottom_right")
FULLY_MASKED_MODES = ("zeros", "nan", "unsupported")
# the LSE a row with no visible key (and no sink) returns under fully_masked="zeros": "-inf" (the reference's log 0),
# or "+inf" (FlashMLA and FA2/FA3 store it so that a backward's exp(s - lse) is 0)
KEYLESS_LSE_MODES = ("-inf", "+inf")


@dataclass(frozen=True)
class Spec:
    """What to compute, beyond q, k and v. Unset features have neutral values.

    `scale=None` means the default 1/sqrt(D); adapters that need a number use `resolved_scale(D)`.
    """

    scale: Optional[float] = None
    causal: str = "none"
    window: Optional[Tuple[int, int]] = None
    softcap: Optional[float] = None
    alibi_slopes: Any = None  # tensor (Hq,) or (B, Hq), float32
    attn_mask: Any = None  # bool (True = may attend) or float (added), broadcastable to (B, Hq, Lq, Lk)
    dropout_p: float = 0.0
    seed: Optional[int] = None
    cu_seqlens_q: Any = None  # int32 (n+1,)
    cu_seqlens_k: Any = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_k: Optional[int] = None
    return_lse: bool = False
    # KV cache (flash_attn_with_kvcache semantics; attnverify/paged.py): k and v are caches (N, S, Hkv, D)
    block_table: Any = None  # int32 (B, max_blocks): batch b's keys are pages block_table[b, :] (N pages of S)
    page_size: Optional[int] = None  # S of a paged cache (k.shape[1])
    cache_seqlens: Any = None  # int32 (B,): keys already cached per batch (before any append)
    cache_batch_idx: Any = None  # int32 (B,): cache row of batch b (contiguous cache only; default b)
    # int32 (B,): flash_attn_with_kvcache's cache_leftpad, the slot batch b's keys start at (default 0): its cached
    # keys are slots cache_leftpad[b] .. cache_seqlens[b] - 1; an append still lands at cache_seqlens[b]
    cache_leftpad: Any = None
    k_new: Any = None  # (B, Hkv, Lnew, D): appended at slot cache_seqlens[b], in place, before attending
    v_new: Any = None
    num_splits: Optional[int] = None  # split-KV partitions (1: no split); None: the adapter's own choice
    # issue 23: per-head sink logits (Hq,) float32 joining every row's softmax denominator (docs/adapters.md)
    sinks: Any = None
    # chunked local attention (Llama 4): a query sees only keys of its own chunk of this many positions
    attention_chunk: Optional[int] = None
    # fp8 (FA3's convention, docs/adapters.md): float32 (B, Hkv) factors; the value a stored element stands for is
    # element * descale[b, kv head], so S = (q * q_descale) (k * k_descale)^T * scale and P @ (v * v_descale)
    q_descale: Any = None
    k_descale: Any = None
    v_descale: Any = None

    def __post_init__(self):
        if self.causal not in CAUSAL_MODES:
            raise ValueError(f"Spec(causal={self.causal!r}): must be one of {CAUSAL_MODES}")
        if self.window is not None:
            w = tuple(int(x) for x in self.window)
            if len(w) != 2 or any(x < -1 for x in w):
                raise ValueError(
                    f"Spec(window={self.window!r}): expected (left, right) with each >= 0 or -1 for unbounded"
                )
            object.__setattr__(self, "window", w)
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"Spec(softcap={self.softcap!r}): must be > 0, or None for no softcap")
        if not 0.0 <= float(self.dropout_p) < 1.0:
            raise ValueError(f"Spec(dropout_p={self.dropout_p!r}): must be in [0, 1)")
        if (self.cu_seqlens_q is None) != (self.cu_seqlens_k is None):
            raise ValueError("Spec(cu_seqlens_q, cu_seqlens_k): give both for varlen, or neither")
        if self.scale is not None and not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale)):
            raise ValueError(f"Spec(scale={self.scale!r}): must be a finite number, or None for 1/sqrt(D)")
        if self.attention_chunk is not None and not (isinstance(self.attention_chunk, int)
                                                     and not isinstance(self.attention_chunk, bool)
                                                     and self.attention_chunk >= 1):
            raise ValueError(f"Spec(attention_chunk={self.attention_chunk!r}): must be an int >= 1, or None for no chunks")
        if self.sinks is not None:
            import torch

            if not isinstance(self.sinks, torch.Tensor) or self.sinks.dim() != 1 or self.sinks.is_complex():
                raise ValueError(f"Spec(sinks=...): expected a 1-D float tensor of per-head logits (Hq,), got "
                                 f"{type(self.sinks).__name__}{tuple(getattr(self.sinks, 'shape', ()))}")
        if self.has_descales:
            from .fp8 import validate_descales

            validate_descales(self)
        if (self.cache_seqlens is not None or self.num_splits is not None or self.block_table is not None
                or self.k_new is not None or self.v_new is not None or self.cache_batch_idx is not None
                or self.cache_leftpad is not None):
            from .paged import validate_spec

            validate_spec(self)

    def resolved_scale(self, head_dim: int) -> float:
        return float(self.scale) if self.scale is not None else 1.0 / math.sqrt(head_dim)

    @property
    def has_descales(self) -> bool:
        return self.q_descale is not None or self.k_descale is not None or self.v_descale is not None

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def replace(self, **changes) -> "Spec":
        return dataclasses.replace(self, **changes)

    def features(self) -> set:
        """Names of the optional features this call uses (matched against adapter claims)."""
        used = set()
        if self.causal != "none":
            used.add("causal")
        if self.window is not None:
            used.add("window")
        if self.softcap is not None:
            used.add("softcap")
        if self.alibi_slopes is not None:
            used.add("alibi")
        if self.attn_mask is not None:
            used.add("attn_mask")
        if self.dropout_p > 0:
            used.add("dropout")
        if self.is_varlen:
            used.add("varlen")
        if self.return_lse:
            used.add("lse")
        if self.cache_seqlens is not None:
            used.add("paged" if self.block_table is not None else "kv_cache")
        if self.k_new is not None:
            used.add("append")
        if self.cache_leftpad is not None:
            used.add("cache_leftpad")
        if self.num_splits is not None:
            used.add("num_splits")
        if self.sinks is not None:
            used.add("sinks")
        if self.attention_chunk is not None:
            used.add("attention_chunk")
        if self.has_descales:
            used.add("descales")
        return used


@dataclass
class Output:
    """What an adapter may return instead of a bare tensor."""

    out: Any
    lse: Any = None
    dropout_mask: Any = None  # bool keep-mask (B, Hq, Lq, Lk) when the adapter can expose it
