"""Standalone: cuDNN's SDPA gives neither 0 nor NaN on a fully-masked row (H200, torch 2.11; F26).

    python benchmarks/repro_cudnn_fully_masked.py

A row whose attn_mask hides every key has no softmax; since torch 2.5 PyTorch's stance is that such a row gives 0
(pytorch/pytorch#133882, "Changes the stance of SDPA on what to do for fully masked out rows"), and the math backend
does so. attnverify's first H200 run with masks claimed for cuDNN saw -0.887 where 0 is expected (bool mask
(2, 1, 9, 1), fp16), wrong dK/dV from those rows, and the dispatch (which sends fp16 with a mask to cuDNN) return
2.23 on a row a top-left causal bool mask of shape (1, 1, 3, 2) hides entirely.

One child process per call (a fault must not end the others). Per call: the largest |out| and |dQ| on the fully-masked
rows (0 expected), the largest error elsewhere against a float64 reference that gives those rows 0, and dK/dV's.
Exit status 0 while cuDNN still returns something other than 0 on a fully-masked row, 1 when it gives 0 (fixed),
2 without a GPU. No attnverify needed.
"""
import json
import os
import subprocess
import sys

# (what, backend or None for the dispatch, dtype, B, H, Lq, Lk, D, mask shape, rows hidden entirely or "random")
CASES = [
    ("CUDNN fp16, bool (1, 1, 9, 20), rows 0 and 4 hidden", "CUDNN_ATTENTION", "float16", 1, 2, 9, 20, 16,
     (1, 1, 9, 20), [0, 4]),
    ("CUDNN bf16, bool (1, 1, 9, 20), rows 0 and 4 hidden", "CUDNN_ATTENTION", "bfloat16", 1, 2, 9, 20, 16,
     (1, 1, 9, 20), [0, 4]),
    ("CUDNN fp16, bool (2, 1, 9, 1) random (the run's case)", "CUDNN_ATTENTION", "float16", 2, 2, 9, 20, 16,
     (2, 1, 9, 1), "random"),
    ("dispatch fp16, bool (1, 1, 9, 20), rows 0 and 4 hidden", None, "float16", 1, 2, 9, 20, 16, (1, 1, 9, 20), [0, 4]),
    ("dispatch fp16, bool (1, 1, 3, 2) rows 2 hidden", None, "float16", 1, 1, 3, 2, 16, (1, 1, 3, 2), [2]),
    ("dispatch fp16, bool (1, 1, 14, 16) all hidden, D=256", None, "float16", 1, 4, 14, 16, 256, (1, 1, 14, 16),
     list(range(14))),
    ("dispatch fp32, bool (1, 1, 9, 20), rows 0 and 4 hidden", None, "float32", 1, 2, 9, 20, 16, (1, 1, 9, 20), [0, 4]),
    ("EFFICIENT fp16, bool (1, 1, 9, 20), rows 0 and 4 hidden", "EFFICIENT_ATTENTION", "float16", 1, 2, 9, 20, 16,
     (1, 1, 9, 20), [0, 4]),
    ("MATH fp16, bool (1, 1, 9, 20), rows 0 and 4 hidden", "MATH", "float16", 1, 2, 9, 20, 16, (1, 1, 9, 20), [0, 4]),
]


def reference(q, k, v, m):
    """float64 attention that gives a row with no visible key 0 (PyTorch's stance since 2.5), with its gradients."""
    import torch

    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~m, float("-inf"))
    hidden = ~m.any(-1, keepdim=True)
    p = torch.softmax(torch.where(hidden, torch.zeros_like(s), s), -1)
    return torch.where(hidden, torch.zeros_like(p), p) @ v


def one(case):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _, backend, dtype, b, h, lq, lk, d, mshape, rows = case
    dev = os.environ.get("REPRO_DEVICE", "cuda")  # "cpu" only to check this script's own code paths
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for n in (lq, lk, lk))
    m = torch.rand(mshape, generator=g) < 0.5
    if rows != "random":
        m[..., 0] = True  # every other row sees a key
        for i in rows:
            m[..., i, :] = False
    full = m.expand(b, h, lq, lk)
    hidden = ~full.any(-1)  # (b, h, lq)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = reference(*leaves, full)
    ref.backward(torch.ones_like(ref))
    rq, rk, rv = (t.grad for t in leaves)
    qc, kc, vc = (t.to(dev, dt).requires_grad_(True) for t in (q, k, v))
    try:
        if backend is None:
            out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=m.to(dev))
        else:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=m.to(dev))
        out.backward(torch.ones_like(out))
        o, dq, dk, dv = (t.double().cpu() for t in (out, qc.grad, kc.grad, vc.grad))
        res = {"status": "ok", "hidden_rows": int(hidden.sum()),
               "out_hidden": float(o[hidden].abs().max()) if hidden.any() else 0.0,
               "out_hidden_nan": bool(o[hidden].isnan().any()),
               "dq_hidden": float(dq[hidden].abs().max()) if hidden.any() else 0.0,
               "out_err": float((o - ref.detach())[~hidden].abs().max()) if (~hidden).any() else 0.0,
               "dk_err": float((dk - rk).abs().max()), "dv_err": float((dv - rv).abs().max())}
    except Exception as e:  # noqa: BLE001
        res = {"status": "raises", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    print(json.dumps(res))


def main():
    import torch

    if not torch.cuda.is_available() and os.environ.get("REPRO_DEVICE", "cuda") == "cuda":
        print("no CUDA device: this reproduces a finding on an NVIDIA GPU (H200, torch 2.11)")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}")
    wrong = False
    for case in CASES:
        try:
            p = subprocess.run([sys.executable, __file__, "--one", json.dumps(case)], capture_output=True, text=True,
                               timeout=120)
        except subprocess.TimeoutExpired:
            print(f"{case[1] if len(case) > 10 else case[0]}: no answer within 120 s")
            continue
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        r = json.loads(lines[-1]) if lines else {"status": "raises", "error": f"child exited {p.returncode}: "
                                                                            f"{p.stderr.strip()[-200:]}"}
        if r["status"] == "ok":
            shown = (f"{r['hidden_rows']} hidden row(s): max |out| {r['out_hidden']:.3g}"
                     f"{' (NaN)' if r['out_hidden_nan'] else ''}, max |dQ| {r['dq_hidden']:.3g} (0 expected); "
                     f"elsewhere out err {r['out_err']:.2g}; dK err {r['dk_err']:.2g}, dV err {r['dv_err']:.2g}")
            if case[1] == "CUDNN_ATTENTION" and r["hidden_rows"] and (r["out_hidden"] > 0 or r["out_hidden_nan"]):
                wrong = True
        else:
            shown = f"raises: {r['error']}"
        print(f"{case[0]:58} {shown}")
    print("F26: " + ("still reproduces (cuDNN: not 0 on a fully-masked row)" if wrong else "NOT reproduced (fixed?)"))
    return 0 if wrong else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        one(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
