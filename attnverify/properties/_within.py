"""Keeping a property within what an adapter claims (issue 18).

A property may need a case the adapter does not claim (a non-causal one, a length, a head dim) or call
the adapter on inputs derived from the drawn case (a permutation, one batch entry, a bigger batch). The
helpers here choose within the claims and refuse, with the adapter's own reason, a derived call it does
not claim, so a property never sends an unclaimed case: it judges what is claimed or skips saying why.
"""
from __future__ import annotations

from typing import Optional, Tuple

from ..spec import CAUSAL_MODES


class Refused(Exception):
    """A call a property derived from its case is one the adapter does not claim (the reason)."""


def none_first(adapter) -> Tuple[str, ...]:
    """("none",) when the adapter claims non-causal attention, else every alignment it claims: for a
    property whose check holds under any masking but reads best without it."""
    c = adapter.claims.causal
    return ("none",) if "none" in c else tuple(m for m in CAUSAL_MODES if m in c)


def ensure_claimed(adapter, q, k, v, spec) -> None:
    """Raise Refused when the adapter does not claim the call (q, k, v, spec) (its claims or `refuses`)."""
    from ..case import Case
    from ..check import unclaimed

    why = unclaimed(adapter, Case(q, k, v, spec))
    if why:
        raise Refused(why)


def first_row_seeing_every_key(lq: int, lk: int, causal: str) -> Optional[int]:
    """The first query row that sees every key under `causal` (rows after it do too); None when no row does."""
    if causal == "none":
        return 0
    first = lk - 1 if causal == "top_left" else lq - 1  # top-left: j <= i; bottom-right: j <= i + lk - lq
    return first if 0 <= first < lq else None
