"""Measuring one call: peak extra memory, time, and the operator/kernel names it ran.

    peak_extra_bytes(call, device)   peak bytes allocated during call() beyond what was allocated before it
    time_call(call, device)          median time in ms, and how it was measured
    profile_names(call, device)      {"ops", "kernels", "top_ops"} seen by the profiler during one call

Used by `attnverify bench` and by the memory_scaling property; knows nothing of either.
"""
from __future__ import annotations

import gc
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from typing import Callable, Dict

import torch

_TRIVIAL = re.compile(r"^aten::(empty|empty_like|empty_strided|as_strided|view|_unsafe_view|reshape|_reshape_alias|"
                      r"transpose|t|expand|permute|detach|alias|resolve_conj|resolve_neg|slice|select|unsqueeze|"
                      r"squeeze|contiguous|to|_to_copy|lift_fresh|result_type|zeros|zero_|fill_|scalar_tensor|"
                      r"size|stride|is_nonzero|item|_local_scalar_dense|split|chunk|narrow|clone|copy_|ones_like|"
                      r"zeros_like|full|full_like|arange|ones|new_empty|new_zeros)$")


class _QuietFd2:
    """Silence file descriptor 2 while the profiler starts and stops (libkineto prints USDT/STAGE lines
    there that no Python setting turns off). Python exceptions are unaffected."""

    def __enter__(self):
        try:
            sys.stderr.flush()
            self._saved = os.dup(2)
            self._null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(self._null, 2)
        except OSError:
            self._saved = None
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            try:
                sys.stderr.flush()
            except Exception:
                pass
            os.dup2(self._saved, 2)
            os.close(self._saved)
            os.close(self._null)
        return False


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def peak_extra_bytes(call: Callable[[], object], device, warmup: bool = True) -> int:
    """Peak bytes allocated during `call()` beyond what was allocated before it (after a warm-up call).

    CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats. CPU: the running sum of the
    profiler's allocation/free events ([memory] events of the CPU allocator) during the call.
    """
    dev = torch.device(device)
    # garbage from earlier calls (autograd graphs in reference cycles) freed by a gc pass *during* the
    # measured call lowers its net peak: the bundled kernel's fwd+bwd read 16 / 8 / 65 MiB at N / 2N / 4N
    gc.collect()
    if warmup:
        r = call()
        synchronize(dev)
        del r
    gc.collect()
    if dev.type == "cuda":
        synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        r = call()
        synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del r
        return int(max(0, peak))
    from torch.profiler import ProfilerActivity, profile

    with _QuietFd2(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        r = call()
        del r
    return int(max(0, _cpu_peak_from_profile(prof)))


def _cpu_peak_from_profile(prof) -> int:
    try:
        evs = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    except Exception:  # pragma: no cover - profiler internals moved
        evs = []
    evs.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in evs:
        if e.device_type() != torch.autograd.DeviceType.CPU:
            continue
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def time_call(call: Callable[[], object], device, *, warmup: int = 3, rep: int = 10, budget_s: float = 3.0,
              gpu_warmup_ms: float = 25.0, gpu_rep_ms: float = 100.0) -> dict:
    """Median time of `call()` in ms, and how it was measured."""
    dev = torch.device(device)
    if dev.type == "cuda":
        try:
            from triton.testing import do_bench

            ms = do_bench(call, warmup=gpu_warmup_ms, rep=gpu_rep_ms, return_mode="median")
            return {"ms": float(ms), "method": f"triton.testing.do_bench median (warm-up {gpu_warmup_ms:g} ms, "
                                             f"rep {gpu_rep_ms:g} ms)"}
        except ImportError:
            for _ in range(warmup):
                call()
            synchronize(dev)
            times = []
            for _ in range(max(rep, 3)):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                call()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            return {"ms": statistics.median(times), "method": f"CUDA events median of {len(times)} after {warmup} warm-up"}
    for _ in range(warmup):
        call()
    times = []
    t_start = time.perf_counter()
    while len(times) < rep and (len(times) < 3 or time.perf_counter() - t_start < budget_s):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": statistics.median(times), "method": f"wall-clock median of {len(times)} after {warmup} warm-up (CPU, synchronous)"}


def profile_names(call: Callable[[], object], device, top: int = 6) -> dict:
    """Operators (and CUDA kernels) seen during one call, by time: {"ops": [...], "kernels": [...]}."""
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with _QuietFd2(), profile(activities=acts) as prof:
        r = call()
        synchronize(dev)
        del r
    ops: Dict[str, float] = defaultdict(float)
    kernels: Dict[str, float] = defaultdict(float)
    for e in prof.events():
        try:
            dt = e.device_type
            dur = float(e.time_range.elapsed_us())
        except Exception:  # pragma: no cover
            continue
        if dt == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += dur
        elif e.name.startswith("aten::") or not e.name.startswith("["):
            ops[e.name] += float(getattr(e, "self_cpu_time_total", dur) or 0.0) + 1e-9
    rank = lambda d: [n for n, _ in sorted(d.items(), key=lambda kv: -kv[1])]  # noqa: E731
    return {"ops": rank(ops), "kernels": rank(kernels)[:top * 3], "top_ops": [n for n in rank(ops) if not _TRIVIAL.match(n)][:top]}
