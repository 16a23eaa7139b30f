"""Crash isolation: a signal, an exit or a hang in an adapter costs one failed example, nothing more."""
import os
import signal
import time

import pytest

from attnverify import device_memory
from attnverify.case import CaseRecipe
from attnverify.isolation import InProcessRunner, SubprocessRunner, make_runner, signal_name
from attnverify.properties.base import ExampleResult, Property

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="crash isolation forks; this platform has no fork")


class Act(Property):
    """Does what the drawn example says, in whichever process judges it."""

    name = "act"

    def run_example(self, adapter, drawn):
        what = drawn["do"]
        if what == "pid":
            return ExampleResult(True, message=str(os.getpid()))
        if what == "torch":
            import torch

            x = torch.randn(64, 64)
            return ExampleResult(True, message=f"{float((x @ x).sum()):.3f}")
        if what in ("SIGFPE", "SIGSEGV"):
            os.kill(os.getpid(), getattr(signal, what))
        if what == "abort":
            os.abort()
        if what == "exit":
            os._exit(7)
        if what == "hang":
            time.sleep(600)
        if what == "raise":
            raise ValueError("boom in the property")
        if what == "fault":  # what a CUDA fault looks like from the judge: an error result, context lost
            return ExampleResult(False, message="RuntimeError: CUDA error: misaligned address", status="error")
        return ExampleResult(False, message="wrong answer", severity=3.0)


class Adapter:
    name = "fake"


@pytest.fixture
def runner():
    from attnverify.device_memory import cuda_initialised

    if cuda_initialised():
        # on a GPU machine an earlier test of this pytest worker may have started CUDA; the runner then
        # judges in-process on purpose (test_cuda_initialised_here_judges_in_process_with_a_warning), so
        # nothing here could fork: seen on the H200 when this file shared workers with the GPU tests
        pytest.skip("CUDA was started in this pytest worker by an earlier test, so examples are judged "
                    "in-process by design; run tests/test_isolation.py in a process of its own")
    r = SubprocessRunner(timeout=2.0)
    yield r
    r.close()


def test_judged_in_a_child_that_lives_on(runner):
    p, a = Act(), Adapter()
    r1 = runner(p, a, {"do": "pid"})
    r2 = runner(p, a, {"do": "pid"})
    assert r1.passed and r1.message != str(os.getpid())
    assert r1.message == r2.message  # one long-lived child, not a fork per example
    assert runner(p, a, {"do": "torch"}).passed  # torch works in the child after the parent used it
    res = runner(p, a, {"do": "wrong"})
    assert not res.passed and res.status == "failed" and res.severity == 3.0


@pytest.mark.parametrize("how,needle", [("SIGFPE", "SIGFPE"), ("SIGSEGV", "SIGSEGV"), ("abort", "SIGABRT"),
                                        ("exit", "exited with status 7")])
def test_a_dying_child_is_one_failed_example(runner, how, needle):
    p, a = Act(), Adapter()
    before = runner(p, a, {"do": "pid"}).message
    recipe = CaseRecipe(len_q=3, len_k=5).to_dict()
    res = runner(p, a, {"do": how, "recipe": recipe})
    assert not res.passed and res.status == "crashed"
    assert needle in res.message and "fake" in res.message and "act" in res.message
    assert res.case is not None and res.case["recipe"]["len_k"] == 5  # kept for repro
    after = runner(p, a, {"do": "pid"})
    assert after.passed and after.message != before  # a fresh child took over
    assert runner.restarts >= 1


def test_crash_message_points_at_the_adapter_frame(runner):
    res = runner(Act(), Adapter(), {"do": "SIGSEGV"})
    assert "test_isolation.py" in res.message and "run_example" in res.message


def test_a_hang_is_a_timeout_and_the_run_goes_on(runner):
    t0 = time.perf_counter()
    res = runner(Act(), Adapter(), {"do": "hang"})
    took = time.perf_counter() - t0
    assert res.status == "timeout" and not res.passed and "2 s" in res.message
    assert 1.9 <= took < 10
    assert runner(Act(), Adapter(), {"do": "pid"}).passed


def test_an_exception_is_an_error_result_not_a_crash(runner):
    res = runner(Act(), Adapter(), {"do": "raise"})
    assert res.status == "error" and "boom in the property" in res.message
    assert runner.restarts == 0


def test_objects_made_after_the_fork_are_judged_too(runner):
    runner(Act(), Adapter(), {"do": "pid"})

    class Later(Act):
        name = "later"

    assert runner(Later(), Adapter(), {"do": "pid"}).passed


def test_in_process_runner_and_factory():
    assert isinstance(make_runner("none"), InProcessRunner)
    r = make_runner("subprocess", 5)
    assert isinstance(r, SubprocessRunner) and r.timeout == 5
    r.close()
    res = InProcessRunner()(Act(), Adapter(), {"do": "raise"})
    assert res.status == "error"
    with pytest.raises(ValueError):
        make_runner("threads")
    assert signal_name(signal.SIGSEGV).startswith("SIGSEGV")


def test_cuda_initialised_here_judges_in_process_with_a_warning(runner, monkeypatch):
    # forking a process whose CUDA is initialised gives children that cannot use CUDA: on the H200
    # every isolated example failed so; the runner judges in this process instead, and warns once

    monkeypatch.setattr(device_memory, "cuda_initialised", lambda: True)
    with pytest.warns(RuntimeWarning, match="without crash isolation"):
        r1 = runner(Act(), Adapter(), {"do": "pid"})
    r2 = runner(Act(), Adapter(), {"do": "pid"})
    assert r1.passed and r1.message == r2.message == str(os.getpid())
    assert runner.in_process_fallback == 2 and runner.pid is None


def test_cuda_present_asks_nvml_not_the_runtime(monkeypatch):
    # torch.cuda.is_available() runs cudaGetDeviceCount, which poisons fork; device_count() asks NVML
    import torch

    from attnverify.devices import cuda_present

    monkeypatch.setattr(torch.cuda, "is_available", lambda: (_ for _ in ()).throw(AssertionError("poisons fork")))
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cuda_present() is True
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert cuda_present() is False


def test_the_driving_process_never_asks_torch_cuda_is_available(tmp_path):
    # torch.cuda.is_available() runs cudaGetDeviceCount, and a process that has called it can no longer
    # fork children that use CUDA: on the H200 every isolated judge failed so. The run's own process
    # (imports, adapter listing, strategies, the driver) must ask through attnverify.devices instead.
    import subprocess
    import sys

    code = (
        "import os, sys, torch\n"
        "PARENT, ORIGINAL = os.getpid(), torch.cuda.is_available\n"
        "def guard(*a, **k):\n"
        "    if os.getpid() == PARENT:\n"
        "        raise AssertionError('torch.cuda.is_available() called in the driving process')\n"
        "    return ORIGINAL(*a, **k)  # a judge child may ask (triton's driver does, on a GPU)\n"
        "torch.cuda.is_available = guard\n"
        "from attnverify import cli\n"
        "sys.exit(cli.main(['run', '--adapter', 'naive,sdpa-math,triton', '--max-examples', '1', '--no-html', '-q',\n"
        "                   '-k', 'forward_matches_reference or contract']))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "ATTNVERIFY_"))}
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert "called in the driving process" not in out, out[-3000:]
    assert p.returncode == 0, out[-3000:]
    assert "passed" in out


def test_after_a_device_fault_the_next_example_gets_a_fresh_child(runner):
    # the child exits after a device fault (its CUDA context is lost); the next example must not be sent
    # to the leaving child and reported as its crash
    p, a = Act(), Adapter()
    first = runner(p, a, {"do": "pid"}).message
    for _ in range(5):
        assert runner(p, a, {"do": "fault"}).status == "error"
        nxt = runner(p, a, {"do": "pid"})
        assert nxt.passed and nxt.status != "crashed", nxt.message
        assert nxt.message != first
        first = nxt.message


def test_the_fallback_is_checked_before_every_fork(runner, monkeypatch):
    # a restart (new property object here) forks again: once CUDA is initialised in this process the
    # runner must judge in-process instead of forking a child that cannot use CUDA

    first = runner(Act(), Adapter(), {"do": "pid"})
    assert first.passed and first.message != str(os.getpid())  # a child judged it
    monkeypatch.setattr(device_memory, "cuda_initialised", lambda: True)
    with pytest.warns(RuntimeWarning, match="without crash isolation"):
        again = runner(Act(), Adapter(), {"do": "pid"})  # new objects: the child would be replaced
    assert again.passed and again.message == str(os.getpid()) and runner.in_process_fallback == 1


def test_the_driving_process_builds_no_case_on_the_adapters_device():
    """The corpus and the strategies' claim filter run in the process that forks the judges. Built on
    CUDA there, they started CUDA, so on the H200 every example fell back to in-process judging and one
    device fault took down every later test of that worker (2026-12-03). They build CPU probes that
    stand for the device; on this CPU-only torch, a case built on "cuda" raises, so the test fails if
    either path builds one."""
    from hypothesis import HealthCheck, given, settings

    import attnverify as av
    from attnverify.properties import PROPERTIES

    seen = []

    def refuses(case):  # makes the strategies' claim filter build a case for every draw
        seen.append((case.device, case.q.device.type))
        return None

    def never_called(q, k, v, spec):
        raise AssertionError("the adapter is not called while drawing")

    cuda_only = av.adapter("cuda-only", register=False, devices=("cuda",), dtypes=("float32",), head_dims=(16, 32),
                           max_seqlen=64, refuses=refuses)(never_called)
    for prop in PROPERTIES:
        if prop.skip_reason(cuda_only) or not hasattr(prop, "kwargs"):
            continue
        corpus = prop.examples(cuda_only, "ci", "cuda")
        assert all(ex["recipe"]["device"] == "cuda" for ex in corpus), prop.name

        @settings(max_examples=3, database=None, suppress_health_check=list(HealthCheck), deadline=None)
        @given(prop.strategy(cuda_only, "ci", "cuda"))
        def draw(drawn):
            assert drawn["recipe"]["device"] == "cuda"

        draw()
    assert seen and all(s == ("cuda", "cpu") for s in seen), seen[:3]


class Sleep(Property):
    name = "sleep"

    def run_example(self, adapter, drawn):
        time.sleep(drawn["s"])
        return ExampleResult(True)


def test_an_adapter_that_compiles_raises_the_timeout_for_itself_only(monkeypatch):
    """flex compiles on a cold cache for minutes on a CPU: it declares min_timeout, so the default
    --attn-timeout does not kill (and so never caches) its first calls; other adapters keep the default."""
    import attnverify as av


    slow = av.adapter("compiles", register=False, min_timeout=4.0)(lambda q, k, v, spec: q)
    plain = av.adapter("plain", register=False)(lambda q, k, v, spec: q)
    # the children here never touch CUDA: fork even where this test process has initialised it (GPU runs)
    monkeypatch.setattr(device_memory, "cuda_initialised", lambda: False)
    r = SubprocessRunner(timeout=1.0)
    try:
        assert r.timeout_for(Sleep(), slow) == 4.0 and r.timeout_for(Sleep(), plain) == 1.0
        assert r(Sleep(), slow, {"s": 1.5}).passed
        res = r(Sleep(), plain, {"s": 1.5})
        assert res.status == "timeout" and "1 s" in res.message
    finally:
        r.close()
    assert SubprocessRunner(timeout=0).timeout_for(Sleep(), slow) is None  # no timeout stays none
    for bad in (-1, float("inf"), True):  # inf crashed the runner's poll; True read as 1 s
        with pytest.raises(ValueError, match="min_timeout"):
            av.adapter("bad", register=False, min_timeout=bad)(lambda q, k, v, spec: q)

    class Costly(Sleep):
        cost = 6.0

    # the floor applies per example (a compile happens once), not multiplied by the property's cost
    assert SubprocessRunner(timeout=1.0).timeout_for(Costly(), slow) == 6.0
    assert SubprocessRunner(timeout=0.5).timeout_for(Costly(), slow) == 4.0


def test_an_error_that_leaves_the_context_lost_is_blamed_and_the_next_example_gets_a_fresh_child(
        runner, monkeypatch, tmp_path):
    """cuDNN's 'mha_graph.execute(...).is_good()' error reads as no device fault but left the CUDA context lost: the
    next example died building its tensors and was shrunk in its place (H200 re-run, 2026-12-04). The child now
    checks its context after every example: the example that lost it says so and the next one gets a fresh child."""

    flag = tmp_path / "lost"

    def fake_lost():  # the child's synchronize fails once, after the example that broke the context
        if flag.exists():
            flag.unlink()
            return "AcceleratorError: CUDA error: misaligned address"
        return ""

    monkeypatch.setattr(device_memory, "lost_context", fake_lost)
    p, a = Act(), Adapter()
    first = runner(p, a, {"do": "pid"}).message
    flag.touch()
    res = runner(p, a, {"do": "raise"})
    assert res.status == "error" and "boom in the property" in res.message
    assert "CUDA context was lost" in res.message and "misaligned address" in res.message
    nxt = runner(p, a, {"do": "pid"})
    assert nxt.passed and nxt.message != first  # a fresh child, not the one with the lost context
    flag.touch()  # a passing example after which the context is lost is that example's failure
    res = runner(p, a, {"do": "pid"})
    assert not res.passed and res.status == "error" and "CUDA context was lost" in res.message
    same = runner(p, a, {"do": "pid"})
    assert same.passed and runner(p, a, {"do": "pid"}).message == same.message  # no loss: the child lives on


def test_lost_context_is_empty_without_cuda():
    from attnverify.device_memory import lost_context

    assert lost_context() == ""  # no CUDA context in this process: nothing to lose, torch not asked
