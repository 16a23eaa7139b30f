"""Two serving-era kernels written as a stranger would, from docs/guide.md and docs/adapters.md alone (issues 22, 23):
a vLLM-style paged decode kernel (tests/stranger/vllm_like_paged.py) and a gpt-oss style sink + fp8 kernel
(tests/stranger/gptoss_sink_fp8.py), each a file adapter with the claims its documentation states. Their ci profile
passes through the CLI and through pytest; three wrong variants of each, mistakes a real kernel makes, fail the
properties the docs say catch them, and the diagnosis names what it can."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

import attnverify as av
from attnverify.case import CaseRecipe, build_case
from attnverify.diagnose import diagnose_result
from attnverify.properties import get_property, run_property

HERE = os.path.dirname(os.path.abspath(__file__))
STRANGER = os.path.join(HERE, "stranger")
sys.path.insert(0, STRANGER)

import gptoss_sink_fp8 as G  # noqa: E402
import vllm_like_paged as V  # noqa: E402

ROOT = os.path.dirname(HERE)
VLLM = os.path.join(STRANGER, "vllm_like_paged.py")
GPTOSS = os.path.join(STRANGER, "gptoss_sink_fp8.py")


def _env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               ATTNVERIFY_NO_HTML="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def _ci_run(tmp_path, *argv):
    return subprocess.run([sys.executable, *argv], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=600)


@dataclasses.dataclass
class _Done:
    returncode: int
    stdout: str
    stderr: str


def _assert_passes(res, name, passed, skipped_because):
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    for prop in passed:  # the summary table: "<property>   ok <n>ex <s>s"
        line = next((x for x in out.splitlines() if x.startswith(prop + " ")), "")
        assert " ok " in line, f"{prop}: {line!r}\n{out[-3000:]}"
    for why in skipped_because:
        assert f"{name} does not claim {why}" in out, out[-3000:]


def test_vllm_like_paged_ci_profile_passes_through_the_cli(tmp_path):
    res = _ci_run(tmp_path, "-m", "attnverify.cli", "run", "--adapter", f"{VLLM}:vllm_like_paged", "--profile", "ci",
                  "--seed", "1", "-n", "0", "--", "-rs")
    _assert_passes(res, "vllm-like-paged", ["forward_matches_reference", "paged_equals_contiguous", "batch_invariance",
                                            "gqa_equals_repeated_kv", "contract", "causal_alignment"],
                   ["backward", "lse", "append", "cache_leftpad", "num_splits", "sinks"])


def test_gptoss_sink_fp8_ci_profile_passes_through_pytest(pytester):
    res = pytester.runpytest(f"--adapter={GPTOSS}:gptoss_sink_fp8", "--attn-profile=ci", "--attn-seed=1", "-rs", "-q",
                             "-p", "no:randomly")
    _assert_passes(_Done(res.ret, res.stdout.str(), res.stderr.str()), "gptoss-sink-fp8", ["sinks_match_reference", "sink_as_extra_key", "sink_limits",
                                            "fp8_matches_reference", "descale_linearity", "lse_merge",
                                            "fully_masked_rows", "forward_matches_reference"],
                   ["backward", "paged", "attention_chunk", "dropout"])


@pytest.mark.slow
def test_the_other_way_round(tmp_path):
    """vLLM-like through pytest, gpt-oss through the CLI (each ~20-40 s on two busy cores)."""
    res = _ci_run(tmp_path, "-m", "pytest", f"--adapter={VLLM}:vllm_like_paged", "--attn-profile=ci", "-rs", "-q",
                  "-p", "no:cacheprovider")
    _assert_passes(res, "vllm-like-paged", ["paged_equals_contiguous"], ["backward"])
    res = _ci_run(tmp_path, "-m", "attnverify.cli", "run", "--adapter", f"{GPTOSS}:gptoss_sink_fp8", "--profile", "ci",
                  "-n", "0", "--", "-rs")
    _assert_passes(res, "gptoss-sink-fp8", ["fp8_matches_reference"], ["backward"])


def _fails(prop, adapter, seed=0):
    with pytest.raises(AssertionError) as e:
        run_property(get_property(prop), adapter, profile="ci", seed=seed, database=None)
    return str(e.value)


def _holds(prop, adapter, seed=0):
    run = run_property(get_property(prop), adapter, profile="ci", seed=seed, database=None)
    assert run.examples > 0
    return run


VLLM_CAUGHT = [  # (bug, the properties that catch it in the ci profile)
    ("block_index_off_by_one", ("paged_equals_contiguous", "forward_matches_reference")),
    ("seq_lens_minus_one", ("forward_matches_reference",)),  # plain calls go through the same length bug
    ("partial_block_full", ("paged_equals_contiguous", "forward_matches_reference")),
]


@pytest.mark.parametrize("bug,props", VLLM_CAUGHT, ids=[b for b, _ in VLLM_CAUGHT])
def test_each_vllm_like_bug_is_caught(bug, props):
    wrong = getattr(V, f"vllm_like_paged_{bug}")
    for prop in props:
        _holds(prop, V.vllm_like_paged)  # the right kernel holds on the same draws
        msg = _fails(prop, wrong)
        assert "MISMATCH" in msg and "first failing example: #" in msg, msg


def test_a_decode_only_kernel_is_never_called_with_lq_above_one():
    """refuses= is the docs' way to claim Lq = 1: no example of a run reaches the kernel with more query rows."""
    seen = []

    @av.adapter("vllm-like-recording", register=False, **V.CLAIMS)
    def recording(q, k, v, spec):
        seen.append(q.shape[2])
        return V._call(q, k, v, spec)

    for prop in ("forward_matches_reference", "paged_equals_contiguous"):
        _holds(prop, recording)
    assert seen and set(seen) == {1}, sorted(set(seen))


def test_causal_alignment_does_not_blame_the_alignment_at_lq_1():
    """With one query row bottom-right causal is no mask: a kernel that drops the last key fails causal_alignment,
    and the message used to add 'the output follows causal=none', which is the asked mask here."""
    msg = _fails("causal_alignment", V.vllm_like_paged_seq_lens_minus_one)
    assert "Lq=1" in msg and "MISMATCH" in msg, msg
    assert "follows causal=none" not in msg, msg


GPTOSS_CAUGHT = [
    ("descale_dropped", ("fp8_matches_reference", "descale_linearity")),
    ("sink_in_numerator", ("sinks_match_reference", "sink_as_extra_key", "sink_limits", "fp8_matches_reference")),
    ("p_fp8_before_max", ("fp8_matches_reference",)),
]


@pytest.mark.parametrize("bug,props", GPTOSS_CAUGHT, ids=[b for b, _ in GPTOSS_CAUGHT])
def test_each_gptoss_bug_is_caught(bug, props):
    wrong = getattr(G, f"gptoss_sink_fp8_{bug}")
    for prop in props:
        _holds(prop, G.gptoss_sink_fp8)
        msg = _fails(prop, wrong)
        assert "MISMATCH" in msg, msg


def test_the_diagnosis_names_the_dropped_descale_and_the_sink_in_the_numerator():
    fp8 = build_case(CaseRecipe(dtype="float8_e4m3fn", descales="random", batch=2, heads_q=4, heads_kv=2, len_q=9,
                                len_k=40, head_dim=64, causal="bottom_right", return_lse=True, seed=3))
    res = av.check(G.gptoss_sink_fp8_descale_dropped, fp8)
    assert res.status == "failed"
    assert diagnose_result(res, adapter=G.gptoss_sink_fp8_descale_dropped).summary == "k_descale ignored (taken as 1)"
    assert av.check(G.gptoss_sink_fp8, fp8).passed
    sinks = build_case(CaseRecipe(dtype="bfloat16", sinks={"kind": "mixed", "level": 2.0, "seed": 0}, heads_q=4,
                                  heads_kv=2, len_q=17, len_k=33, head_dim=64, causal="bottom_right", return_lse=True,
                                  seed=1))
    res = av.check(G.gptoss_sink_fp8_sink_in_numerator, sinks)
    assert res.status == "failed"
    d = diagnose_result(res, adapter=G.gptoss_sink_fp8_sink_in_numerator)
    assert d.best is not None and d.best.key == "sink_in_numerator", d.text()
    assert av.check(G.gptoss_sink_fp8, sinks).passed


def test_a_bug_seen_through_a_derived_call_names_that_call_in_its_case():
    """repeat_and_interleave_stable draws B=1 and fails only in its in_batch call (B=2); the bug summary said
    'needs B >= 2' beside 'smallest case: B=1 ...'. The case line now says which call it was seen through."""
    bugs = []
    with pytest.raises(AssertionError):
        run_property(get_property("repeat_and_interleave_stable"), V.vllm_like_paged_block_index_off_by_one,
                     profile="ci", seed=0, database=None, on_bug=bugs.append)
    (bug,) = bugs[:1]
    assert "B >= 2" in " ".join(bug["needs"]), bug["needs"]
    assert bug["describe"].startswith("B=1 ") and ", seen through its in_batch call (B=2 " in bug["describe"], bug


def test_a_sink_bug_does_not_read_as_needing_the_lse():
    """sinks_match_reference draws its sinks beside the recipe; its 'no LSE' neighbour is judged by
    forward_matches_reference, which used to get the recipe without the sinks, pass, and make the stranger's
    sink-in-numerator bug (which has nothing to do with the LSE) read 'needs return_lse'."""
    bugs = []
    with pytest.raises(AssertionError):
        run_property(get_property("sinks_match_reference"), G.gptoss_sink_fp8_sink_in_numerator, profile="ci", seed=1,
                     database=None, on_bug=bugs.append)
    assert bugs and "return_lse" not in bugs[0]["needs"], bugs[0]["needs"]
    lse = next(v for v in bugs[0]["attribution"]["verdicts"] if v["feature"] == "lse")
    assert lse["verdict"] != "needed" and lse["judged_by"] == "forward_matches_reference", lse  # judged with the sinks
    assert "sinks=" in str(bugs[0]["describe"]), bugs[0]["describe"]


def test_the_summary_repro_line_replays_a_file_adapter_that_does_not_register(tmp_path, capsys):
    """The run's summary prints `attnverify repro <case>` without --adapter; for a file adapter made with
    register=False (here a wrong variant built by a factory) it said 'unknown adapter', though the case file records
    the file and attribute the run took."""
    import json

    from attnverify import cli

    path = str(tmp_path / "c.json")
    build_case(CaseRecipe(len_q=1, len_k=40, head_dim=64, seed=2)).save(path)
    d = json.load(open(path))
    d.update(adapter="vllm-like-paged-seq_lens_minus_one",
             adapter_origin={"kind": "file", "name": "vllm-like-paged-seq_lens_minus_one", "file": VLLM,
                             "attr": "vllm_like_paged_seq_lens_minus_one", "target": f"{VLLM}:vllm_like_paged_seq_lens_minus_one"})
    json.dump(d, open(path, "w"))
    assert cli.main(["repro", path, "--isolate", "none"]) == 1  # STILL FAILS: the wrong kernel was found and run
    out = capsys.readouterr().out
    assert "vllm-like-paged-seq_lens_minus_one" in out and "STILL FAILS" in out, out
    assert cli.main(["repro", path, "--isolate", "none", "--adapter", f"{VLLM}:vllm_like_paged"]) == 0
    assert "HELD" in capsys.readouterr().out


def test_an_output_of_the_wrong_shape_fails_even_with_the_right_numbers():
    """A decode adapter that forgets the Lq axis returns (B, Hq, Dv) for (B, Hq, 1, Dv): the same numbers, so the
    comparison passed it after a reshape, saying nothing (a caller indexing out[:, :, 0] would break)."""
    @av.adapter("vllm-like-no-lq-axis", register=False, **V.CLAIMS)
    def no_lq_axis(q, k, v, spec):
        return V._call(q, k, v, spec)[:, :, 0]

    case = build_case(CaseRecipe(len_q=1, len_k=40, head_dim=64, seed=2))
    res = av.check(no_lq_axis, case)
    assert res.status == "failed", res.message()
    assert "shape (1, 1, 64) instead of (1, 1, 1, 64)" in res.message(), res.message()
    assert av.check(V.vllm_like_paged, case).passed


def test_the_evidence_of_a_paged_failure_is_computed_not_a_crash():
    """The case page of a paged failure said 'running the case again failed (ZeroDivisionError); metrics only': the
    evidence took the caches' dim 2 (heads) for keys. It now maps the error per head, counts each batch's keys, and the
    diagnosis says it models plain calls only."""
    from attnverify.evidence import analyse

    r = CaseRecipe(batch=2, len_q=1, len_k=37, head_dim=64, dtype="float16", cache_lens=(37, 20), paged=True,
                   page_size=16, num_pages=17, block_table=((10, 4, 6, 3), (16, 0, 3, 3)), garbage="nan", seed=100)
    case = build_case(r)
    assert av.check(V.vllm_like_paged_partial_block_full, case).status == "failed"
    info = analyse(V.vllm_like_paged_partial_block_full, "failed", case.to_dict())
    assert info["rerun"] and not any("running the case again failed" in n for n in info["notes"]), info["notes"]
    assert [h["id"] for h in info["heatmaps"]] == ["heads-out"]
    assert sorted(w["visible"] for w in info["worst_rows"]) == [20, 37], info["worst_rows"]
    assert "KV-cache call" in " ".join(info["diagnosis"]["notes"]), info["diagnosis"]


def test_the_attribution_of_a_paged_bug_varies_the_batch_and_says_why_not_the_lengths():
    """The attribution of a paged failure read 'untested: B=1 (cannot be built (ValueError: CaseRecipe(cache_lens=...):
    [37, 20]: one length >= 0 per batch (batch=1)))' and the same for Lk=64: the B -> 1 neighbour kept both requests'
    cache fields. It now keeps the first request, and a length neighbour is said to be none of a cache case."""
    bugs = []
    with pytest.raises(AssertionError):
        run_property(get_property("paged_equals_contiguous"), V.vllm_like_paged_partial_block_full, profile="ci",
                     seed=1, database=None, on_bug=bugs.append)
    text = bugs[0]["attribution"]["text"]
    assert "cannot be built" not in text, text
    verdicts = {v["feature"]: v for v in bugs[0]["attribution"]["verdicts"]}
    if "batch" in verdicts:  # B >= 2 drawn: its neighbour is judged now
        assert verdicts["batch"]["verdict"] in ("needed", "not needed"), verdicts["batch"]
    assert any("takes its key lengths from cache_lens" in (v.get("why") or "") for v in verdicts.values()), text
