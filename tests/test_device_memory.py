"""An example that ran out of device memory is judged again after the process gives its cache back
(attnverify.device_memory): on a GPU shared by 11-19 judging processes (H100, 2026-12-05) 1-3% of the thorough
profile's examples ended as out-of-memory errors, never a verdict. Only such errors are judged again; a verdict
stands, and an example that runs out of memory every time stays an error."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from attnverify import device_memory
from attnverify.isolation import InProcessRunner
from attnverify.properties.base import ExampleResult

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OOM = "[k] ERROR: B=1 Hq=1 ... | backward: OutOfMemoryError: CUDA out of memory. Tried to allocate 1.60 GiB."


class _Scripted:
    """A property whose examples come out as scripted, one result per call (the last one repeats)."""

    name = "scripted"

    def __init__(self, *results):
        self.results, self.calls = list(results), 0

    def run_example(self, adapter, drawn):
        r = self.results[min(self.calls, len(self.results) - 1)]
        self.calls += 1
        return ExampleResult(**r)


class _FakeCuda:
    """torch.cuda as device_memory reads it: a device of 80 GiB, `free` of it free, `reserved` held here."""

    def __init__(self, free_gib, reserved_gib, lost=False):
        self.free, self.reserved, self.lost, self.emptied = int(free_gib * GIB), int(reserved_gib * GIB), lost, 0

    def mem_get_info(self):
        return self.free, 80 * GIB

    def memory_reserved(self):
        return self.reserved

    def empty_cache(self):
        self.emptied += 1
        self.free, self.reserved = self.free + self.reserved, 0

    def synchronize(self):
        if self.lost:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


GIB = 1 << 30


def _oom(text=OOM):
    return dict(passed=False, message=text, severity=1e30, status="error")


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch):
    monkeypatch.setattr(device_memory, "BACKOFF_S", (0.0, 0.0))
    monkeypatch.delenv("ATTNVERIFY_OOM_RETRY", raising=False)


@pytest.fixture
def gpu(monkeypatch):
    """A fake CUDA device that other processes crowd: 8 of 80 GiB free, 2 GiB cached by this process."""
    cuda = _FakeCuda(free_gib=8, reserved_gib=2)
    monkeypatch.setattr(device_memory, "_torch_cuda", lambda: cuda)
    return cuda


def test_an_out_of_memory_error_is_judged_again_after_the_cache_is_returned(gpu):
    prop = _Scripted(_oom(), dict(passed=True, severity=0.3))
    emptied_at_call = []
    run = prop.run_example
    prop.run_example = lambda a, d: (emptied_at_call.append(gpu.emptied), run(a, d))[1]
    res = device_memory.judge(prop, None, {})
    assert (res.status, res.retried, prop.calls) == ("passed", 1, 2)
    assert emptied_at_call == [0, 1]  # the cache went back before the second try
    assert res.to_dict()["retried"] == 1 and ExampleResult.from_dict(res.to_dict()).retried == 1


def test_the_retry_can_fail_a_wrong_answer_found_after_an_out_of_memory_error(gpu):
    prop = _Scripted(_oom(), dict(passed=False, message="out: MISMATCH", severity=7.0))
    res = device_memory.judge(prop, None, {})
    assert (res.status, res.severity, res.retried) == ("failed", 7.0, 1)


def test_an_example_out_of_memory_every_time_stays_an_error_that_says_so(gpu):
    prop = _Scripted(_oom())
    res = device_memory.judge(prop, None, {})
    assert res.status == "error" and prop.calls == device_memory.RETRIES + 1 == 3
    assert res.message.startswith(OOM) and "(out of device memory on each of 3 tries" in res.message


def test_a_retry_that_ends_in_another_error_keeps_the_first_message(gpu):
    prop = _Scripted(_oom(), _oom("[k] ERROR: ... forward: RuntimeError: shape mismatch"))
    res = device_memory.judge(prop, None, {})
    assert res.status == "error" and "shape mismatch" in res.message
    assert "the first try ran out of device memory: [k] ERROR" in res.message


TORCH_OOM = ("CUDA out of memory. Tried to allocate {asked}. GPU 0 has a total capacity of 79.18 GiB of which 928.75 MiB "
             "is free. Process 698 has 744.00 MiB memory in use. Including non-PyTorch memory, this process has 4.20 GiB "
             "memory in use. Of the allocated memory 3.10 GiB is allocated by PyTorch")


def test_torch_says_whether_the_case_would_fit_without_the_others():
    assert device_memory.fits_without_others(TORCH_OOM.format(asked="1.60 GiB")) is True
    assert device_memory.fits_without_others(TORCH_OOM.format(asked="206.00 MiB")) is True
    assert device_memory.fits_without_others(TORCH_OOM.format(asked="76.00 GiB")) is False  # 76 + 4.2 > 79.18
    assert device_memory.fits_without_others("Triton Error [CUDA]: out of memory") is None


@pytest.mark.parametrize("asked,retried", [("1.60 GiB", 1), ("76.00 GiB", 0)])
def test_a_case_too_big_for_the_device_is_not_judged_again(asked, retried, monkeypatch):
    """The numbers torch gives at the moment it failed decide, not the device's state after (the others may have
    returned their caches by then): a device with room now does not stop a retry the numbers call for."""
    cuda = _FakeCuda(free_gib=70, reserved_gib=1)  # not crowded now
    monkeypatch.setattr(device_memory, "_torch_cuda", lambda: cuda)
    prop = _Scripted(_oom("[k] ERROR: ... OutOfMemoryError: " + TORCH_OOM.format(asked=asked)), dict(passed=True))
    assert device_memory.judge(prop, None, {}).retried == retried
    assert cuda.emptied == retried  # a case ruled out by its numbers costs no cache returned and no wait


def test_cublas_out_of_workspace_is_out_of_memory_not_a_device_fault(gpu):
    from attnverify.properties.base import device_fault

    text = "[k] ERROR: ... RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    assert not device_fault(text) and device_fault("CUDA error: an illegal memory access was encountered")
    prop = _Scripted(_oom(text), dict(passed=True))
    assert device_memory.judge(prop, None, {}).retried == 1


@pytest.mark.parametrize("case", ["device-fault", "lost-context", "not-crowded", "no-cuda", "never"])
def test_no_retry_where_a_retry_cannot_help_or_the_context_is_lost(case, monkeypatch):
    """A device fault's OOM (the judging child exits after it), a context a synchronize finds lost, a device with
    room (the case's own size: a retry repeats it), no CUDA to look at, or ATTNVERIFY_OOM_RETRY=never."""
    cuda = {"device-fault": _FakeCuda(8, 2), "lost-context": _FakeCuda(8, 2, lost=True),
            "not-crowded": _FakeCuda(70, 2), "no-cuda": None, "never": _FakeCuda(8, 2)}[case]
    monkeypatch.setattr(device_memory, "_torch_cuda", lambda: cuda)
    if case == "never":
        monkeypatch.setenv("ATTNVERIFY_OOM_RETRY", "never")
    text = "[k] ERROR: ... forward: RuntimeError: Triton Error [CUDA]: out of memory" if case == "device-fault" else OOM
    prop = _Scripted(_oom(text), dict(passed=True))
    res = device_memory.judge(prop, None, {})
    assert (res.status, res.retried, prop.calls) == ("error", 0, 1) and res.message == text


def test_always_judges_again_where_the_others_cannot_be_seen(monkeypatch):
    monkeypatch.setattr(device_memory, "_torch_cuda", lambda: None)
    monkeypatch.setenv("ATTNVERIFY_OOM_RETRY", "always")
    prop = _Scripted(_oom(), dict(passed=True))
    assert device_memory.judge(prop, None, {}).retried == 1


def test_a_bad_retry_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("ATTNVERIFY_OOM_RETRY", "sometimes")
    with pytest.raises(ValueError, match="ATTNVERIFY_OOM_RETRY='sometimes'.*auto, always, never"):
        device_memory.judge(_Scripted(_oom()), None, {})


@pytest.mark.parametrize("result", [
    dict(passed=True, severity=0.2),
    dict(passed=False, message="out: MISMATCH (the backward then ran out of memory)", severity=4.0),  # a verdict
    dict(passed=False, message="the property raised ValueError: unsupported head dim", severity=1e30, status="error"),
    dict(passed=True, message="not claimed", status="skipped"),
], ids=["pass", "wrong-answer", "other-error", "skip"])
def test_anything_else_is_judged_once(result, gpu):
    prop = _Scripted(result, dict(passed=True))
    res = device_memory.judge(prop, None, {})
    assert prop.calls == 1 and res.retried == 0 and res.status == ExampleResult(**result).status
    assert "retried" not in res.to_dict()


def test_the_in_process_runner_judges_again_too_and_books_the_wait(gpu):
    prop = _Scripted(_oom(), dict(passed=True))
    res = InProcessRunner()(prop, None, {})
    assert (res.status, res.retried, prop.calls) == ("passed", 1, 2)
    assert "oom_wait" in res.split  # the cache returned and the wait: not `other`


@pytest.mark.parametrize("free_gib,reserved_gib,emptied", [(5, 4, 1), (5, 0.5, 0), (40, 30, 0)],
                         ids=["crowded-and-holding", "crowded-holding-little", "room"])
def test_after_each_example_a_crowded_device_gets_the_cache_back(free_gib, reserved_gib, emptied, monkeypatch):
    cuda = _FakeCuda(free_gib, reserved_gib)
    monkeypatch.setattr(device_memory, "_torch_cuda", lambda: cuda)
    device_memory.judge(_Scripted(dict(passed=True)), None, {})
    assert cuda.emptied == emptied


@pytest.mark.parametrize("free_gib,reserved_gib,expected", [
    (10, 4, True),   # 10 of 80 GiB free, 4 GiB cached here: give it back
    (10, 0.5, False),  # crowded, but this process holds little: keep it (its next example reuses it)
    (40, 30, False),  # half the device free: nobody is short
])
def test_the_crowded_rule(free_gib, reserved_gib, expected):
    assert device_memory.crowded(int(free_gib * GIB), 80 * GIB, int(reserved_gib * GIB)) is expected


def test_crowded_by_others_counts_what_is_neither_free_nor_ours():
    assert device_memory.crowded_by_others(8 * GIB, 80 * GIB, 2 * GIB)  # others hold 70
    assert not device_memory.crowded_by_others(8 * GIB, 80 * GIB, 60 * GIB)  # we hold most of it: our own size


def test_the_message_rule_is_the_one_check_uses():
    from attnverify.check import out_of_memory

    for text in ("CUDA out of memory. Tried to allocate 2 GiB", "Triton Error [CUDA]: out of memory",
                 "CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"):
        assert device_memory.says_out_of_memory(text) and out_of_memory(RuntimeError(text))
    assert not device_memory.says_out_of_memory("illegal memory access") and not out_of_memory(ValueError("x"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the cache given back is a device's")
def test_a_crowded_device_gets_the_cache_back_on_a_gpu(monkeypatch):
    x = torch.empty(1 << 29, dtype=torch.float32, device="cuda")  # 2 GiB
    del x
    assert torch.cuda.memory_reserved() >= 1 << 31
    monkeypatch.setattr(device_memory, "CROWDED_FREE", 1.01)  # every device is crowded
    assert device_memory.release_if_crowded() and torch.cuda.memory_reserved() < 1 << 30


ADAPTER = textwrap.dedent('''
    """A stranger's CPU kernel whose first call in each process runs out of memory, as on a crowded GPU."""
    import torch
    import attnverify as av

    CALLS = [0]


    @av.adapter("oom-first", register=False, dtypes=("float32",), devices=("cpu",), head_dims=(16, 32, 64))
    def oom_first(q, k, v, spec):
        CALLS[0] += 1
        if CALLS[0] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        s = (q.double() @ k.double().transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
        return (torch.softmax(s, -1) @ v.double()).to(q.dtype)
''')


def test_a_file_adapter_out_of_memory_once_passes_through_the_cli(tmp_path):
    """Through the CLI and the forked judge (the default isolation), as a user runs it: the one example that ran out
    of memory is judged again, passes, and the journal says it was retried."""
    (tmp_path / "oom_first.py").write_text(ADAPTER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               ATTNVERIFY_NO_HTML="1", ATTNVERIFY_OOM_RETRY="always")  # no GPU here to see the others on
    env.pop("PYTEST_XDIST_WORKER", None)
    res = subprocess.run([sys.executable, "-m", "attnverify.cli", "run", "--adapter", "oom_first.py:oom_first",
                          "--profile", "ci", "--seed", "1", "-n", "0", "--isolate", "subprocess", "--report", "rep",
                          "-k", "forward_matches_reference"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    path = tmp_path / "rep" / "results.jsonl"
    rows = [json.loads(x) for x in (gzip.open(path, "rt") if path.suffix == ".gz" else open(path))]
    results = [r for r in rows if r.get("event") == "result"]
    assert results and all(r["status"] == "passed" for r in results)
    assert [r.get("retried", 0) for r in results].count(1) == 1 and sum(r.get("retried", 0) for r in results) == 1


class _SlowOomOnce:
    """Each try takes 0.7 s; the first runs out of memory."""

    name = "slow-oom-once"

    def __init__(self):
        self.calls = 0

    def run_example(self, adapter, drawn):
        import time

        time.sleep(0.7)
        self.calls += 1
        return ExampleResult(**(_oom() if self.calls == 1 else dict(passed=True, severity=0.1)))


class _Timed:
    """Tries of `first` then `then` seconds; the first runs out of memory."""

    name = "timed-oom-once"

    def __init__(self, first, then):
        self.calls, self.first, self.then = 0, first, then

    def run_example(self, adapter, drawn):
        import time

        self.calls += 1
        time.sleep(self.first if self.calls == 1 else self.then)
        return ExampleResult(**(_oom() if self.calls == 1 else dict(passed=True, severity=0.1)))


def _forked(prop, timeout, backoff, monkeypatch):
    from attnverify.isolation import SubprocessRunner

    monkeypatch.setattr(device_memory, "BACKOFF_S", backoff)  # the child is forked with both
    monkeypatch.setenv("ATTNVERIFY_OOM_RETRY", "always")
    r = SubprocessRunner(timeout=timeout)
    try:
        import time

        t0 = time.perf_counter()
        return r(prop, None, {}), time.perf_counter() - t0
    finally:
        r.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the forked judge needs os.fork")
def test_each_try_has_the_whole_per_example_timeout_in_the_forked_judge(monkeypatch):
    """Two tries of 0.7 s and a 0.2 s wait under a 1.2 s per-example limit: the judge tells its driver around the
    wait and the limit starts again for the retry; otherwise the retry would end as a `timeout` failure."""
    res, _ = _forked(_Timed(0.7, 0.7), 1.2, (0.2, 0.2), monkeypatch)
    assert (res.status, res.retried) == ("passed", 1), res.message


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the forked judge needs os.fork")
def test_the_wait_is_not_the_examples_time_in_the_forked_judge(monkeypatch):
    """A 1 s wait under a 0.6 s per-example limit, tries of 0.1 s: the wait has its own cap."""
    res, _ = _forked(_Timed(0.1, 0.1), 0.6, (1.0, 1.0), monkeypatch)
    assert (res.status, res.retried) == ("passed", 1), res.message


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the forked judge needs os.fork")
def test_a_retry_that_hangs_meets_the_per_example_timeout_not_the_waits_cap(monkeypatch):
    res, took = _forked(_Timed(0.1, 30.0), 0.5, (0.1, 0.1), monkeypatch)
    assert res.status == "timeout" and took < 10, (res.status, took)
