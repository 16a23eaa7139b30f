"""Standalone: cuDNN SDPA backward gives NaN dQ when every score is shifted by -1000 (H200, torch 2.11).

    python benchmarks/repro_cudnn_dq_nan.py

Softmax is shift-invariant, so out, dK and dV must not change and dQ changes only in the column that
carries the shift; the math backend agrees with that. Found by the H200 calibration of 2026-12-03
(22 of 2,576 sdpa-cudnn cases, all NaN dQ; docs/tolerances.md, findings). Prints one line per backend
and dtype; no attnverify needed. Exit status 0 while cuDNN still gives NaN dQ, 1 when it does not (fixed), 2 without
a GPU.
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def case(dtype, shift=-1000.0, b=1, h=2, lq=63, lk=64, d=40, seed=0, std=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for n in (lq, lk, lk))
    q, k = q * std, k * std
    scale = d ** -0.5
    k[..., 0] = 1.0  # every key carries a 1 in column 0 ...
    q[..., 0] = shift / scale  # ... so every score of every row moves by `shift`
    return [t.to("cuda", dtype).requires_grad_(True) for t in (q, k, v)]


def run(backend, q, k, v):
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v)
    d_out = torch.ones_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), d_out)
    return out, dq, dk, dv


def main():
    if not torch.cuda.is_available():
        print("no CUDA device: this reproduces a finding on an NVIDIA GPU (H200, torch 2.11)")
        return 2
    nan_cudnn = False
    # the calibration's case (shift -1000), and the H200 re-run's shrunk case of 2026-12-04 (shift -120, q and k of
    # std 0.5, B=1 H=1 Lq=Lk=64 D=16, fp16), which failed gradients_match_reference, outputs_fully_written,
    # no_out_of_bounds and non_default_stream
    for label, kw in (("shift -1000", dict(shift=-1000.0)),
                      ("shift -120", dict(shift=-120.0, h=1, lq=64, lk=64, d=16, std=0.5))):
        for dtype in (torch.float16, torch.bfloat16):
            q, k, v = case(dtype, **kw)
            for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                            SDPBackend.CUDNN_ATTENTION):
                try:
                    out, dq, dk, dv = run(backend, q, k, v)
                    n = int(dq.isnan().sum())
                    print(f"{label:12} {str(dtype):15} {backend.name:20} out finite {bool(out.isfinite().all())}, "
                          f"dQ NaN {n}/{dq.numel()}, dK NaN {int(dk.isnan().sum())}, dV NaN {int(dv.isnan().sum())}")
                    if backend == SDPBackend.CUDNN_ATTENTION and n:
                        nan_cudnn = True
                except RuntimeError as e:
                    print(f"{label:12} {str(dtype):15} {backend.name:20} raised: {str(e).splitlines()[0][:100]}")
    print("F10: " + ("still reproduces (cuDNN dQ NaN)" if nan_cudnn else "NOT reproduced (fixed?)"))
    return 0 if nan_cudnn else 1


if __name__ == "__main__":
    sys.exit(main())
