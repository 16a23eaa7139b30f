"""Standalone: PyTorch SDPA backends on CUDA given q/k/v whose data pointer is not 16-byte aligned.

    python benchmarks/repro_misaligned_sdpa.py            # one child process per backend and offset

A view that starts `offset` fp16 elements into a buffer (e.g. a slice of a packed buffer) is a valid
tensor; a kernel must use it, or refuse it with an error, never fault. Each case runs in its own
process because a CUDA fault poisons the process's context.
"""
import json
import subprocess
import sys

CHILD = r"""
import sys, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
backend, offset, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
buf = torch.randn(offset + 3 * 64 * d, device="cuda", dtype=torch.float16)
q, k, v = (buf[offset + i * 64 * d: offset + (i + 1) * 64 * d].view(1, 1, 64, d) for i in range(3))
ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
try:
    with sdpa_kernel([getattr(SDPBackend, backend)]):
        out = F.scaled_dot_product_attention(q, k, v)
    torch.cuda.synchronize()
    print("OK max_err=%.3g ptr%%16=%d" % ((out.float() - ref).abs().max().item(), q.data_ptr() % 16))
except Exception as e:
    print("RAISED " + type(e).__name__ + ": " + str(e).splitlines()[0][:160])
"""

rows = []
for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
    for offset in (0, 1, 8, 67):
        p = subprocess.run([sys.executable, "-c", CHILD, backend, str(offset), "16"], capture_output=True, text=True, timeout=120)
        out = (p.stdout.strip().splitlines() or [""])[-1]
        err = [x for x in p.stderr.strip().splitlines() if "Error" in x or "error" in x][-1:]
        rows.append({"backend": backend, "offset_elems": offset, "exit": p.returncode, "result": out or (err[0][:200] if err else "")})
        print(json.dumps(rows[-1]), flush=True)
