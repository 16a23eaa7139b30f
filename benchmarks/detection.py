"""Detection benchmark: how fast the ci profile catches each deliberately wrong implementation.

    python benchmarks/detection.py [--profile ci] [--seed 0] [--write]

For each wrong implementation (tests/wrong_impls.py): examples and seconds to the first failing
example, and to the end of the run including shrinking; the shrunk case. `--write` replaces the
`## Detection (ci profile)` section of BENCHMARKS.md (other sections are kept).
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def measure(name, adapter, props, *, profile="ci", seed=0, report_dir=None, use_corpus=True):
    from attnverify.properties import get_property
    from attnverify.properties.driver import run_property

    row = {"name": name, "property": None, "first_n": None, "first_s": None, "total_n": 0, "total_s": 0.0, "case": ""}
    for pn in props:
        first = {}
        t0 = time.perf_counter()
        count = {"n": 0}

        def journal(ev, count=count):
            if ev["event"] == "case_start":
                count["n"] += 1

        try:
            run_property(get_property(pn), adapter, profile=profile, seed=seed, database=None, journal=journal,
                         report_dir=report_dir or os.path.join(ROOT, "reports", "detection"),
                         on_first_failure=lambda i, s: first.update(n=i, s=s), use_corpus=use_corpus)
        except AssertionError as e:
            text = str(e)
            m = re.search(r"shrunk case: (.*)", text)
            row.update(property=pn, first_n=first.get("n"), first_s=first.get("s"), total_n=count["n"],
                       total_s=time.perf_counter() - t0, case=m.group(1) if m else text.splitlines()[0])
            return row
        row["total_n"] += count["n"]
        row["total_s"] += time.perf_counter() - t0
    return row


def main(argv=None):
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="ci")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--only", default=None)
    a = ap.parse_args(argv)
    from wrong_impls import WRONG

    tables = []
    for use_corpus in (True, False):
        rows = []
        print("with the @example corpus" if use_corpus else "generated cases only (no @example corpus)")
        for name, (adp, props) in WRONG.items():
            if a.only and name not in a.only.split(","):
                continue
            r = measure(name, adp, props, profile=a.profile, seed=a.seed, use_corpus=use_corpus)
            rows.append(r)
            fs = "MISSED" if r["first_n"] is None else f"#{r['first_n']} {r['first_s']:.2f}s"
            print(f"{name:20s} {str(r['property']):28s} first {fs:14s} end {r['total_n']:4d} ex {r['total_s']:6.2f}s  {r['case']}", flush=True)
        caught = [r for r in rows if r["first_n"] is not None]
        med_first = statistics.median([r["first_s"] for r in caught]) if caught else float("nan")
        med_total = statistics.median([r["total_s"] for r in rows]) if rows else float("nan")
        worst = max([r["first_s"] for r in caught], default=float("nan"))
        print(f"caught {len(caught)}/{len(rows)}; median first failure {med_first:.2f}s (max {worst:.2f}s); median whole run {med_total:.2f}s")
        tables.append((use_corpus, rows, med_first, med_total, worst))
    if a.write:
        write(tables, a.profile, a.seed)


def write(tables, profile, seed):
    import torch

    head = [
        f"## Detection ({profile} profile)", "",
        f"`python benchmarks/detection.py --write` (seed {seed}, database off, {os.cpu_count()} CPU cores, "
        f"torch {torch.__version__}, Python {platform.python_version()}). Each wrong implementation "
        "(tests/wrong_impls.py) is run through the property meant to catch it; `first` is the first failing "
        "example (index and seconds), `end` the whole run with shrinking. Twice: as shipped (the @example "
        "corpus runs first; Hypothesis does not shrink explicit examples, so the case shown is the corpus entry), "
        "and with the corpus switched off, to show what the generated cases and shrinking find on their own.", "",
    ]
    body = []
    for use_corpus, rows, med_first, med_total, worst in tables:
        body += _table(rows, "with the @example corpus" if use_corpus else "generated cases only", med_first, med_total, worst)
    _replace_section(profile, "\n".join(head + body))


def _table(rows, title, med_first, med_total, worst):

    lines = [
        f"### {title}", "",
        "| wrong implementation | property | first failure | end of run (examples, s) | shrunk case |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        fs = "**missed**" if r["first_n"] is None else f"#{r['first_n']}, {r['first_s']:.2f} s"
        lines.append(f"| {r['name']} | {r['property'] or '-'} | {fs} | {r['total_n']}, {r['total_s']:.2f} s | `{r['case']}` |")
    caught = sum(r["first_n"] is not None for r in rows)
    lines += ["", f"Caught {caught}/{len(rows)}. Median time to the first failing example {med_first:.2f} s "
              f"(target <= 1 s; slowest {worst:.2f} s, target <= 60 s); median whole run with shrinking "
              f"{med_total:.2f} s (target <= 20 s).", ""]
    return lines


def _replace_section(profile, sec):
    path = os.path.join(ROOT, "BENCHMARKS.md")
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n\n"
    pat = re.compile(r"## Detection \(" + re.escape(profile) + r" profile\)\n.*?(?=\n## |\Z)", re.S)
    text = pat.sub(lambda m: sec.rstrip("\n"), text) if pat.search(text) else text.rstrip("\n") + "\n\n" + sec
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")


if __name__ == "__main__":
    main()
