"""Time and peak memory of the float64 reference at long sequence lengths (CPU).

    python benchmarks/reference_memory.py --n 32768 --d 128

Peak memory is the process's maximum resident set size (ru_maxrss) minus what it held before the
call; one 32768 x 32768 float64 matrix alone would be 8 GiB.
"""
import argparse
import platform
import resource
import time

import torch

from attnverify.reference import reference_backward, reference_forward
from attnverify.spec import Spec


def rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--causal", default="none")
    ap.add_argument("--backward", action="store_true")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, a.n, a.d, generator=g, dtype=torch.float64) for _ in range(3))
    spec = Spec(causal=a.causal)
    before = rss_mib()
    t0 = time.perf_counter()
    r = reference_forward(q, k, v, spec)
    t_fwd = time.perf_counter() - t0
    peak_fwd = rss_mib() - before
    line = (f"n={a.n} d={a.d} causal={a.causal} forward {t_fwd:.1f} s, peak extra RSS {peak_fwd:.0f} MiB "
            f"(N x N float64 would be {a.n * a.n * 8 / 2**30:.1f} GiB)")
    if a.backward:
        t0 = time.perf_counter()
        reference_backward(q, k, v, spec, torch.ones_like(r.out))
        line += f"; backward {time.perf_counter() - t0:.1f} s, peak extra RSS {rss_mib() - before:.0f} MiB"
    print(line)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
