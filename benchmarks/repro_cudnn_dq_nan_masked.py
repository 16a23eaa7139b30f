"""Standalone: cuDNN's SDPA backward gives NaN dQ on rows whose exact dQ is ~0, fp16 with a mask (F39; H200, torch 2.11).

    python benchmarks/repro_cudnn_dq_nan_masked.py

Seen only in the tolerance calibration of 2026-12-05 (5 of 1,556 fp16 cases of sdpa-cudnn and sdpa, one query row
NaN in four of them; docs/compatibility.md F39): each case had a mask and scores of scale 1-2 (or q, k of std 4),
and the NaN row's exact dQ was 0 or ~1e-16 to 1e-6 -- a row with one visible key (top-left causal row 0 under a
key mask) or keys that score alike. This script sweeps those two kinds of row in fp16 and bf16 at scales
default / 1 / 2 and prints, per call, the rows of cuDNN's dQ that hold NaN and the math backend's largest |dQ| on
them (output, dK and dV are compared too). No attnverify needed. Exit status 0 while cuDNN gives NaN dQ somewhere,
1 when it does not (fixed, or the trigger is narrower than this sweep), 2 without a GPU.
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def inputs(dtype, kind, b=2, h=2, lq=192, lk=192, d=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for n in (lq, lk, lk))
    keep = torch.rand(1, h, 1, lk, generator=g) < 0.7
    keep[..., 0] = True  # key 0 visible: top-left causal row 0 sees it alone
    mask = keep & torch.ones(lq, lk, dtype=torch.bool).tril()
    if kind == "equal keys":  # every key alike: P uniform over the visible keys, dQ = sum_j dS_j k = 0 exactly
        k = k[:, :, :1].expand_as(k).contiguous()
        mask = keep.expand(b, h, lq, lk)
    cuda = [t.to("cuda", dtype).requires_grad_(True) for t in (q, k, v)]
    return cuda, mask.to("cuda")


def run(backend, q, k, v, mask, scale):
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    return (out, *torch.autograd.grad(out, (q, k, v), d_out))


def main():
    if not torch.cuda.is_available():
        print("no CUDA device: this reproduces a finding on an NVIDIA GPU (H200, torch 2.11)")
        return 2
    seen = False
    for kind in ("one visible key", "equal keys"):
        for dtype in (torch.float16, torch.bfloat16):
            for scale in (None, 1.0, 2.0):
                for seed in range(3):
                    (q, k, v), mask = inputs(dtype, kind, seed=seed)
                    try:
                        ref = run(SDPBackend.MATH, *(t.detach().double().requires_grad_(True) for t in (q, k, v)),
                                  mask, scale)
                        got = run(SDPBackend.CUDNN_ATTENTION, q, k, v, mask, scale)
                    except RuntimeError as e:
                        print(f"{kind:16} {str(dtype):15} scale {scale} seed {seed}: raised {str(e).splitlines()[0][:90]}")
                        continue
                    nan_rows = got[1].isnan().any(-1)
                    rows = nan_rows.nonzero().tolist()
                    exact = float(ref[1][nan_rows].abs().max()) if rows else 0.0
                    other = {n: int(t.isnan().sum()) for n, t in zip(("out", "dK", "dV"), (got[0], got[2], got[3]))}
                    print(f"{kind:16} {str(dtype):15} scale {scale} seed {seed}: dQ NaN rows {len(rows)} {rows[:4]} "
                          f"(math |dQ| there <= {exact:.3g}); NaN in {other}")
                    seen = seen or bool(rows)
    print("F39: " + ("reproduces (cuDNN dQ NaN)" if seen else "NOT reproduced by this sweep"))
    return 0 if seen else 1


if __name__ == "__main__":
    sys.exit(main())
