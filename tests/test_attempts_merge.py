"""The merge of a shard's attempts (a Ray task retried after its node was lost): one result per
(adapter, property, example), the worst status among the attempts, nothing a lost attempt journaled lost;
and the `--ray` options' usage errors (no Ray needed)."""
import json
import os

import pytest

from attnverify import cli
from attnverify.journal import read_journal
from attnverify.reports.attempts import combine
from attnverify.reports.merge import merge
from attnverify.reports.model import build_model

P = ("mine", "forward_matches_reference")


def _attempt(run_id, events):
    """Journal records of one attempt: ("cs", x) a case_start of example x, ("r", x, status) its result,
    ("end", outcome) the pair's test_end, "run_end"."""
    recs = [{"v": 1, "event": "run_start", "run_id": run_id, "t": 1.0, "pid": 10, "worker": None,
             "adapters": [{"name": P[0]}], "properties": [P[1]]}]
    for ev in events:
        base = {"v": 1, "run_id": run_id, "t": 2.0, "pid": 10, "worker": None, "adapter": P[0], "property": P[1],
                "test": "test_x[mine]"}
        if ev == "run_end":
            recs.append({**base, "event": "run_end", "exit_status": 0, "seconds": 1.0})
        elif ev[0] == "cs":
            recs.append({**base, "event": "case_start", "drawn": {"x": ev[1]}})
        elif ev[0] == "r":
            recs.append({**base, "event": "result", "passed": ev[2] == "passed", "status": ev[2], "message": ev[1]})
        else:
            recs.append({**base, "event": "test_end", "outcome": ev[1], "status": None if ev[1] == "passed" else ev[1]})
    return recs


def _write(folder, recs):
    os.makedirs(folder)
    with open(os.path.join(folder, "results.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    return str(folder)


LOST = [("cs", 1), ("r", 1, "passed"), ("cs", 2), ("r", 2, "passed"), ("cs", 3)]  # killed judging example 3
RETRY = [("cs", 1), ("r", 1, "passed"), ("cs", 2), ("r", 2, "failed"), ("cs", 3), ("r", 3, "passed"), ("cs", 4),
         ("r", 4, "passed"), ("end", "failed"), "run_end"]


def test_one_result_per_example_worst_status_earliest_on_a_tie():
    out = combine([("a1", _attempt("r1", LOST)), ("a2", _attempt("r2", RETRY))])
    results = [r for r in out if r["event"] == "result"]
    assert sorted(r["message"] for r in results) == [1, 2, 3, 4]  # each example once
    by = {r["message"]: r for r in results}
    assert by[1]["attempt"] == "a1"  # a tie: the lost attempt's own record
    assert by[1]["attempts"] == [{"attempt": "a1", "status": "passed"}, {"attempt": "a2", "status": "passed"}]
    assert by[2]["attempt"] == "a2" and by[2]["status"] == "failed"  # the retry's failure is not hidden by a pass
    assert by[3]["attempt"] == "a2" and "attempts" not in by[3]
    starts = [r for r in out if r["event"] == "case_start"]
    assert sorted(r["drawn"]["x"] for r in starts) == [1, 2, 3, 4]  # the killed example's case_start is gone
    assert [r["attempt"] for r in out if r["event"] in ("run_start", "run_end")] == ["a1", "a2", "a2"]
    # every case_start is followed by its result in its own run (the report finds no dangling case)
    from attnverify.journal import dangling_cases

    assert dangling_cases(out) == []


def test_merged_attempts_show_the_single_runs_cell_where_separate_sources_would_not(tmp_path):
    a1 = _write(tmp_path / "shard1of2-attempt1", _attempt("r1", LOST))
    a2 = _write(tmp_path / "shard1of2-attempt2", _attempt("r2", RETRY))
    merge([[a1, a2]], str(tmp_path / "m"), labels=["shard1of2"])
    cell = build_model(str(tmp_path / "m"))["cells"][P]
    assert (cell["status"], cell["examples"]) == ("failed", 4)
    assert [lab for lab, _ in cell["sources"]] == ["shard1of2"]
    manifest = json.loads((tmp_path / "m" / "merged.json").read_text())
    assert [a["label"] for a in manifest["sources"][0]["attempts"]] == ["shard1of2-attempt1", "shard1of2-attempt2"]
    assert manifest["sources"][0]["run_ids"] == ["r1", "r2"]
    # merged as two unrelated runs, the lost attempt's interrupted example reads as a crash, examples twice
    merge([a1, a2], str(tmp_path / "naive"))
    naive = build_model(str(tmp_path / "naive"))["cells"][P]
    assert (naive["status"], naive["examples"]) == ("crashed", 6)


def test_an_example_no_attempt_got_past_stays_a_crash(tmp_path):
    again = [("cs", 1), ("r", 1, "passed"), ("cs", 2), ("r", 2, "passed"), ("cs", 3)]  # the example kills every node
    a1 = _write(tmp_path / "a1", _attempt("r1", LOST))
    a2 = _write(tmp_path / "a2", _attempt("r2", again))
    merge([[a1, a2]], str(tmp_path / "m"), labels=["shard1of1"])
    recs = read_journal(str(tmp_path / "m"))
    assert sum(r["event"] == "result" for r in recs) == 2
    assert sum(r["event"] == "case_start" and r["drawn"] == {"x": 3} for r in recs) == 2
    cell = build_model(str(tmp_path / "m"))["cells"][P]
    assert cell["status"] == "crashed"


def test_the_worst_test_end_is_kept():
    ended_failed = [("cs", 1), ("r", 1, "failed"), ("end", "failed"), "run_end"]
    ended_passed = [("cs", 1), ("r", 1, "passed"), ("end", "passed"), "run_end"]
    out = combine([("a1", _attempt("r1", ended_failed)), ("a2", _attempt("r2", ended_passed))])
    ends = [r for r in out if r["event"] == "test_end"]
    assert [(r["attempt"], r["outcome"]) for r in ends] == [("a1", "failed")]
    (res,) = [r for r in out if r["event"] == "result"]
    assert res["status"] == "failed" and [a["status"] for a in res["attempts"]] == ["failed", "passed"]


def test_merge_refuses_an_empty_attempt_list_and_a_folder_without_journal(tmp_path):
    from attnverify.reports.merge import MergeError

    with pytest.raises(MergeError, match="empty list of attempt folders"):
        merge([[]], str(tmp_path / "m"))
    with pytest.raises(MergeError, match="no report folder"):
        merge([[str(tmp_path)]], str(tmp_path / "m"))


def test_ray_options_usage_errors(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "--adapter=naive", "--ray-shards=2"]) == cli.EXIT_USAGE
    assert "--ray-shards without --ray" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # ray missing: the error names the fix
    assert cli.main(["run", "--adapter=naive", "--ray"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "ray is not installed" in err and "pip install 'attnverify[ray]'" in err


def test_ray_run_refuses_bad_values_before_starting_ray(tmp_path, monkeypatch, capsys):
    import sys
    import types

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(init=lambda **k: pytest.fail("ray started")))
    assert cli.main(["run", "--adapter=naive", "--ray", "--shard=1/2"]) == cli.EXIT_USAGE
    assert "--shard with --ray" in capsys.readouterr().err
    assert cli.main(["run", "--adapter=naive", "--ray", "--ray-shards=0"]) == cli.EXIT_USAGE
    assert "--ray-shards=0" in capsys.readouterr().err
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "results.jsonl").write_text("")
    assert cli.main(["run", "--adapter=naive", "--ray"]) == cli.EXIT_USAGE
    assert "not a merged report" in capsys.readouterr().err


def test_run_argv_forwards_the_options_every_shard_needs():
    from attnverify.ray_run import run_argv

    ns = cli.build_parser().parse_args(["run", "--adapter=mine", "--adapter=b.py:x", "--seed=5", "--profile=ci", "-k",
                                        "a or b", "--ray", "auto", "--ray-shards=3", "--report=R", "-q"])
    assert ns.ray == "auto" and ns.ray_shards == 3
    argv = run_argv(ns, ["-x"])
    assert argv == ["--adapter=mine", "--adapter=b.py:x", "--profile=ci", "--seed=5", "-k=a or b", "-q", "--", "-x"]
    assert cli.build_parser().parse_args(["run", "--ray", "--adapter=m"]).ray == "local"
    # the pre-warm and its budget reach every shard (they were dropped silently)
    ns = cli.build_parser().parse_args(["run", "--adapter=m", "--ray", "--prewarm", "--prewarm-budget=90"])
    assert run_argv(ns, []) == ["--adapter=m", "--prewarm", "--prewarm-budget=90"]


def test_the_ray_runs_exit_status_from_its_shards():
    from attnverify.ray_run import _overall

    assert _overall([0, 1, 2]) == 1 and _overall([2, 0, 0]) == 0  # a shard with an empty slice says 2
    assert _overall([2, 2]) == 2 and _overall([0, 3, 1]) == 3 and _overall([]) == 3


def test_attempt_folders_are_numbered_and_grouped_per_shard(tmp_path):
    from attnverify.ray_run import attempt_groups, new_attempt_dir

    made = [new_attempt_dir(str(tmp_path), 2, 4) for _ in range(3)] + [new_attempt_dir(str(tmp_path), 1, 4)]
    assert [m for _, m in made] == [1, 2, 3, 1]
    for path, _ in made[:2] + made[3:]:  # the third attempt of shard 2 died before journaling anything
        (tmp_path / path / "results.jsonl").write_text("")
    assert attempt_groups(str(tmp_path)) == {1: [made[3][0]], 2: [made[0][0], made[1][0]]}
