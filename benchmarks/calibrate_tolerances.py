"""Calibrate and audit the tolerances: run correct implementations over many random and
adversarial cases and record, per dtype and output, how close their errors come to the bound.

    python benchmarks/calibrate_tolerances.py --adapters naive,sdpa-math,sdpa-flash --n 1000 --json out.json
    python benchmarks/calibrate_tolerances.py --adapters fp8-online,naive --dtypes float8_e4m3fn,float8_e5m2 --forward-only

For every case: each output's relative L2 error in units of u, the worst element's error in units
of u * (|ref| + s), the ratio to the same-dtype baseline, and whether `check` passed (a failure of a
correct implementation is a false positive, unless the adapter declares it as a known finding:
benchmarks/calibration_findings.py). docs/tolerances.md holds the resulting tables.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
from collections import defaultdict

import torch

import attnverify as av
from attnverify.adapters import registry
from attnverify.check import unclaimed
from attnverify.tolerances import unit_roundoff
from attnverify.zoo import fp8_online_adapter
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when loaded by file path (a test)
from calibration_findings import declared  # noqa: E402

SEQ = [1, 2, 5, 15, 16, 17, 31, 33, 63, 64, 65, 97, 127, 128, 129, 192, 255, 257]
HEAD = [16, 32, 40, 59, 64, 72, 80, 96, 111, 128, 160, 192, 256]


def random_recipe(rng: random.Random, adapter, dtype: str, device: str, big: bool,
                  max_len: int = 0, max_head_dim: int = 0, head_dims=None) -> av.CaseRecipe:
    c = adapter.claims
    seq = SEQ + ([384, 511, 512, 1023, 1024, 2048] if big else [])
    seq = [s for s in seq if not max_len or s <= max_len]
    for _ in range(200):
        hkv = rng.choice([1, 2])
        g = rng.choice([1, 1, 2, 4]) if c.gqa else 1
        dims = [d for d in (head_dims or HEAD) if c.head_dim_ok(d) and (not max_head_dim or d <= max_head_dim)]
        if not dims:
            raise SystemExit(f"--head-dims/--max-head-dim leave no head dim that {adapter.name} claims: "
                             f"give some of {[d for d in range(8, 257, 8) if c.head_dim_ok(d)][:12]}...")
        d = rng.choice(dims)
        dv = rng.choice([d, d, rng.choice(dims)]) if c.dv_ne_d else d
        r = av.CaseRecipe(
            batch=rng.choice([1, 2]), heads_q=hkv * g, heads_kv=hkv, len_q=rng.choice(seq), len_k=rng.choice(seq),
            head_dim=d, head_dim_v=dv, dtype=dtype, device=device, seed=rng.randrange(2**31),
        )
        _draw_values(rng, r)
        if rng.random() < 0.3:
            r.scale = rng.choice([0.05, 0.3, 1.0, 2.0])
        modes = list(c.causal)
        r.causal = rng.choice(modes)
        if c.window and rng.random() < 0.25:
            r.window = (rng.choice([-1, 0, 3, 17]), rng.choice([-1, 0, 5]))
        if c.softcap and rng.random() < 0.25:
            r.softcap = rng.choice([5.0, 30.0])
        if c.alibi and rng.random() < 0.2:
            r.alibi = True
        if c.attn_mask and rng.random() < 0.3:
            r.mask = rng.choice(["bool_random", "bool_padding", "float_random"])
            r.mask_shape = (r.batch if rng.random() < 0.5 else 1, 1 if rng.random() < 0.5 else r.heads_q,
                            1 if rng.random() < 0.3 else r.len_q, r.len_k)
            if c.fully_masked != "unsupported" and r.mask != "float_random" and rng.random() < 0.5 and r.mask_shape[2] != 1:
                r.masked_rows = (rng.randrange(r.len_q),)
        if c.lse and rng.random() < 0.5:
            r.return_lse = True
        if dtype.startswith("float8"):
            _fp8_parts(rng, r, c)
        case = av.build_case(r)
        if unclaimed(adapter, case) is None and (c.fully_masked != "unsupported" or not _has_fully_masked(case)):
            return r
    raise RuntimeError(f"could not draw a claimed case for {adapter.name} {dtype}")


_VALUE_FIELDS = ("q_std", "k_std", "row_shift", "late_from", "late_boost", "equal_scores", "v_mean")


def _draw_values(rng: random.Random, r: av.CaseRecipe) -> None:
    """The case's values, not its shape: adversarial magnitudes (drawn afresh per case in --shape-pool mode)."""
    kind = rng.random()
    if kind < 0.15:  # extreme logits: std of the scores around 10 or more
        r.q_std = r.k_std = rng.choice([3.0, 4.0, 6.0])
    elif kind < 0.25:
        r.row_shift = rng.choice([-1000.0, 1000.0])
    elif kind < 0.35 and r.len_k > 16:
        r.late_from, r.late_boost = rng.randrange(r.len_k // 2, r.len_k), rng.choice([4.0, 8.0])
    elif kind < 0.40:
        r.equal_scores = True
    elif kind < 0.45:
        r.v_mean = rng.choice([-30.0, 5.0, 100.0])


def dominant_key_family(rng: random.Random, r: av.CaseRecipe) -> av.CaseRecipe:
    """--family dominant-key: the plain draw with one key dominating every row (one of the first keys, a gap of
    3-8) and, mostly, a key offset: the values of the backward precision corpus entries
    (attnverify/strategies/_corpus.py), over every shape and feature, for correct kernels (no false positive)."""
    if r.len_k:
        r.dominant_key = rng.choice([0, 0, 1, min(15, r.len_k - 1)])
        r.dominant_gap = rng.choice([3.0, 4.0, 5.0, 6.0, 8.0])
        r.key_offset = rng.choice([0.0, 1.0, 4.0, 8.0])
    return r


def pooled_recipe(rng: random.Random, adapter, pool: list) -> av.CaseRecipe:
    """--shape-pool: one of the pool's recipes (shape, features, mask kind, scale: what a compiled kernel
    specialises on) with a fresh seed and fresh adversarial values, so compiled kernels are reused while
    the data of every case is new."""
    defaults = av.CaseRecipe()
    for _ in range(200):
        r = dataclasses.replace(rng.choice(pool), seed=rng.randrange(2**31))
        for f in _VALUE_FIELDS:
            setattr(r, f, getattr(defaults, f))
        _draw_values(rng, r)
        case = av.build_case(r)
        c = adapter.claims
        if unclaimed(adapter, case) is None and (c.fully_masked != "unsupported" or not _has_fully_masked(case)):
            return r
    raise RuntimeError(f"could not draw a claimed case for {adapter.name} from the shape pool")


def _fp8_parts(rng: random.Random, r: av.CaseRecipe, c) -> None:
    """fp8 (attnverify/fp8.py): descales of every kind, V column-major, and the softmax shapes that stress P's
    rounding to fp8: one key dominating every row by a gap, a sink dominating (where claimed)."""
    from attnverify.fp8 import DESCALE_KINDS

    if c.descales:
        r.descales = rng.choice(DESCALE_KINDS + (None,))
    if rng.random() < 0.3:
        r.layout = "v_colmajor"
    if rng.random() < 0.3 and r.len_k:
        r.dominant_key, r.dominant_gap = rng.randrange(r.len_k), rng.choice([2.0, 4.0, 6.0, 8.0, 12.0, 30.0])
    if c.sinks and rng.random() < 0.3:
        r.sinks = {"kind": rng.choice(["normal", "dominant", "mixed"]), "level": rng.choice([0.5, 2.0, 8.0]),
                   "seed": rng.randrange(2**16)}


def _has_fully_masked(case) -> bool:
    from attnverify.reference import reference_forward

    return bool(torch.isneginf(reference_forward(case.q, case.k, case.v, case.spec).lse).any())


def _dump(args, stats, fails, t0, worst=None):
    summary = {}
    values = {key: {m: [float(f"{x:.4g}") for x in xs] for m, xs in d.items() if not m.startswith("status_")}
              for key, d in stats.items()}
    for key, d in stats.items():
        summary[key] = {}
        for metric, xs in d.items():
            if metric.startswith("status_"):
                summary[key][metric] = len(xs)
                continue
            xs = sorted(xs)
            summary[key][metric] = {
                "n": len(xs), "median": xs[len(xs) // 2], "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))], "max": xs[-1],
            }
    out = {"torch": torch.__version__, "device": args.device if args.device != "auto" else
           ("cuda" if torch.cuda.is_available() else "cpu"),
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "n_per_combo": args.n, "forward_only": bool(getattr(args, "forward_only", False)), "summary": summary,
           "seed": args.seed, "family": getattr(args, "family", "plain"), "shape_pool": args.shape_pool,
           "max_len": args.max_len, "max_head_dim": args.max_head_dim,
           "head_dims": getattr(args, "head_dims", ""), "worst": worst,
           "failures": fails, "seconds": time.time() - t0, "values": values}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--adapters", default="naive,sdpa-math,sdpa-flash")
    ap.add_argument("--dtypes", default="float32,float16,bfloat16")
    ap.add_argument("--n", type=int, default=200, help="cases per adapter and dtype")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--big", action="store_true", help="also draw lengths up to 2048")
    ap.add_argument("--json", default=None)
    ap.add_argument("--forward-only", action="store_true", help="compare out and LSE only (no backward): more cases per second")
    ap.add_argument("--max-len", type=int, default=0,
                    help="draw only sequence lengths up to this (the Triton interpreter's cost grows with Lq x Lk)")
    ap.add_argument("--shape-pool", type=int, default=0,
                    help="draw this many shapes (with features, mask kind, scale) per adapter and dtype and give every "
                         "case one of them with fresh data: compiled kernels (Triton, flex, jax on a GPU) are reused")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (several runs sharing a machine: 1)")
    ap.add_argument("--max-head-dim", type=int, default=0, help="draw only head dims up to this")
    ap.add_argument("--head-dims", default="",
                    help="comma list of head dims to draw instead of the default set, e.g. to leave out the head dims of "
                         "a declared finding (flash-attn4's F18 backward: 8,16,40,48,72,80,104,112) -- recorded in --json")
    ap.add_argument("--family", choices=("plain", "dominant-key"), default="plain",
                    help="dominant-key: every case gets the backward precision corpus entries' values (dominant_key_family)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop drawing after this many seconds and record the cases done (a killed run records none)")
    args = ap.parse_args(argv)
    try:
        head_dims = [int(x) for x in args.head_dims.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--head-dims: give a comma list of ints, e.g. 32,64,128; got {args.head_dims!r}")
    torch.set_num_threads(args.threads)  # several calibrations share a machine; oversubscription costs 10x
    stats = defaultdict(lambda: defaultdict(list))
    fails = []
    worst = {}  # adapter/dtype -> the case with the largest error / bound (any output, norm- or element-wise)
    t0 = time.time()
    for name in args.adapters.split(","):
        # fp8-online: the FA3-like tiled fp8 kernel (attnverify.zoo.fp8_online_adapter), the fp8 calibration's subject
        a = fp8_online_adapter() if name == "fp8-online" else registry.get(name)
        why = a.unavailable_reason()
        if why:
            print(f"{name}: unavailable ({why})", file=sys.stderr)
            continue
        dev = a.run_device(args.device)
        for dt in args.dtypes.split(","):
            if dt not in a.claims.dtypes:
                continue
            rng = random.Random(f"{args.seed}-{name}-{dt}")
            u = {o: unit_roundoff(dt, o) for o in ("out", "lse", "dq", "dk", "dv")}
            pool = [random_recipe(rng, a, dt, dev, args.big, args.max_len, args.max_head_dim, head_dims)
                    for _ in range(args.shape_pool)]
            for i in range(args.n):
                if args.budget_s and time.time() - t0 > args.budget_s:
                    print(f"{name}/{dt}: budget spent after {i} cases", file=sys.stderr)
                    break
                rec = (pooled_recipe(rng, a, pool) if pool else
                       random_recipe(rng, a, dt, dev, args.big, args.max_len, args.max_head_dim, head_dims))
                if args.family == "dominant-key":
                    rec = dominant_key_family(rng, rec)
                res = av.check(a, av.build_case(rec), keep_tensors=False, backward=False if args.forward_only else None)
                key = f"{name}/{dt}"
                stats[key]["status_" + res.status].append(1)
                known = None
                if res.status != "passed":
                    # a declared known finding (semantics, narrowed by its match) is counted apart and its ratios
                    # kept out of the tolerance statistics (benchmarks/calibration_findings.py)
                    known = declared(a.known_finding, res.case.describe(), res.message()) if res.status == "failed" else None
                    fails.append({"adapter": name, "dtype": dt, "status": res.status, "case": res.case.describe(),
                                  "message": res.message()[:3000], "known": known})
                for c in ([] if known else res.comparisons):
                    if c.name not in u or not math.isfinite(c.rel_l2):
                        continue
                    stats[key][c.name + "_norm_u"].append(c.rel_l2 / u[c.name])
                    if c.allowed_at_worst:
                        stats[key][c.name + "_norm_vs_bound"].append(c.rel_l2 / c.tol_norm)
                        stats[key][c.name + "_elem_vs_bound"].append(c.max_abs / c.allowed_at_worst)
                        r = max(c.rel_l2 / c.tol_norm, c.max_abs / c.allowed_at_worst)
                        if r > worst.get(key, {}).get("ratio", -1.0):
                            worst[key] = {"ratio": r, "output": c.name, "case": res.case.describe()}
                if i % 10 == 9:
                    _dump(args, stats, fails, t0, worst)
            _dump(args, stats, fails, t0, worst)
            st_ = stats[f"{name}/{dt}"]
            n_cases = sum(len(v) for k, v in st_.items() if k.startswith("status_"))
            print(f"{name}/{dt}: {n_cases} cases, {len(st_['status_passed'])} passed ({time.time() - t0:.0f}s)",
                  file=sys.stderr)
    out = _dump(args, stats, fails, t0, worst)
    summary = out["summary"]
    for key, d in summary.items():
        print(key, {m: (v if isinstance(v, int) else f"med {v['median']:.2f} max {v['max']:.2f}") for m, v in sorted(d.items())})
    unexplained = [f for f in fails if not f.get("known")]
    print(f"false positives: {len(unexplained)} ({len(fails) - len(unexplained)} more failures are declared known findings)")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
