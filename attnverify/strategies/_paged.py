"""`cache_cases`: CaseRecipes of KV-cache calls (attnverify/paged.py), drawn from what an adapter claims.

Decode shapes are weighted in: Lq in 1..8 against long caches, GQA ratios up to 16, many short sequences.
A paged cache gets a scrambled block table (each sequence's pages drawn from a pool about 3x the pages
needed), sequences sharing full prefix pages, a partial last page, table entries past the last page
pointing at unused pages, page sizes 1, odd, 16, 64, 128, 256 (those claimed), and garbage (NaN, huge
values) in every slot no sequence uses, past cache_seqlens included. With left padding (claim cache_leftpad)
batches start at slots 0, 1, a few or many (the padding below them is garbage too).
"""
from __future__ import annotations

import random
from typing import List, Optional

from hypothesis import assume
from hypothesis import strategies as st

from ..case import CaseRecipe, build_probe
from ..timesplit import strategy_clock
from ._args import InvalidArgument, check_tristate
from ._cases import DTYPE_ORDER, note_refusal
from ._profiles import profile_limits
from ._shapes import head_dim_candidates, seqlens

PAGE_SIZES = (1, 3, 5, 7, 13, 16, 64, 128, 256)
# serving batches are many short sequences: more of them than the profile's max_batch, bounded by max_numel
MAX_BATCH = {"ci": 8, "dev": 16, "thorough": 32}
MAX_GROUP = 16
GARBAGE = ("nan", "huge", "mixed", "none")


def page_size_choices(claims) -> List[int]:
    """The drawn page sizes the adapter claims, and any exact claim up to 1024 beyond them."""
    out = [p for p in PAGE_SIZES if claims.page_size_ok(p)]
    if not callable(claims.page_sizes):
        out += sorted(p for p in claims.page_sizes if p not in out and p <= 1024)
    return out


def cache_cases(*, adapter, profile: str = "dev", device: str = "auto", paged: Optional[bool] = None,
                append: Optional[bool] = None, num_splits=None, min_batch: int = 1, distinct_lengths: bool = False,
                window: Optional[bool] = None, softcap: Optional[bool] = None, alibi: Optional[bool] = None,
                return_lse: Optional[bool] = None, leftpad: Optional[bool] = None):
    """A strategy of cache `CaseRecipe`s for `adapter`.

    `paged`: True a paged cache (claim paged), False a contiguous one (claim kv_cache), None either, as
    claimed. `append`: k_new/v_new (claim append), tri-state like the feature switches of attention_cases.
    `num_splits`: None leaves it to the adapter, "draw" draws one of the claimed values, or an int.
    `leftpad`: spec.cache_leftpad (claim cache_leftpad), tri-state; True makes at least one batch start past slot 0.
    """
    from ..adapters.base import Adapter

    if not isinstance(adapter, Adapter):
        raise InvalidArgument(f"adapter={adapter!r} must be an attnverify Adapter")
    c = adapter.claims
    kinds = [k for k, ok in ((True, c.paged), (False, c.kv_cache)) if ok and (paged is None or paged == k)]
    if not kinds:
        raise InvalidArgument(f"paged={paged!r}: {adapter.name} claims " + (
            "neither paged nor kv_cache" if paged is None else ("no paged cache" if paged else "no kv_cache")))
    if check_tristate("append", append) is True and not c.append:
        raise InvalidArgument(f"append=True but {adapter.name} does not claim append")
    if check_tristate("leftpad", leftpad) is True and not c.cache_leftpad:
        raise InvalidArgument(f"leftpad=True but {adapter.name} does not claim cache_leftpad")
    if True in kinds and not page_size_choices(c):
        if len(kinds) == 1:
            raise InvalidArgument(f"{adapter.name} claims none of the page sizes {PAGE_SIZES}")
        kinds.remove(True)
    limits = profile_limits(profile)
    dev = adapter.run_device(device)
    dtypes = [d for d in DTYPE_ORDER if d in c.dtypes and not d.startswith("float8")]
    hd = head_dim_candidates(c, limits.head_dims)
    if not dtypes or not hd:
        raise InvalidArgument(f"{adapter.name} claims no dtype or head dim a cache case can use")
    return _cache_case(adapter, limits, dev, tuple(kinds), tuple(dtypes), hd, append, num_splits, min_batch,
                       distinct_lengths, dict(window=window, softcap=softcap, alibi=alibi, return_lse=return_lse,
                                          leftpad=leftpad))


def _flag(draw, arg, claimed: bool, den: int) -> bool:
    if arg is False or not claimed:
        return False
    return True if arg is True else draw(st.integers(0, den - 1)) == den - 1


@st.composite
def _cache_case(draw, a, lim, dev, kinds, dtypes, hd, append, num_splits, min_batch, distinct, feats):
    with strategy_clock():  # draw.strategy of the time split (attnverify.timesplit)
        return _draw_cache_case(draw, a, lim, dev, kinds, dtypes, hd, append, num_splits, min_batch, distinct, feats)


def _draw_cache_case(draw, a, lim, dev, kinds, dtypes, hd, append, num_splits, min_batch, distinct, feats):
    c = a.claims
    paged = draw(st.sampled_from(kinds))
    dtype = draw(st.sampled_from(dtypes))
    max_len = min(lim.max_len, c.max_seqlen)
    # decode first: Lq = 1, then up to 8 (speculative decoding, chunked append), rarely longer
    lq = draw(st.one_of(st.integers(1, min(8, max_len)), st.sampled_from([x for x in (16, 33) if x <= max_len] or [1])))
    new = 0
    if _flag(draw, append, c.append, 2):
        new = draw(st.one_of(st.just(lq), st.integers(1, min(8, max_len))))
    lo = max(1, lq)  # every query row sees a key: L_b = cache_len + new >= Lq
    many = draw(st.integers(0, 3)) == 3  # many short sequences
    b_cap = MAX_BATCH.get(lim.name, lim.max_batch)
    b = draw(st.integers(max(min_batch, 4 if many else 1), max(min_batch, b_cap if many else lim.max_batch)))
    short = seqlens(min_len=max(0, lo - new), max_len=max(max(0, lo - new), min(20, max_len - new)))
    long_ = seqlens(min_len=max(0, lo - new), max_len=max(max(0, lo - new), max_len - new))
    lens = [draw(short if many else long_) for _ in range(b)]
    if distinct:
        assume(len(set(lens)) > 1)
    lk = max(x + new for x in lens)
    assume(lk <= max_len)
    hkv = draw(st.integers(1, lim.max_heads_kv))
    group = draw(st.sampled_from([g for g in (1, 2, 4, 8, 16) if g <= MAX_GROUP])) if c.gqa else 1
    assume(b * hkv * group * lq * lk <= lim.max_numel)
    d = draw(st.sampled_from(hd))
    dv = None
    if c.dv_ne_d and draw(st.integers(0, 4)) == 4:
        dv = draw(st.sampled_from([x for x in hd if x != d] or [d]))
        dv = None if dv == d else dv
    causal = draw(st.sampled_from([m for m in ("none", "bottom_right", "top_left") if m in c.causal]))
    win = None
    if _flag(draw, feats["window"], c.window, 6):
        win = (draw(st.sampled_from((-1, 0, 3, 16, 63))), draw(st.sampled_from((-1, 0, 2))))
        if causal == "top_left" or (win[0] >= 0 and win[1] >= 0 and causal == "none"):
            win = (win[0], max(win[1], 0)) if causal != "top_left" else None
    cap = draw(st.sampled_from((30.0, 5.0))) if _flag(draw, feats["softcap"], c.softcap, 6) else None
    alibi = _flag(draw, feats["alibi"], c.alibi, 6)
    lse = _flag(draw, feats["return_lse"], c.lse, 2)
    scale = draw(st.sampled_from((None, None, None, 0.5, 2.0)))
    garbage = draw(st.sampled_from(GARBAGE))
    splits = None
    if num_splits == "draw" and c.num_splits:
        splits = draw(st.sampled_from(c.num_splits))
    elif isinstance(num_splits, int):
        splits = num_splits
    rng = random.Random(draw(st.integers(0, 2**31 - 1)))
    pads = None
    if _flag(draw, feats["leftpad"], c.cache_leftpad, 4):  # lens stay the key counts; the slots move right
        pads = [draw(st.sampled_from((0, 1, 3, 16, 37))) for _ in range(b)]
        if feats["leftpad"] is True and not any(pads):
            pads[draw(st.integers(0, b - 1))] = draw(st.sampled_from((1, 5, 16)))
    slots = [x + (pads[i] if pads else 0) for i, x in enumerate(lens)]  # cache_seqlens
    if paged:
        size = draw(st.sampled_from(page_size_choices(c)))
        table, n = _block_table(draw, rng, slots, new, size)
        cache = dict(paged=True, page_size=size, num_pages=n, block_table=table)
    else:
        size = max(x + new for x in slots) + draw(st.sampled_from((0, 1, 7)))
        rows = b + draw(st.integers(0, 2))
        idx = rng.sample(range(rows), b) if draw(st.booleans()) else None
        cache = dict(page_size=size, num_pages=rows, cache_batch_idx=idx)
    r = CaseRecipe(batch=b, heads_q=hkv * group, heads_kv=hkv, len_q=lq, len_k=lk, head_dim=d, head_dim_v=dv,
                   dtype=dtype, device=dev, seed=draw(st.integers(0, 2**31 - 1)), causal=causal, window=win,
                   softcap=cap, alibi=alibi, scale=scale, return_lse=lse, cache_lens=slots, cache_leftpad=pads, new_len=new,
                   garbage=garbage, num_splits=splits, v_mean=draw(st.sampled_from((0.0, 0.0, 0.0, 10.0))), **cache)
    from ..check import unclaimed

    # a CPU probe (never start CUDA while drawing) without drawn values or garbage: a claim or refusal is about
    # shapes, layouts and the spec (docs/adapters.md); the real case is asked again where it is judged
    why = unclaimed(a, build_probe(r, values=False))
    if why is not None:
        note_refusal(a.name, why)  # a property none of whose draws is accepted then says why it skipped
    assume(why is None)
    return r


def _block_table(draw, rng: random.Random, lens, new: int, size: int):
    """A scrambled block table: full prefix pages sometimes shared with sequence 0, a pool ~3x the pages
    needed, entries past a sequence's last page pointing at unused pages."""
    need = [-(-(x + new) // size) for x in lens]
    shared = [0] * len(lens)
    for b in range(1, len(lens)):
        if draw(st.integers(0, 2)) == 2:  # share full, never-written prefix pages with sequence 0
            shared[b] = min(lens[0] // size, lens[b] // size)
    distinct = sum(n - s for n, s in zip(need, shared))
    extra = draw(st.integers(0, 2))
    pool = max(1, 3 * distinct + extra + 1)
    pages = rng.sample(range(pool), pool)
    used, table = pages[:distinct], []
    it = iter(used)
    for b, n in enumerate(need):
        row = table[0][:shared[b]] if shared[b] else []
        row += [next(it) for _ in range(n - shared[b])]
        table.append(row)
    spare = pages[distinct:] or [0]
    width = max(need) + extra
    for row in table:
        row += [rng.choice(spare) for _ in range(width - len(row))]
    return table, pool


def cache_corpus(adapter, *, profile: str = "dev", device: str = "auto", paged: Optional[bool] = None,
                 append: bool = False, num_splits: Optional[int] = None, leftpad: bool = False) -> List[CaseRecipe]:
    """Nasty cache cases, run first: page size 1 scrambled, an odd page size with a partial last page and
    NaN past the lengths, shared prefix pages, decode with GQA 16, many short sequences, append with Lq > 1;
    with `leftpad`, every case's batches start at slots 0, 3, 17, ... (the padding below them garbage)."""
    from ..check import unclaimed

    c = adapter.claims
    lim = profile_limits(profile)
    dev = adapter.run_device(device)
    dt = next((d for d in ("float16", "bfloat16", "float32") if d in c.dtypes), None)
    hd = head_dim_candidates(c, lim.head_dims)
    if dt is None or not hd:
        return []
    d = next((x for x in (64, 128, 32, 16) if x in hd), hd[0])
    causal = "bottom_right" if "bottom_right" in c.causal else "none"
    new = 4 if append else 0
    specs = [  # (batch, Hkv, group, Lq, lens, page size)
        (2, 1, 1, 1, [37, 20], 1), (3, 2, 2, 4 if append else 1, [45, 13, 30], 7), (2, 1, 16, 1, [130, 64], 16),
        (8, 1, 4, 1, [1, 5, 9, 2, 17, 3, 11, 6], 3), (2, 2, 1, 4, [64, 100], 64), (1, 1, 2, 8, [200], 256),
    ]
    out = []
    rng = random.Random(7)
    for i, (b, hkv, g, lq, lens, size) in enumerate(specs):
        lens = [max(x, lq - new) for x in lens]
        lk = max(x + new for x in lens)
        pads = [(3, 17, 0, 1)[j % 4] for j in range(b)] if leftpad else None
        lens = [x + (pads[j] if pads else 0) for j, x in enumerate(lens)]  # cache_seqlens: padding + keys
        if lk > min(lim.max_len, c.max_seqlen) or (g > 1 and not c.gqa):
            continue
        kind = paged if paged is not None else c.paged
        if kind:
            if not c.page_size_ok(size):
                size = next((p for p in PAGE_SIZES if c.page_size_ok(p)), None)
                if size is None:
                    continue
            need = [-(-(x + new) // size) for x in lens]
            sh = min(lens[0] // size, lens[-1] // size) if b > 1 and i % 2 else 0
            pool = 3 * sum(need) + 2
            pages = rng.sample(range(pool), pool)
            table, k = [], 0
            for j, n in enumerate(need):
                row = list(table[0][:sh]) if (j == b - 1 and sh) else []
                fresh = n - len(row)
                row += pages[k:k + fresh]
                k += fresh
                table.append(row)
            width = max(need) + 1
            table = [row + [pages[-1]] * (width - len(row)) for row in table]
            cache = dict(paged=True, page_size=size, num_pages=pool, block_table=table)
        else:
            cache = dict(page_size=max(lens) + new + 3, num_pages=b + 1, cache_batch_idx=rng.sample(range(b + 1), b))
        r = CaseRecipe(batch=b, heads_q=hkv * g, heads_kv=hkv, len_q=lq, len_k=lk, head_dim=d, dtype=dt, device=dev,
                       seed=100 + i, causal=causal, return_lse=c.lse, cache_lens=lens, cache_leftpad=pads, new_len=new,
                       garbage=GARBAGE[i % 3], num_splits=num_splits, **cache)
        try:
            if unclaimed(adapter, build_probe(r)) is None:
                out.append(r)
        except ValueError:
            continue
    return out
