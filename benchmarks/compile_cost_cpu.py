"""What a Triton compile of the bundled kernels costs, cold and from the disk cache, on a machine without a GPU.

    env -u TRITON_INTERPRET PYTHONPATH=$PWD python benchmarks/compile_cost_cpu.py [--only NAME,...]

Each configuration below is launched through `launch.forward` and `launch.backward` (the launcher's own
arguments, tiles and specialisations for CUDA tensors) with the stand-in driver of benchmarks/standin_driver.py:
the real `triton.runtime.jit` path compiles for sm_90 with Triton's bundled ptxas and never launches. It prints,
per kernel (the forward, and the backward's preprocess, dK/dV and dQ), the wall time of the launch call:
first with an empty TRITON_CACHE_DIR (a cold compile), then in a fresh process on the same cache (a disk-cache
hit: the process's in-memory cache is empty, as a new pytest-xdist worker's is). Issue 25, BENCHMARKS.md
"Fuzzer throughput".
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

# name -> (dtype, D, spec keywords): plain, causal, the D = 256 kernel with TMA + FMA + LPT, fp32, varlen + window
CONFIGS = {
    "bf16_d64_causal": ("bfloat16", 64, {"causal": "bottom_right"}),
    "fp16_d128": ("float16", 128, {}),
    "bf16_d256_causal": ("bfloat16", 256, {"causal": "bottom_right"}),
    "fp32_d64_window": ("float32", 64, {"window": (32, 0)}),
    "bf16_d80_varlen_softcap": ("bfloat16", 80, {"varlen": True, "softcap": 30.0}),
}


def _spec(kw, lq, lk):
    import torch

    from attnverify.spec import Spec

    args = {"causal": kw.get("causal", "none")}
    if "window" in kw:
        args["window"] = kw["window"]
    if "softcap" in kw:
        args["softcap"] = kw["softcap"]
    if kw.get("varlen"):
        args.update(cu_seqlens_q=torch.tensor([0, 100, lq], dtype=torch.int32),
                    cu_seqlens_k=torch.tensor([0, 90, lk], dtype=torch.int32), max_seqlen_q=lq - 100,
                    max_seqlen_k=lk - 90)
    return Spec(**args)


def measure(names) -> dict:
    """{config: {kernel: seconds}} of the launches of each configuration's forward and backward, in this process."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import standin_driver
    import torch
    from triton.runtime.jit import JITFunction

    standin_driver.install(cuda_tiles=True)
    from attnverify.kernels import launch

    times: dict = {}
    run = JITFunction.run

    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return run(self, *a, **kw)
        finally:
            times[self.fn.__name__] = times.get(self.fn.__name__, 0.0) + time.perf_counter() - t0

    JITFunction.run = timed
    out = {}
    for name in names:
        dt, d, kw = CONFIGS[name]
        dtype = getattr(torch, dt)
        b, h, lq, lk = (1 if kw.get("varlen") else 2), 4, 300, 300
        spec = _spec(kw, lq, lk)
        q, k, v = (torch.randn(b, h, n, d).to(dtype) for n in (lq, lk, lk))
        times.clear()
        t0 = time.perf_counter()
        o, lse, p = launch.forward(q, k, v, spec)
        launch.backward(q, k, v, o, lse, torch.zeros_like(o), torch.zeros_like(lse), spec, prep=p)
        out[name] = {**{kn: round(s, 3) for kn, s in times.items()}, "total": round(time.perf_counter() - t0, 3)}
        print(json.dumps({name: out[name]}), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma list of configurations (default: all)")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child: measure and print JSON
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("compile_cost_cpu: unset TRITON_INTERPRET (it compiles, it does not interpret)")
    names = [x for x in a.only.split(",") if x] or list(CONFIGS)
    if a.measure:
        measure(names)
        return 0
    cache = tempfile.mkdtemp(prefix="compile_cost_")
    env = {**os.environ, "TRITON_CACHE_DIR": cache}
    rows = {}
    for phase in ("cold", "disk-cache hit"):  # each in a fresh process: the in-memory cache starts empty
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, __file__, "--measure", "--only", ",".join(names)], env=env,
                             capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if res.returncode:
            sys.exit(f"compile_cost_cpu: the {phase} process failed:\n{res.stderr[-3000:]}")
        for line in res.stdout.splitlines():
            for cfg, per in json.loads(line).items():
                rows.setdefault(cfg, {})[phase] = per
        print(f"{phase}: process wall {wall:.1f} s (imports included)", flush=True)
    kernels = ("_attn_fwd", "_bwd_preprocess", "_bwd_dkdv", "_bwd_dq")
    print("\n| configuration | " + " | ".join(f"{k} cold / hit (s)" for k in kernels) + " | all four cold / hit (s) |")
    print("|---|" + "---|" * (len(kernels) + 1))
    for cfg, ph in rows.items():
        c, h = ph.get("cold", {}), ph.get("disk-cache hit", {})
        print(f"| {cfg} | " + " | ".join(f"{c.get(k, 0):.2f} / {h.get(k, 0):.3f}" for k in kernels)
              + f" | {c.get('total', 0):.2f} / {h.get('total', 0):.3f} |")
    print(f"\n({sum(len(f) for _, _, f in os.walk(cache))} files in the cache)")
    shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
