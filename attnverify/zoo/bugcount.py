"""`attnverify selftest` on a multi-bug member: distinct bugs planted against distinct bugs found.

Every property the member claims runs (its expected ones first) with the continued search of
properties.driver (up to `max_bugs` distinct bugs per property: the profile's by default, 1 in ci);
the bugs found are grouped by signature (attnverify.bugs) and each planted bug (zoo._multi.PlantedBug)
is matched to the found bug whose needs are exactly its needs. The count is right (`exact`) when every
planted bug is found as its own entry and every entry found is a planted bug: found == planted.
"""
from __future__ import annotations

import os
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import List, Optional

from ..attribution_text import needs_text


@dataclass
class BugCount:
    member: str
    planted: List[str]
    found: List[dict] = field(default_factory=list)  # grouped bugs: signature, needs, properties, describe
    matched: dict = field(default_factory=dict)  # planted name -> signature of the found bug, or None
    seconds: float = 0.0
    examples: int = 0
    properties_run: List[str] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)

    @property
    def all_found(self) -> bool:
        return bool(self.planted) and all(self.matched.get(p) for p in self.planted)

    @property
    def planted_of(self) -> dict:
        """found signature -> the planted bug it is (None: an entry no planted bug accounts for)."""
        by_sig = {sig: name for name, sig in self.matched.items() if sig}
        return {g["signature"]: by_sig.get(g["signature"]) for g in self.found}

    @property
    def exact(self) -> bool:
        """found == planted: each planted bug its own entry, and no other entry."""
        return self.all_found and len(self.found) == len(self.planted) and not self.errors

    def to_dict(self) -> dict:
        return dict(asdict(self), all_found=self.all_found, exact=self.exact, planted_of=self.planted_of)


def count_bugs(member, *, profile: str = "dev", seed: int = 0, max_examples: Optional[int] = None,
               max_bugs: Optional[int] = None, shrink_budget_s: Optional[float] = None,
               properties: Optional[List[str]] = None, report_dir: Optional[str] = None) -> BugCount:
    from ..bugs import brief, group
    from ..isolation import make_runner
    from ..properties import get_property
    from ..properties.driver import PropertySkipped, run_property
    from .selftest import property_order

    out = BugCount(member.name, [p.name for p in member.planted])
    report_dir = report_dir or os.path.join(tempfile.gettempdir(), "attnverify-selftest")
    props = [get_property(n) for n in properties] if properties else property_order(member)
    runner = make_runner("auto")
    found = []
    t0 = time.perf_counter()
    try:
        for prop in props:
            if prop.why_skipped(member.adapter):
                continue
            n = {"ex": 0}

            def journal(ev, n=n):
                if ev.get("event") == "case_start":
                    n["ex"] += 1

            out.properties_run.append(prop.name)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    run_property(prop, member.adapter, profile=profile, seed=seed, database=None, runner=runner,
                                 journal=journal, report_dir=report_dir, max_examples=max_examples,
                                 max_bugs=max_bugs, shrink_budget_s=shrink_budget_s)
            except PropertySkipped:
                out.properties_run.pop()
            except AssertionError as e:
                found += [brief(b) for b in getattr(e, "bugs", [])]
            except Exception as e:  # noqa: BLE001 - the machinery failed, not the member: say so
                out.errors.append(f"{prop.name}: {type(e).__name__}: {e}")
            out.examples += n["ex"]
    finally:
        runner.close()
    out.seconds = time.perf_counter() - t0
    out.found = group(found)
    for p in member.planted:
        hit = next((g for g in out.found if sorted(p.needs) == sorted(g["needs"])), None)
        out.matched[p.name] = hit["signature"] if hit else None
    return out


def row_text(c: BugCount) -> str:
    n_hit = sum(1 for v in c.matched.values() if v)
    verdict = "found == planted" if c.exact else "FOUND != PLANTED"
    lines = [f"{c.member:28s} multi    planted {len(c.planted)}, found {len(c.found)}: {verdict} ({n_hit}/{len(c.planted)} "
             f"planted bugs found as their own entry; {c.examples} examples, {c.seconds:.1f}s)"]
    for g in c.found:
        name = c.planted_of.get(g["signature"])
        lines.append(f"{'':38s}[{g['signature']}] {needs_text(g['needs'])} -> "
                     + (f"planted {name}" if name else f"NOT PLANTED: {g['describe']}")
                     + f" (seen by {', '.join(g['properties'])})")
    for name, sig in c.matched.items():
        if not sig:
            lines.append(f"{'':38s}planted {name}: MISSED (no entry with exactly its needs)")
    for e in c.errors:
        lines.append(f"{'':38s}ERROR {e}")
    return "\n".join(lines)
