"""Render calibration JSONs (benchmarks/calibrate_tolerances.py --json) as markdown tables.

    python benchmarks/tolerance_tables.py cal_cpu.json cal_gpu_*.json > table.md
    python benchmarks/tolerance_tables.py --merge cpu_per_case_2026-12-04/cal_*_seed1*.json   (shards -> one row)

Per adapter/dtype: cases, passed/failed (of which NaN/Inf where the reference is finite)/error, false
positives (failures that are neither NaN/Inf nor a finding the adapter declares, marked "known" by
benchmarks/calibration_findings.py: a bound too tight for a correct kernel), the worst error / bound
over every output, norm- and element-wise, and for each output the median and the worst of (error / bound).
A value below 1 passes; the worst value says how much room a correct implementation left. With --merge,
every file's rows of one adapter/dtype (shards of other seeds) become one row, recomputed from the cases'
ratios the JSONs keep ("values"); the seeds are listed.
"""
import json
import sys

OUTS = ("out", "lse", "dq", "dk", "dv")


def _only_nonfinite(message: str) -> bool:
    """Every mismatching output of this failure has NaN/Inf where the reference is finite."""
    blocks = message.split(": MISMATCH")[1:]
    return bool(blocks) and all("non-finite value(s) where the reference differs" in b.split("MISMATCH")[0] for b in blocks)


def _stats(xs):
    xs = sorted(xs)
    return {"n": len(xs), "median": xs[len(xs) // 2], "max": xs[-1]} if xs else None


def rows(paths, merge=False):
    """key -> row dict (device, torch, seeds, statuses, failures, per-metric {median, max})."""
    out = {}
    for p in paths:
        d = json.load(open(p))
        dev = d.get("gpu") or d.get("device")
        for key, s in d["summary"].items():
            rk = key if merge else (key, p)
            r = out.setdefault(rk, {"key": key, "dev": dev, "torch": d["torch"], "seeds": [], "status": {},
                                    "failures": [], "values": {}, "summary": {}})
            r["seeds"].append(d.get("seed"))
            for m, v in s.items():
                if m.startswith("status_"):
                    r["status"][m] = r["status"].get(m, 0) + v
            r["failures"] += [f for f in d.get("failures", []) if f"{f['adapter']}/{f['dtype']}" == key]
            vals = d.get("values", {}).get(key)
            if vals is not None:
                for m, xs in vals.items():
                    r["values"].setdefault(m, []).extend(xs)
            elif merge and len(r["seeds"]) > 1:
                raise SystemExit(f"{p}: no per-case values for {key}; cannot merge it with another file")
            else:
                r["summary"] = s
    for r in out.values():
        r["metric"] = {m: _stats(xs) for m, xs in r["values"].items()} if r["values"] else r["summary"]
    return out


def main(argv):
    merge = "--merge" in argv
    paths = [a for a in argv if a != "--merge"]
    cols = ["adapter/dtype", "device", "seeds", "cases", "passed", "failed", "error", "false positives", "worst"]
    print("| " + " | ".join(cols) + " | " + " | ".join(f"{o} norm med/max" for o in OUTS) + " | "
          + " | ".join(f"{o} elem max" for o in OUTS) + " |")
    print("|" + "---|" * (len(cols) + 2 * len(OUTS)))
    for _, r in sorted(rows(paths, merge).items(), key=lambda kv: kv[1]["key"]):
        st, met = r["status"], r["metric"]
        n = sum(st.values())
        # a NaN/Inf where the reference is finite is a finding about the implementation, not a
        # question of tolerance: count those apart
        failed = [f for f in r["failures"] if f["status"] == "failed"]
        known = sum(1 for f in failed if f.get("known"))
        failed = [f for f in failed if not f.get("known")]  # declared findings (calibration_findings.py): semantics
        nonfinite = sum(1 for f in failed if _only_nonfinite(f["message"]))
        notes = [f"{known} known"] * bool(known) + [f"{nonfinite} NaN/Inf"] * bool(nonfinite)
        fcell = str(st.get("status_failed", 0)) + (f" ({', '.join(notes)})" if notes else "")
        ratios = [m["max"] for k, m in met.items() if m and k.endswith("_vs_bound")]
        cells = [r["key"], f"{r['dev']} (torch {r['torch']})", ",".join(str(s) for s in r["seeds"]), str(n),
                 str(st.get("status_passed", 0)), fcell, str(st.get("status_error", 0)),
                 str(len(failed) - nonfinite), f"{max(ratios):.2f}" if ratios else "-"]
        for o in OUTS:
            m = met.get(f"{o}_norm_vs_bound")
            cells.append(f"{m['median']:.2f} / {m['max']:.2f}" if m else "-")
        for o in OUTS:
            m = met.get(f"{o}_elem_vs_bound")
            cells.append(f"{m['max']:.2f}" if m else "-")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
