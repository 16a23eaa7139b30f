"""Shards (--attn-shard K/N): N slices of the (adapter, property) pairs cover one run exactly, and the
merged report of the shards is the single run's matrix, each result labelled with its shard."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from attnverify import shards
from attnverify.journal import last_run
from attnverify.reports.merge import merge
from attnverify.reports.model import build_model

# a user's file adapter: forward only, fp32/fp64 on the CPU, wrong past 24 keys (a failure some shard draws)
MINE = """
import torch, attnverify as av

@av.adapter("mine", dtypes=("float32", "float64"), devices=("cpu",), backward=False)
def mine(q, k, v, spec):
    s = (q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
    o = torch.softmax(s, dim=-1) @ v
    return o * 1.5 if k.shape[2] > 24 else o
"""

RUN = ("--adapter=mine", "--attn-profile=ci", "--attn-max-examples=4", "--attn-seed=7", "-p", "no:randomly",
       "-p", "no:cacheprovider")


def test_parse_names_the_option_and_the_fix():
    assert shards.parse_shard("2/4") == (2, 4) and shards.parse_shard(" 1 / 1 ") == (1, 1)
    assert shards.parse_shard(None) is None and shards.parse_shard("") is None
    for bad in ("0/4", "5/4", "2", "a/b", "1/0", "-1/2"):
        with pytest.raises(shards.ShardError, match=r"ATTNVERIFY_SHARD='.*'.*K"):
            shards.parse_shard(bad, "ATTNVERIFY_SHARD")


def test_slices_cover_every_pair_once_balanced_and_stable_across_processes():
    adapters, props = ["a", "b", "mine"], [f"p{i}" for i in range(13)]
    pairs = [(a, p) for a in adapters for p in props]
    for n in (1, 2, 3, 4, 7, 50):
        slices = [shards.shard_pairs(adapters, props, (k, n)) for k in range(1, n + 1)]
        flat = [x for s in slices for x in s]
        assert sorted(flat) == sorted(pairs) and len(flat) == len(set(flat))  # whole run, no overlap
        sizes = [len(s) for s in slices]
        assert max(sizes) - min(sizes) <= 1
    # the same slices in another interpreter with another hash salt (no coordinator needed)
    code = "from attnverify import shards; print(shards.shard_pairs(['a','b','mine'], ['p%d' % i for i in range(13)], (2, 4)))"
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(shards.shard_pairs(adapters, props, (2, 4)))
    # a wrong assignment (one pair dropped) would fail the coverage check above
    assert sorted(flat[1:]) != sorted(pairs)


def _judged(folder):
    """(adapter, property, example) judged, and the test_end outcomes, of a report folder's last run."""
    recs = last_run(str(folder))
    examples = {(r["adapter"], r["property"], json.dumps(r["drawn"], sort_keys=True))
                for r in recs if r.get("event") == "case_start"}
    ends = {(r["adapter"], r["property"]): r["outcome"] for r in recs if r.get("event") == "test_end"}
    return recs, examples, ends


def _matrix(folder):
    m = build_model(str(folder))
    return {k: (c["status"], c["examples"]) for k, c in m["cells"].items()}, m


def test_four_shards_judge_what_one_run_judges_and_merge_to_its_matrix(pytester):
    pytester.makeconftest(MINE)
    res = pytester.runpytest(*RUN, "--attn-report=single")
    assert res.ret == 1, res.stdout.str()  # the planted bug is found
    _, one_examples, one_ends = _judged(pytester.path / "single")
    assert "failed" in one_ends.values() and "passed" in one_ends.values()
    folders = []
    for k in range(1, 5):
        shutil.rmtree(pytester.path / ".hypothesis", ignore_errors=True)  # each CI job starts bare
        res = pytester.runpytest(*RUN, f"--attn-shard={k}/4", f"--attn-report=shard{k}")
        out = res.stdout.str()
        assert res.ret in (0, 1), out
        assert "deselected" in out, out
        folders.append(pytester.path / f"shard{k}")
    per_shard = [_judged(f) for f in folders]
    slices = []
    for k, (recs, examples, ends) in enumerate(per_shard, start=1):
        sh = recs[0]["shard"]  # run_start says which slice ran
        assert recs[0]["event"] == "run_start" and (sh["index"], sh["count"]) == (k, 4)
        pairs = {tuple(p) for p in sh["pairs"]}
        assert set(ends) <= pairs and {(a, p) for a, p, _ in examples} <= pairs  # it ran its slice only
        slices.append(pairs)
    assert sum(len(s) for s in slices) == len(set().union(*slices))  # no overlap
    assert set().union(*slices) == {("mine", p) for p in recs[0]["properties"]}  # nothing missed
    union_examples = set().union(*(e for _, e, _ in per_shard))
    assert union_examples == one_examples
    merged_ends = {}
    for _, _, ends in per_shard:
        merged_ends.update(ends)
    assert merged_ends == one_ends
    # the merged report: the single run's matrix, every cell labelled with the shard it ran on
    merge([str(f) for f in folders], str(pytester.path / "merged"))
    single, _ = _matrix(pytester.path / "single")
    merged, model = _matrix(pytester.path / "merged")
    assert merged == single
    labels = {s["label"] for s in model["sources"]}
    assert labels == {f"shard{k}-shard{k}of4" for k in range(1, 5)}  # folder name + the slice it ran
    assert model["cells"]
    for (a, p), c in model["cells"].items():
        k = next(i for i, s in enumerate(slices, start=1) if (a, p) in s)
        assert [lab for lab, _ in c["sources"]] == [f"shard{k}-shard{k}of4"]


def test_shard_from_env_and_ini_and_bad_values_are_usage_errors(pytester, monkeypatch):
    pytester.makeconftest(MINE)
    pytester.makeini("[pytest]\nattn_shard = 3/2\n")
    res = pytester.runpytest(*RUN)
    assert res.ret == 4 and "ini attn_shard='3/2'" in res.stderr.str() + res.stdout.str()
    monkeypatch.setenv("ATTNVERIFY_SHARD", "2/2")
    res = pytester.runpytest(*RUN, "--attn-report=r")
    assert res.ret in (0, 1), res.stdout.str()
    assert last_run(str(pytester.path / "r"))[0]["shard"]["index"] == 2
    res = pytester.runpytest(*RUN, "--attn-shard=x")
    assert res.ret == 4 and "--attn-shard='x'" in res.stderr.str() + res.stdout.str()


def test_attnverify_run_shard_passes_the_slice_to_pytest(pytester, monkeypatch):
    from attnverify import cli

    ns = cli.build_parser().parse_args(["run", "--adapter=mine", "--shard", "3/4", "--db", "redis://h:1/0"])
    args = cli.pytest_args_for_run(ns, [], gpu=False)
    assert "--attn-shard=3/4" in args and "--attn-db=redis://h:1/0" in args
    assert not any(a.startswith("--attn-shard") for a in cli.pytest_args_for_run(
        cli.build_parser().parse_args(["run", "--adapter=mine"]), [], gpu=False))
    pytester.makeconftest(MINE)
    monkeypatch.chdir(pytester.path)
    rc = cli.main(["run", "--adapter=mine", "--profile=ci", "--max-examples=2", "--seed=7", "--shard=1/4",
                   "--report=s1", "--no-html", "-q"])
    assert rc in (0, 1)
    assert last_run(str(pytester.path / "s1"))[0]["shard"]["index"] == 1
