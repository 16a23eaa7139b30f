"""`attnverify selftest`: run the suite against the zoo and show what it caught, and how fast.

    attnverify selftest [--fast] [--member NAME ...] [--seed N] [--json PATH] [--profile ci] [--list]

For every member (or the `--fast` CI subset) the properties run under the ci profile: the member's
expected properties first, then every other property it claims, stopping at the first failure.
One row per member: caught or not, by which property, the examples and seconds to the first failing
example (counted from the start of the member, so a property that passed first is included), the
shrunk case, and the diagnosis (attnverify.diagnose on a re-check of the shrunk case, where the
failure is one a check can show; otherwise the property's own finding).

Exit status: 0 when every member was caught, 1 when one was missed or could not run here
(`--skip-unavailable` lets a member whose library is missing be skipped instead), 2 on a usage error.
Runs are reproducible: a fixed seed (default 0), Hypothesis's example database off.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence
from ..devices import cuda_present

# properties whose failure may lie in the backward pass only (the re-check then includes gradients)
_BACKWARD_PROPS = ("gradients_match_reference", "fully_masked_rows", "gqa_equals_repeated_kv")


@dataclass
class MemberResult:
    member: str
    kind: str
    status: str  # caught | missed | unavailable | error
    caught_by: Optional[str] = None  # the property that caught it
    expected: bool = False  # caught by one of its expected properties
    first_examples: Optional[int] = None  # examples run (all properties of this member) up to the first failure
    first_seconds: Optional[float] = None  # seconds from the member's start to its first failing example
    prop_first_index: Optional[int] = None  # index of the first failing example inside the catching property run
    prop_first_seconds: Optional[float] = None  # seconds inside the catching property run
    total_examples: int = 0
    total_seconds: float = 0.0  # with shrinking
    case: str = ""  # the shrunk case
    diagnosis: str = ""
    finding: str = ""  # the first lines of the failure message
    replay: str = ""
    properties_run: List[str] = field(default_factory=list)
    reason: str = ""  # unavailable / error: why
    diagnosis_seconds: float = 0.0  # re-check and diagnosis of the shrunk case (not in total_seconds)

    @property
    def caught(self) -> bool:
        return self.status == "caught"

    def to_dict(self) -> dict:
        return asdict(self)


def property_order(member) -> List:
    """The member's expected properties first, then every other property, in the suite's order."""
    from ..properties import PROPERTIES, get_property

    order = [get_property(n) for n in member.expected]
    order += [p for p in PROPERTIES if p.name not in member.expected]
    return order


def run_member(member, *, profile: str = "ci", seed: int = 0, report_dir: Optional[str] = None,
               shrink_budget_s: Optional[float] = None, max_examples: Optional[int] = None,
               properties: Optional[Sequence[str]] = None, diagnose: bool = True) -> MemberResult:
    """Run the suite against one member until its first failing property; never raises for a miss."""
    from ..properties.driver import PropertySkipped, run_property
    from ..properties import get_property

    res = MemberResult(member.name, member.kind, "missed")
    why = member.unavailable_reason()
    if why:
        res.status, res.reason = "unavailable", why
        return res
    report_dir = report_dir or os.path.join(tempfile.gettempdir(), "attnverify-selftest")
    props = [get_property(n) for n in properties] if properties else property_order(member)
    t_member = time.perf_counter()
    for prop in props:
        if prop.why_skipped(member.adapter):
            continue
        count = {"n": 0}
        first: Dict[str, float] = {}

        def journal(ev, count=count):
            if ev.get("event") == "case_start":
                count["n"] += 1

        def on_first(i, s, first=first, count=count):
            first.update(i=i, s=s, n=count["n"], t=time.perf_counter() - t_member)

        res.properties_run.append(prop.name)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run_property(prop, member.adapter, profile=profile, seed=seed, database=None, journal=journal,
                             report_dir=report_dir, on_first_failure=on_first, max_examples=max_examples,
                             shrink_budget_s=shrink_budget_s)
        except PropertySkipped:
            res.properties_run.pop()
            continue
        except AssertionError as e:
            text = str(e)
            if _raised(text):
                # the member crashed: not its bug (the zoo's bugs are wrong numbers), so not a catch
                res.status, res.reason = "error", f"{prop.name}: the member raised: {_finding(text, prop.doc)}"
                res.total_examples += count["n"]
                res.total_seconds = time.perf_counter() - t_member
                return res
            res.status = "caught"
            res.caught_by = prop.name
            res.expected = prop.name in member.expected
            res.first_examples = res.total_examples + int(first.get("n", count["n"]))
            res.first_seconds = first.get("t")
            res.prop_first_index = int(first["i"]) if "i" in first else None
            res.prop_first_seconds = first.get("s")
            res.total_examples += count["n"]
            res.total_seconds = time.perf_counter() - t_member
            m = re.search(r"^shrunk case: (.*)$", text, re.M)
            res.case = m.group(1) if m else ""
            m = re.search(r"^replay: attnverify repro (.*)$", text, re.M)
            res.replay = m.group(1).strip() if m else ""
            res.finding = _finding(text, prop.doc)
            if diagnose:
                t_d = time.perf_counter()
                res.diagnosis = diagnosis_for(member, prop.name, res.replay, res.finding)
                res.diagnosis_seconds = time.perf_counter() - t_d
            return res
        except Exception as e:  # the machinery failed, not the member: say so
            res.status, res.reason = "error", f"{prop.name}: {type(e).__name__}: {e}"
            res.total_seconds = time.perf_counter() - t_member
            return res
        res.total_examples += count["n"]
    res.total_seconds = time.perf_counter() - t_member
    return res


def _raised(text: str) -> bool:
    """Did the failing example fail because the adapter (or the property around it) raised?"""
    head = "\n".join(text.splitlines()[:4])
    return bool(re.search(r"\] ERROR: |the property raised |runner raised ", head))


def _finding(text: str, doc: str = "") -> str:
    """The informative lines of a property failure: what failed, not the headers."""
    keep = []
    for line in text.splitlines()[1:]:
        s = line.strip()
        if not s or (doc and s == doc.strip()) or s.startswith(("shrunk case:", "replay:", "first failing example:", "property parameters:",
                                  "Traceback", "File ")):
            continue
        if s.startswith("[") and ("FAILED" in s or "modified" in s or "claims" in s or "dropout" in s) and ":" in s:
            continue
        keep.append(s)
        if len(keep) == 2:
            break
    return " / ".join(keep)[:300]


def diagnosis_for(member, prop_name: str, replay_path: str, finding: str) -> str:
    """attnverify.diagnose on a reference check of the saved shrunk case, when that check fails
    (whatever property found the case); otherwise the property's own finding."""
    if replay_path and os.path.exists(replay_path):
        try:
            from ..case import load_case
            from ..check import check, unclaimed
            from ..diagnose import NO_EXPLANATION, diagnose_result

            case = load_case(replay_path)
            # a KV-cache case is judged by its property alone (check() compares plain calls)
            if case.spec.dropout_p == 0 and case.spec.cache_seqlens is None and unclaimed(member.adapter, case) is None:
                # the forward first (cheap, and what diagnose explains); the backward only if needed
                passes = [False] + ([True] if member.adapter.claims.backward and prop_name in _BACKWARD_PROPS else [])
                for bwd in passes:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        res = check(member.adapter, case, backward=bwd)
                    if any(c.name == "inputs" for c in res.failing()):
                        # the adapter changed its inputs: the numbers compared afterwards mean nothing
                        return f"{finding} (the re-check saw the inputs modified in place too)"
                    numeric = [c for c in res.failing() if c.name in ("out", "lse", "dq", "dk", "dv")]
                    if numeric:
                        d = diagnose_result(res, adapter=member.adapter)
                        text = f"{d.summary} [failing: {', '.join(c.name for c in numeric)}]"
                        if d.summary == NO_EXPLANATION:
                            text += "; " + _brief(numeric[0])
                        return text
        except Exception as e:  # a diagnosis problem must not hide the catch
            return f"(diagnosis unavailable: {type(e).__name__}: {e}) {finding}"
    return finding


def _brief(c) -> str:
    """One line for a failing comparison."""
    parts = [f"{c.name}: {c.mismatched}/{c.numel} elements off ({100.0 * c.mismatch_fraction:.0f}%)"]
    if c.worst_index is not None and c.worst_actual is not None:
        parts.append(f"worst at {tuple(c.worst_index)}: got {c.worst_actual:.4g}, expected {c.worst_expected:.4g}")
    if c.problems:
        parts.append(c.problems[0])
    return ", ".join(parts)


def select(names: Optional[Sequence[str]] = None, fast: bool = False):
    from . import ZOO, fast_members, get_member

    if names:
        out = []
        for n in names:
            for part in n.split(","):
                if part.strip():
                    out.append(get_member(part.strip()))
        return out
    return fast_members() if fast else list(ZOO)


def summarize(rows: List[MemberResult]) -> dict:
    caught = [r for r in rows if r.caught]
    firsts = [r.first_seconds for r in caught if r.first_seconds is not None]
    return {
        "members": len(rows),
        "caught": len(caught),
        "missed": [r.member for r in rows if r.status == "missed"],
        "unavailable": [r.member for r in rows if r.status == "unavailable"],
        "errors": [r.member for r in rows if r.status == "error"],
        "median_first_seconds": statistics.median(firsts) if firsts else None,
        "max_first_seconds": max(firsts) if firsts else None,
        "caught_by_unexpected": [r.member for r in caught if not r.expected],
        "total_seconds": sum(r.total_seconds for r in rows),
    }


def _row_text(r: MemberResult) -> str:
    if r.caught:
        first = f"#{r.first_examples} {r.first_seconds:6.2f}s"
        return (f"{r.member:28s} {r.kind:8s} caught  {r.caught_by:27s} {first:>14s}  "
                f"case: {r.case}\n{'':38s}diagnosis: {r.diagnosis}")
    if r.status == "unavailable":
        return f"{r.member:28s} {r.kind:8s} SKIPPED (unavailable: {r.reason})"
    if r.status == "error":
        return f"{r.member:28s} {r.kind:8s} ERROR   {r.reason}"
    return (f"{r.member:28s} {r.kind:8s} MISSED  ({r.total_examples} examples, {r.total_seconds:.1f}s over "
            f"{', '.join(r.properties_run)})")


def _interpreter_on() -> None:
    """Without a GPU the Triton members run under the interpreter, which must be switched on before
    triton is first imported (triton reads TRITON_INTERPRET at import as well as at @jit)."""
    import torch  # noqa: F401 - torch first, so that a triton it pulls in is seen by the check below

    if not cuda_present() and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="attnverify selftest", description=__doc__.split("\n\n")[0])
    ap.add_argument("--fast", action="store_true", help="only the CI subset (about 8 members, 2 of them Triton)")
    ap.add_argument("--member", action="append", default=[], metavar="NAME", help="run only this member (repeatable, comma lists)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="ci", choices=("ci", "dev", "thorough"))
    ap.add_argument("--json", default=None, metavar="PATH", help="write every row and the summary as JSON")
    ap.add_argument("--report-dir", default=None, help="where failing cases are saved (default: a temp folder)")
    ap.add_argument("--shrink-budget", type=float, default=None, metavar="S",
                    help="seconds of shrinking after a first failure (default: the profile's)")
    ap.add_argument("--max-examples", type=int, default=None, metavar="N",
                    help="generated examples per property (default: the profile's)")
    ap.add_argument("--max-bugs", type=int, default=None, metavar="K",
                    help="distinct bugs per property on multi-bug members (default: the profile's, 1 in ci)")
    ap.add_argument("--property", action="append", default=[], metavar="NAME",
                    help="run only these properties (repeatable, comma lists; default: every property, the "
                         "member's expected ones first)")
    ap.add_argument("--skip-unavailable", action="store_true",
                    help="members that cannot run here (e.g. triton missing) do not fail the run")
    ap.add_argument("--list", action="store_true", help="list the members and exit")
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0) if e.code in (0, None) else 2
    _interpreter_on()
    try:
        members = select(a.member, a.fast)
    except KeyError as e:
        print(f"attnverify selftest: {e.args[0]}", file=sys.stderr)
        return 2
    props = [x.strip() for n in a.property for x in n.split(",") if x.strip()] or None
    if props:
        from ..properties import PROPERTIES

        known = [p.name for p in PROPERTIES]
        bad = [n for n in props if n not in known]
        if bad:
            print(f"attnverify selftest: --property {', '.join(bad)}: no such property; one of {', '.join(known)}",
                  file=sys.stderr)
            return 2
    if a.list:
        for m in members:
            print(f"{m.name:28s} {m.kind:8s} {'fast ' if m.fast else '     '}{', '.join(m.expected)}\n"
                  f"{'':28s} bug: {m.bug}\n{'':28s} stands for: {m.stands_for}")
        return 0
    print(f"attnverify selftest: {len(members)} zoo member(s), profile {a.profile}, seed {a.seed}", flush=True)
    rows, counts = [], []
    for m in members:
        if m.planted:  # a multi-bug member: distinct bugs planted and found (zoo/bugcount.py)
            from .bugcount import count_bugs, row_text

            c = count_bugs(m, profile=a.profile, seed=a.seed, max_examples=a.max_examples, max_bugs=a.max_bugs,
                           shrink_budget_s=a.shrink_budget, report_dir=a.report_dir, properties=props)
            counts.append(c)
            rows.append(MemberResult(m.name, m.kind, "caught" if c.found else "missed", total_seconds=c.seconds,
                                     total_examples=c.examples, properties_run=c.properties_run,
                                     caught_by=", ".join(c.found[0]["properties"]) if c.found else None,
                                     expected=True, first_seconds=None))
            print(row_text(c), flush=True)
            continue
        r = run_member(m, profile=a.profile, seed=a.seed, report_dir=a.report_dir, shrink_budget_s=a.shrink_budget,
                       max_examples=a.max_examples, properties=props)
        rows.append(r)
        print(_row_text(r), flush=True)
    s = summarize(rows)
    s["miscounted"] = [f"{c.member} (planted {len(c.planted)}, found {len(c.found)})" for c in counts if not c.exact]
    med = "n/a" if s["median_first_seconds"] is None else f"{s['median_first_seconds']:.2f}s"
    mx = "n/a" if s["max_first_seconds"] is None else f"{s['max_first_seconds']:.2f}s"
    print(f"\ncaught {s['caught']}/{s['members']}; median time to the first failure {med} (slowest {mx}); "
          f"{s['total_seconds']:.0f}s in all")
    for key, label in (("missed", "MISSED"), ("errors", "ERRORS"), ("unavailable", "could not run here"),
                       ("miscounted", "DISTINCT BUGS FOUND != PLANTED")):
        if s[key]:
            print(f"{label}: {', '.join(s[key])}")
    if s["caught_by_unexpected"]:
        print(f"caught, but not by an expected property: {', '.join(s['caught_by_unexpected'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"profile": a.profile, "seed": a.seed, "rows": [r.to_dict() for r in rows], "summary": s,
                       "bug_counts": [c.to_dict() for c in counts]}, f, indent=1, default=str)
    bad = s["missed"] + s["errors"] + s["miscounted"] + ([] if a.skip_unavailable else s["unavailable"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
