"""Standalone: SDPA backends on CUDA given one key that holds +inf (H200, torch 2.11).

    python benchmarks/repro_inf_key_nan.py

Key j holds +inf in one column. A query whose entry in that column is negative scores -inf against
key j: that key gets weight exp(-inf) = 0 and the row's output is finite (the other keys' average).
A query whose entry is positive scores +inf: its row is NaN in exact arithmetic too. Found by
`attnverify run --profile thorough` (nonfinite_inputs_propagate[sdpa], shrunk to B=1 Hq=2 Lq=16 Lk=33
D=32 fp32, +inf at key 32, column 0). Prints, per backend, dtype and Lk, how many rows are NaN where
the exact output is finite. No attnverify needed.
"""
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def exact(q, k, v, scale):
    """float64 attention where -inf scores weigh 0 and a +inf score makes the row NaN."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    return torch.softmax(s, dim=-1) @ v.double()


def main():
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for lk in (33, 64, 65, 128, 129):
            for at in (lk - 1, 0):
                g = torch.Generator().manual_seed(0)
                q = torch.randn(1, 2, 16, 32, generator=g)
                k = torch.randn(1, 2, lk, 32, generator=g)
                v = torch.randn(1, 2, lk, 32, generator=g)
                k[0, 0, at, 0] = float("inf")
                q, k, v = (t.to("cuda", dtype) for t in (q, k, v))
                ref = exact(q, k, v, 32 ** -0.5)
                finite_rows = torch.isfinite(ref).all(-1)
                for be in ("default", "MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
                    try:
                        if be == "default":  # PyTorch's own choice
                            out = F.scaled_dot_product_attention(q, k, v)
                        else:
                            with sdpa_kernel([getattr(SDPBackend, be)]):
                                out = F.scaled_dot_product_attention(q, k, v)
                        torch.cuda.synchronize()
                        bad = int((finite_rows & ~torch.isfinite(out).all(-1)).sum())
                        res = f"{bad} NaN rows where exact is finite (of {int(finite_rows.sum())})"
                    except Exception as e:  # noqa: BLE001 - a refusal is a result here
                        res = "RAISED " + type(e).__name__ + ": " + str(e).splitlines()[0][:120]
                    rows.append({"dtype": str(dtype)[6:], "lk": lk, "inf_key": at, "backend": be, "result": res})
                    print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
