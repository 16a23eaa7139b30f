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


def _oom():
    return dict(passed=False, message=OOM, severity=1e30, status="error")


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch):
    monkeypatch.setattr(device_memory, "BACKOFF_S", (0.0, 0.0))


def test_an_out_of_memory_error_is_judged_again_and_its_verdict_counts():
    prop = _Scripted(_oom(), dict(passed=True, severity=0.3))
    res = device_memory.judge(prop, None, {})
    assert (res.status, res.retried, prop.calls) == ("passed", 1, 2)
    assert res.to_dict()["retried"] == 1 and ExampleResult.from_dict(res.to_dict()).retried == 1


def test_the_retry_can_fail_a_wrong_answer_found_after_an_out_of_memory_error():
    prop = _Scripted(_oom(), dict(passed=False, message="out: MISMATCH", severity=7.0))
    res = device_memory.judge(prop, None, {})
    assert (res.status, res.severity, res.retried) == ("failed", 7.0, 1)


def test_an_example_out_of_memory_every_time_stays_an_error_that_says_so():
    prop = _Scripted(_oom())
    res = device_memory.judge(prop, None, {})
    assert res.status == "error" and prop.calls == device_memory.RETRIES + 1 == 3
    assert res.message.startswith("out of device memory on each of 3 tries") and OOM in res.message


@pytest.mark.parametrize("result", [
    dict(passed=True, severity=0.2),
    dict(passed=False, message="out: MISMATCH (the backward then ran out of memory)", severity=4.0),  # a verdict
    dict(passed=False, message="the property raised ValueError: unsupported head dim", severity=1e30, status="error"),
    dict(passed=True, message="not claimed", status="skipped"),
], ids=["pass", "wrong-answer", "other-error", "skip"])
def test_anything_else_is_judged_once(result):
    prop = _Scripted(result, dict(passed=True))
    res = device_memory.judge(prop, None, {})
    assert prop.calls == 1 and res.retried == 0 and res.status == ExampleResult(**result).status
    assert "retried" not in res.to_dict()


def test_the_in_process_runner_judges_again_too():
    prop = _Scripted(_oom(), dict(passed=True))
    res = InProcessRunner()(prop, None, {})
    assert (res.status, res.retried, prop.calls) == ("passed", 1, 2)


@pytest.mark.parametrize("free_gib,reserved_gib,expected", [
    (10, 4, True),   # 10 of 80 GiB free, 4 GiB cached here: give it back
    (10, 0.5, False),  # crowded, but this process holds little: keep it (its next example reuses it)
    (40, 30, False),  # half the device free: nobody is short
])
def test_the_crowded_rule(free_gib, reserved_gib, expected):
    g = 1 << 30
    assert device_memory.crowded(int(free_gib * g), 80 * g, int(reserved_gib * g)) is expected


def test_the_message_rule_is_the_one_check_uses():
    from attnverify.check import out_of_memory

    for text in ("CUDA out of memory. Tried to allocate 2 GiB", "Triton Error [CUDA]: out of memory",
                 "CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"):
        assert device_memory.says_out_of_memory(text) and out_of_memory(RuntimeError(text))
    assert not device_memory.says_out_of_memory("illegal memory access") and not out_of_memory(ValueError("x"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the cache given back is a device's")
def test_a_crowded_device_gets_the_cache_back(monkeypatch):
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
               ATTNVERIFY_NO_HTML="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    res = subprocess.run([sys.executable, "-m", "attnverify.cli", "run", "--adapter", "oom_first.py:oom_first",
                          "--profile", "ci", "--seed", "1", "-n", "0", "--report", "rep", "-k", "forward_matches_reference"],
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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the forked judge needs os.fork")
def test_each_try_has_the_whole_per_example_timeout_in_the_forked_judge(monkeypatch):
    """About 1.7 s in all (two tries of 0.7 s, a 0.2 s wait and a garbage collection) under a 1.5 s per-example
    limit: the judge tells its driver before a retry, and the limit starts again; otherwise the retry would end as
    a `timeout` failure."""
    from attnverify.isolation import SubprocessRunner

    monkeypatch.setattr(device_memory, "BACKOFF_S", (0.2, 0.2))  # the child is forked with it
    r = SubprocessRunner(timeout=1.5)
    try:
        res = r(_SlowOomOnce(), None, {})
    finally:
        r.close()
    assert (res.status, res.retried) == ("passed", 1), res.message
