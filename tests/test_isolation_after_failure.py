"""Crash isolation holds after the first failure, with and without pytest-html.

On an H200 an adapter registered by name from a conftest, wrong for Lq < 48 and faulting (illegal
memory access) for Lq >= 48, made the process that drives the run initialise CUDA after its first
wrong answer (the failure's diagnosis and the pytest-html extras re-ran the adapter there): every later
example was judged in that process, the next fault poisoned it, and every later property "failed" on a
bogus case. Here the same adapter (SIGSEGV on the CPU; a real illegal memory access on a GPU) runs
through several properties in a fresh pytest process, which must never call the adapter itself.

The GPU variant runs where torch sees a CUDA device and triton is installed, and skips saying why
elsewhere (the lead runs it on the H200: `pytest tests/test_isolation_after_failure.py -k cuda`).
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest

from attnverify.journal import describe_recipe, read_journal

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="crash isolation forks; this platform has no fork")

# The H200 run faulted from Lq = 48. Here the fault is on even Lq from 12, so that whatever the seed the
# properties' corpus (run before anything is generated; Hypothesis stops at its first failing example)
# meets both: forward_matches_reference's first case (Lq 17) is a wrong answer, and each later property
# reaches Lq 16 and faults.
LIMIT = 12


def faults(lq: int) -> bool:
    return lq >= LIMIT and lq % 2 == 0

CONFTEST = '''
import os, signal, torch, attnverify as av

DRIVER = os.getpid()  # the process that imports this conftest drives the run
DEVICE = os.environ["AV_TEST_DEVICE"]
MARK = os.environ["AV_TEST_MARK"]
LIMIT = int(os.environ["AV_TEST_LIMIT"])

if DEVICE == "cuda":
    import triton
    import triton.language as tl

    @triton.jit
    def _far_store(p):
        tl.store(p + (1 << 40), 1.0)  # four terabytes past the tensor: an illegal memory access

def _fault(q):
    if DEVICE == "cuda":
        _far_store[(1,)](q)
        torch.cuda.synchronize()
    else:
        os.kill(os.getpid(), signal.SIGSEGV)

@av.adapter("flaky", devices=(DEVICE,), dtypes=("float32",))
def flaky(q, k, v, spec):
    if os.getpid() == DRIVER:  # never: the driving process must not run the adapter
        with open(MARK, "a") as f:
            f.write(f"adapter called in the driving process on {tuple(q.shape)}\\n")
    if q.shape[2] >= LIMIT and q.shape[2] % 2 == 0:
        _fault(q)
    return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v   # forgets the scale: wrong, every Lq
'''

# a wrong answer shows in forward_matches_reference; the metamorphic properties hold for a missing
# scale, so any failure of theirs must be a crash on a case with Lq >= LIMIT
PROPS = "forward_matches_reference or kv_permutation_invariance or batch_head_independence or value_scaling"


def _cuda_ready() -> str:
    from attnverify.devices import cuda_present  # NVML: this pytest process stays fork-safe for later tests

    if not cuda_present():
        return "no CUDA device here"
    # find_spec, not import: pytester restores sys.modules after each test, and importing triton's C
    # extension a second time in this process fails (the H200 run skipped its second GPU variant so)
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (the GPU fault is a triton kernel's out-of-bounds store)"
    return ""


@pytest.mark.parametrize("html", [False, True], ids=["plain", "pytest-html"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_example_is_judged_in_a_child_after_failures_and_crashes(pytester, device, html):
    if device == "cuda" and _cuda_ready():
        pytest.skip(f"GPU variant: {_cuda_ready()}")
    if html:
        pytest.importorskip("pytest_html", reason="pytest-html is not installed: the --html variant cannot run")
    mark = pytester.path / "driver_calls.txt"
    pytester.makeconftest(CONFTEST)
    os.environ.update(AV_TEST_DEVICE=device, AV_TEST_MARK=str(mark), AV_TEST_LIMIT=str(LIMIT))
    try:
        args = ["--adapter=flaky", f"--attn-device={device}", "--attn-profile=ci", "--attn-max-examples=6",
                "--attn-timeout=120", "-p", "no:randomly", "-p", "no:cacheprovider", "-k", PROPS, "-v"]
        if html:
            args += ["--html=report.html", "--self-contained-html"]
        res = pytester.runpytest_subprocess(*args, timeout=900)
    finally:
        for k in ("AV_TEST_DEVICE", "AV_TEST_MARK", "AV_TEST_LIMIT"):
            os.environ.pop(k, None)
    out = res.stdout.str() + res.stderr.str()
    assert not mark.exists(), mark.read_text()  # the driving process never called the adapter
    recs = read_journal(str(pytester.path / "reports"))
    assert recs and recs[-1]["event"] == "run_end", out[-3000:]  # the run finished: no crash took it down
    ends = [r for r in recs if r["event"] == "test_end"]
    assert len(ends) == 4, [(r["property"], r["outcome"]) for r in ends]
    # every example of every property was judged in a forked child
    assert all(int(r.get("judged_in_process") or 0) == 0 for r in ends), ends
    assert "judged in the process that drives the run" not in out
    statuses = {}
    for r in ends:
        statuses[r["property"]] = r.get("status") or r["outcome"]
        if r["outcome"] not in ("failed", "error"):
            continue
        assert r["outcome"] == "failed", r  # a crash is a failed case, never an error of the test
        case = _failing_case(recs, r)
        lq = case["len_q"]
        fault = r["status"] == "crashed" or (r["status"] == "error" and re.search(
            r"illegal memory access|CUDA error", r["message"] or ""))
        # no property reports a case it did not fail on: a fault only where the adapter faults, a wrong
        # answer only where it answers (and only in the property that can see a missing scale)
        if fault:
            assert faults(lq), (r["property"], describe_recipe(case), r["message"][:500])
        else:
            assert r["status"] == "failed" and r["property"] == "forward_matches_reference", r
            assert not faults(lq) and "mismatch" in (r["message"] or "").lower(), r
        assert "build_case" not in (r["message"] or ""), r["message"][:800]  # the H200's bogus failures
    assert statuses["forward_matches_reference"] == "failed", (statuses, out[-3000:])
    later = {p: s for p, s in statuses.items() if p != "forward_matches_reference"}
    assert later and all(s in ("crashed", "error") for s in later.values()), (statuses, out[-3000:])
    crashed = [r for r in recs if r["event"] == "result" and r.get("status") == "crashed"]
    assert crashed or device == "cuda"  # on the CPU the fault is a signal: crashed examples, one result each
    if html:
        page = (pytester.path / "report.html").read_text()
        assert "attnverify diagnosis" in page  # the extras, read from the evidence the judging child stored


def _failing_case(recs, end) -> dict:
    """The recipe of the case a test_end reports (its saved case file, or the last failing result)."""
    import json

    if end.get("case_file") and os.path.exists(end["case_file"]):
        with open(end["case_file"]) as f:
            d = json.load(f)
        recipe = d.get("recipe") or (d.get("drawn") or {}).get("recipe")
        if recipe:
            return recipe
    fails = [r for r in recs if r["event"] == "result" and r.get("test") == end.get("test") and not r.get("passed")]
    return (fails[-1].get("case") or {}).get("recipe") or {}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
