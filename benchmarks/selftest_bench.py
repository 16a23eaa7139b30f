"""Selftest benchmark: the ci profile against the zoo, beside the fixed-grid baseline.

    python benchmarks/selftest_bench.py [--seeds 0,1,2] [--grid-budget 180] [--only a,b] [--write]
    python benchmarks/selftest_bench.py --from-json reports/selftest_bench.json --write

For every zoo member (attnverify/zoo): `attnverify selftest`'s run (caught or not, by which
property, examples and seconds to the first failing example, the shrunk case, the diagnosis) at each
seed, and the fixed grid of attnverify/zoo/grid.py (caught or not, the first failing configuration,
its index and seconds; a member not caught within the budget is reported with the share of its grid
that ran). Results go to reports/selftest_bench.json as they come (a killed run keeps what it had);
`--write` replaces the `## Selftest: zoo vs fixed grid` section of BENCHMARKS.md (other sections kept).
Timing follows benchmarks/detection.py: wall-clock seconds from the start of the member's run to the
first failing example (Hypothesis database off, fixed seeds).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SECTION = "## Selftest: zoo vs fixed grid"


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def _env() -> dict:
    import hypothesis
    import torch

    from importlib import metadata

    try:  # not `import triton`: it must not be imported before TRITON_INTERPRET is set
        tv = metadata.version("triton")
    except metadata.PackageNotFoundError:
        tv = "missing"
    return {"cores": os.cpu_count(), "torch": torch.__version__, "triton": tv, "hypothesis": hypothesis.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}


def run(seeds, grid_budget, only, out_path, skip_grid=False, skip_selftest=False):
    from attnverify.zoo import ZOO
    from attnverify.zoo.grid import run_grid
    from attnverify.zoo.selftest import run_member

    members = [m for m in ZOO if not only or m.name in only]
    data = {"env": _env(), "seeds": seeds, "grid_budget": grid_budget, "selftest": {}, "grid": {}, "load": []}
    if os.path.exists(out_path):  # resume: keep what a previous (killed) run measured
        with open(out_path) as f:
            old = json.load(f)
        data["selftest"] = old.get("selftest", {})
        data["grid"] = old.get("grid", {})
        data["load"] = old.get("load", [])

    def save():
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(data, f, indent=1, default=str)

    report_dir = os.path.join(ROOT, "reports", "selftest")
    if not skip_selftest:
        for seed in seeds:
            for m in members:
                key = f"{m.name}@{seed}"
                if key in data["selftest"]:
                    continue
                l0 = _load()
                r = run_member(m, profile="ci", seed=seed, report_dir=report_dir)
                d = r.to_dict()
                d["load_before"] = l0
                data["selftest"][key] = d
                data["load"].append(l0)
                fs = "MISSED" if not r.caught else f"{r.caught_by} #{r.first_examples} {r.first_seconds:.2f}s"
                print(f"[seed {seed}] {m.name:26s} {fs}  {r.case}", flush=True)
                save()
    if not skip_grid:
        for m in members:
            if m.name in data["grid"]:
                continue
            r = run_grid(m, budget_s=grid_budget)
            data["grid"][m.name] = r.to_dict()
            fs = (f"caught #{r.first_index}/{r.configs_total} {r.first_seconds:.1f}s {r.first_config}" if r.caught
                  else f"{r.status} {r.configs_run}/{r.configs_total} in {r.seconds:.0f}s")
            print(f"[grid] {m.name:26s} {fs}", flush=True)
            save()
    return data


def _md(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def render(data) -> str:
    from attnverify.zoo import ZOO

    seeds = data["seeds"]
    s0 = seeds[0]
    env = data["env"]
    loads = [x for x in data.get("load", []) if x == x]
    names = [m.name for m in ZOO if f"{m.name}@{s0}" in data["selftest"]]
    kinds = {m.name: m.kind for m in ZOO}
    lines = [
        SECTION, "",
        f"`python benchmarks/selftest_bench.py --seeds {','.join(map(str, seeds))} --grid-budget {data['grid_budget']:g} --write` "
        f"({env['date']}; {env['cores']} CPU cores shared with other jobs: 1-minute load average "
        f"{min(loads, default=float('nan')):.1f} to {max(loads, default=float('nan')):.1f} during the run; torch {env['torch']}, "
        f"triton {env['triton']} (interpreter), hypothesis {env['hypothesis']}, Python {env['python']}).",
        "",
        "Each zoo member (attnverify/zoo, `attnverify selftest --list`) is run through the ci profile the way "
        "`attnverify selftest` does: its expected properties first, then every other property it claims, stopping at "
        "the first failure; Hypothesis's database off. *First failure* = examples run and wall-clock seconds from the "
        "start of the member to its first failing example (a property that passed before it is included). The "
        "diagnosis comes from attnverify.diagnose on a re-check of the shrunk case (the property's own finding where a "
        "reference check cannot show the bug). The grid is attnverify/zoo/grid.py: flash-attn's `test_flash_attn_output` "
        "grid and criterion (max error <= 2x the same-dtype baseline's for out, 3x for grads) computed independently of "
        "attnverify, run in pytest's order until its first failing configuration (`-x`), "
        f"giving up after {data['grid_budget']:g} s per member.",
        "",
        f"### Per member (seed {s0})", "",
        "| member | kind | attnverify ci: caught by | first failure | shrunk case | diagnosis | grid: first failure | grid configs run / total |",
        "|---|---|---|---|---|---|---|---|",
    ]
    firsts, caught, g_caught, g_firsts = [], 0, 0, []
    for n in names:
        r = data["selftest"][f"{n}@{s0}"]
        g = data["grid"].get(n)
        if r["status"] == "caught":
            caught += 1
            firsts.append(r["first_seconds"])
            a = f"{r['caught_by']}" + ("" if r["expected"] else " (not an expected one)")
            f = f"#{r['first_examples']}, {r['first_seconds']:.2f} s"
        else:
            a, f = f"**{r['status']}** {r.get('reason', '')}", f"{r['total_examples']} examples, {r['total_seconds']:.1f} s"
        if g is None:
            gc, gr = "not run", ""
        elif g["caught"]:
            g_caught += 1
            g_firsts.append(g["first_seconds"])
            gc = f"#{g['first_index']}, {g['first_seconds']:.1f} s: {g['first_config']}"
            gr = f"{g['configs_run']} / {g['configs_total']}"
        else:
            gc = f"**{g['status']}**" + (" (budget spent)" if g["budget_exhausted"] else " (whole grid)")
            gr = f"{g['configs_run']} / {g['configs_total']} in {g['seconds']:.0f} s"
        lines.append(f"| {n} | {kinds.get(n, '')} | {_md(a)} | {f} | `{_md(r['case'])}` | {_md(r['diagnosis'])} | {_md(gc)} | {gr} |")
    med = statistics.median(firsts) if firsts else float("nan")
    mx = max(firsts, default=float("nan"))
    over = [n for n in names if data["selftest"][f"{n}@{s0}"]["status"] == "caught"
            and data["selftest"][f"{n}@{s0}"]["first_seconds"] > 60]
    gmed = statistics.median(g_firsts) if g_firsts else float("nan")
    lines += [
        "",
        f"attnverify (seed {s0}): caught {caught}/{len(names)}; median time to the first failure {med:.2f} s "
        f"(target < 10 s), slowest {mx:.2f} s (target <= 60 s)" + (f"; over 60 s: {', '.join(over)}" if over else "") + ".",
        f"Fixed grid: caught {g_caught}/{len(names)}; median time to its first failure {gmed:.1f} s among those caught.",
        "",
    ]
    if len(seeds) > 1:
        lines += [f"### Across seeds {', '.join(map(str, seeds))}", "",
                  "| member | caught | first failure: median s | slowest s | caught by |", "|---|---|---|---|---|"]
        all_first, worst_over = [], []
        for n in names:
            rs = [data["selftest"].get(f"{n}@{s}") for s in seeds]
            rs = [r for r in rs if r]
            c = [r for r in rs if r["status"] == "caught"]
            fs = [r["first_seconds"] for r in c]
            all_first += fs
            by = sorted({r["caught_by"] for r in c})
            lines.append(f"| {n} | {len(c)}/{len(rs)} | {statistics.median(fs) if fs else float('nan'):.2f} | "
                         f"{max(fs, default=float('nan')):.2f} | {', '.join(by)} |")
            if any(f > 60 for f in fs) or len(c) < len(rs):
                worst_over.append(n)
        lines += ["", f"Over all seeds: median time to the first failure {statistics.median(all_first):.2f} s; "
                  f"members missed or over 60 s at some seed: {', '.join(worst_over) or 'none'}.", ""]
    return "\n".join(lines)


def write_section(text: str) -> None:
    path = os.path.join(ROOT, "BENCHMARKS.md")
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    pat = re.compile(re.escape(SECTION) + r"\n.*?(?=\n## |\Z)", re.S)
    notes = ""
    m = pat.search(old)
    if m:  # keep the hand-written notes under "### Notes" of an earlier version of this section
        n = re.search(r"\n### Notes\n.*", m.group(0), re.S)
        notes = n.group(0) if n else ""
    new_sec = text.rstrip("\n") + ("\n" + notes.strip("\n") if notes else "")
    new = pat.sub(lambda _: new_sec.rstrip("\n"), old) if m else old.rstrip("\n") + "\n\n" + new_sec
    with open(path, "w") as f:
        f.write(new.rstrip("\n") + "\n")


def main(argv=None):
    warnings.filterwarnings("ignore")
    from attnverify.zoo.selftest import _interpreter_on

    _interpreter_on()
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--grid-budget", type=float, default=180.0)
    ap.add_argument("--only", default=None)
    ap.add_argument("--json", default=os.path.join(ROOT, "reports", "selftest_bench.json"))
    ap.add_argument("--from-json", default=None, help="render from saved results, run nothing")
    ap.add_argument("--no-grid", action="store_true")
    ap.add_argument("--no-selftest", action="store_true")
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args(argv)
    if a.from_json:
        with open(a.from_json) as f:
            data = json.load(f)
    else:
        seeds = [int(x) for x in a.seeds.split(",")]
        only = set(a.only.split(",")) if a.only else None
        data = run(seeds, a.grid_budget, only, a.json, skip_grid=a.no_grid, skip_selftest=a.no_selftest)
    text = render(data)
    print(text)
    if a.write:
        write_section(text)


if __name__ == "__main__":
    main()
