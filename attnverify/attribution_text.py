"""How an attribution reads (attnverify.attribution): the one home of its user-facing words.

A need is a feature whose single-feature neighbour passes: the failure shows only with it ("fails only with B >= 2",
the neighbour with B = 1 passed). A hold is a neighbour that still fails: the failure does not depend on that
feature ("still fails with causal=none"). The records keep the terse keys (`needs`, `holds`); every report, summary
and log renders them through these functions, so a stranger reads which way each verdict went.
"""
from __future__ import annotations

from typing import Iterable

NEEDED = "fails only with"  # + the feature the failure needs: "fails only with B >= 2"
HOLDS = "still fails with"  # + the neighbour that failed too: "still fails with causal=none"
NO_NEED = "no single feature varied makes it pass"


def needed(label: str) -> str:
    return f"{NEEDED} {label}"


def needs_text(needs: Iterable[str]) -> str:
    """ "fails only with B >= 2; fails only with Lk not a multiple of 64", or NO_NEED when nothing is needed."""
    return "; ".join(needed(n) for n in needs) or NO_NEED


def attribution_text(needs: Iterable[str], holds: Iterable[str]) -> str:
    """The needs, then the neighbours that still fail: '' when there is neither."""
    return "; ".join([needed(n) for n in needs] + [f"{HOLDS} {h}" for h in holds])
