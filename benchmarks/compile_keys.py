"""How many Triton compiles the fuzzer's cases ask of the bundled kernel, with and without `Config.nospec`.

    export PYTHONPATH=$PWD TRITON_INTERPRET=1
    python benchmarks/compile_keys.py --profile dev --examples 200 --seed 0

Runs on a CPU and compiles nothing: it draws cases as `attnverify run` does (the triton adapter's claims,
the profile's limits, forward and backward), calls the launchers with each kernel replaced by a recorder,
and computes the key Triton's JIT would compile under (every constexpr's value, each int argument's value
class: equal to 1, divisible by 16, other; each pointer's dtype and 16-byte alignment; warps and stages;
an argument in the kernel's do_not_specialize list gives only its type). It prints, per kernel, the number
of distinct keys among the examples for the default kernels and for the nospec twins. A compile on the
H200 costs about a second (issue 25), so the difference is the saving per run, before properties that
derive cases of their own (GQA repeats, tile partitions) add theirs.
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys

KERNELS = {  # launcher attribute -> (module, do_not_specialize of the kernel, of its nospec twin)
    "_attn_fwd": ("flash_fwd", ("HEAD_DIM", "HEAD_DIM_V"), "NOSPEC"),
    "_bwd_preprocess": ("flash_bwd", ("HEAD_DIM_V",), "PRE_NOSPEC"),
    "_bwd_dkdv": ("flash_bwd", ("HEAD_DIM", "HEAD_DIM_V"), "DKDV_NOSPEC"),
    "_bwd_dq": ("flash_bwd", ("HEAD_DIM", "HEAD_DIM_V"), "DQ_NOSPEC"),
}


def value_class(x, specialize: bool):
    """The part of Triton's key one runtime argument contributes (triton.runtime.jit's specialisation)."""
    import torch

    if x is None:
        return ("none",)
    if isinstance(x, bool):
        return ("u1",)
    if isinstance(x, int):
        ty = "i32" if -2 ** 31 <= x < 2 ** 31 else "i64"
        if not specialize:
            return (ty,)
        if x == 1:
            return ("constexpr", 1)
        return (ty, "D" if x % 16 == 0 else "")
    if isinstance(x, float):
        return ("fp32",)
    if isinstance(x, torch.Tensor):
        return ("*" + str(x.dtype), "D" if x.data_ptr() % 16 == 0 else "")
    return (type(x).__name__, tuple(getattr(x, "block_shape", ()) or ()))


class Recorder:
    """Stands in for a @triton.jit kernel: records the key of each launch, runs nothing."""

    def __init__(self, real, nospec: tuple, keys: set, one_align_flag: bool = False):
        self.sig = inspect.signature(real.fn)
        self.nospec, self.keys, self.one_flag = set(nospec), keys, one_align_flag

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            extra = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
            bound = self.sig.bind(*args, **kwargs)
            bound.apply_defaults()
            key = []
            strides = [(n, x) for n, x in bound.arguments.items()  # the strides of tiles (not LSE, dLSE, slopes)
                       if n.startswith("stride_") and not n.startswith(("stride_l", "stride_dl", "stride_a"))]
            for name, x in bound.arguments.items():
                ann = self.sig.parameters[name].annotation
                if "constexpr" in str(ann):
                    key.append((name, repr(x)))
                elif self.one_flag and name.startswith("stride_"):
                    key.append((name, value_class(x, False)))
                else:
                    key.append((name, value_class(x, name not in self.nospec)))
            if self.one_flag:  # what a kernel taking one ALIGNED constexpr (and tl.multiple_of) would see
                key.append(("ALIGNED", all(x % 8 == 0 for n, x in strides if not n.endswith(("k", "ok", "dok")))
                            and all(x == 1 for n, x in strides if n.endswith("k"))))
            self.keys.add((tuple(key), tuple(sorted(extra.items()))))
        return launch


def draw_recipes(profile: str, n: int, seed: int) -> list:
    from hypothesis import HealthCheck, given, settings, seed as hseed

    from attnverify.adapters.registry import get
    from attnverify.strategies import attention_cases

    out = []
    strat = attention_cases(adapter=get("triton"), profile=profile, backward=True)

    @hseed(seed)
    @settings(max_examples=n, database=None, deadline=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(strat)
    def collect(recipe):
        out.append(recipe)

    collect()
    return out


def count(recipes, nospec: bool, one_align_flag: bool = False) -> dict:
    from dataclasses import replace

    import torch

    import attnverify as av
    from attnverify.kernels import flash_bwd, flash_fwd, launch

    mods = {"flash_fwd": flash_fwd, "flash_bwd": flash_bwd}
    keys = {name: set() for name in KERNELS}
    saved = {}
    for name, (mod, dns, twin) in KERNELS.items():
        m = mods[mod]
        for attr, names in ((name, dns), (name + "_nospec", dns + getattr(m, twin))):
            saved[(m, attr)] = getattr(m, attr)
            setattr(m, attr, Recorder(saved[(m, attr)], names, keys[name], one_align_flag))
    skipped = 0
    try:
        for r in recipes:
            case = av.build_case(r)
            q, k, v = case.q, case.k, case.v
            try:
                p = launch.prepare(q, k, v, case.spec)
            except (NotImplementedError, ValueError):
                skipped += 1
                continue
            cfg = replace(launch.default_config(p.d, q.dtype, "cuda", p.dv), nospec=nospec)
            out, lse, p = launch.forward(q, k, v, case.spec, prep=p, config=cfg)
            d_out = torch.zeros_like(out)
            d_lse = torch.zeros_like(lse) if case.spec.return_lse else None
            launch.backward(q, k, v, out, lse, d_out, d_lse, case.spec, prep=p, config=cfg)
    finally:
        for (m, attr), real in saved.items():
            setattr(m, attr, real)
    return keys, skipped


def varying(keys: set) -> dict:
    """argument -> number of distinct values it takes among `keys` (those that take more than one)."""
    vals = {}
    for key, extra in keys:
        for name, x in key + extra:
            vals.setdefault(name, set()).add(x)
    return {name: len(v) for name, v in vals.items() if len(v) > 1}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="dev")
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("compile_keys: set TRITON_INTERPRET=1 (it runs on the CPU and compiles nothing)")
        return 2
    recipes = draw_recipes(a.profile, a.examples, a.seed)
    base, skipped = count(recipes, False)
    twin, _ = count(recipes, True)
    flag, _ = count(recipes, True, True)
    print(f"{len(recipes)} cases drawn ({a.profile} profile, seed {a.seed}); {skipped} refused by the launcher")
    print("| kernel | distinct keys, default | nospec | nospec + strides as one ALIGNED flag (not built) |")
    print("|---|---|---|---|")
    for name in KERNELS:
        print(f"| {name} | {len(base[name])} | {len(twin[name])} | {len(flag[name])} |")
    print(f"| all | {sum(len(x) for x in base.values())} | {sum(len(x) for x in twin.values())} | "
          f"{sum(len(x) for x in flag.values())} |")
    for name in ("_attn_fwd", "_bwd_dkdv"):
        print(f"{name}, nospec: arguments whose value class varies (distinct values): "
              + ", ".join(f"{n} {c}" for n, c in sorted(varying(twin[name]).items(), key=lambda x: -x[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
