"""Tile sweep of the bundled Triton kernel on a GPU, with a baseline copy of the kernels beside it.

    PYTHONPATH=. python benchmarks/tune_triton.py --dims 64,128,256 --causal 0,1 --baseline .baseline/attnverify/kernels

For each head dim and causal setting (bf16 by default, N = 8192, B*N = 16k tokens, H*D = 2048, as the
bench) it times the forward candidates (do_bench median) and the backward candidates, each backward
kernel (dK/dV, dQ) on its own from the profiler's kernel times, so the best dK/dV and the best dQ
configuration are chosen independently. `--baseline DIR` loads another copy of `attnverify/kernels`
(say the commit before a change) under another name and times its default forward and
forward+backward the same way, for a before/after in one process.

Compiling dominates a sweep: every candidate is first compiled (and run once, at batch 1 with the same
specialisation) by a pool of processes that fill Triton's on-disk cache; the timed pass then loads them.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

# (BLOCK_M, BLOCK_N, warps, stages). Forward tiles stay <= 64: the adapter claims tiles (64, 64) and
# promises that other configurations use tiles that divide them.
FWD = {
    "small": [(64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 2), (64, 32, 4, 4), (64, 64, 8, 3)],
    "large": [(64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (64, 32, 8, 3), (64, 32, 4, 3)],
}
# dK/dV: BLOCK_M queries per step, BLOCK_N keys per program; dQ: BLOCK_M queries per program, BLOCK_N keys per step
DKDV = {
    "small": [(64, 128, 8, 3), (32, 128, 4, 3), (32, 128, 4, 4), (64, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 4),
              (128, 128, 8, 2)],
    "large": [(32, 64, 4, 1), (32, 64, 4, 2), (32, 64, 8, 2), (16, 64, 4, 2), (32, 32, 4, 2), (64, 64, 8, 1),
              (16, 32, 4, 3)],
}
DQ = {
    "small": [(128, 64, 8, 3), (128, 32, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 4),
              (128, 128, 8, 2)],
    "large": [(64, 32, 4, 1), (64, 32, 4, 2), (64, 32, 8, 2), (32, 32, 4, 2), (64, 64, 8, 1), (32, 64, 4, 2),
              (64, 16, 4, 3)],
}


def parse_configs(text: str) -> list:
    """'64x128w8s3,32x64w4s2' -> [(64, 128, 8, 3), (32, 64, 4, 2)]."""
    out = []
    for item in text.split(","):
        tiles, rest = item.strip().split("w")
        bm, bn = tiles.split("x")
        w, st = rest.split("s")
        out.append((int(bm), int(bn), int(w), int(st)))
    return out


def load_kernels(path: str, name: str):
    """Import the kernels package at `path` as top-level package `name` (its modules import relatively)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return importlib.import_module(name + ".launch")


def _setup(dtype_name, d, causal, n, batch):
    import torch

    from attnverify.spec import Spec

    dtype = getattr(torch, dtype_name)
    h = 2048 // d
    g = torch.Generator(device="cuda").manual_seed(d * 7 + causal)
    q, k, v, do = (torch.randn(batch, h, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    return q, k, v, do, Spec(causal="top_left" if causal else "none")


def _config(launch, fwd=None, dkdv=None, dq=None):
    base = launch.Config(*(fwd or (64, 64, 4, 3)))
    if dkdv is None:
        return base
    from dataclasses import replace

    return replace(base, bwd_block_m=dkdv[0], bwd_block_n=dkdv[1], bwd_warps=dkdv[2], bwd_stages=dkdv[3],
                   dq_block_m=dq[0], dq_block_n=dq[1], dq_warps=dq[2], dq_stages=dq[3])


def _run_once(job):
    """Compile (and run once at batch 1) one candidate; returns (job, error or None)."""
    variant, dtype_name, d, causal, n, fwd, dkdv, dq, baseline = job
    try:
        launch = load_kernels(baseline, "base_kernels") if variant == "baseline" else \
            importlib.import_module("attnverify.kernels.launch")
        q, k, v, do, spec = _setup(dtype_name, d, causal, n, 1)
        if variant == "baseline":
            out, lse, p = launch.forward(q, k, v, spec)
            launch.backward(q, k, v, out, lse, do, None, spec, prep=p)
        elif dkdv is None:
            launch.forward(q, k, v, spec, config=_config(launch, fwd))
        else:
            out, lse, p = launch.forward(q, k, v, spec)
            launch.backward(q, k, v, out, lse, do, None, spec, prep=p, config=_config(launch, None, dkdv, dq))
        import torch

        torch.cuda.synchronize()
        return job, None
    except Exception as e:  # out of shared memory or registers: a skipped candidate
        return job, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def kernel_times(fn, iters=10):
    """Mean device microseconds per call of each kernel that `fn` launches (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t:
            out[e.key] = out.get(e.key, 0.0) + t / iters
    return out


def _pick(times, name):
    return sum(t for k, t in times.items() if name in k)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--jobs", type=int, default=12, help="processes compiling candidates ahead")
    ap.add_argument("--baseline", default=None, help="another copy of attnverify/kernels to time beside")
    ap.add_argument("--json", default=None)
    ap.add_argument("--fwd", default=None, help="forward candidates instead of the built-in lists, e.g. 64x64w4s3,64x32w4s2")
    ap.add_argument("--dkdv", default=None, help="dK/dV candidates (pairs with --dq, same length)")
    ap.add_argument("--dq", default=None, help="dQ candidates")
    ap.add_argument("--ab", type=int, default=0, help="then time baseline and new defaults alternately, N rounds")
    a = ap.parse_args(argv)
    for name in ("fwd", "dkdv", "dq"):
        if getattr(a, name):
            table = {"fwd": FWD, "dkdv": DKDV, "dq": DQ}[name]
            table["small"] = table["large"] = parse_configs(getattr(a, name))
    import torch

    if not torch.cuda.is_available():
        print("tune_triton: needs a CUDA GPU")
        return 2
    from triton.testing import do_bench

    dims = [int(x) for x in a.dims.split(",")]
    causals = [int(x) for x in a.causal.split(",")]
    jobs = []
    for d in dims:
        size = "small" if d <= 128 else "large"
        for c in causals:
            jobs += [("new", a.dtype, d, c, a.n, f, None, None, a.baseline) for f in FWD[size]]
            jobs += [("new", a.dtype, d, c, a.n, None, x, y, a.baseline) for x, y in zip(DKDV[size], DQ[size])]
            if a.baseline:
                jobs.append(("baseline", a.dtype, d, c, a.n, None, None, None, a.baseline))
    t0 = time.time()
    import multiprocessing as mp

    with ProcessPoolExecutor(a.jobs, mp_context=mp.get_context("spawn")) as ex:
        errors = {j: e for j, e in ex.map(_run_once, jobs) if e}
    print(f"# compiled {len(jobs)} candidates in {time.time() - t0:.0f} s ({len(errors)} failed)", flush=True)

    new = importlib.import_module("attnverify.kernels.launch")
    base = load_kernels(a.baseline, "base_kernels") if a.baseline else None
    results = []
    for d in dims:
        size = "small" if d <= 128 else "large"
        for c in causals:
            q, k, v, do, spec = _setup(a.dtype, d, c, a.n, 16384 // a.n)
            b, h = q.shape[0], q.shape[1]
            fl = 4.0 * b * h * a.n * a.n * d / (2 if c else 1)
            row = {"d": d, "causal": c, "fwd": [], "dkdv": [], "dq": []}
            for f in FWD[size]:
                key = ("new", a.dtype, d, c, a.n, f, None, None, a.baseline)
                if key in errors:
                    row["fwd"].append((f, None, errors[key]))
                    continue
                ms = do_bench(lambda: new.forward(q, k, v, spec, config=_config(new, f)), warmup=10, rep=40,
                              return_mode="median")
                row["fwd"].append((f, fl / ms * 1e-9, None))
            out, lse, p = new.forward(q, k, v, spec)
            for x, y in zip(DKDV[size], DQ[size]):
                key = ("new", a.dtype, d, c, a.n, None, x, y, a.baseline)
                if key in errors:
                    row["dkdv"].append((x, None, errors[key]))
                    row["dq"].append((y, None, errors[key]))
                    continue
                cfg = _config(new, None, x, y)
                kt = kernel_times(lambda: new.backward(q, k, v, out, lse, do, None, spec, prep=p, config=cfg))
                row["dkdv"].append((x, _pick(kt, "_bwd_dkdv"), None))
                row["dq"].append((y, _pick(kt, "_bwd_dq"), None))
                row["pre_us"] = _pick(kt, "_bwd_preprocess")
            if base is not None:
                def fb(launch=base):
                    o, lse_, pp = launch.forward(q, k, v, spec)
                    return launch.backward(q, k, v, o, lse_, do, None, spec, prep=pp)
                fwd_ms = do_bench(lambda: base.forward(q, k, v, spec), warmup=10, rep=40, return_mode="median")
                fb_ms = do_bench(fb, warmup=10, rep=40, return_mode="median")
                row["baseline"] = {"fwd": fl / fwd_ms * 1e-9, "fwd+bwd": 3.5 * fl / fb_ms * 1e-9}
                kt = kernel_times(fb)
                row["baseline"]["kernels_us"] = {n: _pick(kt, n) for n in ("_attn_fwd", "_bwd_preprocess",
                                                                            "_bwd_dkdv", "_bwd_dq")}
            # the default configuration of the kernels under test, timed like the baseline
            def fb_new():
                o, lse_, pp = new.forward(q, k, v, spec)
                return new.backward(q, k, v, o, lse_, do, None, spec, prep=pp)
            row["default"] = {"config": str(new.default_config(d, q.dtype, "cuda")),
                              "fwd": fl / do_bench(lambda: new.forward(q, k, v, spec), warmup=10, rep=40,
                                                   return_mode="median") * 1e-9,
                              "fwd+bwd": 3.5 * fl / do_bench(fb_new, warmup=10, rep=40, return_mode="median") * 1e-9}
            if base is not None and a.ab:
                row["ab"] = []
                for _ in range(a.ab):
                    for tag, mod in (("baseline", base), ("new", new)):
                        ms = do_bench(lambda: mod.forward(q, k, v, spec), warmup=10, rep=60, return_mode="median")
                        row["ab"].append((tag, round(fl / ms * 1e-9)))
            results.append(row)
            _print_row(row, fl)
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"errors": {str(k): v for k, v in errors.items()}, "results": results}, f, indent=1, default=str)
    return 0


def _print_row(row, fl):
    d, c = row["d"], row["causal"]
    print(f"\n## D={d} causal={c}")
    if "baseline" in row:
        bl = row["baseline"]
        print(f"baseline: fwd {bl['fwd']:.0f} TFLOP/s, fwd+bwd {bl['fwd+bwd']:.0f}; kernels us "
              + ", ".join(f"{k} {v:.0f}" for k, v in bl["kernels_us"].items()))
    if row.get("ab"):
        print("fwd A/B (TFLOP/s, alternating): " + ", ".join(f"{t} {x}" for t, x in row["ab"]))
    df = row["default"]
    print(f"default {df['config']}: fwd {df['fwd']:.0f} TFLOP/s, fwd+bwd {df['fwd+bwd']:.0f}")
    print("fwd: " + "; ".join(f"{c_} {t:.0f}" if t else f"{c_} ({e[:40]})" for c_, t, e in row["fwd"]))
    print("dkdv us: " + "; ".join(f"{c_} {t:.0f}" if t else f"{c_} ({e[:40]})" for c_, t, e in row["dkdv"]))
    print("dq us: " + "; ".join(f"{c_} {t:.0f}" if t else f"{c_} ({e[:40]})" for c_, t, e in row["dq"]))
    def ok(xs):
        return [x for x in xs if x[1]]
    if ok(row["dkdv"]) and ok(row["dq"]) and ok(row["fwd"]):
        bk, bq = min(ok(row["dkdv"]), key=lambda x: x[1]), min(ok(row["dq"]), key=lambda x: x[1])
        bf = max(ok(row["fwd"]), key=lambda x: x[1])
        bwd_us = bk[1] + bq[1] + row.get("pre_us", 0.0)
        fwd_us = fl / bf[1] * 1e-6
        print(f"best: fwd {bf[0]} {bf[1]:.0f}; dkdv {bk[0]} + dq {bq[0]} -> bwd {2.5 * fl / bwd_us * 1e-6:.0f} "
              f"TFLOP/s, est. fwd+bwd {3.5 * fl / (fwd_us + bwd_us) * 1e-6:.0f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
