"""Issue 25 item 3: the throughput changes keep the verdicts, and the time split is real.

- one judging child serves every property of a session (the plugin prepares them all before the first
  fork) instead of a fork per new property: the same seed gives the same draws and the same verdicts as
  a child per property, and a crash still costs one example and gets a fresh child;
- every result carries a time split whose judge phases add up to the judge's seconds, and the table
  read back from the journal says where the time went.
"""
import os

import pytest
import torch

import attnverify as av
from attnverify.device_memory import cuda_initialised
from attnverify.isolation import SubprocessRunner
from attnverify.properties import get_property
from attnverify.properties.base import ExampleResult, Property
from attnverify.properties.driver import PropertyFailed, run_property
from attnverify.split_table import split_rows, split_table
from attnverify.timesplit import PARTS, PHASES

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="crash isolation forks; this platform has no fork"),
    pytest.mark.skipif(cuda_initialised(), reason="CUDA started in this worker: examples are judged in process"),
]


def _attention(q, k, v, scale):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    p = torch.softmax((q.float() @ k.float().transpose(-1, -2)) * scale, dim=-1)
    return (p @ v.float()).to(q.dtype)


# a user's adapters, written the way a conftest.py would: a plain eager kernel claiming float32 on the CPU,
# GQA and any scale; and one that loses the last key on long rows (a bug the properties must find)
@av.adapter("tp_eager", register=False, dtypes=("float32",), devices=("cpu",), gqa=True, max_seqlen=64)
def tp_eager(q, k, v, spec):
    return _attention(q, k, v, spec.resolved_scale(q.shape[-1]))


@av.adapter("tp_drops_last_key", register=False, dtypes=("float32",), devices=("cpu",), gqa=True, max_seqlen=64)
def tp_drops_last_key(q, k, v, spec):
    if k.shape[2] > 20:
        k, v = k[:, :, :-1], v[:, :, :-1]
    return _attention(q, k, v, spec.resolved_scale(q.shape[-1]))


PROPS = ("forward_matches_reference", "value_scaling")


def _verdicts(runner_for, adapter, tmp_path):
    """(property, index, drawn, status, severity) of every example of PROPS, with the runner runner_for(prop)."""
    out = []
    for name in PROPS:
        prop = get_property(name)

        def journal(ev, name=name):
            if ev.get("event") == "result":
                out.append((name, ev["index"], ev["status"], round(float(ev["severity"]), 9)))
            elif ev.get("event") == "case_start":
                out.append((name, ev["index"], ev["drawn"]))

        try:
            run_property(prop, adapter, profile="ci", seed=1234, max_examples=12, runner=runner_for(prop),
                         journal=journal, database=None, report_dir=str(tmp_path), max_bugs=1, shrink_budget_s=5)
        except PropertyFailed:
            out.append((name, "failed"))
    return out


@pytest.mark.parametrize("adapter", [tp_eager, tp_drops_last_key], ids=lambda a: a.name)
def test_one_child_for_every_property_gives_the_same_verdicts(adapter, tmp_path):
    fresh = []  # before: a child forked for each property

    def per_property(prop):
        fresh.append(SubprocessRunner(timeout=120))
        return fresh[-1]

    shared = SubprocessRunner(timeout=120)  # now: every property prepared before the first fork
    shared.prepare(*(get_property(n) for n in PROPS), adapter)
    try:
        before = _verdicts(per_property, adapter, tmp_path / "a")
        after = _verdicts(lambda prop: shared, adapter, tmp_path / "b")
        assert shared.started == 1 and shared.restarts == 0  # one child judged both properties
        assert sum(r.started for r in fresh) == len(PROPS)
    finally:
        shared.close()
        for r in fresh:
            r.close()
    assert before == after
    assert any(len(v) == 4 for v in after)  # examples were judged, not just drawn
    failed = [v for v in after if v[1:] == ("failed",)]
    assert bool(failed) == (adapter is tp_drops_last_key)  # the bug is found by both ways alike


class Dies(Property):
    name = "tp_dies"

    def run_example(self, adapter, drawn):
        if drawn.get("die"):
            os._exit(3)
        return ExampleResult(True, message=str(os.getpid()))


class Reports(Dies):
    name = "tp_reports"


def test_a_crash_in_the_shared_child_is_one_example_and_the_next_property_gets_a_fresh_child():
    dies, reports = Dies(), Reports()
    r = SubprocessRunner(timeout=30)
    r.prepare(dies, reports, tp_eager)
    try:
        pid = r(dies, tp_eager, {}).message
        assert r(reports, tp_eager, {}).message == pid  # the same child serves the second property
        res = r(dies, tp_eager, {"die": True})
        assert res.status == "crashed" and "exited with status 3" in res.message
        after = r(reports, tp_eager, {})
        assert after.passed and after.message != pid and after.message != str(os.getpid())
        assert r.in_process_fallback == 0 and r.restarts == 1
    finally:
        r.close()


def test_every_result_carries_its_time_split_and_the_table_reads_it(tmp_path):
    from attnverify.journal import Journal, read_journal

    j = Journal(str(tmp_path), run_id="split")
    r = SubprocessRunner(timeout=120)
    prop = get_property("forward_matches_reference")
    try:
        run_property(prop, tp_eager, profile="ci", seed=7, max_examples=6, runner=r, database=None,
                     journal=lambda ev: j.write({**ev, "test": "t"}), report_dir=str(tmp_path))
    finally:
        r.close()
    j.write({"event": "test_end", "property": prop.name, "adapter": tp_eager.name, "seconds": 2.0})
    results = [rec for rec in read_journal(str(tmp_path)) if rec["event"] == "result"]
    assert results
    gaps, rests = [], []
    for rec in results:
        split = rec["split"]
        assert {"draw", "transfer", "adapter", "reference", "compare"} <= set(split), split
        judged = sum(v for k, v in split.items() if k not in ("draw", "journal", "transfer") + PARTS)
        gaps.append((abs(judged - rec["seconds"]) - 0.05 * rec["seconds"], judged, rec["seconds"]))
        # transfer's parts, on the driver's and the child's clocks, are within transfer (each rounded to 0.1 ms);
        # the rest is a child being started (the first example)
        parts = [split[k] for k in PARTS if k.startswith("transfer.") and k in split]
        assert all(p >= 0 for p in parts) and sum(parts) <= split["transfer"] + 5e-4, split
        rests.append(split["transfer"] - sum(parts))
        assert split.get("draw.strategy", 0.0) <= split["draw"] + 1e-4, split
    # the judge's phases are its seconds, split (rounded to 0.1 ms each; the child's own bookkeeping aside): on the
    # median example to 2 ms, on every one to 50 ms (a loaded 2-core machine preempted one example's bookkeeping
    # for 10 ms between the two clocks, 2026-12-05)
    gaps.sort()
    assert gaps[len(gaps) // 2][0] <= 0.002 and gaps[-1][0] <= 0.05, gaps
    assert sorted(rests)[len(rests) // 2] <= 5e-4, rests
    # the strategy's part of the draw is measured where examples were drawn (the corpus ones are given)
    assert any(rec["split"].get("draw.strategy", 0.0) > 0 for rec in results)
    assert sum(1 for rec in results if "transfer.to_judge" in rec["split"]) >= len(results) - 1
    (row,) = split_rows(read_journal(str(tmp_path)))
    assert row["examples"] == len(results) and row["wall"] == 2.0 and row["per_s"] == len(results) / 2.0
    table = split_table(read_journal(str(tmp_path)))
    assert "| tp_eager | forward_matches_reference |" in table and "adapter" in table.splitlines()[0]
    # parts are columns of their own, never counted twice in the shares
    assert "transfer.to_judge" in table.splitlines()[0]
    shares = split_table(read_journal(str(tmp_path)), per="share").splitlines()
    cols = [c.strip() for c in shares[0].strip("|").split("|")]
    cells = [c.strip() for c in shares[2].strip("|").split("|")]
    phase_cells = [float(x.rstrip("%")) for c, x in zip(cols[5:], cells[5:]) if c in PHASES + ("unsplit",)]
    assert sum(phase_cells) == pytest.approx(100, abs=len(PHASES)) and "transfer.to_judge" in cols[5:]
    with pytest.raises(ValueError, match="per="):
        split_table([], per="seconds")


PID_CONFTEST = '''
import os, torch, attnverify as av

DRIVER = os.getpid()

@av.adapter("pidlog", dtypes=("float32",), devices=("cpu",))
def pidlog(q, k, v, spec):
    with open(os.environ["AV_TEST_PIDS"], "a") as f:
        f.write(f"{os.getpid()} {DRIVER}\\n")
    p = torch.softmax((q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1]), dim=-1)
    return p @ v
'''


def test_the_plugin_judges_every_property_in_one_child(pytester, monkeypatch):
    pids = pytester.path / "pids.txt"
    pytester.makeconftest(PID_CONFTEST)
    monkeypatch.setenv("AV_TEST_PIDS", str(pids))
    res = pytester.runpytest_subprocess(
        "--adapter=pidlog", "--attn-profile=ci", "--attn-max-examples=3", "-p", "no:cacheprovider",
        "-k", "forward_matches_reference or value_scaling or kv_permutation_invariance", timeout=600)
    res.assert_outcomes(passed=3)
    calls = [ln.split() for ln in pids.read_text().splitlines()]
    judges = {c[0] for c in calls}
    assert len(calls) >= 9 and all(c[0] != c[1] for c in calls)  # judged in a child, never in the driver
    assert len(judges) == 1, judges  # one child for the three properties (was: a fork per property)


def test_the_worst_index_is_torchs_and_comparing_imports_no_sympy():
    """torch.unravel_index's first call imported sympy: 2.7 s in every new judging process."""
    import subprocess
    import sys

    from attnverify.compare import compare
    from attnverify.tolerances import tolerance_for

    g = torch.Generator().manual_seed(0)
    for shape in [(2, 4, 65, 32), (1,), (3, 1, 5), (7, 1)]:
        e = torch.randn(shape, generator=g, dtype=torch.float64)
        a = e.float()
        flat = (a.double() - e).abs().argmax()
        a.view(-1)[int(flat)] += 1.0  # one planted worst element
        want = tuple(int(i) for i in torch.unravel_index(torch.tensor(int(flat)), e.shape))
        assert compare("out", a, e, tolerance_for("out", "float32")).worst_index == want
    code = ("import sys, torch; from attnverify.compare import compare; from attnverify.tolerances import tolerance_for;"
            "e = torch.randn(2, 3, 4, dtype=torch.float64); compare('out', e.float() + 1, e, tolerance_for('out', 'float32'));"
            "print('sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "False", out.stdout + out.stderr


# every keyword a refusal might read, claimed, so the drawn recipes reach every built-in refusal's rules
@av.adapter("tp_wide", register=False, dtypes=("float16", "bfloat16", "float32"), devices=("cpu",),
            causal=("none", "top_left", "bottom_right"), window=True, softcap=True, alibi=True, attn_mask=True,
            gqa=True, varlen=True, dropout=True, lse=True, dv_ne_d=True, fully_masked="zeros", max_seqlen=512)
def tp_wide(q, k, v, spec):  # pragma: no cover - only its claims are drawn from
    raise AssertionError("never called")


def test_the_value_free_probe_refuses_what_the_full_probe_refuses():
    """Issue 25: the strategies filter draws with a probe whose q, k, v are not drawn (3 of a draw's 4 ms);
    every built-in refusal answers the same on it as on the full probe, on CPU and CUDA stand-ins."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    from attnverify.adapters.registry import all_adapters
    from attnverify.case import CaseRecipe, build_probe
    from attnverify.check import unclaimed
    from attnverify.strategies import attention_cases

    refusing = [a for a in all_adapters() if a.refuses is not None]
    assert any(a.name == "sdpa-flash" for a in refusing)
    seen = {"refused": 0, "judged": 0}

    @hseed(5)
    @settings(max_examples=150, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(attention_cases(adapter=tp_wide, profile="dev", device="cpu"))
    def check(r):
        for dev in ("cpu", "cuda"):
            rr = CaseRecipe.from_dict({**r.to_dict(), "device": dev})
            full, bare = build_probe(rr), build_probe(rr, values=False)
            assert [t.shape for t in (full.q, full.k, full.v)] == [t.shape for t in (bare.q, bare.k, bare.v)]
            assert [t.stride() for t in (full.q, full.k, full.v)] == [t.stride() for t in (bare.q, bare.k, bare.v)]
            for a in refusing:
                try:
                    want = a.refuses(full)
                except Exception as e:  # noqa: BLE001 - an optional library's refusal may need it
                    want = f"raised {type(e).__name__}"
                try:
                    got = a.refuses(bare)
                except Exception as e:  # noqa: BLE001
                    got = f"raised {type(e).__name__}"
                assert got == want, (a.name, rr.to_dict())
                seen["refused" if want else "judged"] += 1
            assert unclaimed(tp_eager, bare) == unclaimed(tp_eager, full)

    check()
    assert seen["refused"] and seen["judged"]  # both answers were met


@av.adapter("tp_small_values", register=False, dtypes=("float32",), devices=("cpu",),
            refuses=lambda case: "refuses |q| > 1" if float(case.q.abs().max()) > 1 else None)
def tp_small_values(q, k, v, spec):
    return _attention(q, k, v, spec.resolved_scale(q.shape[-1]))


def test_a_refusal_about_values_is_asked_again_on_the_real_case():
    """The documented fallback: the probe's zeros pass a refusal about values; the judge asks the real case
    and skips it, never judges it."""
    from attnverify.case import CaseRecipe, build_probe
    from attnverify.check import unclaimed

    r = CaseRecipe(len_q=8, len_k=8, head_dim=16, q_std=10.0)
    assert unclaimed(tp_small_values, build_probe(r, values=False)) is None
    res = get_property("forward_matches_reference").run_example(tp_small_values, {"recipe": r.to_dict()})
    assert res.status == "skipped" and "refuses |q| > 1" in res.message


def test_a_crashed_examples_seconds_are_unsplit_not_lost():
    recs = [{"event": "result", "adapter": "a", "property": "p", "seconds": 2.5, "status": "crashed",
             "split": {"draw": 0.5, "journal": 0.1}},
            {"event": "result", "adapter": "a", "property": "p", "seconds": 1.0,
             "split": {"draw": 0.25, "adapter": 0.75, "other": 0.25}}]
    (row,) = split_rows(recs)
    assert row["phases"]["unsplit"] == 2.5 and row["phases"]["draw"] == 0.75 and row["examples"] == 2
    assert "unsplit" in split_table(recs).splitlines()[0]


def test_a_torch_compile_is_booked_to_compile_on_its_first_call_only():
    """The compile phase comes from torch.compile's own callbacks (backend="eager": Dynamo traces, no C++
    compiler needed): the first call of a shape compiles, the same shape again does not."""
    from attnverify.isolation import InProcessRunner

    compiled = torch.compile(lambda q, k, v, s: _attention(q, k, v, s), backend="eager", dynamic=False)

    @av.adapter("tp_compiled", register=False, dtypes=("float32",), devices=("cpu",))
    def tp_compiled(q, k, v, spec):
        return compiled(q, k, v, spec.resolved_scale(q.shape[-1]))

    from attnverify.case import CaseRecipe

    prop, run = get_property("forward_matches_reference"), InProcessRunner()
    drawn = {"recipe": CaseRecipe(len_q=8, len_k=8, head_dim=16, seed=3).to_dict()}
    first, again = run(prop, tp_compiled, drawn), run(prop, tp_compiled, drawn)
    assert first.passed and again.passed, (first.message, again.message)
    assert first.split.get("compile", 0.0) > 0.0, first.split
    assert again.split.get("compile", 0.0) == 0.0 and again.split.get("adapter", 0.0) > 0.0, again.split
    assert first.split["compile"] > again.split["adapter"]  # a trace costs more than the call it makes


def test_parts_are_never_added_to_an_examples_seconds():
    """Without a test_end record the wall is the examples' phases summed: a part (draw.strategy, transfer.*) is
    inside its phase and is not added again (timesplit.total, the one rule)."""
    from attnverify.timesplit import total

    split = {"draw": 0.010, "draw.strategy": 0.004, "transfer": 0.002, "transfer.to_judge": 0.001, "adapter": 0.005}
    (row,) = split_rows([{"event": "result", "adapter": "a", "property": "p", "split": split, "seconds": 0.005}])
    assert row["wall"] == pytest.approx(0.017) and total(split) == pytest.approx(0.017)
