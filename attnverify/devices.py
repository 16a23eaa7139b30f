"""Asking whether a GPU is here without poisoning fork.

`torch.cuda.is_available()` runs cudaGetDeviceCount (unless PYTORCH_NVML_BASED_CUDA_CHECK=1), and
after that torch refuses CUDA in every forked child ("Cannot re-initialize CUDA in forked
subprocess"): on the H200 every isolated judge of `attnverify run` failed so. `torch.cuda.device_count()`
asks NVML first and touches no CUDA context, so the parent stays fork-safe.
"""
from __future__ import annotations


def cuda_present() -> bool:
    import torch

    try:
        return bool(torch.backends.cuda.is_built()) and torch.cuda.device_count() > 0
    except Exception:  # a broken driver install: no usable GPU
        return False
