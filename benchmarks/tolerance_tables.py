"""Render calibration JSONs (benchmarks/calibrate_tolerances.py --json) as markdown tables.

    python benchmarks/tolerance_tables.py cal_cpu.json cal_gpu_*.json > table.md

Per adapter/dtype: cases, passed/failed/error, and for each output the median and the worst of
(error / bound), norm-wise and element-wise. A value below 1 passes; the worst value says how much
room a correct implementation left.
"""
import json
import sys

OUTS = ("out", "lse", "dq", "dk", "dv")


def main(paths):
    print("| adapter/dtype | device | cases | passed | failed | error | " +
          " | ".join(f"{o} norm med/max" for o in OUTS) + " | " + " | ".join(f"{o} elem max" for o in OUTS) + " |")
    print("|" + "---|" * (6 + 2 * len(OUTS)))
    for p in paths:
        d = json.load(open(p))
        dev = d.get("gpu") or d.get("device")
        for key, s in sorted(d["summary"].items()):
            n = sum(v for m, v in s.items() if m.startswith("status_"))
            cells = [key, f"{dev} (torch {d['torch']})", str(n), str(s.get("status_passed", 0)),
                     str(s.get("status_failed", 0)), str(s.get("status_error", 0))]
            for o in OUTS:
                m = s.get(f"{o}_norm_vs_bound")
                cells.append(f"{m['median']:.2f} / {m['max']:.2f}" if m else "-")
            for o in OUTS:
                m = s.get(f"{o}_elem_vs_bound")
                cells.append(f"{m['max']:.2f}" if m else "-")
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
