"""Decode on a GPU in one go: the bundled Triton split-KV path against SDPA and flex, then the serving properties.

    export PYTHONPATH=$PWD PYTEST_PLUGINS=attnverify.plugin
    python benchmarks/decode_bench.py --out $OUT            # ~4 min on an H200

(a) timing (first, alone on the GPU): decode with Lq = 1 and 4, batch 1..64, Lk 1k..32k, GQA 8:1 (Hq 64, Hkv 8),
    bf16, D = 128, no mask (every key visible; SDPA's is_causal would be top-left), one time per backend, the
    median of triton.testing.do_bench in microseconds:
      triton      attnverify.kernels.paged_decode on a contiguous cache (B, Lk, Hkv, D), and on paged pools of
                  page size 16 and 64 with a scrambled block table (num_splits=None: the kernel's choice)
      sdpa-*      torch.nn.functional.scaled_dot_product_attention, enable_gqa=True, each backend (flash,
                  efficient, cudnn) that accepts the call, on the same cache as a (B, Hkv, Lk, D) view
      flex        torch.compile(flex_attention) with enable_gqa (flex decoding for Lq <= 128), on a subset of
                  shapes (a compile each)
      flex-pNN    torch.nn.attention.experimental._paged_attention.PagedAttention (if present) on page size NN
    Each triton result is checked against sdpa (max |diff| in the JSON). A deadline skips what does not fit.
(b) correctness: `attnverify run --profile thorough` of the serving properties on triton and naive (cuda),
    --max-examples each, under a time limit; logs and report folders (tar.gz) to --out.

Outputs (at most 7 files): decode_bench.md (the table), decode_bench.json, versions.txt, run_triton.log,
run_naive.log, rep_triton.tgz, rep_naive.tgz. Without a CUDA GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROPS = ("paged_equals_contiguous", "kv_cache_append", "split_invariance", "lse_merge", "batch_invariance",
         "kv_cache_leftpad")
SDPA = ("flash", "efficient", "cudnn")


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "decode_bench_out"))
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--seqlens", default="1024,4096,16384,32768")
    p.add_argument("--lqs", default="1,4")
    p.add_argument("--heads", default="64,8", help="Hq,Hkv")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--pages", default="16,64")
    p.add_argument("--flex-shapes", default="1x4096,64x4096,1x32768,64x32768", help="BxLk timed with flex (a compile each)")
    p.add_argument("--flex-paged-lqs", default="1", help="Lq values timed with flex's PagedAttention")
    p.add_argument("--time-budget", type=float, default=150.0, help="seconds for the timing part")
    p.add_argument("--check-budget", type=float, default=80.0, help="seconds for the correctness runs")
    p.add_argument("--max-examples", type=int, default=100)
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script (TRITON_INTERPRET=1)")
    return p.parse_args(argv)


def _ints(s):
    return [int(x) for x in s.split(",") if x]


class Timer:
    def __init__(self, budget):
        self.end = time.time() + budget

    def left(self):
        return self.end - time.time()


def _bench(fn):
    import triton

    fn()  # compile / warm
    return 1000.0 * triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")  # us


def _flex(q, k, v, fns):
    from torch.nn.attention.flex_attention import flex_attention
    import torch

    if "flex" not in fns:
        fns["flex"] = torch.compile(flex_attention, dynamic=False)
    return lambda: fns["flex"](q, k, v, enable_gqa=True)


def _flex_paged(q, kc, page, fns):
    """PagedAttention of torch.nn.attention.experimental: pool (1, Hkv, N * page, D), converted block mask."""
    import torch
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask

    b, lk, hkv, d = kc.shape
    dev = kc.device
    n = b * (lk // page)
    pa = PagedAttention(n, page, b, device=dev)
    for i in range(b):
        pa.reserve(torch.tensor(i, device=dev), torch.tensor(lk, device=dev))
    kp = torch.zeros(1, hkv, n * page, d, device=dev, dtype=kc.dtype)
    vp = torch.zeros_like(kp)
    pos = torch.arange(lk, device=dev)[None].expand(b, lk)
    kv = kc.transpose(1, 2)
    pa.assign(torch.arange(b, device=dev), pos, kv, kv, kp, vp)
    lq = q.shape[2]
    mask = create_block_mask(lambda bb, h, qi, kj: kj >= 0, b, None, lq, lk, device=dev, BLOCK_SIZE=(128, page))
    pmask = pa.convert_logical_block_mask(mask)
    score = pa.get_score_mod(None)
    if "flex" not in fns:
        from torch.nn.attention.flex_attention import flex_attention

        fns["flex"] = torch.compile(flex_attention, dynamic=False)
    return lambda: fns["flex"](q, kp, vp, block_mask=pmask, score_mod=score, enable_gqa=True)


def _pool_on(k, table, page):
    """k (B, Lk, Hkv, D) written into a pool (N, page, Hkv, D) along a block table (B, Lk / page)."""
    import torch

    b, lk = k.shape[:2]
    pool = torch.empty(table.numel(), page, *k.shape[2:], device=k.device, dtype=k.dtype)
    pool[table.reshape(-1).long()] = k.reshape(b * (lk // page), page, *k.shape[2:])
    return pool


def _err(e) -> str:
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}"[:200]


def timing(a, t: Timer):
    """Pass 1: triton (contiguous and paged) and SDPA on every shape; pass 2: flex on --flex-shapes, as time allows."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnverify.kernels import paged_decode

    hq, hkv = _ints(a.heads)
    d, dev = a.head_dim, a.device
    gen = torch.Generator().manual_seed(0)
    flex_shapes = [tuple(int(x) for x in s.split("x")) for s in a.flex_shapes.split(",") if s]
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}
    rows, fns = {}, {}
    for pass_ in (1, 2):
        for lk in _ints(a.seqlens):
            for b in _ints(a.batches):
                if pass_ == 2 and (b, lk) not in flex_shapes:
                    continue
                kc = torch.randn(b, lk, hkv, d, device=dev, dtype=torch.bfloat16)
                vc = torch.randn(b, lk, hkv, d, device=dev, dtype=torch.bfloat16)
                lens = torch.full((b,), lk, device=dev, dtype=torch.int32)
                kb, vb = kc.transpose(1, 2), vc.transpose(1, 2)  # (B, Hkv, Lk, D) views, no copy
                pools = {}
                for lq in _ints(a.lqs):
                    row = rows.setdefault((lq, b, lk), {"Lq": lq, "B": b, "Lk": lk, "us": {}, "err": {}, "notes": {}})
                    q = torch.randn(b, hq, lq, d, device=dev, dtype=torch.bfloat16)
                    if pass_ == 2:
                        for name, make, paged_ok in [("flex", lambda: _flex(q, kb, vb, fns), True)] + [
                                (f"flex-p{p}", (lambda p=p: _flex_paged(q, kc, p, fns)), lq in _ints(a.flex_paged_lqs))
                                for p in _ints(a.pages)]:
                            if not paged_ok:
                                continue
                            if t.left() < 15:
                                row["notes"][name] = "skipped: time budget"
                                continue
                            try:
                                row["us"][name] = _bench(make())
                            except Exception as e:
                                row["notes"][name] = _err(e)
                        print(_line(row), flush=True)
                        continue
                    if t.left() < 0:
                        row["notes"]["all"] = "skipped: time budget"
                        continue
                    ref = None
                    for name, be in backends.items():
                        try:
                            def f():
                                return torch.nn.functional.scaled_dot_product_attention(q, kb, vb, enable_gqa=True)

                            with sdpa_kernel([be]):
                                out = f()
                                row["us"][f"sdpa-{name}"] = _bench(f)
                            ref = out if ref is None else ref
                        except Exception as e:  # a backend that refuses the call
                            row["notes"][f"sdpa-{name}"] = _err(e)
                    variants = [("triton", kc, vc, None)]
                    for page in _ints(a.pages):
                        if page not in pools:
                            table = torch.randperm(b * (lk // page), generator=gen).view(b, lk // page).to(dev, torch.int32)
                            pools[page] = (_pool_on(kc, table, page), _pool_on(vc, table, page), table)
                        variants.append((f"triton-p{page}", *pools[page]))
                    for name, kx, vx, table in variants:
                        try:
                            def f(kx=kx, vx=vx, table=table):
                                return paged_decode(q, kx, vx, lens, block_table=table, validate_lengths=False)

                            row["us"][name] = _bench(f)
                            if ref is not None:
                                row["err"][name] = float((f()[0].float() - ref.float()).abs().max())
                        except Exception as e:
                            row["notes"][name] = _err(e)
                    if "triton" in row["us"]:
                        row["triton_GBps"] = 2 * b * lk * hkv * d * 2 / (row["us"]["triton"] * 1e-6) / 1e9
                    print(_line(row), flush=True)
                kc = vc = kb = vb = pools = None  # freed before the next shape is allocated
                if dev == "cuda":
                    torch.cuda.empty_cache()
    return list(rows.values())


def _cols(rows):
    seen = []
    for r in rows:
        for c in r["us"]:
            if c not in seen:
                seen.append(c)
    order = ["triton", "triton-p16", "triton-p64", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flex", "flex-p16",
             "flex-p64"]
    return [c for c in order if c in seen] + [c for c in seen if c not in order]


def _line(r):
    return f"Lq={r['Lq']} B={r['B']} Lk={r['Lk']}: " + " ".join(f"{k}={v:.1f}us" for k, v in r["us"].items())


def table(rows) -> str:
    cols = _cols(rows)
    out = ["| Lq | B | Lk | " + " | ".join(cols) + " | triton GB/s | best other / triton |",
           "|---|---|---|" + "---|" * len(cols) + "---|---|"]
    for r in rows:
        others = [v for k, v in r["us"].items() if not k.startswith("triton")]
        ratio = f"{min(others) / r['us']['triton']:.2f}" if others and "triton" in r["us"] else "-"
        cells = [f"{r['us'][c]:.1f}" if c in r["us"] else "-" for c in cols]
        gbs = f"{r['triton_GBps']:.0f}" if "triton_GBps" in r else "-"
        out.append(f"| {r['Lq']} | {r['B']} | {r['Lk']} | " + " | ".join(cells) + f" | {gbs} | {ratio} |")
    return "\n".join(out)


def checks(a, out_dir):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("PYTEST_PLUGINS", "attnverify.plugin")
    procs = []
    for name, workers in (("triton", 3), ("naive", 2)):
        rep = os.path.join(out_dir, f"rep_{name}")
        cmd = [sys.executable, "-m", "attnverify.cli", "run", "--adapter", name, "--profile", "thorough",
               "--device", "cuda", "--max-examples", str(a.max_examples), "-n", str(workers), "-k", " or ".join(PROPS),
               "--report", rep, "--no-html"]
        log = open(os.path.join(out_dir, f"run_{name}.log"), "w")
        log.write(" ".join(cmd) + "\n")
        log.flush()
        procs.append((name, rep, log, subprocess.Popen(["timeout", str(int(a.check_budget)), *cmd], stdout=log,
                                                       stderr=subprocess.STDOUT, env=env)))
    for name, rep, log, p in procs:
        rc = p.wait()
        log.write(f"\nexit {rc}{' (time limit: the properties not listed above did not finish)' if rc == 124 else ''}\n")
        log.close()
        if os.path.isdir(rep):
            subprocess.run(["tar", "czf", f"{rep}.tgz", "-C", out_dir, os.path.basename(rep)], check=False)
            subprocess.run(["rm", "-rf", rep], check=False)


def main(argv=None) -> int:
    a = _args(argv)
    import torch

    if not torch.cuda.is_available():
        print("decode_bench: no CUDA GPU here (torch.cuda.is_available() is False): nothing measured")
        return 0
    os.makedirs(a.out, exist_ok=True)
    import triton

    with open(os.path.join(a.out, "versions.txt"), "w") as f:
        f.write(f"torch {torch.__version__} triton {triton.__version__} gpu {torch.cuda.get_device_name(0)}\n")
        try:
            import torch.nn.attention.experimental._paged_attention  # noqa: F401
            f.write("torch.nn.attention.experimental._paged_attention: present\n")
        except ImportError as e:
            f.write(f"torch.nn.attention.experimental._paged_attention: absent ({e})\n")
    t0 = time.time()
    rows = timing(a, Timer(a.time_budget))
    md = table(rows)
    notes = sorted({f"{k}: {v}" for r in rows for k, v in r["notes"].items()})
    text = (f"decode, bf16, D={a.head_dim}, Hq,Hkv={a.heads}, no mask, median us (triton.testing.do_bench); "
            f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}\n\n{md}\n\n"
            + ("notes (a backend's refusal or error, first seen):\n" + "\n".join(f"- {n}" for n in notes[:40]) + "\n"
               if notes else ""))
    with open(os.path.join(a.out, "decode_bench.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.out, "decode_bench.json"), "w") as f:
        json.dump({"args": vars(a), "rows": rows, "timing_s": time.time() - t0}, f, indent=1)
    print(text, flush=True)
    if not a.no_check:
        checks(a, a.out)
        for name in ("triton", "naive"):
            with open(os.path.join(a.out, f"run_{name}.log")) as f:
                tail = [ln for ln in f.read().splitlines() if ln.strip()][-12:]
            print(f"--- run_{name}.log (tail)\n" + "\n".join(tail))
    print(f"decode_bench: {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
