"""The verdicts of a run, from its journal alone: for tests that compare two runs (same seed, same verdicts)."""
from __future__ import annotations

import json

from attnverify.journal import read_journal


def run_verdicts(report) -> list:
    """(property, index, what was drawn, status, severity) of every judged example of the run in `report`."""
    recs = read_journal(str(report))
    drawn = {(r["property"], r["index"]): json.dumps(r.get("drawn"), sort_keys=True) for r in recs
             if r.get("event") == "case_start"}
    return sorted((r["property"], r["index"], drawn.get((r["property"], r["index"])), r["status"],
                   round(float(r["severity"]), 9)) for r in recs if r.get("event") == "result")
