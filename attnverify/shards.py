"""Shards: `--attn-shard K/N` runs a deterministic slice of the (adapter, property) work.

    pytest --adapter=mine --attn-shard 2/4      # the second of four CI jobs (K counts from 1)

Every (adapter, property) pair is one unit of work (its Hypothesis search, with the run's seed, is its
seed stream). The pairs are ordered by a stable hash of "adapter\\0property" (sha256, not Python's
salted hash()) and dealt round-robin to the N shards, so

- the N shards of one run cover every pair exactly once (no overlap, nothing missed),
- the slices are balanced to within one pair,
- every shard computes the same slices on its own (no coordinator): give all N jobs the same
  adapters, seed and profile, and the union of their journals is the single run's.

The journal's run_start says which slice a shard ran: {"shard": {"index": K, "count": N,
"pairs": [[adapter, property], ...]}}. Unselected items are deselected the pytest way (they count
as "deselected" in the summary line).
"""
from __future__ import annotations

import hashlib
import re
from typing import Iterable, List, Optional, Sequence, Set, Tuple

Pair = Tuple[str, str]

_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


class ShardError(ValueError):
    """A --attn-shard value that is not K/N with 1 <= K <= N."""


def parse_shard(value, source: str = "--attn-shard") -> Optional[Tuple[int, int]]:
    """'2/4' -> (2, 4); None or '' -> None (no sharding). A bad value raises ShardError naming `source`."""
    if value is None or str(value).strip() == "":
        return None
    m = _SPEC.match(str(value))
    if not m:
        raise ShardError(f"{source}={value!r}: give K/N, the K-th of N shards counting from 1 (e.g. 2/4)")
    k, n = int(m.group(1)), int(m.group(2))
    if n < 1 or not 1 <= k <= n:
        raise ShardError(f"{source}={value!r}: K must be between 1 and N and N at least 1 (e.g. 1/{max(n, 1)} "
                         f"... {max(n, 1)}/{max(n, 1)})")
    return k, n


def pair_key(adapter: str, prop: str) -> str:
    return hashlib.sha256(f"{adapter}\0{prop}".encode()).hexdigest()


def assign(pairs: Iterable[Pair], count: int) -> List[List[Pair]]:
    """The N slices: pairs ordered by their stable hash, dealt round-robin (slice i is shard i+1)."""
    if count < 1:
        raise ShardError(f"count={count}: at least 1 shard")
    ordered = sorted(set(pairs), key=lambda p: (pair_key(*p), p))
    return [ordered[i::count] for i in range(count)]


def shard_pairs(adapters: Sequence[str], props: Sequence[str], shard: Tuple[int, int]) -> List[Pair]:
    """The (adapter, property) pairs shard K of N runs, in the run's own order (adapters, then properties)."""
    k, n = shard
    mine: Set[Pair] = set(assign([(a, p) for a in adapters for p in props], n)[k - 1])
    return [(a, p) for a in adapters for p in props if (a, p) in mine]


def run_start_record(adapters: Sequence[str], props: Sequence[str], shard: Optional[Tuple[int, int]]) -> dict:
    """What run_start records about the slice (empty without sharding)."""
    if shard is None:
        return {}
    k, n = shard
    return {"shard": {"index": k, "count": n, "pairs": [list(p) for p in shard_pairs(adapters, props, shard)]}}


def select(config, items: list, shard: Optional[Tuple[int, int]], adapters: Sequence[str],
           props: Sequence[str]) -> list:
    """Keep the items of this shard's slice; the rest are reported through pytest_deselected."""
    if shard is None:
        return items
    mine = set(shard_pairs(adapters, props, shard))
    keep = [it for it in items if (it.adapter.name, it.prop.name) in mine]
    drop = [it for it in items if (it.adapter.name, it.prop.name) not in mine]
    if drop:
        config.hook.pytest_deselected(items=drop)
    return keep


def label(rec: Optional[dict]) -> Optional[str]:
    """'shard2of4' from a run_start record that ran a slice, else None."""
    sh = (rec or {}).get("shard")
    if not isinstance(sh, dict):
        return None
    return f"shard{sh.get('index')}of{sh.get('count')}"
