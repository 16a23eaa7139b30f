"""Under pytest-xdist on a machine with several GPUs each worker is pinned to one GPU through
CUDA_VISIBLE_DEVICES before anything can initialise CUDA (an outer CUDA_VISIBLE_DEVICES is honoured;
the GPU count comes from ATTNVERIFY_GPU_COUNT or `nvidia-smi -L`; ATTNVERIFY_PIN_GPUS=0 turns it off)."""
from __future__ import annotations

import os
import re
from typing import List, Optional


def _worker_index(worker_id: str) -> int:
    m = re.search(r"(\d+)$", worker_id or "")
    return int(m.group(1)) if m else 0


def gpu_count_without_cuda(environ=None) -> int:
    """GPUs on this machine without initialising CUDA: ATTNVERIFY_GPU_COUNT, else `nvidia-smi -L`."""
    environ = os.environ if environ is None else environ
    if environ.get("ATTNVERIFY_GPU_COUNT", "") != "":
        return int(environ["ATTNVERIFY_GPU_COUNT"])
    from .journal import gpu_names

    return len(gpu_names())


def visible_devices(outer: Optional[str]) -> List[str]:
    """The device list an outer CUDA_VISIBLE_DEVICES names (CUDA stops at the first invalid entry)."""
    devs = []
    for tok in (outer or "").split(","):
        tok = tok.strip()
        if not tok or tok.startswith("-"):
            break
        devs.append(tok)
    return devs


def gpu_for_worker(worker_id: str, outer_visible: Optional[str], gpu_count: int) -> Optional[str]:
    """The CUDA_VISIBLE_DEVICES value for one xdist worker, or None to leave it alone.

    Workers take the visible GPUs round robin (gw0 -> first, gw1 -> second, ...); an outer
    CUDA_VISIBLE_DEVICES restricts and orders the choice; with one GPU or none nothing changes."""
    devs = visible_devices(outer_visible) if outer_visible is not None else [str(i) for i in range(gpu_count)]
    if len(devs) <= 1:
        return None
    return devs[_worker_index(worker_id) % len(devs)]


def pin_worker_gpu(environ=None, gpu_count: Optional[int] = None) -> Optional[str]:
    """Set CUDA_VISIBLE_DEVICES for this xdist worker (no-op outside xdist); returns what it set."""
    environ = os.environ if environ is None else environ
    wid = environ.get("PYTEST_XDIST_WORKER")
    if not wid or environ.get("ATTNVERIFY_PIN_GPUS", "1") == "0" or "ATTNVERIFY_PINNED_GPU" in environ:
        return environ.get("ATTNVERIFY_PINNED_GPU") or None
    outer = environ.get("CUDA_VISIBLE_DEVICES")
    n = 0 if outer is not None else (gpu_count if gpu_count is not None else gpu_count_without_cuda(environ))
    chosen = gpu_for_worker(wid, outer, n)
    environ["ATTNVERIFY_PINNED_GPU"] = chosen or ""
    if chosen is not None:
        environ["CUDA_VISIBLE_DEVICES"] = chosen
    return chosen
