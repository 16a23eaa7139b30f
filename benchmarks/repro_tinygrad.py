"""Standalone: two findings of tinygrad's `Tensor.scaled_dot_product_attention` on its CPU device (tinygrad 0.14.0).

    python benchmarks/repro_tinygrad.py        # ~1-2 min on 2 cores: tinygrad compiles each shape with clang

F34  the scores are cast to the input dtype before the softmax (`qk.cast(self.dtype).softmax(-1)`): in float16 they
     are rounded, and with every score of a row shifted by 100 (softmax is shift-invariant) the output is off by
     ~1e-2 where a float16 kernel with float32 scores stays near 1e-3.
F36  a single key (Lk = 1): a NaN in q comes back as the value row, not NaN. The softmax over one key is folded to 1
     (x - max(x) over a one-element axis is x - x), so the NaN score never reaches the output; with two keys it does.

Each line: the case, what tinygrad returned, and for F34 the relative L2 error against a float64 reference next to
that of torch computing the same float16 inputs with float32 scores. Exit status 0 while both reproduce, 1 when one
no longer does. Needs tinygrad and clang; no attnverify.
"""
import math
import sys

import numpy as np
import torch


def tiny(q, k, v):
    from tinygrad import Tensor

    t = [Tensor(x, device="CPU") for x in (q, k, v)]
    return t[0].scaled_dot_product_attention(t[1], t[2]).numpy()


def ref64(q, k, v):
    q, k, v = (torch.from_numpy(x.astype(np.float64)) for x in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).numpy()


def rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


def f36():
    seen = False
    for lq, lk in ((1, 1), (3, 1), (64, 1), (1, 2), (3, 2)):
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 1, n, 16)).astype(np.float32) for n in (lq, lk, lk))
        q[0, 0, 0, 0] = np.nan
        row = tiny(q, k, v)[0, 0, 0]
        nan = bool(np.isnan(row).all())
        equals_v = bool(lk == 1 and np.allclose(row, v[0, 0, 0]))
        print(f"F36 Lq={lq:2} Lk={lk}: NaN in q row 0 -> {'NaN (right)' if nan else 'finite'}"
              + (" = the value row" if equals_v else ""), flush=True)
        seen |= lk == 1 and not nan
    return seen


def f34():
    worst = 0.0
    for shift in (0.0, 100.0):
        rng = np.random.default_rng(1)
        q, k, v = (rng.standard_normal((1, 1, 64, 16)) for _ in range(3))
        scale = 1 / math.sqrt(16)
        k[..., 0] = 1.0  # every key carries a 1 in column 0 ...
        q[..., 0] += shift / scale  # ... so every score of a row moves by `shift`
        q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
        exact = ref64(q16, k16, v16)
        got = tiny(q16, k16, v16)
        tq, tk, tv = (torch.from_numpy(x) for x in (q16, k16, v16))
        p = torch.softmax((tq.float() @ tk.float().transpose(-1, -2)) * scale, -1)
        base = (p.half().float() @ tv.float()).half().numpy()  # float16 in and out, float32 scores and softmax
        e_t, e_b = rel(got, exact), rel(base, exact)
        print(f"F34 fp16 B=1 H=1 L=64 D=16, scores shifted by {shift:5}: tinygrad rel L2 {e_t:.3g}, float32 scores "
              f"{e_b:.3g} ({e_t / e_b:.1f}x)", flush=True)
        if shift:
            worst = e_t / e_b
    return worst > 3


def main():
    try:
        import tinygrad  # noqa: F401
    except ImportError:
        print("tinygrad is not installed (pip install tinygrad; its CPU device needs clang)")
        return 2
    a, b = f36(), f34()
    print(f"F34: {'reproduces' if b else 'NOT reproduced'}; F36: {'reproduces' if a else 'NOT reproduced'}")
    return 0 if a and b else 1


if __name__ == "__main__":
    sys.exit(main())
