"""The time split of a run, read from its journal: where each (adapter, property)'s examples spent their time.

Reads only the journal (`result` records' `split`, `test_end` records' wall time); phases as in
attnverify.timesplit. `python benchmarks/time_split.py REPORT_DIR` prints it.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional

from .timesplit import JUDGE_PHASES, PARTS, PHASES, total


def split_rows(records: List[dict]) -> List[dict]:
    """One row per (adapter, property) with results: examples, wall seconds (the test items' own, else the
    examples' sum), examples/s, seconds per phase ("unsplit": the seconds of examples without a split: a
    crash or timeout, or a journal written before the split existed)."""
    rows: Dict[tuple, dict] = {}
    walls: Dict[tuple, float] = defaultdict(float)
    for rec in records:
        key = (rec.get("adapter"), rec.get("property"))
        if rec.get("event") == "test_end":
            walls[key] += float(rec.get("seconds") or 0.0)
            continue
        if rec.get("event") != "result":
            continue
        row = rows.setdefault(key, {"adapter": key[0], "property": key[1], "examples": 0, "phases": defaultdict(float)})
        row["examples"] += 1
        split = rec.get("split") or {}
        for k, v in split.items():
            row["phases"][k] += float(v)
        if not any(k in split for k in JUDGE_PHASES):  # a crash or timeout (the judge died with its timer), or a
            # journal from before the split: its seconds are known, not where they went
            row["phases"]["unsplit"] += float(rec.get("seconds") or 0.0)
    out = []
    for key, row in rows.items():
        summed = total(row["phases"])
        wall = walls.get(key) or summed
        row["wall"] = wall
        row["per_s"] = row["examples"] / wall if wall > 0 else 0.0
        row["phases"] = dict(row["phases"])
        out.append(row)
    return out


def _totals(rows: List[dict]) -> dict:
    tot = {"adapter": "all", "property": "all", "examples": 0, "wall": 0.0, "phases": defaultdict(float)}
    for r in rows:
        tot["examples"] += r["examples"]
        tot["wall"] += r["wall"]
        for k, v in r["phases"].items():
            tot["phases"][k] += v
    tot["per_s"] = tot["examples"] / tot["wall"] if tot["wall"] > 0 else 0.0
    tot["phases"] = dict(tot["phases"])
    return tot


def split_table(records: List[dict], *, per: str = "ms") -> str:
    """A markdown table: per (adapter, property) the examples, examples/s and the mean milliseconds per
    example in each phase, then every phase's share of the summed time; `per="share"` gives shares only."""
    if per not in ("ms", "share"):
        raise ValueError(f"per={per!r}: use 'ms' (mean milliseconds per example) or 'share' (percent of the time)")
    rows = split_rows(records)
    if not rows:
        return "(no result records with a time split in this journal)"
    rows.sort(key=lambda r: (str(r["adapter"]), str(r["property"])))
    if len(rows) > 1:
        rows.append(_totals(rows))
    cols = [p for p in PHASES + ("unsplit",) + PARTS if any(r["phases"].get(p) for r in rows)]
    head = ["adapter", "property", "examples", "wall s", "examples/s"] + cols
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        summed = total(r["phases"]) or 1.0
        if per == "ms":
            cells = [f"{1000.0 * r['phases'].get(p, 0.0) / max(1, r['examples']):.1f}" for p in cols]
        else:
            cells = [f"{100.0 * r['phases'].get(p, 0.0) / summed:.0f}%" for p in cols]
        lines.append("| " + " | ".join([str(r["adapter"]), str(r["property"]), str(r["examples"]), f"{r['wall']:.1f}",
                                        f"{r['per_s']:.1f}"] + cells) + " |")
    return "\n".join(lines)


def journal_split_table(path: str, *, run_id: Optional[str] = None, per: str = "ms") -> str:
    """split_table of a report folder's (or journal file's) last run, or of `run_id`."""
    from .journal import last_run, read_journal

    records = read_journal(path, run_id=run_id) if run_id else last_run(path)
    return split_table(records, per=per)
