"""A stand-in Triton driver for a machine without a GPU: it reports an sm_90 target, compiles through the real
`triton.runtime.jit` path (Triton's bundled ptxas, its disk cache in TRITON_CACHE_DIR) and never launches.

    import standin_driver; standin_driver.install()   # before the first launch, TRITON_INTERPRET unset

After `install()` every `kernel[grid](...)` compiles (or finds its compile in the disk cache) and returns
without running, as `JITFunction.warmup` does; outputs stay uninitialised. With `cuda_tiles=True` the
launcher's default configuration is the one it picks for CUDA tensors (the H200 tiles and switches), though
the tensors are CPU tensors, so the keys compiled are the ones an H200 run compiles for those shapes.
Used by benchmarks/compile_cost_cpu.py, tests/test_prewarm.py and scripts/kernel_fingerprint.py (its one home).
Needs Triton 3.6+ with its NVIDIA backend (the pip wheel has it).
"""
from __future__ import annotations

import os


def nogpu_driver():
    """A CudaDriver that reports sm_90 and never touches libcuda (also scripts/kernel_fingerprint.py's)."""
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


def install(cuda_tiles: bool = True) -> None:
    """Make this process compile for sm_90 without a GPU and never launch (idempotent)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("standin_driver: unset TRITON_INTERPRET (the interpreter compiles nothing)")
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    if getattr(JITFunction.run, "standin", False):
        return
    driver.set_active(nogpu_driver())
    run = JITFunction.run

    def warm_only(self, *a, grid, warmup, **kw):  # compile (or read the disk cache), never launch
        return run(self, *a, grid=grid, warmup=True, **kw)

    warm_only.standin = True
    JITFunction.run = warm_only
    if cuda_tiles:
        from attnverify.kernels import launch

        real = launch.default_config

        def default_config(head_dim, dtype, device_type, head_dim_v=None):
            return real(head_dim, dtype, "cuda", head_dim_v)

        launch.default_config = default_config
