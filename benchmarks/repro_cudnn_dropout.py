"""Standalone: cuDNN's SDPA dropout keep rate and the independence of its masks (H200, torch 2.11; F33).

    python benchmarks/repro_cudnn_dropout.py

attnverify's `dropout` property read a kept fraction of 0.4936 over 145,924 draws at p = 0.5 from cuDNN (fp16,
B = Hq = 2, Lq = Lk = 191, D = 16; binomial p-value 8.7e-7), and attributed it to B >= 2, Hq >= 2 and more than 64
queries and keys: with B = 1 or Hq = 1 the same seed passed. A binomial test assumes independent draws; if cuDNN's
masks for different (batch, head) pairs were the same or correlated, the kept fraction would swing several times
more than the test allows. This script measures both, against the mem-efficient and math backends:

1. the property's own reading (q = 0 makes attention uniform, V = 1 makes a row's output count its kept keys) over
   many seeds: the pooled kept fraction and its binomial z, and the dispersion of the per-seed z-scores (mean z^2 is
   1 for independent draws, 4 if the 4 (batch, head) slices shared one mask);
2. the masks themselves (V = identity, Lk = D = 128): how often two (batch, head) slices of one call agree
   (0.5 for independent masks at p = 0.5).

Exit status 0 while cuDNN misbehaves (pooled keep rate off with |z| > 5, mean z^2 beyond 5 standard errors, or two
slices agreeing beyond 6 standard errors), 1 when it does not (then the property's 0.4936 was chance or attnverify's
statistics are at fault: say so in docs/compatibility.md F33), 2 without a GPU. No attnverify needed.
"""
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DEV = os.environ.get("REPRO_DEVICE", "cuda")  # "cpu" only to check this script's own code paths
P = 0.5


def call(backend, q, k, v, seed):
    torch.manual_seed(seed)
    with sdpa_kernel([backend]), torch.no_grad():
        return F.scaled_dot_product_attention(q, k, v, dropout_p=P)


def counts(backend, b, h, n, d, seeds):
    """Per seed: (kept, draws) read the property's way."""
    q = torch.zeros(b, h, n, d, device=DEV, dtype=torch.float16)
    k = torch.randn(b, h, n, d, device=DEV, dtype=torch.float16)
    v = torch.ones(b, h, n, d, device=DEV, dtype=torch.float16)
    out = []
    for s in seeds:
        o = call(backend, q, k, v, s)[..., 0].double().cpu()
        kept = o * n * (1 - P)
        assert float((kept - kept.round()).abs().max()) < 0.3, "counts not resolvable in fp16"
        out.append((int(kept.round().sum()), b * h * n * n))
    return out


def stats(per_seed):
    kept = sum(c for c, _ in per_seed)
    n = sum(t for _, t in per_seed)
    z = (kept - n * (1 - P)) / math.sqrt(n * P * (1 - P))
    zs = [(c - t * (1 - P)) / math.sqrt(t * P * (1 - P)) for c, t in per_seed]
    m2 = sum(x * x for x in zs) / len(zs)
    return kept / n, z, m2, (m2 - 1) / math.sqrt(2 / len(zs))  # mean z^2 and its distance from 1 in standard errors


def agreement(backend, seeds, b=2, h=2, n=128):
    """Largest and smallest fraction of equal keep decisions between two (batch, head) slices of one call."""
    q = torch.zeros(b, h, n, n, device=DEV, dtype=torch.float16)
    k = torch.randn(b, h, n, n, device=DEV, dtype=torch.float16)
    v = torch.eye(n, device=DEV, dtype=torch.float16).expand(b, h, n, n).contiguous()
    hi, lo = 0.0, 1.0
    for s in seeds:
        keep = (call(backend, q, k, v, s).double().cpu() * n * (1 - P)).round().bool().reshape(b * h, n * n)
        for i in range(b * h):
            for j in range(i + 1, b * h):
                a = float((keep[i] == keep[j]).double().mean())
                hi, lo = max(hi, a), min(lo, a)
    return hi, lo, 0.5 / math.sqrt(n * n)  # the standard error of one agreement fraction


def main():
    if DEV == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this reproduces a finding on an NVIDIA GPU (H200, torch 2.11)")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if DEV == 'cuda' else 'CPU'}; p = {P}, fp16")
    bad = False
    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    seeds = list(range(515099439, 515099439 + 200))  # from the property's shrunk seed on
    for name, shape in (("B=2 H=2 L=191", (2, 2, 191, 16)), ("B=1 H=1 L=191", (1, 1, 191, 16)),
                        ("B=2 H=2 L=64", (2, 2, 64, 16))):
        for be in backends:
            try:
                frac, z, m2, m2_se = stats(counts(be, *shape, seeds))
            except RuntimeError as e:
                print(f"{name:14} {be.name:20} raises: {str(e).splitlines()[0][:100]}")
                continue
            print(f"{name:14} {be.name:20} kept {frac:.5f} over {len(seeds)} seeds (pooled z {z:+.2f}); "
                  f"mean z^2 per seed {m2:.2f} ({m2_se:+.1f} s.e. from 1)")
            if be == SDPBackend.CUDNN_ATTENTION and (abs(z) > 5 or m2_se > 5):
                bad = True
    for be in backends:
        try:
            hi, lo, se = agreement(be, seeds[:20])
        except RuntimeError as e:
            print(f"masks          {be.name:20} raises: {str(e).splitlines()[0][:100]}")
            continue
        print(f"masks          {be.name:20} two (batch, head) slices agree on {lo:.4f} to {hi:.4f} of 16,384 "
              f"decisions (0.5 +- {se:.4f} if independent)")
        if be == SDPBackend.CUDNN_ATTENTION and max(hi - 0.5, 0.5 - lo) > 6 * se:
            bad = True
    print("F33: " + ("still reproduces" if bad else "NOT reproduced: cuDNN's keep rate and mask independence look "
                                                   "right here"))
    return 0 if bad else 1


if __name__ == "__main__":
    sys.exit(main())
