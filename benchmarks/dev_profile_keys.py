"""How many Triton kernels (compile keys) a whole profile of the bundled `triton` adapter launches, and why they differ.

    env -u TRITON_INTERPRET PYTHONPATH=$PWD python benchmarks/dev_profile_keys.py --max-examples 25 --seed 1 \
        [--props a,b] [--json keys.json] [--compare before.json] [--journal REPORT_DIR]

On a CPU, with the stand-in sm_90 driver (benchmarks/standin_driver.py: the launcher's CUDA tiles and switches,
CPU tensors) and nothing compiled: every launch goes through the real `triton.runtime.jit` binder, and Triton's
`jit_cache_hook` records the key it would compile under (its own string: each argument's type and value class,
each constexpr, warps, stages) and answers "skip". The draws and calls are the pre-warm's (attnverify/prewarm.py:
`drawn_examples`, then each distinct example judged by `warm_example` inside the hook's context), for every
property the adapter does not skip, with the run's profile, seed and example count. What it cannot see: draws that
depend on verdicts (Hypothesis's target phase, shrinking), which a real run makes differently (BENCHMARKS.md).

Prints the distinct keys per kernel and per property, and per kernel what makes its keys differ: for each argument
(and warps/stages) how many keys would be left if that argument alone were not part of the key, and the same for
classes of arguments (Triton's int specialisation: == 1 and divisibility by 16; pointer alignment; dtypes;
feature flags; head-dim padding; block sizes). --json writes the keys; --compare prints the counts of another run.
--journal REPORT_DIR: a real run's journal (`attnverify run --adapter triton ... --report DIR`): the keys of the cases
it drew against the pre-warm's, per property (what the pre-warm foresaw). The default configuration's kernels are
counted (a GPU's default: the specialised kernels until the perf gate times the twins, launch.NOSPEC_ON_GPU);
ATTNVERIFY_TRITON_VARIANT=nospec counts the nospec twins, `spec` the specialised ones, `aligned`, `rtmask` or
`aligned,rtmask` the nospec twins' variants (kernels/variants.py).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FLAGS = {"IS_CAUSAL", "CAUSAL_BR", "HAS_WINDOW", "HAS_SOFTCAP", "HAS_ALIBI", "IS_VARLEN", "HAS_SINKS", "HAS_DLSE",
         "HAS_DESCALE", "DESC", "HAS_LEFTPAD", "ROW_IS_BATCH", "DIRECT", "UPCAST", "IEEE"}
SWITCHES = {"FMA", "LAZY", "TMA", "WS", "LPT", "DESC_K", "DESC_V"}
PADDING = {"BLOCK_D", "BLOCK_DV", "EVEN_D", "EVEN_DV"}
BLOCKS = {"BLOCK_M", "BLOCK_N", "BLOCK_R", "BLOCK_S", "SPLIT_ALIGN", "num_warps", "num_stages"}


def parse_key(key: str, names: list) -> dict:
    """Triton's key string -> {argument: its part of the key, 'num_warps': .., 'num_stages': ..}."""
    opt = key.find("Options(")
    end = key.rfind("]", 0, opt if opt > 0 else len(key)) + 1 if key.startswith("[") else 0
    spec = ast.literal_eval(key[:end]) if end else []
    out = {n: tuple(s) if isinstance(s, (list, tuple)) else s for n, s in zip(names, spec)}
    opts = key[end:]
    for field in ("num_warps", "num_stages"):
        i = opts.find(field + "=")
        if i >= 0:
            out[field] = opts[i + len(field) + 1:].split(",")[0].split(")")[0]
    return out


def arg_class(name: str, part) -> str:
    """Which class of the key an argument's part belongs to."""
    if name in FLAGS:
        return "feature flags"
    if name in SWITCHES:
        return "speed switches (fma, tma, lpt, ...)"
    if name in PADDING:
        return "head-dim padding (BLOCK_D/DV, EVEN_D/DV)"
    if name in BLOCKS:
        return "tiles, warps, stages"
    if isinstance(part, tuple) and part and str(part[0]).startswith("*"):
        return "pointers: dtype and 16-byte alignment"
    if isinstance(part, tuple) and part and (part[0] in ("i32", "i64") or part == ("constexpr", 1)):
        return "ints: == 1, divisible by 16"
    return "other constexprs"


def collapse(keys: list, drop) -> int:
    """Distinct keys left when the parts for which drop(name, part) is true are left out."""
    return len({tuple(sorted((n, repr(p)) for n, p in k.items() if not drop(n, p))) for k in keys})


class Recorder:
    """jit_cache_hook: records (kernel, key) into the current bucket and skips the compile."""

    def __init__(self):
        self.bucket, self.names = set(), {}

    def __call__(self, *, key, fn, compile, **_):
        self.names[fn.name] = list(compile["signature"])
        self.bucket.add((fn.name, key))
        return True


def journal_draws(report_dir: str) -> dict:
    """{property: [drawn, ...]} of a run's journal (its case_start records: what the run really drew)."""
    from attnverify.journal import last_run

    out: dict = {}
    for r in last_run(report_dir):
        if r.get("event") == "case_start" and r.get("adapter") == "triton":
            out.setdefault(r["property"], []).append(r["drawn"])
    return out


def count(props_arg: str, profile: str, seed: int, max_examples: int, draws: dict = None) -> dict:
    import standin_driver

    standin_driver.install(cuda_tiles=True)  # idempotent
    from triton import knobs

    from attnverify.adapters.base import Adapter
    from attnverify.adapters.registry import get
    from attnverify.prewarm import drawn_examples, warm_example
    from attnverify.properties import PROPERTIES, get_property

    rec = Recorder()
    knobs.runtime.jit_cache_hook = rec
    real = get("triton")

    @contextlib.contextmanager
    def recording(scratch):
        yield None

    adapter = Adapter(name="triton", fn=real.fn, claims=real.claims, refuses=real.refuses, prewarm=recording)
    props = [get_property(p) for p in props_arg.split(",")] if props_arg else list(PROPERTIES)
    per_prop, names, errors = {}, {}, []
    scratch = tempfile.mkdtemp(prefix="keys_")
    for prop in props:
        if prop.why_skipped(adapter) is not None:
            continue
        t0 = time.perf_counter()
        rec.bucket = set()
        if draws is not None and prop.name not in draws:
            continue
        drawn = draws[prop.name] if draws is not None else drawn_examples(
            prop, adapter, profile=profile, seed=seed, max_examples=max_examples, device="cpu")
        seen = set()
        for ex in drawn:
            k = json.dumps(ex, sort_keys=True, default=str)
            if k in seen:
                continue
            seen.add(k)
            err = warm_example(adapter, prop, ex, scratch)[2]
            if err:
                errors.append(err)
        per_prop[prop.name] = sorted(rec.bucket)
        print(f"- {prop.name}: {len(drawn)} examples ({len(seen)} distinct), {len(rec.bucket)} keys, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    names.update(rec.names)
    return {"profile": profile, "seed": seed, "max_examples": max_examples, "per_property": per_prop,
            "names": names, "errors": errors[:20], "n_errors": len(errors), "adapter": adapter}


def report(res: dict, other: dict = None) -> None:
    per_prop, names = res["per_property"], res["names"]
    allkeys = sorted({tuple(x) for v in per_prop.values() for x in v})
    kernels = sorted({n for n, _ in allkeys})
    okeys = {tuple(x) for v in (other or {}).get("per_property", {}).values() for x in v}
    print(f"\n{len(allkeys)} distinct kernels (keys) over {len(per_prop)} properties "
          f"({res['profile']} profile, seed {res['seed']}, --max-examples {res['max_examples']}); "
          f"{res['n_errors']} examples raised{': ' + res['errors'][0] if res['errors'] else ''}\n")
    print("| kernel | keys |" + (" other run |" if other else ""))
    print("|---|---|" + ("---|" if other else ""))
    for kn in kernels:
        print(f"| {kn} | {sum(1 for n, _ in allkeys if n == kn)} |"
              + (f" {sum(1 for n, _ in okeys if n == kn)} |" if other else ""))
    print(f"| all | {len(allkeys)} |" + (f" {len(okeys)} |" if other else ""))
    print("\n| property | keys | of them first met here (in this order) |" + (" other run |" if other else ""))
    print("|---|---|---|" + ("---|" if other else ""))
    met = set()
    for p, v in per_prop.items():
        ks = {tuple(x) for x in v}
        ov = len((other or {}).get("per_property", {}).get(p, []))
        print(f"| {p} | {len(ks)} | {len(ks - met)} |" + (f" {ov} |" if other else ""))
        met |= ks
    for kn in kernels:
        keys = [parse_key(k, names.get(kn, [])) for n, k in allkeys if n == kn]
        classes, singles = {}, []
        for name in keys[0]:
            vals = {repr(k.get(name)) for k in keys}
            if len(vals) > 1:
                singles.append((name, len(vals), collapse(keys, lambda n, p, name=name: n == name)))
            classes.setdefault(arg_class(name, keys[0][name]), None)
        print(f"\n{kn}: {len(keys)} keys. Left if one argument were not in the key (its distinct values):")
        print(", ".join(f"{n} {left} ({nv})" for n, nv, left in sorted(singles, key=lambda x: x[2])))
        print("Left if a class of arguments were not in the key: " + ", ".join(
            f"{c} {collapse(keys, lambda n, p, c=c: arg_class(n, p) == c)}" for c in sorted(classes)))


def coverage(a) -> int:
    """The keys of a real run's draws against the pre-warm's draws and keys, per property."""
    from attnverify.prewarm import drawn_examples
    from attnverify.properties import get_property

    draws = journal_draws(a.journal)
    props = ",".join(draws)
    run = count(props, a.profile, a.seed, a.max_examples, draws=draws)
    pre = count(props, a.profile, a.seed, a.max_examples)
    print("\n| property | run: examples drawn | of them not drawn by the pre-warm | run: keys | of them pre-warmed |")
    print("|---|---|---|---|---|")
    tot = [0, 0, 0, 0]
    for p in run["per_property"]:
        mine = {json.dumps(x, sort_keys=True, default=str) for x in drawn_examples(
            get_property(p), run["adapter"], profile=a.profile, seed=a.seed, max_examples=a.max_examples, device="cpu")}
        rk, pk = {tuple(x) for x in run["per_property"][p]}, {tuple(x) for x in pre["per_property"].get(p, [])}
        row = [len(draws[p]), sum(json.dumps(d, sort_keys=True, default=str) not in mine for d in draws[p]),
               len(rk), len(rk & pk)]
        tot = [x + y for x, y in zip(tot, row)]
        print(f"| {p} | {row[0]} | {row[1]} | {row[2]} | {row[3]} |")
    print(f"| all | {tot[0]} | {tot[1]} | {tot[2]} | {tot[3]} ({100 * tot[3] / max(tot[2], 1):.0f}%) |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--props", default="", help="comma list (default: every property the adapter does not skip)")
    ap.add_argument("--profile", default="dev")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-examples", type=int, default=25)
    ap.add_argument("--json", default="", help="write the keys here")
    ap.add_argument("--compare", default="", help="a --json file of another run: its counts side by side")
    ap.add_argument("--journal", default="", help="a report folder of a real run (`attnverify run --adapter triton "
                    "... --report DIR`): the keys of the cases it drew, and how many of them the pre-warm's draws have")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("dev_profile_keys: unset TRITON_INTERPRET (the stand-in driver computes the JIT's real keys)")
    t0 = time.perf_counter()
    if a.journal:
        return coverage(a)
    res = count(a.props, a.profile, a.seed, a.max_examples)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["variant"] = os.environ.get("ATTNVERIFY_TRITON_VARIANT", "")
    res.pop("adapter")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f)
    other = json.load(open(a.compare)) if a.compare else None
    report(res, other)
    print(f"\n{res['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
