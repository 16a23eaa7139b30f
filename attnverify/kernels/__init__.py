"""The bundled Triton FlashAttention kernel: jit kernels (flash_fwd, flash_bwd) -> host launchers
(launch) -> autograd.Function (autograd). Importing this package imports nothing of Triton;
`flash_attention` is loaded on first use. Set TRITON_INTERPRET=1 before first use to run on a CPU.
"""
from __future__ import annotations

__all__ = ["flash_attention"]


def __getattr__(name):
    if name == "flash_attention":
        from .autograd import flash_attention

        return flash_attention
    raise AttributeError(name)
