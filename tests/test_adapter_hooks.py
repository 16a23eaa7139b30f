"""`prepare=`: an adapter's hook the plugin calls once at the run's start, before any property, in the process
that forks the judges (the bundled Triton adapter switches the interpreter on with it). Driven through pytester
with a conftest adapter, as a user would write one."""
import pytest

import attnverify as av

FAST = ("--attn-profile=ci", "--attn-max-examples=3", "-p", "no:randomly", "-p", "no:cacheprovider")

# an adapter whose library must be set up before its first call (as triton's interpreter must be switched on
# before triton is imported): without the set-up every call raises
NEEDS_SETUP = """
import os, torch, attnverify as av

READY = []
LOG = os.path.join(os.path.dirname(__file__), "prepared.log")

def set_up():
    READY.append(True)
    with open(LOG, "a") as f:
        f.write(f"{os.getpid()}\\n")

@av.adapter("mine-setup"PREPARE)
def mine(q, k, v, spec):
    if not READY:
        raise RuntimeError("library used before its set-up")
    s = (q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
    return torch.softmax(s, dim=-1) @ v
"""


def _run(pytester, prepare: str):
    pytester.makeconftest(NEEDS_SETUP.replace("PREPARE", prepare))
    return pytester.runpytest("--adapter=mine-setup", "-k", "forward_matches_reference or inputs_unmodified", *FAST)


def test_prepare_runs_once_before_the_first_property(pytester):
    res = _run(pytester, ", prepare=set_up")
    out = res.stdout.str()
    assert res.ret == 0 and res.parseoutcomes().get("passed", 0) >= 2, out
    assert len((pytester.path / "prepared.log").read_text().split()) == 1  # once, whatever the property count


def test_without_prepare_the_same_adapter_fails(pytester):
    """The control: the properties above pass because prepare ran, not by luck."""
    res = _run(pytester, "")
    assert res.ret == 1 and "library used before its set-up" in res.stdout.str(), res.stdout.str()
    assert not (pytester.path / "prepared.log").exists()


def test_a_prepare_that_raises_is_a_usage_error_naming_the_adapter(pytester):
    pytester.makeconftest(NEEDS_SETUP.replace("PREPARE", ", prepare=lambda: 1 / 0"))
    res = pytester.runpytest("--adapter=mine-setup", *FAST)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    assert "--adapter mine-setup: its prepare() raised ZeroDivisionError" in res.stderr.str() + res.stdout.str()


def test_prepare_must_be_callable():
    with pytest.raises(TypeError, match=r"prepare=.*give a function"):
        av.adapter("bad-prepare", register=False, prepare="TRITON_INTERPRET=1")(lambda q, k, v, s: q)


def test_the_bundled_triton_adapter_declares_its_interpreter_switch():
    from attnverify.adapters.registry import get
    from attnverify.adapters.triton_adapter import use_interpreter_if_needed

    assert get("triton").prepare is use_interpreter_if_needed
