"""Fingerprint the forward kernel's generated code for sm_90, on a machine without a GPU.

A refactor of attnverify/kernels that claims "no codegen change" (a rule moved into a shared @triton.jit
helper, which Triton inlines) proves it by running this before and after and diffing the two outputs:
each line is one launch configuration and the sha256 of its TTGIR and PTX (line info and locations stripped,
so moved source lines do not count). Same hashes: the same code runs on the GPU, and the perf gate can only
show noise. A differing hash says which configuration to look at (--dump DIR writes the PTX and TTGIR).

It compiles through `launch.forward` itself (the launcher's own arguments, tiles and specialisations) with
a stand-in Triton driver that reports an sm_90 target and never launches; ptxas is Triton's bundled one.

    env -u TRITON_INTERPRET TRITON_DISABLE_LINE_INFO=1 PYTHONPATH=$PWD python scripts/kernel_fingerprint.py > a.txt

Needs Triton 3.6+ with its NVIDIA backend (the pip wheel has it); slow on a small CPU (about 10 s a kernel).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import tempfile
from dataclasses import replace


def _fake_driver():
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    class NoGpuDriver(CudaDriver):  # compiles for sm_90; never loads or launches
        def __init__(self):  # CudaDriver's would load libcuda
            pass

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    return NoGpuDriver()


# (name, dtype, d, spec kwargs, candidates on top of launch.default_config(d, dtype, 'cuda'), which already has
# the adopted ones: fma + lpt at D <= 64, tma + fma + lpt at D > 128)
CASES = [
    ("bf16_d64", "bfloat16", 64, {}, ""),
    ("fp16_d64_causal", "float16", 64, {"causal": "bottom_right"}, ""),
    ("bf16_d128_causal", "bfloat16", 128, {"causal": "bottom_right"}, ""),
    ("bf16_d256", "bfloat16", 256, {}, ""),
    ("fp16_d256_causal", "float16", 256, {"causal": "bottom_right"}, ""),
    ("fp16_d72", "float16", 72, {}, ""),
    ("fp16_d80_window", "float16", 80, {"window": (32, 0)}, ""),
    ("bf16_d128_softcap_alibi", "bfloat16", 128, {"softcap": 30.0, "alibi": True}, ""),
    ("fp32_d64_causal_tl", "float32", 64, {"causal": "top_left"}, ""),
    ("bf16_d64_varlen", "bfloat16", 64, {"varlen": True}, ""),
    ("bf16_d128_sinks", "bfloat16", 128, {"sinks": True}, ""),
    ("fp8_d128", "float8_e4m3fn", 128, {}, ""),
    ("bf16_d128_fma_lazy", "bfloat16", 128, {}, "fma,lazy"),
    ("bf16_d72_causal_lazy", "bfloat16", 72, {"causal": "bottom_right"}, "lazy"),
    ("bf16_d128_tma", "bfloat16", 128, {}, "tma"),
    ("fp16_d80_tma_causal", "float16", 80, {"causal": "bottom_right"}, "tma,fma"),
    ("bf16_d128_ws", "bfloat16", 128, {}, "ws"),
    ("bf16_d128_lpt_causal", "bfloat16", 128, {"causal": "bottom_right"}, "lpt"),
    ("bf16_d64_nospec", "bfloat16", 64, {}, "nospec"),
]


def _spec(kw, b, h, lq, lk):
    import torch

    from attnverify.spec import Spec

    args = {"causal": kw.get("causal", "none")}
    if "window" in kw:
        args["window"] = kw["window"]
    if "softcap" in kw:
        args["softcap"] = kw["softcap"]
    if kw.get("alibi"):
        args["alibi_slopes"] = torch.rand(h)
    if kw.get("varlen"):
        args.update(cu_seqlens_q=torch.tensor([0, 100, lq], dtype=torch.int32),
                    cu_seqlens_k=torch.tensor([0, 90, lk], dtype=torch.int32), max_seqlen_q=lq - 100,
                    max_seqlen_k=lk - 90)
    if kw.get("sinks"):
        args["sinks"] = torch.zeros(h)
    return Spec(**args)


def _strip(text: str) -> str:
    text = re.sub(r"^\s*\.(loc|file)\b.*$", "", text, flags=re.M)
    text = re.sub(r"\s*loc\((#loc\d*|\"[^\"]*\"[^)]*)\)", "", text)
    text = re.sub(r"^#loc.*$", "", text, flags=re.M)
    text = re.sub(r"\.section\s+\.debug.*?}", "", text, flags=re.S)
    return "\n".join(x for x in text.splitlines() if x.strip())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma list of case names (default: all)")
    ap.add_argument("--dump", default="", help="folder to write each case's PTX and TTGIR into")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("kernel_fingerprint: unset TRITON_INTERPRET (it compiles, it does not interpret)")
    os.environ.setdefault("TRITON_DISABLE_LINE_INFO", "1")
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="kfp_cache_"))
    import torch
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from attnverify.kernels import launch, variants

    driver.set_active(_fake_driver())
    compiled = []
    run = JITFunction.run

    def warm_only(self, *a, grid, warmup, **kw):  # compile, never launch
        kernel = run(self, *a, grid=grid, warmup=True, **kw)
        compiled.append(kernel)
        return kernel

    JITFunction.run = warm_only
    only = {x for x in args.only.split(",") if x}
    b, h, lq, lk = 2, 4, 300, 300
    for name, dt, d, kw, var in CASES:
        if only and name not in only:
            continue
        dtype = getattr(torch, dt)
        spec = _spec(kw, b, h, lq, lk)
        bb = 1 if kw.get("varlen") else b
        q, k, v = (torch.randn(bb, h, lq, d).to(dtype) for _ in range(3))
        cfg = launch.default_config(d, dtype, "cuda")
        if var:
            cfg = replace(cfg, **variants.parse(var))
        compiled.clear()
        try:
            launch.forward(q, k, v, spec, config=cfg)
        except Exception as e:  # a compile failure is a fingerprint too (WS fails on sm_90 with Triton 3.9)
            print(f"{name:28s} error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            continue
        kern = compiled[-1]
        ttgir, ptx = _strip(kern.asm["ttgir"]), _strip(kern.asm["ptx"])
        hg = hashlib.sha256(ttgir.encode()).hexdigest()[:16]
        hp = hashlib.sha256(ptx.encode()).hexdigest()[:16]
        print(f"{name:28s} ttgir={hg} ptx={hp} smem={kern.metadata.shared}", flush=True)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            for ext, text in (("ttgir", ttgir), ("ptx", ptx)):
                with open(os.path.join(args.dump, f"{name}.{ext}"), "w") as f:
                    f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
