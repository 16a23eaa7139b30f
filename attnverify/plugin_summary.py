"""The run's summary: per-item outcomes (also from xdist workers) and the adapters x properties table."""
from __future__ import annotations

import os
import re

from .origin import display_path as _rel
from .plugin_settings import Settings, _bugs


class _Reporter:
    """Collects per-item outcomes (also from xdist workers) and prints the adapters x properties table."""

    def __init__(self, s: Settings):
        self.s = s

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and not (report.when == "setup" and report.skipped):
            return
        for name, info in getattr(report, "user_properties", ()):
            if name == "attnverify":
                self.s.outcomes[report.nodeid] = info
                return
        if report.when == "setup" and report.skipped and report.nodeid.startswith("attnverify::"):
            m = re.match(r"attnverify::test_(.+)\[(.+)\]$", report.nodeid)
            if m:
                reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                self.s.outcomes[report.nodeid] = ({"property": m.group(1), "adapter": m.group(2), "outcome": "skipped",
                                                       "message": reason, "examples": 0, "seconds": 0.0})

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        s = self.s
        if s.is_worker:
            return
        rows = dict(s.outcomes)
        if not rows:
            return
        tr = terminalreporter
        tr.section("attnverify")
        for line in _bugs().summary_lines(rows.values()):  # "3 distinct bugs (seen by 26 properties)", each
            tr.write_line(line, red=not line.startswith(" "), bold=not line.startswith(" "))
        adapters = list(dict.fromkeys(i["adapter"] for i in rows.values()))
        props = list(dict.fromkeys(i["property"] for i in rows.values()))
        w = max(len(p) for p in props) + 2
        tr.write_line("property".ljust(w) + "".join(a[:18].ljust(20) for a in adapters))
        by = {(i["property"], i["adapter"]): i for i in rows.values()}
        for p in props:
            cells = []
            for a in adapters:
                i = by.get((p, a))
                if i is None:
                    cells.append("-".ljust(20))
                    continue
                o = i["outcome"]
                cell = {"passed": "ok", "failed": "FAIL", "skipped": "skip", "error": "ERROR", "known": "known",
                        "xpass": "XPASS"}.get(o, o)
                if o in ("passed", "failed"):
                    cell += f" {i.get('examples', 0)}ex {i.get('seconds', 0):.1f}s"
                if i.get("status") in ("crashed", "timeout"):
                    cell = f"{i['status'].upper()} {i.get('examples', 0)}ex"
                cells.append(cell[:19].ljust(20))
            tr.write_line(p.ljust(w) + "".join(cells))
        for i in rows.values():
            if i.get("repro"):
                tr.write_line(f"{i['property']}[{i['adapter']}]: {i['repro']}")
            if i.get("outcome") == "xpass":
                tr.write_line(f"{i['property']}[{i['adapter']}]: {i.get('message')}")
        unisolated = sum(int(i.get("judged_in_process") or 0) for i in rows.values())
        if unisolated:
            tr.write_line(f"WARNING: {unisolated} example(s) were judged in the process that drives the run, without "
                          f"crash isolation: CUDA had been initialised there, so no judge could be forked (a device "
                          f"fault there fails every later test of that worker)")
        tr.write_line(f"journal: {_rel(os.path.join(s.report, 'results.jsonl'))}  seed: {s.seed}")
        for line in s.untested_lines:
            tr.write_line(line, red=True, bold=line.startswith("NOTHING"))
