"""Times the Triton kernel's speed candidates (issue 25) against its default and SDPA-flash, in one go.

    export PYTHONPATH=$PWD
    python benchmarks/perf_candidates.py --out $OUT          # about 3-4 minutes on one H200

The configurations are the perf gate's misses (B*N = 16k tokens, H*D = 2048, BHSD contiguous, as
`attnverify bench`): forward of D = 64, fp16 and bf16, N = 8192 and 16384, causal and not; forward and
forward+backward of D = 256 causal, fp16 and bf16, N = 8192 and 16384. A candidate is a set of
`launch.Config` switches (`attnverify/kernels/variants.py`; `ATTNVERIFY_TRITON_VARIANT` names them the
same way), with other Config fields after a "|" (forward stages, dQ tiles).

1. Compile and check (a pool of processes): each candidate runs once on a small instance of each
   configuration's specialisation (B = 1, the same heads, N = 1040: a masked tail block) and is
   compared with the float64 reference (out, LSE, and for D = 256 dq, dk, dv): its max error must be
   within 2x the default's plus a small slack, or the candidate is marked wrong and never wins.
2. Time: `--rounds` rounds; in each, every configuration times sdpa-flash and every candidate (shuffled
   order) with triton.testing.do_bench (median); a candidate's figure is the median over rounds.
3. Select, per configuration: the fastest correct candidate, its gain over the default and its ratio to
   sdpa-flash (gate: forward >= 1.30x, forward+backward >= 1.00x). Per group (D = 64 forward, D = 256
   forward+backward): RECOMMEND the candidate with the best geometric-mean gain over the default, if that
   gain is >= 1% and it loses no more than 2% on any configuration of the group; else keep the default.

Writes perf_candidates.json and perf_candidates.md under --out. Exit 0 (2 without a GPU).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor

DTYPES = ("float16", "bfloat16")
# the timed shapes (B*N tokens, H*D, N) and the checked one (N), on a GPU; --smoke: tiny, on the CPU
# under the Triton interpreter, to prove the script end to end without a GPU
SIZES = {"gpu": dict(dev="cuda", tokens=16384, hd=2048, seqlens=(8192, 16384), check_n=1040),
         "smoke": dict(dev="cpu", tokens=256, hd=128, seqlens=(128, 256), check_n=80)}
SEQLENS = SIZES["gpu"]["seqlens"]
# name -> (Config switches, Config tile fields). "default" is the Config as the adapter uses it (the specialised
# kernels while launch.NOSPEC_ON_GPU is off); "spec" the specialised kernels (the A/B once nospec is the default).
# nospec+aligned, nospec+rtmask and both: the nospec twins' variants with fewer compiles (kernels/variants.py).
FWD64 = {
    "default": "", "fma": "fma", "lazy": "lazy", "fma+lazy": "fma,lazy", "lpt": "lpt", "fma+lpt": "fma,lpt",
    "fma+lazy+lpt": "fma,lazy,lpt", "tma": "tma", "tma+fma": "tma,fma", "tma+fma+lazy": "tma,fma,lazy",
    "tma+fma+lpt": "tma,fma,lpt", "tma+fma+ws": "tma,fma,ws", "nospec": "nospec", "spec": "spec",
    "tma+fma s2": "tma,fma|num_stages=2", "tma+fma s4": "tma,fma|num_stages=4",
    "nospec+aligned": "aligned", "nospec+rtmask": "rtmask", "nospec+aligned+rtmask": "aligned,rtmask",
}
DQ128 = "dq_block_m=128,dq_block_n=32,dq_warps=8,dq_stages=2"
BWD256 = {
    "default": "", "lpt": "lpt", "fma+lpt": "fma,lpt", "tma+fma+lpt": "tma,fma,lpt",
    "lpt+dq128x32w8s2": "lpt|" + DQ128, "fma+lpt+dq128x32w8s2": "fma,lpt|" + DQ128, "nospec": "nospec", "spec": "spec",
    "nospec+aligned": "aligned", "nospec+rtmask": "rtmask", "nospec+aligned+rtmask": "aligned,rtmask",
}
FWD_MIN, FWD_BWD_MIN = 1.30, 1.00


def configurations(seqlens=SEQLENS):
    """(group, dtype, D, causal, N) in a fixed order."""
    out = [("fwd64", dt, 64, c, n) for dt in DTYPES for n in seqlens for c in (0, 1)]
    return out + [("bwd256", dt, 256, 1, n) for dt in DTYPES for n in seqlens]


def candidates(group: str) -> dict:
    return FWD64 if group == "fwd64" else BWD256


def make_config(launch, variants, d, dtype, text: str, dev: str = "cuda"):
    from dataclasses import replace

    switches, _, fields = text.partition("|")  # "fma,lpt|num_stages=4,dq_warps=8"
    cfg = replace(launch.default_config(d, dtype, dev), **variants.parse(switches))
    if fields:
        cfg = replace(cfg, **{k: int(x) for k, x in (f.split("=") for f in fields.split(","))})
    return cfg


def _inputs(dtype, d, n, batch, seed, size):
    import torch

    g = torch.Generator(device=size["dev"]).manual_seed(seed)
    h = max(1, size["hd"] // d)
    return [torch.randn(batch, h, n, d, device=size["dev"], dtype=dtype, generator=g) for _ in range(4)]


def _check_one(job):
    """Compile (same specialisation as the timed shape) and check one candidate against the reference:
    -> (job, {name: max abs error}, error text or None)."""
    group, dtype_name, d, causal, name, text, size = job
    size = SIZES[size]
    try:
        import torch

        from attnverify.kernels import launch, variants
        from attnverify.reference import reference_backward, reference_forward
        from attnverify.spec import Spec

        dtype = getattr(torch, dtype_name)
        spec = Spec(causal="top_left" if causal else "none")
        q, k, v, do = _inputs(dtype, d, size["check_n"], 1, 1000 + d + causal, size)
        cfg = make_config(launch, variants, d, dtype, text, size["dev"])
        out, lse, p = launch.forward(q, k, v, spec, config=cfg)
        ref = reference_forward(q, k, v, spec)
        errs = {"out": (out.double() - ref.out).abs().max().item(), "lse": (lse.double() - ref.lse).abs().max().item()}
        if group == "bwd256":
            dq, dk, dv = launch.backward(q, k, v, out, lse, do, None, spec, prep=p, config=cfg)
            rg = reference_backward(q, k, v, spec, do.double())
            for nm, got, want in (("dq", dq, rg.dq), ("dk", dk, rg.dk), ("dv", dv, rg.dv)):
                errs[nm] = (got.double() - want).abs().max().item()
        if size["dev"] == "cuda":
            torch.cuda.synchronize()
        return job, errs, None
    except Exception as e:  # a candidate that does not compile on this Triton: reported, never picked
        return job, None, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"


def _correct(errs, base) -> bool:
    if errs is None or base is None:
        return False
    return all(math.isfinite(errs[k]) and errs[k] <= 2.0 * base[k] + 2e-3 for k in base)


def _time(fn, rep, dev="cuda"):
    if dev != "cuda":  # --smoke: one wall-clock call
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "perf_candidates")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=60, help="do_bench rep (ms) per timing")
    ap.add_argument("--jobs", type=int, default=14, help="processes compiling and checking candidates")
    ap.add_argument("--budget-s", type=float, default=200.0, help="start no further round after this many seconds")
    ap.add_argument("--groups", default="fwd64,bwd256")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (TRITON_INTERPRET=1): a dry run")
    a = ap.parse_args(argv)
    size_name = "smoke" if a.smoke else "gpu"
    size = SIZES[size_name]
    if a.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        print("perf_candidates: --smoke needs TRITON_INTERPRET=1 in the environment")
        return 2
    import torch

    if not a.smoke and not torch.cuda.is_available():
        print("perf_candidates: needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    t0 = time.time()
    os.makedirs(a.out, exist_ok=True)
    groups = a.groups.split(",")
    confs = [c for c in configurations(size["seqlens"]) if c[0] in groups]
    jobs = sorted({(g, dt, d, c, nm, tx, size_name) for g, dt, d, c, _n in confs
                   for nm, tx in candidates(g).items()})
    import multiprocessing as mp

    # a fresh process per job: a kernel that faults cannot poison the CUDA context of the jobs after it
    per_child = {"max_tasks_per_child": 1} if sys.version_info >= (3, 11) else {}
    with ProcessPoolExecutor(a.jobs, mp_context=mp.get_context("spawn"), **per_child) as ex:
        checked = {j[:5]: (e, err) for j, e, err in ex.map(_check_one, jobs)}
    print(f"# compiled and checked {len(jobs)} candidate specialisations in {time.time() - t0:.0f} s", flush=True)

    rows = []
    for g, dt, d, c, n in confs:
        base = checked[(g, dt, d, c, "default")][0]
        cands = {}
        for nm, tx in candidates(g).items():
            errs, err = checked[(g, dt, d, c, nm)]
            cands[nm] = dict(text=tx, errors=errs, failure=err, correct=nm == "default" and errs is not None
                             or _correct(errs, base), fwd=[], fwd_bwd=[])
        rows.append(dict(group=g, dtype=dt, d=d, causal=c, n=n, cands=cands, sdpa_fwd=[], sdpa_fwd_bwd=[]))
    rng = random.Random(0)
    for r in range(a.rounds):
        if r and time.time() - t0 > a.budget_s:
            print(f"# budget: stopped after {r} rounds", flush=True)
            break
        for row in rows:
            time_row(row, a.rep, rng, size)
            if size["dev"] == "cuda":
                torch.cuda.empty_cache()
        print(f"# round {r + 1} done at {time.time() - t0:.0f} s", flush=True)
        write(a.out, rows, size, t0)  # after every round: a later failure keeps what was measured
    print(write(a.out, rows, size, t0))
    return 0


def write(out_dir, rows, size, t0) -> str:
    import torch
    import triton

    report = summarise(rows)
    meta = dict(device=torch.cuda.get_device_name() if size["dev"] == "cuda" else "cpu (smoke)",
                torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), seconds=round(time.time() - t0))
    with open(os.path.join(out_dir, "perf_candidates.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, recommendation=report["recommend"]), f, indent=1, default=str)
    md = f"# perf_candidates {meta}\n\n" + report["text"]
    with open(os.path.join(out_dir, "perf_candidates.md"), "w") as f:
        f.write(md)
    return md


def time_row(row, rep, rng, size):
    """One round of one configuration: sdpa-flash, then every correct candidate in a shuffled order."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnverify.kernels import launch, variants
    from attnverify.spec import Spec

    dtype = getattr(torch, row["dtype"])
    b = size["tokens"] // row["n"]
    q, k, v, do = _inputs(dtype, row["d"], row["n"], b, 7, size)
    spec = Spec(causal="top_left" if row["causal"] else "none")
    bwd = row["group"] == "bwd256"
    fl = 4.0 * b * q.shape[1] * row["n"] ** 2 * row["d"] / (2 if row["causal"] else 1)
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))

    def sdpa_f():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(row["causal"]))

    def sdpa_fb():
        o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=bool(row["causal"]))
        return torch.autograd.grad(o, (qg, kg, vg), do)

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        row["sdpa_fwd"].append(fl / _time(sdpa_f, rep, size["dev"]) * 1e-9)
        if bwd:
            row["sdpa_fwd_bwd"].append(3.5 * fl / _time(sdpa_fb, rep, size["dev"]) * 1e-9)
    names = [nm for nm, cd in row["cands"].items() if cd["correct"]]
    rng.shuffle(names)
    for nm in names:
        cd = row["cands"][nm]
        cfg = make_config(launch, variants, row["d"], dtype, cd["text"], size["dev"])

        def fwd(cfg=cfg):
            return launch.forward(q, k, v, spec, config=cfg)

        def fb(cfg=cfg):
            o, lse, p = launch.forward(q, k, v, spec, config=cfg)
            return launch.backward(q, k, v, o, lse, do, None, spec, prep=p, config=cfg)

        try:
            cd["fwd"].append(fl / _time(fwd, rep, size["dev"]) * 1e-9)
            if bwd:
                cd["fwd_bwd"].append(3.5 * fl / _time(fb, rep, size["dev"]) * 1e-9)
        except Exception as e:  # reported, and never timed again
            cd["correct"], cd["failure"] = False, f"timing: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
            print(f"# {row['group']} {row['dtype']} N={row['n']} causal={row['causal']} {nm}: {cd['failure']}", flush=True)


def _med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def _fig(x) -> str:
    return f"{x:.3g}" if x else "-"


def summarise(rows) -> dict:
    """Per-configuration winners and the per-group recommendation (the selection rule of the docstring)."""
    lines, gains = [], {}
    lines.append("| group | dtype | D | causal | N | metric | sdpa-flash | default | x sdpa | best | best x sdpa | gain | "
                 "gate: default / best | all candidates (TFLOP/s; ! = wrong vs reference, x = failed) |")
    lines.append("|" + "---|" * 14)
    for row in rows:
        metric = "fwd_bwd" if row["group"] == "bwd256" else "fwd"
        thr = FWD_BWD_MIN if metric == "fwd_bwd" else FWD_MIN
        ref = _med(row["sdpa_" + metric])
        figs = {nm: _med(cd[metric]) for nm, cd in row["cands"].items()}
        base = figs.get("default")
        ok = {nm: f for nm, f in figs.items() if f and row["cands"][nm]["correct"]}
        best = max(ok, key=ok.get) if ok else None
        for nm, f in ok.items():
            if base:
                gains.setdefault(row["group"], {}).setdefault(nm, []).append(f / base)
        cells = [f"{nm} x" if cd["failure"] else f"{nm} !" if not cd["correct"] else f"{nm} {_fig(figs[nm])}"
                 for nm, cd in row["cands"].items()]
        bf = ok.get(best)

        def ratio(x):
            return f"{x / ref:.2f}x" if x and ref else "-"

        def verdict(x):
            return "-" if not (x and ref) else "pass" if x / ref >= thr else "FAIL"

        gain = f"{(bf / base - 1) * 100:+.1f}%" if bf and base else "-"
        lines.append(f"| {row['group']} | {row['dtype']} | {row['d']} | {row['causal']} | {row['n']} | {metric} | "
                     f"{_fig(ref)} | {_fig(base)} | {ratio(base)} | {best or '-'} | {ratio(bf)} | {gain} | "
                     f"{verdict(base)} / {verdict(bf)} ({thr:.2f}x) | {'; '.join(cells)} |")
        if row["group"] == "bwd256":  # the forward alone too, for the record
            fwd = {nm: _med(cd["fwd"]) for nm, cd in row["cands"].items() if _med(cd["fwd"])}
            lines.append(f"| | | | | | fwd | {_fig(_med(row['sdpa_fwd']))} | {_fig(fwd.get('default'))} | | | | | | "
                         + "; ".join(f"{nm} {_fig(f)}" for nm, f in fwd.items()) + " |")
    recommend = {}
    lines.append("")
    for group, by in gains.items():
        n_conf = max(len(v) for v in by.values())
        scored = []
        for nm, rs in by.items():
            if nm == "default" or len(rs) < n_conf:
                continue
            geo = math.exp(sum(math.log(x) for x in rs) / len(rs))
            scored.append((geo, min(rs), nm))
        scored.sort(reverse=True)
        pick = next((s for s in scored if s[0] >= 1.01 and s[1] >= 0.98), None)
        text = candidates(group)[pick[2]] if pick else ""
        recommend[group] = dict(candidate=pick[2] if pick else "default", switches=text,
                                geomean_gain=round(pick[0], 4) if pick else 1.0,
                                ranking=[(nm, round(geo, 4), round(worst, 4)) for geo, worst, nm in scored])
        lines.append(f"RECOMMEND {group}: {recommend[group]['candidate']} ({text or 'no change'}); ranking "
                     "(geomean gain, worst gain): " + ", ".join(f"{nm} {geo:.3f}/{w:.3f}" for geo, w, nm in scored))
    return dict(text="\n".join(lines) + "\n", recommend=recommend)


if __name__ == "__main__":
    sys.exit(main())
