"""Shape strategies: sequence lengths around tile boundaries, head dims from the claims, tile partitions."""
from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from ._args import InvalidArgument, check_int, check_order

DEFAULT_TILES = (16, 32, 64, 128)
PRIMES = (2, 3, 5, 7, 11, 13, 17, 31, 37, 61, 67, 97, 101, 127, 131, 193, 251, 257, 509, 521, 1021, 2053, 4099, 8191)
SMALL_MAX = 20


def interesting_lengths(*, max_len: int, min_len: int = 1, tiles: Optional[Sequence[int]] = None) -> List[int]:
    """Lengths that break kernels: tile multiples and +-1, primes, L % 128 == 64, 1. Sorted, deduplicated."""
    check_int("max_len", max_len, min_value=0)
    check_int("min_len", min_len, min_value=0)
    check_order("min_len", min_len, "max_len", max_len)
    return list(_interesting(max_len, min_len, tuple(sorted(set(int(t) for t in (tiles or ()) if int(t) > 0)))))


# issue 25: the case strategy asks for the same few (max_len, tiles) on every draw; the lists and the
# strategies made of them are the same each time (same elements, same order: Hypothesis draws alike)
@lru_cache(maxsize=4096)
def _interesting(max_len: int, min_len: int, tiles: Tuple[int, ...]) -> Tuple[int, ...]:
    ts = sorted(set(tiles) | set(DEFAULT_TILES))
    out = {1, 2}
    for t in ts:
        for m in (1, 2, 3, 4, 8, 16, 32, 64):
            base = t * m
            if base - 1 > max_len:
                break
            out.update((base - 1, base, base + 1))
    out.update(PRIMES)
    out.update(128 * n + 64 for n in range(0, max_len // 128 + 1))
    return tuple(sorted(x for x in out if min_len <= x <= max_len))


def seqlens(*, min_len: int = 1, max_len: int, tiles: Optional[Sequence[int]] = None):
    """A length: small ones first (shrink target), then the interesting ones; never outside [min_len, max_len]."""
    check_int("min_len", min_len, min_value=0)
    check_int("max_len", max_len, min_value=0)
    check_order("min_len", min_len, "max_len", max_len)
    if any(isinstance(x, SearchStrategy) for x in (min_len, max_len)):
        return _seqlens(min_len, max_len, tiles)
    return _seqlens_cached(min_len, max_len, tuple(sorted(set(int(t) for t in (tiles or ()) if int(t) > 0))))


def _seqlens(min_len, max_len, tiles):
    small = st.integers(min_len, max(min_len, min(max_len, SMALL_MAX)))
    inter = interesting_lengths(max_len=max_len, min_len=min_len, tiles=tiles)
    return st.one_of(small, st.sampled_from(inter)) if inter else small


@lru_cache(maxsize=4096)
def _seqlens_cached(min_len: int, max_len: int, tiles: Tuple[int, ...]):
    return _seqlens(min_len, max_len, tiles)


def head_dim_candidates(claims, profile_dims: Sequence[int]) -> Tuple[int, ...]:
    """Head dims the adapter claims, in the profile's order (simplest first); exact claims beyond it added, those
    above the profile's largest too (a claimed 576, MLA's, was never drawn beside a claimed 512: the claim untested)."""
    out = [d for d in profile_dims if claims.head_dim_ok(d)]
    cap = max(profile_dims)
    if not callable(claims.head_dims):
        out += sorted(d for d in claims.head_dims if d not in out)
    elif not out:  # a predicate none of the profile's dims passes (d % 48 == 0): the smallest it accepts
        out = [d for d in range(1, cap + 1) if claims.head_dim_ok(d)][:3]
    return tuple(out)


def tile_partitions(length: int, *, max_tiles: Optional[int] = None, min_tiles: int = 1):
    """Arbitrary (uneven) partitions [0, b1, ..., length] of `length` keys, for the online-softmax model."""
    check_int("length", length, min_value=1)
    check_int("min_tiles", min_tiles, min_value=1)
    mt = length if max_tiles is None else check_int("max_tiles", max_tiles, min_value=1)
    check_order("min_tiles", min_tiles, "max_tiles", mt)
    if min_tiles > length:
        raise InvalidArgument(f"min_tiles={min_tiles} is larger than length={length}")
    cuts = st.lists(st.integers(1, length - 1), unique=True, min_size=min_tiles - 1,
                    max_size=max(min_tiles - 1, min(mt, length) - 1)) if length > 1 else st.just([])
    return cuts.map(lambda c: [0] + sorted(c) + [length])


def block_sizes(*, tiles: Optional[Sequence[int]] = None, choices: Sequence[int] = (16, 32, 64, 128)):
    """(BLOCK_M, BLOCK_N) pairs for adapters that take their tile sizes as a parameter."""
    vals = sorted(set(choices) | set(tiles or ()))
    return st.tuples(st.sampled_from(vals), st.sampled_from(vals))
