"""The pre-warm draws what the run draws (attnverify.prewarm.drawn_examples), example database included.

A run has an example database (the profiles' folder, or --attn-db), and with one Hypothesis keeps a Pareto front
whose upkeep draws from generation's random stream: a pre-warm drawing without a database drew other cases than
the run from the first generated example on (2026-12-05, BENCHMARKS.md). The pre-warm reads the run's database
and never writes to it (a private copy). A user's eager adapter, a run of its own (run_property with a database and a runner
whose verdicts all pass alike), and the pre-warm's draws compared example by example.
"""
from __future__ import annotations

import json

import torch
from hypothesis.database import InMemoryExampleDatabase

import attnverify as av
from attnverify.prewarm import drawn_examples
from attnverify.properties import get_property
from attnverify.properties.base import ExampleResult
from attnverify.properties.driver import run_property


def _eager(q, k, v, spec):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return torch.softmax((q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1]), dim=-1) @ v


EAGER = av.adapter("eager_for_draws", dtypes=("float32",), devices=("cpu",), gqa=True, max_seqlen=64,
                   register=False)(_eager)


def _key(x) -> str:
    return json.dumps(x, sort_keys=True, default=str)


def _run_draws(prop, adapter, database, **kw) -> list:
    """What a run with this database draws (each example passing alike), in order."""
    out = []

    def judge(_p, _a, drawn):
        out.append(drawn)
        return ExampleResult(True, status="passed")

    run_property(prop, adapter, runner=judge, database=database, max_bugs=1, **kw)
    return out


def test_the_prewarm_draws_what_a_run_with_a_database_draws():
    prop, adapter = get_property("forward_matches_reference"), EAGER
    kw = dict(profile="ci", seed=5, max_examples=12, device="cpu")
    run = _run_draws(prop, adapter, InMemoryExampleDatabase(), **kw)
    assert len(run) > 12
    assert [_key(x) for x in drawn_examples(prop, adapter, **kw)] == [_key(x) for x in run]
    # the comparison can fail: drawing without a database (what the pre-warm did before) draws other cases
    nodb = drawn_examples(prop, adapter, database=None, **kw)
    assert [_key(x) for x in nodb] == [_key(x) for x in _run_draws(prop, adapter, None, **kw)]
    assert [_key(x) for x in nodb] != [_key(x) for x in run]


def test_the_prewarm_reads_the_runs_database_and_writes_nothing():
    prop, adapter = get_property("forward_matches_reference"), EAGER
    kw = dict(profile="ci", seed=5, max_examples=12, device="cpu")
    db = InMemoryExampleDatabase()
    _run_draws(prop, adapter, db, **kw)  # a first run: its Pareto front is saved in the database
    saved = {k: set(v) for k, v in db.data.items()}
    assert saved, "the control: a run with a database saves examples there"
    pre = [_key(x) for x in drawn_examples(prop, adapter, database=db, **kw)]  # before the run, as in a run
    assert {k: set(v) for k, v in db.data.items()} == saved, "the pre-warm wrote to the run's database"
    again = _run_draws(prop, adapter, db, **kw)  # the run: it replays what the first saved, then generates
    assert pre == [_key(x) for x in again]


def _files(path) -> dict:
    return {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_a_folder_database_is_copied_and_left_as_it_was(tmp_path):
    from hypothesis.database import DirectoryBasedExampleDatabase

    prop, adapter = get_property("forward_matches_reference"), EAGER
    kw = dict(profile="ci", seed=6, max_examples=12, device="cpu")
    db = DirectoryBasedExampleDatabase(str(tmp_path / "db"))
    _run_draws(prop, adapter, db, **kw)
    saved = _files(tmp_path / "db")
    assert saved, "the control: a run with a database saves examples there"
    pre = [_key(x) for x in drawn_examples(prop, adapter, database=db, **kw)]
    assert _files(tmp_path / "db") == saved, "the pre-warm wrote to the run's database folder"
    assert pre == [_key(x) for x in _run_draws(prop, adapter, db, **kw)]
