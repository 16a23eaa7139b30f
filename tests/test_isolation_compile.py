"""The per-example timeout does not count compiles (issue 22/25: on the H200 a cold Triton compile of one split-KV
specialisation, float32 D = 160, ran past the 60 s timeout and the example was reported as a TIMEOUT; the replay
compiled the rest in 26 s and passed). The judging child tells its parent as each compile starts and ends
(timesplit.compile_event, which Triton's JIT hooks and torch.compile's callbacks call); the parent's deadline moves by
the compile's time, and a compile that never ends is still a timeout after the compile cap."""
import os
import time

import pytest

from attnverify import device_memory, timesplit
from attnverify.isolation import SubprocessRunner
from attnverify.properties.base import ExampleResult, Property

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="crash isolation forks; this platform has no fork")


class Compiles(Property):
    """Spends `compile` seconds inside a compile (as the hooks report one), then `work` seconds judging."""

    name = "compiles"

    def run_example(self, adapter, drawn):
        for _ in range(drawn.get("n", 1)):
            timesplit.compile_event("start")
            time.sleep(drawn["compile"])
            if not drawn.get("never_ends"):
                timesplit.compile_event("end")
        time.sleep(drawn["work"])
        return ExampleResult(True)


class Adapter:
    name = "user-kernel"


@pytest.fixture
def runner(monkeypatch):
    monkeypatch.setattr(device_memory, "cuda_initialised", lambda: False)  # the children never touch CUDA
    r = SubprocessRunner(timeout=1.0)
    yield r
    r.close()


def test_compile_time_is_not_counted_against_the_timeout(runner):
    res = runner(Compiles(), Adapter(), {"compile": 0.8, "n": 2, "work": 0.6})  # 2.2 s in all, 0.6 s of judging
    assert res.passed, res.message
    assert res.split.get("compile", 0.0) >= 1.5  # the time split still books the compiles
    assert res.seconds >= 2.0


def test_judging_past_the_timeout_is_still_a_timeout(runner):
    res = runner(Compiles(), Adapter(), {"compile": 0.3, "work": 1.6})  # 1.6 s of judging after the compile
    assert res.status == "timeout" and "compiles not counted" in res.message, res.message
    assert runner(Compiles(), Adapter(), {"compile": 0.1, "work": 0.1}).passed  # a fresh child judges on


def test_a_compile_that_never_ends_is_a_timeout_after_the_cap(runner):
    runner.compile_cap = 1.5
    t0 = time.perf_counter()
    res = runner(Compiles(), Adapter(), {"compile": 30.0, "never_ends": True, "work": 0.0})
    assert res.status == "timeout" and "one compile ran past 1.5 s" in res.message, res.message
    assert time.perf_counter() - t0 < 10.0


def test_no_timeout_waits_through_compile_messages(monkeypatch):
    monkeypatch.setattr(device_memory, "cuda_initialised", lambda: False)
    r = SubprocessRunner(timeout=0)
    try:
        assert r(Compiles(), Adapter(), {"compile": 0.2, "n": 3, "work": 0.2}).passed
    finally:
        r.close()
