"""Does the GPU's fp8 P @ V keep a subnormal V element? (the H200 thorough run, 2026-12-05: descale_linearity of the
bundled kernel, float8_e5m2, failed only when V was scaled and V held subnormal elements: v x 2 gave other bf16 bits)

    PYTHONPATH=. python benchmarks/repro_fp8_subnormal_v.py        # GPU; under TRITON_INTERPRET=1 on a CPU too

q = 0 makes every score 0, so P = 1 for each of the 32 keys (exact in fp8) and out[..., d] = mean_j v[j, d] * v_descale.
V is zero but for v[0, 0] = x. A kept x gives out[0, 0, :, 0] = x / 32; a flushed one gives 0. Printed for x a
normal e5m2 value (control), e5m2 subnormals, and e4m3's smallest normal and a subnormal.
"""
from __future__ import annotations

import json

import torch

from attnverify.kernels import flash_attention
from attnverify.spec import Spec


def one(dtype, x: float, device: str) -> dict:
    lk, d = 32, 32
    q = torch.zeros(1, 1, 16, d, device=device).to(dtype)
    k = torch.zeros(1, 1, lk, d, device=device).to(dtype)
    v = torch.zeros(1, 1, lk, d, device=device)
    v[0, 0, 0, 0] = x
    v = v.to(dtype)
    one_ = torch.ones(1, 1, device=device)
    spec = Spec(q_descale=one_, k_descale=one_, v_descale=one_)
    out, _ = flash_attention(q, k, v, spec)
    got = out[0, 0, :, 0].double()
    want = v.double()[0, 0, 0, 0].item() / lk
    return {"dtype": str(dtype).split(".")[-1], "x": v.double()[0, 0, 0, 0].item(), "want": want,
            "got": sorted(set(got.tolist())), "kept": bool((got == want).all())}


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for dtype, xs in ((torch.float8_e5m2, (2.0**-14, 2.0**-15, 2.0**-16, 3 * 2.0**-16)),
                      (torch.float8_e4m3fn, (2.0**-6, 2.0**-7, 2.0**-9))):
        for x in xs:
            print(json.dumps(one(dtype, x, device)), flush=True)


if __name__ == "__main__":
    main()
