"""Standalone: SDPA's CPU flash backend on old torch (F27, F28 in docs/compatibility.md).

    python benchmarks/repro_sdpa_cpu_old_torch.py      # any torch >= 2.3 on a CPU

F27: a bool mask broadcast along the keys, (B, 1, Lq, 1) -- one bit per query row, valid by SDPA's "attn_mask
... broadcastable" -- gives wrong rows in the forced flash backend on torch 2.3.1 (2.13 is right): compared with
the math backend on the same inputs (rows whose bit is False are fully masked: NaN on torch < 2.5, 0 since).
F28: float16 accuracy of the flash backend, relative L2 error against a float64 computation, beside the math
backend in float16 (median and max over 200 cases of B=1 H=1 L=9 D=16, q and k of std 3.2).
Prints one JSON line per check.
"""
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def sdpa(backend, *args, **kw):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(*args, **kw)


def main():
    print(json.dumps(dict(torch=torch.__version__)), flush=True)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 9, 16, generator=g)
    k, v = torch.randn(2, 2, 20, 16, generator=g), torch.randn(2, 2, 20, 16, generator=g)
    rows = torch.rand(2, 1, 9, 1, generator=g) > 0.3
    for name, mask in (("(B, 1, Lq, 1)", rows), ("(B, 1, Lq, Lk) expanded (control)", rows.expand(2, 1, 9, 20).contiguous())):
        flash = sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, attn_mask=mask)
        math = sdpa(SDPBackend.MATH, q, k, v, attn_mask=mask)
        live = rows.expand(2, 2, 9, 1).squeeze(-1)  # rows that see every key
        err = (flash - math)[live].abs().max().item()
        print(json.dumps(dict(check="F27 flash vs math, rows that see all keys", mask=name, max_abs_diff=err)), flush=True)
    errs = {"flash": [], "math": []}
    for _ in range(200):
        q, k = (torch.randn(1, 1, 9, 16, generator=g, dtype=torch.float64) * 3.2 for _ in range(2))
        v = torch.randn(1, 1, 9, 16, generator=g, dtype=torch.float64)
        ref = F.scaled_dot_product_attention(q, k, v)
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("math", SDPBackend.MATH)):
            out = sdpa(backend, q.half(), k.half(), v.half()).double()
            errs[name].append(((out - ref).norm() / ref.norm()).item())
    for name, e in errs.items():
        e = torch.tensor(e)
        print(json.dumps(dict(check="F28 float16 rel L2 error", backend=name, median=e.median().item(),
                              max=e.max().item())), flush=True)


if __name__ == "__main__":
    main()
