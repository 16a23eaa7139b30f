"""This process's CUDA state, and judging on a GPU that other processes share: an example that ran out of device
memory because others hold it is judged again, and a process gives back the memory it cached when the device is
crowded.

Several judging processes on one GPU (pytest-xdist workers, or runs started side by side) each keep what PyTorch's
caching allocator took for the largest case they judged. On an 80 GB H100 (2026-12-05) 11 to 14 such processes of
the thorough profile ran out of memory in about 1% of their examples: every one an `error` (attnverify.check), none
a verdict. Rules, one home:

- `cuda_initialised()`, `lost_context()`: whether this process has started CUDA (then it must not fork), and whether
  its context still works (a synchronize that raises: the context is lost). Neither imports torch.
- `judge(prop, adapter, drawn)`: an example whose result is an error that says the device ran out of memory is
  judged again, at most RETRIES times, after this process returns its cached blocks (`gc.collect`,
  `torch.cuda.empty_cache`) and waits BACKOFF_S seconds for the others (booked to the `oom_wait` phase of the time
  split). Not judged again: a device fault (`properties.base.device_fault`: "CUDA error: out of memory", a Triton
  launch's "Triton Error [CUDA]: out of memory", after which the project treats the context as lost and the judging
  child exits) or a context a synchronize finds lost; under ATTNVERIFY_OOM_RETRY=auto (the default) also an example
  too big for the device whoever else is there: torch's message says at the moment it failed how much it asked
  for, the device's capacity and this process's use (`fits_without_others`), and where a message has no numbers
  (cuBLAS's workspace) the others' share is read after this process returned its cache (CROWDED_FREE). `always`
  judges every such error again but a device fault or a lost context, `never` none. What the error's text settles
  is settled first; only the sampling of the others' share returns the cache (booked to `oom_wait`) before it
  decides. Only such errors: a pass, a wrong answer, a
  skip or any other error stands as it came (a wrong forward whose backward then ran out of memory is `failed`:
  it stands too). An example out of memory on every try stays an error saying how often it was tried; one whose
  retry ends in another error keeps the first try's message beside it. The result says how often it was judged
  again (`ExampleResult.retried`, journaled).
- `release_if_crowded()`: after every example, a process with a CUDA context returns its cached blocks when the
  device's free memory is under CROWDED_FREE of the whole and the process itself holds more than KEEP_BYTES
  (reserved by the allocator): what one process cached for a large case goes back to the others before they need
  it. With the device to itself and room to spare, nothing is released (the next example reuses the cache).
"""
from __future__ import annotations

import gc
import os
import re
import sys
import time

from .timesplit import phase

RETRIES = 2
BACKOFF_S = (1.0, 4.0)  # the wait before each retry: the other processes' examples end and give their cache back
CROWDED_FREE = 0.25  # free memory under this share of the device: crowded; others holding more than it: crowded by them
KEEP_BYTES = 1 << 30  # a process holding less than this keeps its cache even on a crowded device
RETRY_ENV = "ATTNVERIFY_OOM_RETRY"
RETRY_MODES = ("auto", "always", "never")


def says_out_of_memory(text: str) -> bool:
    """Whether an error message says a device ran out of memory (torch's OutOfMemoryError, a CUDA or Triton launch
    error, cuBLAS's CUBLAS_STATUS_ALLOC_FAILED). check.out_of_memory applies it to exceptions."""
    text = (text or "").lower()
    return "out of memory" in text or "alloc_failed" in text


def cuda_initialised() -> bool:
    """Whether this process has initialised CUDA (then forking it is unsafe); never imports torch."""
    t = sys.modules.get("torch")
    try:
        return bool(t is not None and t.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch without CUDA support
        return False


def _torch_cuda():
    """torch.cuda when this process has initialised CUDA, else None (never imports torch)."""
    return sys.modules["torch"].cuda if cuda_initialised() else None


def lost_context() -> str:
    """'' while this process's CUDA context (if it has one) still works, else the error a synchronize raises.

    An error that does not read as a device fault can leave the context faulted all the same: cuDNN's
    "mha_graph.execute(...).is_good() ... got false" did, and the next example, built on the dead context,
    failed with "misaligned address" and was shrunk in its place (H200 re-run of 2026-12-04,
    docs/compatibility.md F32). Never imports torch."""
    cuda = _torch_cuda()
    if cuda is None:
        return ""
    try:
        cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - whatever the runtime raises is the lost context's own error
        return f"{type(e).__name__}: {e}".strip()
    return ""


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


def crowded_by_others(free: int, total: int, reserved: int) -> bool:
    """Other processes hold more than CROWDED_FREE of the device (all that is neither free nor this process's)."""
    return total > 0 and total - free - reserved > CROWDED_FREE * total


def release_if_crowded() -> bool:
    """Return this process's cached blocks when the device is crowded (module doc). -> whether it did."""
    cuda = _torch_cuda()
    if cuda is None:
        return False
    try:
        reserved = cuda.memory_reserved()  # the allocator's own count, no driver call: most examples stop here
        if reserved <= KEEP_BYTES:
            return False
        free, total = cuda.mem_get_info()
        if not crowded(free, total, reserved):
            return False
        cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a lost context: the next example's result says so
        return False
    return True


def retry_mode() -> str:
    """ATTNVERIFY_OOM_RETRY, read now: auto (the default), always or never."""
    mode = os.environ.get(RETRY_ENV, "auto").strip().lower() or "auto"
    if mode not in RETRY_MODES:
        raise ValueError(f"{RETRY_ENV}={os.environ.get(RETRY_ENV)!r}: use one of {', '.join(RETRY_MODES)} "
                         f"(auto: judge an out-of-memory example again when other processes crowd the device)")
    return mode


def out_of_memory_error(res) -> bool:
    """An error ExampleResult (not a verdict) that says the device ran out of memory."""
    return getattr(res, "status", None) == "error" and says_out_of_memory(getattr(res, "message", ""))


_GIB = {"B": 1 / 2**30, "KiB": 1 / 2**20, "MiB": 1 / 2**10, "GiB": 1.0, "TiB": 2.0**10}


def _gib(text: str, pattern: str):
    m = re.search(pattern + r" ([\d.]+) ?(B|KiB|MiB|GiB|TiB)", text)
    return float(m.group(1)) * _GIB[m.group(2)] if m else None


def fits_without_others(message: str):
    """From torch's OutOfMemoryError text, at the moment it failed: whether the allocation asked for plus what this
    process held would fit the device if the other processes held nothing (True: they are to blame; False: the
    case is too big for the device whoever else is there), or None where the text does not say."""
    asked = _gib(message, r"Tried to allocate")
    total = _gib(message, r"total capacity of")
    mine = _gib(message, r"this process has")  # "Including non-PyTorch memory, this process has X GiB memory in use"
    if asked is None or total is None:
        return None
    return asked + (mine or 0.0) <= total


def _ruled_out(res, mode: str) -> bool:
    """What says before anything is returned or waited for that a retry of the out-of-memory error `res` cannot go
    otherwise: `never`, a device fault or a lost context, or torch's numbers showing the case too big for the device."""
    from .properties.base import device_fault

    if mode == "never" or device_fault(res.message) or lost_context():
        return True
    return mode == "auto" and fits_without_others(res.message) is False


def _others_to_blame(res, mode: str) -> bool:
    """After this process returned its cache (not ruled out): whether the others' memory is why `res` ran out."""
    if mode == "always" or fits_without_others(res.message):
        return True  # told to, or torch's own numbers at the moment it failed
    cuda = _torch_cuda()
    if cuda is None:
        return False  # no device of this process's to look at: nothing says the others are to blame
    try:  # no numbers in the message (cuBLAS's workspace): the others' share now
        free, total = cuda.mem_get_info()
        return crowded_by_others(free, total, cuda.memory_reserved())
    except Exception:  # noqa: BLE001 - a lost context
        return False


def judge(prop, adapter, drawn, on_retry=None):
    """`prop.run_example(adapter, drawn)`, judged again after running out of device memory (module doc).
    `on_retry("wait", n)` is called before the n-th retry's wait and `on_retry("go", n)` after it (the forked judge
    tells its driver: the wait is not the example's time, and each try has the whole per-example timeout)."""
    t0 = time.perf_counter()
    res = prop.run_example(adapter, drawn)
    mode = retry_mode() if out_of_memory_error(res) else "never"
    tries, first = 0, getattr(res, "message", "")
    while out_of_memory_error(res) and tries < RETRIES and not _ruled_out(res, mode):
        if on_retry is not None:
            on_retry("wait", tries + 1)
        with phase("oom_wait"):
            release_cache()
            if not _others_to_blame(res, mode):
                break
            time.sleep(BACKOFF_S[min(tries, len(BACKOFF_S) - 1)])
        if on_retry is not None:
            on_retry("go", tries + 1)
        tries += 1
        res = prop.run_example(adapter, drawn)
    if tries and hasattr(res, "retried"):
        res.retried = tries
        res.seconds = time.perf_counter() - t0
        waited = f"{sum(BACKOFF_S[:tries]):g} s"
        if out_of_memory_error(res):
            res.message += (f"\n(out of device memory on each of {tries + 1} tries: this process's cache returned "
                            f"and {waited} waited between them)")
        elif res.status == "error":
            res.message += f"\n(the first try ran out of device memory: {first.strip().splitlines()[0][:300]})"
    release_if_crowded()
    return res
