"""Coverage of `--attn-prewarm` for the bundled triton adapter: of the kernel keys a real run launches, how many
the pre-warm compiles.

    export PYTHONPATH=$PWD TRITON_INTERPRET=1
    python benchmarks/prewarm_coverage.py --props forward_matches_reference,gqa_equals_repeated_kv --examples 8

1. The run: each property runs against the `triton` adapter under the Triton interpreter, as `attnverify run`
   judges it (run_property, the property's own runner: real verdicts, so targeting and any shrinking happen as
   in a run), with each of the four kernels (forward, backward preprocess, dK/dV, dQ) wrapped to record the
   key of every launch before it runs.
2. The pre-warm: the same properties, seed, profile and example count through the pre-warm's own steps
   (attnverify.prewarm: drawn_examples, then warm_example: each example judged inside the hook's context) with
   the hook's context replaced by one in which the kernels are recorders that run nothing (the interpreter's
   tiles; the verdicts thrown away, as the pre-warm does).
Keys are computed as benchmarks/compile_keys.py computes them (what triton.runtime.jit specialises on); both
sides use the interpreter's tiles, so they compare like for like. Prints per kernel: the run's distinct keys,
how many of them the pre-warm had, and the keys the pre-warm made that the run did not launch.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def install(keys: dict, tee: bool) -> dict:
    """Wrap the four kernels: record each launch's key in keys[kernel]; with `tee`, run the real kernel too."""
    from compile_keys import KERNELS, Recorder

    from attnverify.kernels import flash_bwd, flash_fwd

    mods = {"flash_fwd": flash_fwd, "flash_bwd": flash_bwd}
    saved = {}
    for name, (mod, dns, _) in KERNELS.items():
        m = mods[mod]
        real = getattr(m, name)
        rec = Recorder(real, dns, keys.setdefault(name, set()))

        class Tee:
            def __init__(self, real, rec):
                self.real, self.rec = real, rec

            def __getitem__(self, grid):
                def launch(*a, **kw):
                    self.rec[grid](*a, **dict(kw))
                    if tee:
                        return self.real[grid](*a, **kw)
                return launch

        saved[(m, name)] = real
        setattr(m, name, Tee(real, rec))
    return saved


def restore(saved: dict) -> None:
    for (m, name), real in saved.items():
        setattr(m, name, real)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--props", default="forward_matches_reference,gradients_match_reference,gqa_equals_repeated_kv")
    ap.add_argument("--examples", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile", default="dev")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("prewarm_coverage: set TRITON_INTERPRET=1 (the run is judged under the interpreter)")
    from hypothesis.database import InMemoryExampleDatabase

    from attnverify.adapters.base import Adapter
    from attnverify.adapters.registry import get
    from attnverify.prewarm import drawn_examples, warm_example
    from attnverify.properties import get_property
    from attnverify.properties.driver import PropertyFailed, PropertySkipped, run_property

    triton = get("triton")
    props = [get_property(p) for p in a.props.split(",") if p]
    run_keys: dict = {}
    pre_keys: dict = {}
    print(f"seed {a.seed}, {a.profile} profile, {a.examples} examples per property, load {os.getloadavg()[0]:.1f}")
    for prop in props:
        t0 = time.perf_counter()
        mine: dict = {}
        saved = install(mine, tee=True)
        verdict = "passed"
        try:
            # an empty example database, as a run in a fresh folder has (its Pareto front changes what is drawn)
            run = run_property(prop, triton, profile=a.profile, seed=a.seed, max_examples=a.examples, device="cpu",
                               database=InMemoryExampleDatabase())
            n = run.examples
        except PropertySkipped as e:
            verdict, n = f"skipped ({e})", 0
        except PropertyFailed as e:
            verdict, n = f"failed ({str(e).splitlines()[0][:80]})", -1
        finally:
            restore(saved)
        t1 = time.perf_counter()
        pre: dict = {}

        @contextlib.contextmanager
        def recording(scratch, pre=pre):  # the pre-warm's context with recorders for compiles: nothing runs
            saved = install(pre, tee=False)
            try:
                yield None
            finally:
                restore(saved)

        hook = Adapter(name="triton", fn=triton.fn, claims=triton.claims, refuses=triton.refuses, prewarm=recording)
        drawn = drawn_examples(prop, hook, profile=a.profile, seed=a.seed, max_examples=a.examples, device="cpu")
        errors = [e for ex in drawn for e in [warm_example(hook, prop, ex, "")[2]] if e]
        for name in set(mine) | set(pre):
            run_keys.setdefault(name, set()).update(mine.get(name, ()))
            pre_keys.setdefault(name, set()).update(pre.get(name, ()))
        got = sum(len(mine[k] & pre.get(k, set())) for k in mine)
        total = sum(len(v) for v in mine.values())
        print(f"- {prop.name}: run {verdict}, {n} examples, {total} distinct keys, {time.perf_counter() - t0:.0f} s "
              f"(pre-warm side {time.perf_counter() - t1:.1f} s, {len(drawn)} examples"
              f"{', errors: ' + errors[0] if errors else ''}); pre-warm had {got} of them "
              f"({100 * got / max(total, 1):.0f}%), and {sum(len(pre[k] - mine.get(k, set())) for k in pre)} more",
              flush=True)
    print("\n| kernel | keys the run launched | of them pre-warmed | pre-warmed, not launched |")
    print("|---|---|---|---|")
    tot = [0, 0, 0]
    for name in sorted(run_keys):
        r, p = run_keys[name], pre_keys.get(name, set())
        row = [len(r), len(r & p), len(p - r)]
        tot = [x + y for x, y in zip(tot, row)]
        print(f"| {name} | {row[0]} | {row[1]} | {row[2]} |")
    print(f"| all | {tot[0]} | {tot[1]} ({100 * tot[1] / max(tot[0], 1):.0f}%) | {tot[2]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
