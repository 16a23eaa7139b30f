"""Speed and peak memory of the bundled Triton kernel beside SDPA flash / cuDNN / efficient and compiled flex.

    python benchmarks/bench_attention.py                      # the full table (CUDA only)
    python benchmarks/bench_attention.py --tune               # also sweep the kernel's tile configs
    python benchmarks/bench_attention.py --dtypes bfloat16 --dims 128 --seqlens 4096 --quick

Timing: `triton.testing.do_bench` (median of the repetitions after its warm-up), inputs drawn fresh
(random normal, never zeros) for every (shape, implementation). Tokens per call are fixed
(B * N = 16k, H * D = 2048), so every N fills the GPU. FLOPs: forward 4 * B * H * N^2 * D (half when
causal); forward+backward 3.5x the forward (2 matmuls forward, 5 backward). Peak memory: the
extra bytes allocated during one call beyond the inputs (torch.cuda.max_memory_allocated).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _impls(causal: bool):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnverify.kernels.autograd import flash_attention
    from attnverify.spec import Spec

    spec = Spec(causal="top_left" if causal else "none")

    def triton_fn(q, k, v):
        return flash_attention(q, k, v, spec)[0]

    def sdpa(backend):
        def fn(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return fn

    impls = {
        "triton": triton_fn,
        "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa-efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
    }
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        import torch._dynamo

        # one compile per shape: without this the 9th shape silently falls back to the unfused eager path
        torch._dynamo.config.recompile_limit = 256
        torch._dynamo.config.cache_size_limit = 256
        compiled = torch.compile(flex_attention, dynamic=False)
        masks = {}

        def flex(q, k, v):
            n = q.shape[2]
            if causal:
                if n not in masks:
                    masks[n] = create_block_mask(lambda b, h, i, j: j <= i, None, None, n, n, device=q.device)
                return compiled(q, k, v, block_mask=masks[n])
            return compiled(q, k, v)

        impls["flex"] = flex
    except Exception as e:  # pragma: no cover
        print(f"flex unavailable: {e}", file=sys.stderr)
    return impls


def _flops(b, h, n, d, causal, mode):
    f = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
    return f * (3.5 if mode == "fwd+bwd" else 1.0)


def bench_one(fn, b, h, n, d, dtype, mode, seed):
    from triton.testing import do_bench

    g = torch.Generator(device="cuda").manual_seed(seed)
    need_grad = mode == "fwd+bwd"
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g).requires_grad_(need_grad)
               for _ in range(3))
    do = torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g)
    if mode == "fwd":
        def call():
            with torch.no_grad():
                return fn(q, k, v)
    else:
        def call():
            o = fn(q, k, v)
            o.backward(do)
            q.grad = k.grad = v.grad = None
    call()  # compile / warm up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = do_bench(call, warmup=25, rep=100, return_mode="median")
    return ms, peak


def check_correct(dtype, d, causal):
    """Quick sanity beside the timings: the triton output against SDPA math in fp32."""
    import torch.nn.functional as F

    from attnverify.kernels.autograd import flash_attention
    from attnverify.spec import Spec

    q, k, v = (torch.randn(2, 4, 1000, d, device="cuda", dtype=dtype) for _ in range(3))
    o = flash_attention(q, k, v, Spec(causal="top_left" if causal else "none"))[0]
    r = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    return ((o.float() - r).norm() / r.norm()).item()


def tune(dtype, d, n, causal, mode):
    """Sweep forward / backward tiles of the Triton kernel on one shape; prints and returns the best."""
    from triton.testing import do_bench

    from attnverify.kernels import launch
    from attnverify.spec import Spec

    b, h = 16384 // n, 2048 // d
    spec = Spec(causal="top_left" if causal else "none")
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(4))
    res = []
    if mode == "fwd":
        cands = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
                 (64, 128, 4, 3), (128, 64, 8, 4), (128, 32, 4, 4)]
        for bm, bn, w, s in cands:
            try:
                fn = lambda: launch.forward(q, k, v, spec, block_m=bm, block_n=bn, num_warps=w, num_stages=s)  # noqa
                fn()
                ms = do_bench(fn, warmup=10, rep=40, return_mode="median")
            except Exception as e:
                print(f"  fwd {bm}x{bn} w{w} s{s}: {type(e).__name__}")
                continue
            res.append((ms, (bm, bn, w, s)))
    else:
        out, lse, prep = launch.forward(q, k, v, spec)
        cands = [(64, 128, 8, 2), (64, 128, 4, 2), (32, 128, 4, 2), (64, 64, 4, 2), (128, 128, 8, 1),
                 (32, 64, 4, 3), (64, 128, 8, 3), (128, 64, 8, 2)]
        for bm, bn, w, s in cands:
            try:
                fn = lambda: launch.backward(q, k, v, out, lse, do, None, spec, block_m=bm, block_n=bn,  # noqa
                                             num_warps=w, num_stages=s, prep=prep)
                fn()
                ms = do_bench(fn, warmup=10, rep=40, return_mode="median")
            except Exception as e:
                print(f"  bwd {bm}x{bn} w{w} s{s}: {type(e).__name__}")
                continue
            res.append((ms, (bm, bn, w, s)))
    res.sort()
    fl = _flops(b, h, n, d, causal, "fwd") * (2.5 if mode == "bwd" else 1.0)
    for ms, c in res[:5]:
        print(f"tune {mode} {str(dtype)[6:]} D{d} N{n} causal={causal}: {c} {ms:.3f} ms {fl / ms * 1e-9:.0f} TFLOP/s")
    return res[0] if res else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--impls", default="triton,sdpa-flash,sdpa-cudnn,sdpa-efficient,flex")
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--flex-seqlens", default="1024,4096,16384",
                    help="compiled flex recompiles per shape: measure it at these N only")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-only", action="store_true")
    ap.add_argument("--json", default=None, help="write every measurement here")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new measurements after this")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA GPU")
        return 2
    import triton

    t0 = time.time()
    dtypes = [getattr(torch, x) for x in a.dtypes.split(",")]
    dims = [int(x) for x in a.dims.split(",")]
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
          f"cuda {torch.version.cuda} {time.strftime('%Y-%m-%d %H:%M')}")
    if a.tune or a.tune_only:
        for dt in dtypes:
            for d in dims:
                for causal in ((False, True) if d == 128 else (False,)):
                    for mode in ("fwd", "bwd"):
                        tune(dt, d, 8192, causal, mode)
        if a.tune_only:
            return 0
    for dt in dtypes:
        for d in dims:
            for causal in (False, True):
                print(f"# correctness {str(dt)[6:]} D{d} causal={causal}: rel L2 vs fp32 math "
                      f"{check_correct(dt, d, causal):.2e}")
    rows = []
    for mode in a.modes.split(","):
        for causal in [bool(int(x)) for x in a.causal.split(",")]:
            impls = _impls(causal)
            for dt in dtypes:
                for d in dims:
                    for n in [int(x) for x in a.seqlens.split(",")]:
                        b, h = max(1, 16384 // n), 2048 // d
                        for name in a.impls.split(","):
                            if name not in impls:
                                continue
                            if name == "flex" and str(n) not in a.flex_seqlens.split(","):
                                continue
                            if time.time() - t0 > a.budget_s:
                                print(f"# budget reached: skipped {name} {mode} ...")
                                continue
                            try:
                                ms, peak = bench_one(impls[name], b, h, n, d, dt, mode, seed=n + d)
                                tf = _flops(b, h, n, d, causal, mode) / ms * 1e-9
                                rows.append(dict(impl=name, dtype=str(dt)[6:], d=d, n=n, b=b, h=h, causal=causal,
                                                 mode=mode, ms=ms, tflops=tf, peak_mib=peak / 2**20))
                                print(f"{mode:7s} causal={int(causal)} {str(dt)[6:]:8s} D={d:3d} N={n:5d} {name:15s} "
                                      f"{ms:8.3f} ms {tf:6.0f} TFLOP/s peak+{peak / 2**20:7.0f} MiB", flush=True)
                            except Exception as e:
                                print(f"{mode:7s} causal={int(causal)} {str(dt)[6:]:8s} D={d:3d} N={n:5d} {name:15s} "
                                      f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}",
                                      flush=True)
                            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    # summary: TFLOP/s per impl at each shape, for the markdown table
    print("\n| mode | causal | dtype | D | N | " + " | ".join(a.impls.split(",")) + " |")
    print("|---|---|---|---|---|" + "---|" * len(a.impls.split(",")))
    keys = sorted({(r["mode"], r["causal"], r["dtype"], r["d"], r["n"]) for r in rows},
                  key=lambda x: (x[0] != "fwd", x[1], x[2], x[3], x[4]))
    for key in keys:
        cells = []
        for name in a.impls.split(","):
            r = [r for r in rows if (r["mode"], r["causal"], r["dtype"], r["d"], r["n"]) == key and r["impl"] == name]
            cells.append(f"{r[0]['tflops']:.0f} ({r[0]['peak_mib']:.0f} MiB)" if r else "-")
        print(f"| {key[0]} | {int(key[1])} | {key[2]} | {key[3]} | {key[4]} | " + " | ".join(cells) + " |")
    print(f"# total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
