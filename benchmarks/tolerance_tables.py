"""Render calibration JSONs (benchmarks/calibrate_tolerances.py --json) as markdown tables.

    python benchmarks/tolerance_tables.py cal_cpu.json cal_gpu_*.json > table.md

Per adapter/dtype: cases, passed/failed (of which NaN/Inf where the reference is finite)/error, and for each output the median and the worst of
(error / bound), norm-wise and element-wise. A value below 1 passes; the worst value says how much
room a correct implementation left.
"""
import json
import sys

OUTS = ("out", "lse", "dq", "dk", "dv")


def _only_nonfinite(message: str) -> bool:
    """Every mismatching output of this failure has NaN/Inf where the reference is finite."""
    blocks = message.split(": MISMATCH")[1:]
    return bool(blocks) and all("non-finite value(s) where the reference differs" in b.split("MISMATCH")[0] for b in blocks)


def main(paths):
    print("| adapter/dtype | device | cases | passed | failed | error | " +
          " | ".join(f"{o} norm med/max" for o in OUTS) + " | " + " | ".join(f"{o} elem max" for o in OUTS) + " |")
    print("|" + "---|" * (6 + 2 * len(OUTS)))
    for p in paths:
        d = json.load(open(p))
        dev = d.get("gpu") or d.get("device")
        for key, s in sorted(d["summary"].items()):
            n = sum(v for m, v in s.items() if m.startswith("status_"))
            failed = s.get("status_failed", 0)
            # a NaN/Inf where the reference is finite is a finding about the implementation, not a
            # question of tolerance: count those apart
            nonfinite = sum(1 for f in d.get("failures", []) if f"{f['adapter']}/{f['dtype']}" == key
                            and f["status"] == "failed" and _only_nonfinite(f["message"]))
            fcell = f"{failed} ({nonfinite} NaN/Inf)" if nonfinite else str(failed)
            cells = [key, f"{dev} (torch {d['torch']})", str(n), str(s.get("status_passed", 0)),
                     fcell, str(s.get("status_error", 0))]
            for o in OUTS:
                m = s.get(f"{o}_norm_vs_bound")
                cells.append(f"{m['median']:.2f} / {m['max']:.2f}" if m else "-")
            for o in OUTS:
                m = s.get(f"{o}_elem_vs_bound")
                cells.append(f"{m['max']:.2f}" if m else "-")
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
