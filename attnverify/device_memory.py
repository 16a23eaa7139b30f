"""Judging on a GPU that other processes share: an example that ran out of device memory is judged again, and a
process gives back the memory it cached when the device is crowded.

Several judging processes on one GPU (pytest-xdist workers, or runs started side by side) each keep what PyTorch's
caching allocator took for the largest case they judged. On an 80 GB H100 (2026-12-05) 11 to 19 such processes of
the thorough profile ran out of memory in 1-3% of their examples: every one an `error` (attnverify.check), none a
verdict. Two rules, one home:

- `judge(prop, adapter, drawn)`: an example whose result is an error that says the device ran out of memory is
  judged again, at most RETRIES times, after this process returns its cached blocks (`gc.collect`,
  `torch.cuda.empty_cache`) and waits BACKOFF_S seconds for the others. Only such errors are judged again: a pass, a
  wrong answer, a skip or any other error stands as it came (a wrong forward whose backward then ran out of memory
  is `failed`: it stands too); an example that runs out of memory every time stays an error, its message saying how
  often it was tried. The result says how often it was judged again (`ExampleResult.retried`, journaled).
- `release_if_crowded()`: after every example, a process with a CUDA context returns its cached blocks when the
  device's free memory is under CROWDED_FREE of the whole and the process itself holds more than KEEP_BYTES
  (reserved by the allocator): what one process cached for a large case goes back to the others before they need
  it. Alone on a GPU, free memory stays high and nothing is released (the next example reuses the cache).

Nothing here imports torch or touches a device unless this process has already initialised CUDA.
"""
from __future__ import annotations

import gc
import sys
import time

RETRIES = 2
BACKOFF_S = (1.0, 4.0)  # the wait before each retry: the other processes' examples end and give their cache back
CROWDED_FREE = 0.25  # the device's free memory under this share of its total: crowded
KEEP_BYTES = 1 << 30  # a process holding less than this keeps its cache even on a crowded device


def says_out_of_memory(text: str) -> bool:
    """Whether an error message says a device ran out of memory (torch's OutOfMemoryError, a CUDA or Triton launch
    error, cuBLAS's CUBLAS_STATUS_ALLOC_FAILED). check.out_of_memory applies it to exceptions."""
    text = (text or "").lower()
    return "out of memory" in text or "alloc_failed" in text


def _torch_cuda():
    """torch.cuda when this process has initialised CUDA, else None (never imports torch)."""
    t = sys.modules.get("torch")
    try:
        return t.cuda if t is not None and t.cuda.is_initialized() else None
    except Exception:  # noqa: BLE001 - a torch without CUDA support
        return None


def release_cache() -> bool:
    """Collect garbage and return this process's cached device blocks to the driver. -> whether CUDA was there."""
    gc.collect()
    cuda = _torch_cuda()
    if cuda is None:
        return False
    try:
        cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a lost context: the example's own result says so
        return False
    return True


def crowded(free: int, total: int, reserved: int) -> bool:
    """The rule of release_if_crowded, on numbers: under CROWDED_FREE of the device free, and more than KEEP_BYTES
    of it held by this process."""
    return total > 0 and free < CROWDED_FREE * total and reserved > KEEP_BYTES


def release_if_crowded() -> bool:
    """Return this process's cached blocks when the device is crowded (module doc). -> whether it did."""
    cuda = _torch_cuda()
    if cuda is None:
        return False
    try:
        free, total = cuda.mem_get_info()
        if not crowded(free, total, cuda.memory_reserved()):
            return False
        cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a lost context: the next example's result says so
        return False
    return True


def out_of_memory_error(res) -> bool:
    """An error ExampleResult (not a verdict) that says the device ran out of memory."""
    return getattr(res, "status", None) == "error" and says_out_of_memory(getattr(res, "message", ""))


def judge(prop, adapter, drawn, on_retry=None):
    """`prop.run_example(adapter, drawn)`, judged again after running out of device memory (module doc).
    `on_retry(n)` is called before the n-th retry and its wait (the forked judge tells its driver, whose
    per-example timeout then starts again: each try, with its wait, has the whole limit)."""
    t0 = time.perf_counter()
    res = prop.run_example(adapter, drawn)
    tries = 0
    while out_of_memory_error(res) and tries < RETRIES:
        if on_retry is not None:
            on_retry(tries + 1)  # the wait below is the retry's
        release_cache()
        time.sleep(BACKOFF_S[min(tries, len(BACKOFF_S) - 1)])
        tries += 1
        res = prop.run_example(adapter, drawn)
    if tries and hasattr(res, "retried"):
        res.retried = tries
        res.seconds = time.perf_counter() - t0
        if out_of_memory_error(res):
            res.message = (f"out of device memory on each of {tries + 1} tries (this process's cache returned and "
                           f"{sum(BACKOFF_S[:tries]):g} s waited between them)\n" + res.message)
    release_if_crowded()
    return res
