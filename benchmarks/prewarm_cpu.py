"""`--attn-prewarm` on a machine without a GPU: the bundled triton adapter's pre-warm through the real Triton JIT.

    env -u TRITON_INTERPRET PYTHONPATH=$PWD python benchmarks/prewarm_cpu.py --props gradients_match_reference \
        --examples 6 --seed 1

With the stand-in driver (benchmarks/standin_driver.py: sm_90, CUDA tiles, compiles and never launches) and the
bundled `triton` adapter's own function, claims and prewarm hook (its availability check, which asks for a GPU or
the interpreter, left out), on CPU cases, each step in a fresh process on its own fresh TRITON_CACHE_DIR:

1. the run alone: the properties' own calls (run_property, each example judged by the property, its verdict
   ignored: the kernels do not run here) on an empty cache: the kernels it compiles (cache misses);
2. the pre-warm serially (`run_prewarm(workers=1)`), then with a pool of 2 on another empty cache: wall time,
   the compiles each made (the claims deduplicate keys across processes: each key once);
3. the run again, on the cache the pool of 2 left: its cache misses (the keys the pre-warm did not cover).

A cache miss is a new kernel in TRITON_CACHE_DIR (a folder holding a .cubin). Prints a JSON line per step and a
summary. The --step options run one step in this process (the test suite's tests/test_prewarm.py uses them).
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

HERE = os.path.dirname(os.path.abspath(__file__))


def kernels_in(cache: str) -> set:
    """The compiled kernels in a Triton cache folder: the folders holding a .cubin."""
    out = set()
    for root, _, files in os.walk(cache):
        if any(f.endswith(".cubin") for f in files):
            out.add(os.path.relpath(root, cache))
    return out


def standin_triton():
    """The bundled triton adapter's function, claims, refusals and prewarm hook, available on this CPU."""
    sys.path.insert(0, HERE)
    import standin_driver

    standin_driver.install(cuda_tiles=True)
    from attnverify.adapters.base import Adapter
    from attnverify.adapters.registry import get

    t = get("triton")
    return Adapter(name="triton", fn=t.fn, claims=t.claims, refuses=t.refuses, prewarm=t.prewarm,
                   description="the bundled triton adapter, compiled for sm_90 by a stand-in driver")


def step(which: str, props, examples: int, seed: int, workers: int) -> dict:
    from attnverify.properties import get_property
    from attnverify.properties.base import ExampleResult

    adapter = standin_triton()
    cache = os.environ["TRITON_CACHE_DIR"]
    before = kernels_in(cache)
    t0 = time.perf_counter()
    out: dict = {"step": which}
    if which == "run":
        from attnverify.properties.driver import run_property

        def judged_verdict_ignored(prop, adapter, drawn):  # every call the property makes, no shrinking
            prop.run_example(adapter, drawn)
            return ExampleResult(True, status="passed")

        for name in props:
            run_property(get_property(name), adapter, profile="dev", seed=seed, max_examples=examples, device="cpu",
                         runner=judged_verdict_ignored, database=None, max_bugs=1)
    else:
        from attnverify.prewarm import run_prewarm

        res = run_prewarm([(adapter, get_property(n)) for n in props], profile="dev", seed=seed,
                          max_examples=examples, device="cpu", workers=workers)
        out.update({k: v for k, v in res.items() if k != "per_property"})
    out["wall"] = round(time.perf_counter() - t0, 2)
    new = kernels_in(cache) - before
    out.update(new_kernels=len(new), kernels=sorted(kernels_in(cache)))
    return out


def _child(which: str, cache: str, a) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=cache, PYTHONPATH=os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, __file__, "--step", which, "--props", a.props, "--examples", str(a.examples),
                          "--seed", str(a.seed), "--workers", str(a.workers)], env=env, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"prewarm_cpu: step {which} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--props", default="forward_matches_reference,gradients_match_reference")
    ap.add_argument("--examples", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--step", choices=("run", "prewarm"), help="run one step in this process (TRITON_CACHE_DIR set)")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("prewarm_cpu: unset TRITON_INTERPRET (it compiles through a stand-in driver, it does not interpret)")
    props = [p for p in a.props.split(",") if p]
    if a.step:
        print(json.dumps(step(a.step, props, a.examples, a.seed, a.workers)), flush=True)
        return 0
    caches = [tempfile.mkdtemp(prefix="prewarm_cpu_") for _ in range(3)]
    try:
        cold = _child("run", caches[0], a)
        serial = _child("prewarm", caches[1], argparse.Namespace(**{**vars(a), "workers": 1}))
        pool = _child("prewarm", caches[2], a)
        after = _child("run", caches[2], a)
    finally:
        for c in caches:
            shutil.rmtree(c, ignore_errors=True)
    for r in (cold, serial, pool, after):
        print(json.dumps({k: v for k, v in r.items() if k != "kernels"}), flush=True)
    run_keys = set(cold["kernels"])
    print(f"\nproperties {', '.join(props)}, {a.examples} examples each, seed {a.seed}, dev profile, load {os.getloadavg()[0]:.1f}")
    print(f"- the run alone on an empty cache: {cold['new_kernels']} compiles, {cold['wall']:.1f} s")
    print(f"- pre-warm, 1 process: {serial['compiles']} compiles, {serial['wall']:.1f} s; "
          f"{a.workers} processes: {pool['compiles']} compiles, {pool['wall']:.1f} s "
          f"({serial['wall'] / max(pool['wall'], 1e-9):.2f}x)")
    print(f"- the run after the pre-warm: {after['new_kernels']} compiles (cache misses), {after['wall']:.1f} s; "
          f"the pre-warm compiled {len(run_keys & set(pool['kernels']))} of the run's {len(run_keys)} kernels and "
          f"{len(set(pool['kernels']) - run_keys)} it did not launch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
