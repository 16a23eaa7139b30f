"""Whether the bundled Triton kernel claims fp8 inputs with descales here, asked when its claims are first read
(adapters/deferred.py), never at import.

- On CUDA: every visible GPU of compute capability 8.9 or more (Ada, Hopper, Blackwell: fp8 tensor cores; Triton's
  float8e4nv needs sm_89). The capability is read through NVML (no CUDA context, so fork stays safe), else in a
  probe process; unknown means not claimed.
- Under the interpreter (CPU): Triton 3.9 or newer, where fp8 loads, stores and dots were checked
  (tests/test_triton_fp8.py); its fp32 -> fp8 conversion does not round (the kernel rounds P by hand) and it reads
  fp8 NaN / inf bit patterns as finite numbers, so non-finite fp8 inputs are outside the claim there.
"""
from __future__ import annotations

import ctypes
from typing import List, Optional, Tuple

FP8_CLAIMS = dict(dtypes=("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"), descales=True)
MIN_CAPABILITY = (8, 9)
MIN_INTERPRETER_TRITON = (3, 9)

_CAP_PROBE = r"""
import torch
_done(True, caps=[list(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())])
"""


def nvml_capabilities() -> Optional[List[Tuple[int, int]]]:
    """Compute capabilities of the machine's GPUs through NVML, or None when NVML cannot say."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    try:
        if lib.nvmlInit_v2() != 0:
            return None
        n = ctypes.c_uint()
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) != 0:
            return None
        caps = []
        for i in range(n.value):
            h, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)) != 0 or \
                    lib.nvmlDeviceGetCudaComputeCapability(h, ctypes.byref(major), ctypes.byref(minor)) != 0:
                return None
            caps.append((major.value, minor.value))
        return caps or None
    except AttributeError:  # an NVML without these entry points
        return None
    finally:
        try:
            lib.nvmlShutdown()
        except AttributeError:
            pass


def cuda_capabilities() -> Optional[List[Tuple[int, int]]]:
    caps = nvml_capabilities()
    if caps is None:
        from ._external import probe

        ok, _why, info = probe("triton-fp8", _CAP_PROBE, timeout=120)
        caps = [tuple(c) for c in info.get("caps", [])] if ok else None
    return caps or None


def fp8_claims(cuda: bool, triton_version: Optional[str]) -> dict:
    """The fp8 claim keywords ({} when fp8 is not claimed) for a machine with or without CUDA."""
    if cuda:
        caps = cuda_capabilities()
        return dict(FP8_CLAIMS) if caps and min(caps) >= MIN_CAPABILITY else {}
    from ._external import version_tuple

    return dict(FP8_CLAIMS) if triton_version and version_tuple(triton_version) >= MIN_INTERPRETER_TRITON else {}
