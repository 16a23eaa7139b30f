"""The results journal: append-only JSONL, readable after a kill, shared by several writers."""
import json
import os

import pytest

from attnverify.case import CaseRecipe, build_case
from attnverify.journal import (Journal, case_hint, dangling_cases, dumps, example_id, last_run, read_journal,
                                runs, save_case)


def test_records_round_trip_with_common_keys(tmp_path):
    j = Journal(str(tmp_path), run_id="r1", worker="gw3")
    j.write({"event": "run_start", "seed": 5, "env": {"torch": "x"}})
    j({"event": "case_start", "property": "p", "adapter": "a", "drawn": {"recipe": {"len_q": 3}}})
    j({"event": "result", "property": "p", "adapter": "a", "passed": False, "severity": float("inf")})
    j.close()
    recs = read_journal(str(tmp_path))
    assert [r["event"] for r in recs] == ["run_start", "case_start", "result"]
    assert all(r["run_id"] == "r1" and r["worker"] == "gw3" and r["v"] == 1 and r["pid"] == os.getpid() for r in recs)
    assert recs[2]["severity"] == "inf"  # strict JSON: no bare Infinity in the file
    for line in open(tmp_path / "results.jsonl"):
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def test_truncated_last_line_is_skipped(tmp_path):
    j = Journal(str(tmp_path), run_id="r1")
    for i in range(3):
        j({"event": "case_start", "index": i})
    j.close()
    with open(tmp_path / "results.jsonl", "ab") as f:
        f.write(b'{"v": 1, "event": "result", "run_id": "r1", "mess')  # a kill mid-write
    recs = read_journal(str(tmp_path / "results.jsonl"))
    assert [r["index"] for r in recs] == [0, 1, 2]
    # and appending after the damage keeps every record of the next run
    j2 = Journal(str(tmp_path), run_id="r2")
    j2({"event": "run_start"})
    assert runs(str(tmp_path)) == ["r1", "r2"]


@pytest.mark.parametrize("cut", [1, 17, 40, -1])
def test_a_journal_cut_mid_line_loses_nothing_of_the_next_run(tmp_path, cut):
    """A kill in the middle of a record's write: the next run (a new process, a new Journal) keeps every
    one of its records, its run_start first, and the earlier run keeps all its whole records."""
    j = Journal(str(tmp_path), run_id="killed")
    j({"event": "run_start", "seed": 1})
    j({"event": "case_start", "index": 1, "drawn": {"recipe": {"len_q": 3}}})
    j.close()
    torn = (dumps({"v": 1, "event": "result", "run_id": "killed", "index": 1, "message": "x" * 50}) + "\n").encode()
    with open(tmp_path / "results.jsonl", "ab") as f:
        f.write(torn[:cut])  # the process died here: no newline
    nxt = Journal(str(tmp_path), run_id="next")
    for i, ev in enumerate(("run_start", "case_start", "result", "test_end", "run_end")):
        nxt({"event": ev, "index": i})
    nxt.close()
    assert runs(str(tmp_path)) == ["killed", "next"]
    assert [r["event"] for r in read_journal(str(tmp_path), run_id="next")] == [
        "run_start", "case_start", "result", "test_end", "run_end"]
    assert [r["event"] for r in last_run(str(tmp_path))][0] == "run_start"
    whole = ["result"] if cut == -1 else []  # only the newline was missing: the record is whole
    assert [r["event"] for r in read_journal(str(tmp_path), run_id="killed")] == ["run_start", "case_start"] + whole
    # the torn line stays a line of its own: no record of the next run shares it
    lines = [ln for ln in open(tmp_path / "results.jsonl", "rb").read().split(b"\n") if ln.strip()]
    mine = [ln for ln in lines if b'"next"' in ln]
    assert len(mine) == 5 and all(json.loads(ln)["run_id"] == "next" for ln in mine)


def test_a_journal_torn_by_an_older_writer_is_salvaged_on_reading(tmp_path):
    """Journals written before the repair have the next run's first record glued to the torn line."""
    with open(tmp_path / "results.jsonl", "wb") as f:
        f.write(b'{"v": 1, "event": "run_start", "run_id": "a"}\n{"v": 1, "event": "result", "run_id": "a", "mess')
        f.write(b'{"v": 1, "event": "run_start", "run_id": "b"}\n{"v": 1, "event": "run_end", "run_id": "b"}\n')
    assert [(r["run_id"], r["event"]) for r in read_journal(str(tmp_path))] == [
        ("a", "run_start"), ("b", "run_start"), ("b", "run_end")]


def test_dangling_case_names_the_example_that_killed_the_run(tmp_path):
    j = Journal(str(tmp_path), run_id="old")
    j({"event": "case_start", "test": "t", "drawn": 1})
    j = Journal(str(tmp_path), run_id="new")
    j({"event": "run_start"})
    j({"event": "case_start", "test": "t", "drawn": 2})
    j({"event": "result", "test": "t", "passed": True})
    j({"event": "case_start", "test": "t", "drawn": 3})
    recs = last_run(str(tmp_path))
    assert {r["run_id"] for r in recs} == {"new"}
    assert [r["drawn"] for r in dangling_cases(recs)] == [3]


def test_concurrent_writers_never_interleave(tmp_path):
    pids = []
    for w in range(3):
        pid = os.fork()
        if pid == 0:  # child: hammer the same file
            try:
                j = Journal(str(tmp_path), run_id="r", worker=f"gw{w}", fsync=False)
                for i in range(300):
                    j({"event": "result", "i": i, "pad": "x" * (50 * (i % 40))})
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    lines = open(tmp_path / "results.jsonl").read().splitlines()
    assert len(lines) == 900
    recs = [json.loads(ln) for ln in lines]  # every line parses: no torn records
    assert sorted((r["worker"], r["i"]) for r in recs) == sorted((f"gw{w}", i) for w in range(3) for i in range(300))


def test_case_hint_matches_case_id_without_tensors():
    r = CaseRecipe(batch=2, heads_q=4, heads_kv=2, len_q=5, len_k=7, head_dim=16, seed=3, causal="bottom_right")
    hint = case_hint({"recipe": r.to_dict(), "extra": 1})
    case = build_case(r)
    assert hint["id"] == case.case_id()
    assert hint["shapes"]["k"] == list(case.k.shape)
    assert "causal=bottom_right" in hint["describe"] and "Lq=5" in hint["describe"]
    assert case_hint({"x": 1}) is None and case_hint(42) is None


def test_save_case_is_keyed_per_property_adapter_and_example(tmp_path):
    drawn = {"recipe": CaseRecipe(len_q=4, len_k=4).to_dict()}
    p1 = save_case(str(tmp_path), prop_name="p", adapter_name="a", drawn=drawn, result={"status": "crashed"}, seed=9)
    p2 = save_case(str(tmp_path), prop_name="p", adapter_name="b", drawn=drawn, result={"status": "failed"})
    assert p1 != p2 and os.path.basename(p1) == example_id("p", "a", drawn) + ".json"
    d = json.load(open(p1))
    assert d["adapter"] == "a" and d["property"] == "p" and d["drawn"] == json.loads(json.dumps(drawn)) and d["status"] == "crashed"
    assert d["recipe"]["len_q"] == 4 and d["repro"].startswith("attnverify repro ") and d["seed_run"] == 9
    assert d["env"]["python"]


def test_per_example_records_are_fsynced_at_most_once_a_second(tmp_path, monkeypatch):
    """Issue 25: an fsync per example cost a third of an example's judging; the file still gets every
    record at once (one O_APPEND write), and a lost machine loses at most `fsync_every` seconds."""
    import attnverify.journal as jm

    synced = []
    monkeypatch.setattr(jm.os, "fsync", lambda fd: synced.append(fd))
    j = Journal(str(tmp_path), run_id="r", fsync_every=3600.0)
    j.write({"event": "run_start"})
    for i in range(20):
        j.write({"event": "case_start", "index": i})
        j.write({"event": "result", "index": i, "passed": True})
    j.write({"event": "test_end"})
    assert len(synced) == 2  # run_start and test_end; the per-example records within the hour: none
    assert len(read_journal(str(tmp_path))) == 42  # every record is in the file all the same
    every = Journal(str(tmp_path), run_id="r2", fsync_every=0.0)
    for i in range(5):
        every.write({"event": "result", "index": i})
    assert len(synced) == 7  # fsync_every=0: each one
