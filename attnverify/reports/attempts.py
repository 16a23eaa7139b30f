"""Attempts of one shard (a Ray task retried after its node was lost) combined into one source's records.

A retried attempt runs its whole shard again with the same seed, into a new attempt folder, so the
attempts' journals overlap: the examples the lost attempt judged before it died are judged again. The
merge keeps one result per (adapter, property, example), an example being the drawn value of its
case_start record:

- a result judged by one attempt only is kept (what a lost attempt journaled before it died stays);
- an example judged by several attempts keeps one result, the worst status among them (a flaky kernel's
  failure is never hidden by a later pass), the earliest attempt on a tie; that result lists every
  attempt's status under `attempts` (e.g. [{"attempt": "attempt1", "status": "passed"}, ...]);
- a case_start without its result (the example that was running when the attempt died) is dropped when
  another attempt judged the same example (the death was not that example's doing); when no attempt
  did, it stays, and the report shows the pair as crashed on that example;
- one test_end per (adapter, property): the worst status, the later attempt on a tie (the complete one);
- run_start, run_end and conventions records are all kept.

Every kept record is marked with `attempt`, the attempt's label. Only records are read: nothing runs.
"""
from __future__ import annotations

import json
from typing import Dict, List, Sequence, Tuple

from .model import ORDER

Attempt = Tuple[str, List[dict]]  # (label, the attempt folder's last run), first attempt first


def _rank(status: str) -> int:
    """0 for the worst status (ORDER's first), higher for better; unknown statuses sit with 'failed'."""
    return ORDER.index(status) if status in ORDER else ORDER.index("failed")


def _result_status(rec: dict) -> str:
    return str(rec.get("status") or ("passed" if rec.get("passed") else "failed"))


def _end_status(rec: dict) -> str:
    return str(rec.get("status") or rec.get("outcome") or "not run")


def example_key(rec: dict) -> tuple:
    """(adapter, property, the drawn example as canonical JSON) of a case_start record."""
    return (rec.get("adapter"), rec.get("property"), json.dumps(rec.get("drawn"), sort_keys=True, default=str))


def pair_examples(records: List[dict]) -> List[Tuple[int, int, tuple]]:
    """(index of a case_start, index of its result or -1, example key) for each case_start of one run,
    the result being the next one of the same (run, process, test)."""
    open_: Dict[tuple, int] = {}
    out: List[Tuple[int, int, tuple]] = []
    slot: Dict[int, int] = {}
    for i, rec in enumerate(records):
        key = (rec.get("run_id"), rec.get("pid"), rec.get("test") or (rec.get("property"), rec.get("adapter")))
        if rec.get("event") == "case_start":
            open_[key] = i
            slot[i] = len(out)
            out.append((i, -1, example_key(rec)))
        elif rec.get("event") == "result" and key in open_:
            start = open_.pop(key)
            s, _, k = out[slot[start]]
            out[slot[start]] = (s, i, k)
    return out


def combine(attempts: Sequence[Attempt]) -> List[dict]:
    """The records of a shard's attempts as one source's records (rules in the module doc)."""
    judged: Dict[tuple, List[Tuple[int, int, int]]] = {}  # example -> [(attempt, case_start, result)]
    dangling: List[Tuple[int, int, tuple]] = []
    paired = set()  # (attempt, index) of every case_start and result matched up here
    ends: Dict[tuple, Tuple[int, int]] = {}  # (adapter, property) -> (attempt, index) of the test_end kept
    for a, (_, recs) in enumerate(attempts):
        for s, r, key in pair_examples(recs):
            paired |= {(a, s), (a, r)}
            if r >= 0:
                judged.setdefault(key, []).append((a, s, r))
            else:
                dangling.append((a, s, key))
        for i, rec in enumerate(recs):
            if rec.get("event") != "test_end":
                continue
            pk = (rec.get("adapter"), rec.get("property"))
            if pk in ends:
                pa, pi = ends[pk]
                if _rank(_end_status(rec)) > _rank(_end_status(attempts[pa][1][pi])):
                    continue  # the earlier attempt's end is worse: it stays
            ends[pk] = (a, i)
    keep: Dict[Tuple[int, int], dict] = {}  # (attempt, index) -> the record to write
    for key, seen in judged.items():
        best = min(seen, key=lambda x: (_rank(_result_status(attempts[x[0]][1][x[2]])), x[0]))
        a, s, r = best
        result = dict(attempts[a][1][r])
        if len(seen) > 1:
            result["attempts"] = [{"attempt": attempts[x[0]][0], "status": _result_status(attempts[x[0]][1][x[2]])}
                                  for x in seen]
        keep[(a, s)] = attempts[a][1][s]
        keep[(a, r)] = result
    for a, s, key in dangling:
        if key not in judged:
            keep[(a, s)] = attempts[a][1][s]
    for pk, (a, i) in ends.items():
        keep[(a, i)] = attempts[a][1][i]
    out: List[dict] = []
    for a, (label, recs) in enumerate(attempts):
        for i, rec in enumerate(recs):
            ev = rec.get("event")
            if ev == "test_end" or (ev in ("case_start", "result") and (a, i) in paired):
                if (a, i) not in keep:
                    continue
                rec = keep[(a, i)]
            out.append(dict(rec, attempt=label))
    return out
