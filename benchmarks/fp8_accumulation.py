"""How precisely do the GPU's fp8 tensor cores accumulate the scores q.k? (tolerances.FP8_ACC_U, docs/tolerances.md)

attnverify's fp8 score term assumes about 14 mantissa bits (FP8_ACC_U = 2^-14, the DeepSeek-V3 report on Hopper).
This measures it on the machine's GPU with torch._scaled_mm (the fp8 GEMM FA3-class kernels use), with and without
fast accumulation: the worst |S_fp8 - S_exact| / sum_d |q_d k_d| over random e4m3 q, k at head dims 64-576.

    export PYTHONPATH=$PWD; python benchmarks/fp8_accumulation.py --json $OUT/fp8_accumulation.json

A ratio near 2^-24 means float32 accumulation (FP8_ACC_U could be tightened); near 2^-14 confirms it; above it
means the fp8 score term must grow. Needs a CUDA GPU with fp8 (sm_89+); on a CPU it says so and exits 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--trials", type=int, default=20)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        print("fp8_accumulation: needs a CUDA GPU and torch._scaled_mm", file=sys.stderr)
        return 2
    dev = "cuda"
    one = torch.ones((), device=dev, dtype=torch.float32)
    rows = []
    t0 = time.time()
    for d in (64, 128, 256, 576):
        for fast in (False, True):
            worst = 0.0
            for t in range(args.trials):
                g = torch.Generator(device=dev).manual_seed(1000 * d + t)
                q = (torch.randn(256, d, device=dev, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
                k = (torch.randn(512, d, device=dev, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
                try:
                    s = torch._scaled_mm(q, k.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                                         use_fast_accum=fast)
                except Exception as e:  # noqa: BLE001 -- report what the GPU refuses
                    rows.append({"head_dim": d, "fast_accum": fast, "error": f"{type(e).__name__}: {e}"[:300]})
                    break
                s = s[0] if isinstance(s, tuple) else s
                exact = q.double() @ k.double().t()
                mag = q.double().abs() @ k.double().abs().t()
                worst = max(worst, float(((s.double() - exact).abs() / mag.clamp_min(1e-30)).max()))
            else:
                rows.append({"head_dim": d, "fast_accum": fast, "worst_rel": worst,
                             "in_units_of_2^-14": worst / 2.0**-14, "in_units_of_2^-24": worst / 2.0**-24,
                             "bits": -math.log2(worst) if worst > 0 else None})
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "seconds": time.time() - t0}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
