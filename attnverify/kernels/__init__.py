"""The bundled Triton FlashAttention kernel: jit kernels (flash_fwd, flash_bwd) -> host launchers
(launch) -> autograd.Function (autograd). Importing this package imports nothing of Triton;
`flash_attention` is loaded on first use. Set TRITON_INTERPRET=1 before first use to run on a CPU.
`paged_decode` (kernels/serving.py) is the serving path: split-KV decode (decode.py) over paged or
contiguous KV caches, merged by the LSE combine kernel (combine.py); forward only.
"""
from __future__ import annotations

__all__ = ["flash_attention", "paged_decode"]


def __getattr__(name):
    if name == "flash_attention":
        from .autograd import flash_attention

        return flash_attention
    if name == "paged_decode":
        from .serving import paged_decode

        return paged_decode
    raise AttributeError(name)
