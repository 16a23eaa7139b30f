"""Standalone: SDPA on CUDA with an attn_mask broadcast along the keys, e.g. shape (B, 1, Lq, 1) (H200, torch 2.11).

    python benchmarks/repro_sdpa_key_broadcast_mask.py          # both findings
    python benchmarks/repro_sdpa_key_broadcast_mask.py F31      # or one of them

PyTorch documents (torch.nn.functional.scaled_dot_product_attention, 2.11 and 2.13): "attn_mask (optional Tensor) --
Attention mask; shape must be broadcastable to the shape of attention weights, which is (N,...,L,S)". A mask whose
key dimension is 1 is such a shape. Found by the H200 re-run of attnverify's SDPA adapters (2026-12-04):

F31  PyTorch's own dispatch, fp32: picks the mem-efficient kernel, which raises
     "RuntimeError: (*bias): last dimension must be contiguous" instead of the dispatch choosing another backend.
F32  the cuDNN backend, fp16/bf16: "CUDA error: misaligned address" (or "mha_graph.execute(...).is_good()" false),
     and the process's CUDA context is lost.

Each call runs in a child process of its own (a fault loses the CUDA context); one line per call says what it did:
ok (max error against a float64 reference on the rows that see a key), raises, or FAULT. Rows the mask hides
entirely are left out of the error (that is F26, benchmarks/repro_cudnn_fully_masked.py). Exit status 0 while every
named finding still reproduces, 1 when one no longer does (fixed), 2 without a GPU. No attnverify needed.
"""
import json
import os
import subprocess
import sys

# (finding, what, backend or None for the dispatch, dtype, B, H, Lq, Lk, D, mask shape, mask kind)
CASES = [
    ("F31", "dispatch fp32, bool mask (1, 1, 9, 1)", None, "float32", 1, 1, 9, 20, 16, (1, 1, 9, 1), "bool"),
    ("F31", "dispatch fp32, float mask (1, 1, 9, 1)", None, "float32", 1, 1, 9, 20, 16, (1, 1, 9, 1), "float"),
    ("F31", "dispatch fp32, float mask (1, 2, 1, 1)", None, "float32", 1, 2, 14, 97, 16, (1, 2, 1, 1), "float"),
    ("F32", "CUDNN fp16, bool mask (1, 1, 9, 1)", "CUDNN_ATTENTION", "float16", 1, 1, 9, 20, 16, (1, 1, 9, 1), "bool"),
    ("F32", "CUDNN fp16, float mask (1, 2, 1, 1)", "CUDNN_ATTENTION", "float16", 1, 2, 14, 97, 16, (1, 2, 1, 1),
     "float"),
    ("F32", "CUDNN bf16, bool mask (1, 1, 64, 1), D=72", "CUDNN_ATTENTION", "bfloat16", 1, 1, 64, 64, 72,
     (1, 1, 64, 1), "bool"),
    # context: the same shapes elsewhere, and the controls
    (None, "CUDNN fp16, bool mask (2, 1, 9, 1), B=H=2", "CUDNN_ATTENTION", "float16", 2, 2, 9, 20, 16, (2, 1, 9, 1),
     "bool"),
    (None, "CUDNN fp16, float mask (1, 1, 1, 1)", "CUDNN_ATTENTION", "float16", 1, 1, 14, 97, 16, (1, 1, 1, 1), "float"),
    (None, "dispatch fp16, bool mask (1, 1, 9, 1)", None, "float16", 1, 1, 9, 20, 16, (1, 1, 9, 1), "bool"),
    (None, "EFFICIENT fp16, bool mask (1, 1, 9, 1)", "EFFICIENT_ATTENTION", "float16", 1, 1, 9, 20, 16, (1, 1, 9, 1),
     "bool"),
    (None, "MATH fp32, bool mask (1, 1, 9, 1)", "MATH", "float32", 1, 1, 9, 20, 16, (1, 1, 9, 1), "bool"),
    (None, "control: dispatch fp32, bool mask (1, 1, 9, 20)", None, "float32", 1, 1, 9, 20, 16, (1, 1, 9, 20), "bool"),
    (None, "control: CUDNN fp16, bool mask (1, 1, 9, 20)", "CUDNN_ATTENTION", "float16", 1, 1, 9, 20, 16,
     (1, 1, 9, 20), "bool"),
]


def one(case):
    """In a child: one call; prints a JSON line."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _, _, backend, dtype, b, h, lq, lk, d, mshape, kind = case
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for n in (lq, lk, lk))
    if kind == "bool":
        m = torch.rand(mshape, generator=g) < 0.5
    else:
        m = torch.randn(mshape, generator=g, dtype=torch.float64) * 2.0
    ref_mask = m.expand(b, h, lq, lk)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=ref_mask)  # float64 on the CPU: the math kernel
    seen = ref_mask.any(-1) if kind == "bool" else torch.ones(b, h, lq, dtype=torch.bool)
    dev = os.environ.get("REPRO_DEVICE", "cuda")  # "cpu" only to check this script's own code paths
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    qc, kc, vc = (t.to(dev, dt) for t in (q, k, v))
    mc = m.to(dev) if kind == "bool" else m.to(dev, dt)
    try:
        if backend is None:
            out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mc)
        else:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mc)
        sync()
        err = (out.double().cpu() - ref).abs()[seen]
        res = {"status": "ok", "max_err": float(err.max()) if err.numel() else 0.0}
    except Exception as e:  # noqa: BLE001
        text = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        fault = any(s in text for s in ("CUDA error", "misaligned address", "illegal memory access"))
        if not fault:  # did it lose the context all the same?
            try:
                sync()
            except Exception as e2:  # noqa: BLE001
                text += f"; then synchronize: {type(e2).__name__}: {str(e2).splitlines()[0][:120]}"
                fault = True
        res = {"status": "fault" if fault else "raises", "error": text}
    print(json.dumps(res))


def main(wanted):
    import torch

    if not torch.cuda.is_available() and os.environ.get("REPRO_DEVICE", "cuda") == "cuda":
        print("no CUDA device: this reproduces a finding on an NVIDIA GPU (H200, torch 2.11)")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}")
    still = {f: False for f in wanted}
    for case in CASES:
        finding, what = case[0], case[1]
        try:
            p = subprocess.run([sys.executable, __file__, "--one", json.dumps(case)], capture_output=True, text=True,
                               timeout=120)
        except subprocess.TimeoutExpired:
            print(f"{case[1] if len(case) > 10 else case[0]}: no answer within 120 s")
            continue
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        res = json.loads(lines[-1]) if lines else {"status": "fault", "error": f"child exited {p.returncode}: "
                                                                             f"{p.stderr.strip()[-200:]}"}
        if res["status"] == "ok":
            shown = f"ok, max error {res['max_err']:.3g} on rows that see a key"
        else:
            shown = f"{'FAULT' if res['status'] == 'fault' else 'raises'}: {res['error']}"
        print(f"{finding or '   '} {what:52} {shown}")
        if finding in still:
            if finding == "F31" and res["status"] == "raises" and "(*bias)" in res.get("error", ""):
                still[finding] = True
            if finding == "F32" and res["status"] == "fault":
                still[finding] = True
    for f, yes in still.items():
        print(f"{f}: {'still reproduces' if yes else 'NOT reproduced (fixed?)'}")
    return 0 if all(still.values()) else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        one(json.loads(sys.argv[2]))
    else:
        sys.exit(main([a for a in sys.argv[1:] if a in ("F31", "F32")] or ["F31", "F32"]))
