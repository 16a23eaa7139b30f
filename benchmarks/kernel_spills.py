"""Register spills of the bundled split-KV decode kernel for sm_90, without a GPU: each configuration is compiled
through the stand-in driver (benchmarks/standin_driver.py) into a fresh Triton cache, and the cubin Triton built
(its own ptxas, with its own flags) is read by Triton's bundled `cuobjdump --dump-resource-usage`: registers and
STACK, the local memory a thread needs. A launch reserves local memory for every thread the GPU can hold (an H100:
132 SMs x 2,048 threads), so a few hundred bytes a thread is a few hundred MB a launch, and on a GPU other processes
have filled the launch fails with "Triton Error [CUDA]: out of memory" (attnverify/kernels/serving.py, decode_tiles).
(Reading the PTX with ptxas -v instead gives other figures: Triton 3.9 passes ptxas flags of its own.)

    python benchmarks/kernel_spills.py float32:128:64 float32:64:64 bfloat16:128:64      # dtype:D:query rows per kv head
    python benchmarks/kernel_spills.py float32:128:64:16x64x2                           # tiles forced (BMxBNxSTAGES)
    python benchmarks/kernel_spills.py --json ...                                       # one JSON object per line

Prints per configuration the tiles decode_tiles chose (or the forced ones), the stack bytes a thread and the
registers. Exit 2 where Triton's NVIDIA backend or its cuobjdump is missing.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def cuobjdump_path():
    """Triton's bundled cuobjdump, or None."""
    try:
        import triton
    except ImportError:
        return None
    try:
        from triton import knobs

        p = knobs.nvidia.cuobjdump.path
        if p and os.path.isfile(p):
            return p
    except Exception:  # noqa: BLE001 - an older Triton: look for the binary
        pass
    p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return p if os.path.isfile(p) and os.access(p, os.X_OK) else None


def _one(dtype: str, d: int, rows: int, tiles) -> dict:
    """Compile the decode kernel for one configuration in this process (stand-in driver installed) -> ptxas -v."""
    import torch

    from attnverify.kernels import serving

    if tiles is not None:
        serving.decode_tiles = lambda dt, block_d, r: tiles
    dt = getattr(torch, dtype)
    hkv, lq = 1, 1
    hq = rows * hkv // lq
    page, npages, b = 16, 8, 2
    q = torch.randn(b, hq, lq, d).to(dt)
    kc, vc = torch.randn(npages, page, hkv, d).to(dt), torch.randn(npages, page, hkv, d).to(dt)
    table = torch.arange(npages, dtype=torch.int32).reshape(b, -1)
    bd = max(16, 1 << (d - 1).bit_length())
    chosen = serving.decode_tiles(dt, bd, hq // hkv * lq)
    serving.paged_decode(q, kc, vc, torch.tensor([40, 60], dtype=torch.int32), block_table=table, num_splits=2,
                         validate_lengths=False)
    cubin = glob.glob(os.path.join(os.environ["TRITON_CACHE_DIR"], "*", "_decode_partial.cubin"))
    if len(cubin) != 1:
        raise RuntimeError(f"expected one compiled _decode_partial, found {len(cubin)}")
    r = subprocess.run([cuobjdump_path(), "--dump-resource-usage", cubin[0]], capture_output=True, text=True)
    m = re.search(r"REG:(\d+) STACK:(\d+)", r.stdout)
    if r.returncode or not m:
        raise RuntimeError(f"cuobjdump: {(r.stdout + r.stderr)[-500:]}")
    return {"dtype": dtype, "head_dim": d, "rows": rows, "tiles": list(chosen), "stack_bytes": int(m.group(2)),
            "registers": int(m.group(1))}


def _child(spec: str) -> None:
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(HERE))
    import standin_driver

    standin_driver.install(cuda_tiles=True)
    parts = spec.split(":")
    tiles = tuple(int(x) for x in parts[3].split("x")) if len(parts) > 3 else None
    print(json.dumps(_one(parts[0], int(parts[1]), int(parts[2]), tiles)))


def measure(spec: str) -> dict:
    """One configuration 'dtype:D:rows[:BMxBNxSTAGES]', compiled in a child process with its own Triton cache."""
    with tempfile.TemporaryDirectory(prefix="attnverify-spills-") as cache:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(TRITON_CACHE_DIR=cache, PYTHONPATH=os.pathsep.join(
            p for p in (os.path.dirname(HERE), os.environ.get("PYTHONPATH")) if p))
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec], env=env, capture_output=True,
                           text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(f"{spec}: {r.stderr[-1500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", default=["float32:32:64", "float32:64:64", "float32:128:64",
                                                   "float32:160:8", "bfloat16:128:64", "float16:256:64"])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _child(a.child)
        return 0
    if cuobjdump_path() is None:
        print("kernel_spills: Triton's NVIDIA backend or its cuobjdump is not installed here", file=sys.stderr)
        return 2
    for spec in a.configs:
        res = measure(spec)
        if a.json:
            print(json.dumps(res))
        else:
            print(f"{spec:24s} tiles {'x'.join(map(str, res['tiles'])):9s} stack {res['stack_bytes']:5d} B a thread, "
                  f"{res['registers']} registers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
