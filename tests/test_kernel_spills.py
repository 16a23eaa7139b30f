"""The split-KV decode kernel's tiles spill no registers for sm_90 (compiled without a GPU by the stand-in driver,
the cubin Triton built read by its bundled cuobjdump: benchmarks/kernel_spills.py). A spill is local memory that
every launch reserves for the whole GPU: 640 bytes a thread at float32 D = 128 with the old 16 x 64 tiles, about
170 MB on an H100, and such launches failed with "out of memory" on GPUs shared with other processes
(attnverify/kernels/serving.py)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import kernel_spills  # noqa: E402

pytestmark = pytest.mark.skipif(kernel_spills.cuobjdump_path() is None,
                                reason="needs Triton's NVIDIA backend and its cuobjdump (the pip wheel on x86-64 Linux)")


@pytest.mark.parametrize("spec", ["float32:64:64", "float32:128:64", "float32:512:16", "bfloat16:128:64"])
def test_the_decode_tiles_spill_nothing(spec):
    res = kernel_spills.measure(spec)
    assert res["stack_bytes"] == 0, res


def test_the_measurement_sees_the_old_tiles_spill():
    """The same reading on the tiles float32 D = 128 had before (16 x 64, 2 stages): 640 bytes a thread."""
    res = kernel_spills.measure("float32:128:64:16x64x2")
    assert res["tiles"] == [16, 64, 2] and res["stack_bytes"] > 256, res
