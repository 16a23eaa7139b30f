"""The @example corpus: known-nasty cases that always run first, adapted to what an adapter claims.

Each entry is a template; `corpus(adapter, ...)` bends it to the claims (dtype, head dim) and drops
what cannot be bent (an unclaimed feature), so every example is a claimed case.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

from ..case import CaseRecipe, build_probe
from ._profiles import profile_limits


def _t(label, **kw) -> CaseRecipe:
    return CaseRecipe(tags=(label,), **kw)


def templates(tiles=None) -> List[CaseRecipe]:
    bm, bn = tiles or (16, 16)
    big = max(bn, 16)
    out = [
        # cheap, high-yield first: batch, GQA, partial tiles, non-default scale, Lq != Lk
        _t("gqa-batch-partial-tiles", batch=2, heads_q=4, heads_kv=2, len_q=bm + 1, len_k=2 * bn + 1, head_dim=32,
           scale=0.5, seed=1),
        # the two-tile worked example: the second key tile's max is far above the first's
        _t("two-tile", len_q=2, len_k=2 * bn, head_dim=16, late_from=bn, late_boost=8.0, seed=2),
        # Lq = 1 (decode) over a long-ish key sequence
        _t("decode", batch=1, heads_q=2, heads_kv=1, len_q=1, len_k=4 * bn + 1, head_dim=64, seed=3),
        # kv length = 1 mod 32
        _t("lk-1-mod-32", heads_q=2, heads_kv=2, len_q=16, len_k=33, head_dim=32, seed=4),
        # bottom-right causal with Lq > Lk: the first Lq - Lk rows see nothing
        _t("bottom-right-lq-gt-lk", heads_q=2, heads_kv=2, len_q=37, len_k=17, head_dim=32, causal="bottom_right", seed=5),
        # a fully-masked key tile inside a long causal + window row
        _t("masked-key-tile-causal-window", len_q=3 * big, len_k=3 * big, head_dim=32, causal="top_left",
           window=(2 * big, 0), key_block=(big, 2 * big), seed=6),
        # L % 128 == 64, logits near -120 (LSE below -88.7), and a padding mask
        _t("L192-logits-minus-120-mask", len_q=192, len_k=192, head_dim=32, row_shift=-120.0, q_std=0.5, k_std=0.5,
           mask="bool_padding", seed=7),
        # a mask broadcast over keys (size-1 key dim): whole rows on or off
        _t("mask-broadcast-over-keys", batch=2, heads_q=2, heads_kv=2, len_q=9, len_k=20, head_dim=16,
           mask="bool_random", mask_shape=(2, 1, 9, 1), mask_density=0.5, seed=8),
        # scores far above exp's range: max subtraction is mandatory
        _t("shift-plus-1000", len_q=5, len_k=2 * bn + 3, head_dim=16, row_shift=1000.0, seed=9),
        # head dims above 128
        _t("head-dim-above-128", len_q=9, len_k=17, head_dim=160, seed=10),
        _t("head-dim-256", len_q=9, len_k=17, head_dim=256, seed=10),
        # a towering late tile: a max taken from the first tile only overflows
        _t("late-tile-x100", len_q=3, len_k=3 * bn, head_dim=16, late_from=2 * bn, late_boost=100.0, seed=11),
        # features that generated cases draw only now and then (dropped where unclaimed): a window whose
        # left bound falls inside the keys, ALiBi with Lq != Lk over several heads, a softcap that bites,
        # a varlen pack with an empty segment and segments crossing tiles, bf16 with an offset in V
        _t("window-left-bound-inside", heads_q=2, heads_kv=2, len_q=bn + 3, len_k=3 * bn + 5, head_dim=32,
           window=(bn + 3, 2), seed=12),
        _t("alibi-lq-ne-lk-heads", heads_q=4, heads_kv=2, len_q=9, len_k=2 * bn + 7, head_dim=32, alibi=True, seed=13),
        _t("softcap-large-logits", len_q=17, len_k=2 * bn + 1, head_dim=32, softcap=5.0, q_std=3.0, k_std=3.0, seed=14),
        _t("varlen-multi-segment", heads_q=2, heads_kv=1, len_q=bn + 10, len_k=3 * bn + 5, head_dim=32,
           seqlens_q=[5, 0, bn + 3, 2], seqlens_k=[bn + 1, 3, 2 * bn, 1], seed=15),
        _t("bf16-v-offset", len_q=9, len_k=2 * bn + 5, head_dim=64, dtype="bfloat16", v_mean=10.0, seed=16),
        # precision (issue 20): plain inputs over the longest keys a profile allows (256): an accumulator
        # kept in fp16/bf16 rounds once per key tile, and only many tiles lift it above a correct kernel's rounding
        _t("long-keys-precision", heads_q=2, heads_kv=2, len_q=64, len_k=256, head_dim=64, dtype="float16", seed=17),
        # backward precision (issue 20): the first key dominates every row and all keys share a component
        # (key_offset): dQ's exact sum cancels the offset, but the partial sums of a dQ accumulator carry the first
        # key's large dS * (its key + offset) while the other keys' small dS pay it back one by one -- an fp16 dQ
        # accumulator drops them (13-21 u, 2x the bound; a float32 one 0.3 u)
        _t("backward-dominant-first-key-offset", heads_q=2, heads_kv=2, len_q=64, len_k=256, head_dim=64,
           dtype="float16", dominant_key=0, dominant_gap=5.0, key_offset=4.0, seed=18),
        # a wide head under a dominant key: D = rowsum(dO * O) sums 256 products; summed in fp16 it errs ~sqrt(Dv)
        # times the rounding of O that a correct kernel's D carries, and the near one-hot softmax leaves dS = P (dP - D)
        # small next to that error
        _t("backward-dominant-key-wide-head", heads_q=2, heads_kv=2, len_q=16, len_k=64, head_dim=256,
           dtype="float16", dominant_key=0, dominant_gap=8.0, seed=19),
    ]
    return out


def _bend(r: CaseRecipe, adapter, device: str, limits) -> Optional[CaseRecipe]:
    c = adapter.claims
    kw = {}
    if r.dtype not in c.dtypes:
        for d in ("float32", "float16", "bfloat16", "float64"):
            if d in c.dtypes:
                kw["dtype"] = d
                break
        else:
            return None
    if not c.head_dim_ok(r.head_dim):
        if r.head_dim > 128:
            return None  # the point of the case is the big head dim
        for d in (r.head_dim, 32, 64, 16, 128, 40, 80, 96, 8):
            if c.head_dim_ok(d):
                kw["head_dim"] = d
                break
        else:
            return None
    if r.causal not in c.causal:  # an adapter that claims only causal (or only non-causal) still gets the case
        kw["causal"] = next(m for m in ("bottom_right", "top_left", "none") if m in c.causal)
    if r.heads_q != r.heads_kv and not c.gqa:
        kw["heads_kv"] = r.heads_q
    kw["device"] = device
    r2 = dataclasses.replace(r, **kw)
    if max(r2.len_q, r2.len_k) > min(c.max_seqlen, max(limits.max_len, 256)):
        return None
    return r2


def corpus(adapter, *, profile: str = "dev", device: str = "auto",
           adapt: Optional[Callable[[CaseRecipe], Optional[CaseRecipe]]] = None) -> List[CaseRecipe]:
    """The nasty cases `adapter` claims, each passed through `adapt` (which may drop it by returning None)."""
    from ..check import unclaimed

    limits = profile_limits(profile)
    dev = adapter.run_device(device)
    out = []
    # a template sized from big tiles (a multiple of 128) can exceed the profile's length cap; it is then
    # built again from smaller tiles rather than dropped: its segments and tile crossings still share
    # the adapter's real tiles (flex on the CPU lost its varlen pack this way and with it F16)
    bm, bn = adapter.claims.tiles or (16, 16)
    sizes = [(bm, bn)]
    while min(sizes[-1]) > 16:
        sizes.append((max(16, sizes[-1][0] // 2), max(16, sizes[-1][1] // 2)))
    variants = [templates(t) for t in sizes]
    for i in range(len(variants[0])):
        r = next((b for b in (_bend(v[i], adapter, dev, limits) for v in variants) if b is not None), None)
        if r is not None and adapt is not None:
            r = adapt(r)
        if r is None:
            continue
        try:
            case = build_probe(r)  # on the CPU: the driving process must not start CUDA
        except ValueError:
            continue
        if unclaimed(adapter, case) is not None:
            continue
        if adapter.claims.fully_masked == "unsupported":
            from ._cases import fully_masked_row_count

            if fully_masked_row_count(r):
                continue
        out.append(r)
    return out
