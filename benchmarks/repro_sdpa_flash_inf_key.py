"""Standalone: PyTorch's CPU flash attention returns finite outputs when a key holds +inf and every query's score
against it is +inf, where the exact answer (and the math backend) is non-finite (CPU, torch 2.13).

    python benchmarks/repro_sdpa_flash_inf_key.py

Found by attnverify's `nonfinite_inputs_propagate` property on the ci corpus entry `backward-dominant-key-wide-head`
(q[..., 0] = 1 for every query, so k[63, 0] = +inf scores +inf in every row): `B=1 Hq=2 Lq=16 Lk=64 D=256 float16
poison=[('k', 0, 0, 63, 0, 'inf')] key 0 dominant (+8)`. Prints, per backend and dtype, how many query rows come
back all-finite (the exact softmax of a row with a +inf score is undefined: inf - inf). No attnverify needed.
"""
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

res = {"torch": torch.__version__}
for dt in (torch.float16, torch.bfloat16, torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 16, 256, generator=g)
    k = torch.randn(1, 2, 64, 256, generator=g)
    v = torch.randn(1, 2, 64, 256, generator=g)
    q[..., 0] = 1.0  # every query has a positive component along dim 0 ...
    k[0, 0, 63, 0] = float("inf")  # ... so key 63 of head 0 scores +inf in every row of head 0
    q, k, v = (t.to(dt) for t in (q, k, v))
    for name, be in (("math", SDPBackend.MATH), ("flash", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel(be):
            o = F.scaled_dot_product_attention(q, k, v)
        finite_rows = int(torch.isfinite(o[0, 0]).all(-1).sum())
        res[f"{name} {str(dt)[6:]}"] = f"{finite_rows} of 16 head-0 rows all finite (exact: none)"
print(json.dumps(res, indent=1))
