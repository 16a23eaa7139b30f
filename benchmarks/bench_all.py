"""Everything issue 8 asks to show, in one command: the `attnverify bench` tables and the GPU properties.

    python benchmarks/bench_all.py --out DIR            # on an H200: ~5-8 minutes
    python benchmarks/bench_all.py --out DIR --quick    # fewer lengths / examples

Writes DIR/BENCHMARKS.md (also printed) and DIR/bench-*.json:
1. `attnverify bench` for the adapters this machine runs (GPU: sdpa-flash, sdpa-efficient, sdpa-cudnn, triton,
   sdpa-math; CPU: naive, sdpa-math, sdpa-flash), non-causal and causal, forward and forward+backward, with
   the profiler proof of which kernel ran and a correctness check per adapter;
2. memory_scaling measured per adapter claiming memory="linear" (peak extra memory at N, 2N, 4N, the
   quadratic part, the N x N payload avoided) -- and sdpa-math measured the same way as the quadratic contrast;
3. non_default_stream and cuda_graph_replay run through the property driver (ci profile) per GPU adapter.
On a machine without CUDA the GPU parts are listed as skipped, with the reason.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def _bench(args, out_dir, tag, t_end):
    from attnverify import bench

    ns = bench.build_parser().parse_args(args + ["--budget-s", str(max(1.0, t_end - time.time()))])
    res = bench.run_bench(ns)
    with open(os.path.join(out_dir, f"bench-{tag}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return bench.to_markdown(res), res


def _memory_section(adapters, t_end):
    from attnverify.adapters.base import Adapter
    from attnverify.properties import get_property

    prop = get_property("memory_scaling")
    lines = ["| adapter | claims | mode | causal | dtype, B x H, D | peak extra MiB at N / 2N / 4N | growth 2N->4N | "
             "quadratic part at 4N MiB | one N x N score matrix at 4N MiB | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for a in adapters:
        if a.unavailable_reason():
            lines.append(f"| {a.name} | {a.claims.memory} | - | - | - | - | - | - | - | unavailable: {a.unavailable_reason()} |")
            continue
        contrast = a.claims.memory != "linear"
        probe = a
        if contrast:  # measure it as if it claimed linear: the quadratic contrast the check must reject
            import dataclasses

            probe = Adapter(name=a.name, fn=a.fn, claims=dataclasses.replace(a.claims, memory="linear"),
                            refuses=a.refuses)
        for cfg in prop._configs(probe, "auto"):
            if time.time() > t_end:
                lines.append(f"| {a.name} | {a.claims.memory} | {cfg['mode']} | {cfg['causal']} | | | | | | time budget spent |")
                continue
            try:
                r = prop.run_example(probe, cfg)
            except Exception as e:  # noqa: BLE001
                lines.append(f"| {a.name} | {a.claims.memory} | {cfg['mode']} | {cfg['causal']} | | | | | | error: {e} |")
                continue
            m = (r.records[0].get("memory") if r.records else None)
            if not m:
                lines.append(f"| {a.name} | {a.claims.memory} | {cfg['mode']} | {cfg['causal']} | | | | | | "
                             f"{r.status}: {r.message.splitlines()[0] if r.message else ''} |")
                continue
            peaks = " / ".join(f"{v / 2**20:.1f}" for _, v in sorted(m["peaks"].items(), key=lambda kv: int(kv[0])))
            verdict = ("linear: passed" if m["passed"] else "QUADRATIC") + (" (contrast: claims quadratic)" if contrast else "")
            lines.append(f"| {a.name} | {a.claims.memory} | {cfg['mode']} | {cfg['causal']} | {cfg['dtype']}, "
                         f"{cfg['batch']} x {cfg['heads']}, {cfg['head_dim']} | {peaks} (N={cfg['n']}) | "
                         f"{m['growth_2n_to_4n']:.2f} | {m['quadratic_bytes_at_4n'] / 2**20:.1f} | "
                         f"{m['payload_bytes_at_4n'] / 2**20:.1f} | {verdict} |")
    return "\n".join(lines)


def _property_section(adapters, props, max_examples, t_end):
    from attnverify.properties import get_property
    from attnverify.properties.driver import PropertySkipped, run_property

    lines = ["| adapter | " + " | ".join(props) + " |", "|---|" + "---|" * len(props)]
    for a in adapters:
        cells = []
        for pname in props:
            p = get_property(pname)
            why = a.unavailable_reason() or p.skip_reason(a)
            if why:
                cells.append(f"skipped: {why}")
                continue
            if time.time() > t_end:
                cells.append("not run: time budget spent")
                continue
            t0 = time.time()
            try:
                run = run_property(p, a, profile="ci", seed=0, max_examples=max_examples, database=None,
                                   report_dir="reports/bench_all", shrink_budget_s=10.0)
                st = ", ".join(f"{k} {v}" for k, v in sorted(run.statuses.items()))
                cells.append(f"held ({st}; {time.time() - t0:.0f} s)")
            except PropertySkipped as e:
                cells.append(f"skipped: {e}")
            except AssertionError as e:
                first = [x for x in str(e).splitlines() if x.strip()][:4]
                cells.append("**FAILED**: " + " / ".join(first).replace("|", "\\|")[:400])
            except Exception as e:  # noqa: BLE001
                cells.append(f"error: {type(e).__name__}: {str(e)[:200]}")
        lines.append(f"| {a.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for BENCHMARKS.md and the JSON files")
    ap.add_argument("--quick", action="store_true", help="fewer sequence lengths and examples")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting new work after this many seconds")
    ap.add_argument("--adapter", action="append", help="restrict to these adapters (default: the built-ins for this device)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    t_end = t0 + a.budget_s
    cuda = torch.cuda.is_available()
    from attnverify.adapters.registry import get, resolve

    if a.adapter:
        adapters = resolve(a.adapter)
    elif cuda:
        adapters = [get(n) for n in ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "triton", "sdpa-math")]
    else:
        adapters = [get(n) for n in ("naive", "sdpa-math", "sdpa-flash")]
    names = ",".join(x.name for x in adapters)
    if cuda:
        seqlens = "1024,4096" if a.quick else "1024,2048,4096,8192"
        common = ["--adapter", names, "--dtype", "bf16", "--head-dim", "128", "--seqlens", seqlens, "--backward"]
    else:
        seqlens = "128,256" if a.quick else "256,512"
        common = ["--adapter", names, "--dtype", "fp32", "--head-dim", "64", "--seqlens", seqlens, "--backward",
                  "--rep", "5"]
    parts = [f"# attnverify benchmarks ({time.strftime('%Y-%m-%d %H:%M')}, "
             f"{torch.cuda.get_device_name() if cuda else 'CPU only'})", "",
             f"`python benchmarks/bench_all.py --out {a.out}{' --quick' if a.quick else ''}`", ""]
    failed = False
    for causal in (False, True):
        tag = "causal" if causal else "noncausal"
        parts.append(f"## Speed and memory, {'causal' if causal else 'no mask'}\n")
        try:
            md, res = _bench(common + (["--causal"] if causal else []), a.out, tag, t_end)
            failed |= bool(res["failed"])
            parts.append(md)
        except Exception:  # noqa: BLE001
            parts.append("bench failed:\n```\n" + traceback.format_exc()[-3000:] + "\n```")
            failed = True
        parts.append("")
    parts.append("## memory_scaling (peak extra memory at N, 2N, 4N; no N x N part for memory=\"linear\")\n")
    parts.append("Measured with " + ("torch.cuda.max_memory_allocated" if cuda else
                 "the profiler's allocation events (CPU)") + " after a warm-up call; a fit a + bN + cN^2 through the "
                 "three points gives the quadratic part, which must stay under 1/8 of one score matrix. Adapters "
                 "claiming quadratic memory are measured the same way as the contrast.\n")
    try:
        parts.append(_memory_section(adapters, t_end))
    except Exception:  # noqa: BLE001
        parts.append("```\n" + traceback.format_exc()[-3000:] + "\n```")
    parts.append("")
    parts.append("## GPU-only properties (ci profile, seed 0)\n")
    if not cuda:
        parts.append("skipped: no CUDA device on this machine (non_default_stream, cuda_graph_replay need a GPU)")
    else:
        parts.append(_property_section(adapters, ["non_default_stream", "cuda_graph_replay"], 4 if a.quick else 10, t_end))
    parts.append("")
    parts.append(f"({time.time() - t0:.0f} s in all)")
    md = "\n".join(parts)
    with open(os.path.join(a.out, "BENCHMARKS.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
