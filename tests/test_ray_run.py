"""`attnverify run --ray`: one Ray task per shard on a local Ray instance, one merged report; a task
killed mid-run is retried into a new attempt folder and the merge keeps what the killed attempt journaled.

These start a real local Ray instance (CPU tasks) and real `attnverify run` processes against a user's
conftest adapter."""
import json
import os
import subprocess
import sys

import pytest

from attnverify.journal import last_run, read_journal
from attnverify.reports.attempts import example_key
from attnverify.reports.model import build_model

pytest.importorskip("ray", reason="ray is not installed: pip install 'attnverify[ray]' (scripts/setup.sh installs it "
                                  "unless ATTNVERIFY_NO_RAY=1)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a user's conftest adapter: forward only, fp32/fp64 on the CPU, wrong past 24 keys (a failure some shard draws)
MINE = """
import torch, attnverify as av

@av.adapter("mine", dtypes=("float32", "float64"), devices=("cpu",), backward=False)
def mine(q, k, v, spec):
    s = (q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
    o = torch.softmax(s, dim=-1) @ v
    return o * 1.5 if k.shape[2] > 24 else o
"""

# the same kernel, correct everywhere, whose first attempt of every shard kills its Ray worker (the process
# that would go down with a lost node) at its 6th call: judging child -> the shard's run -> the Ray worker
KILLER = """
import os, signal, torch, attnverify as av

def _grandparent():
    with open(f"/proc/{os.getppid()}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])

@av.adapter("mine", dtypes=("float32", "float64"), devices=("cpu",), backward=False)
def mine(q, k, v, spec):
    if os.environ.get("ATTNVERIFY_RAY_ATTEMPT") == "1":
        path = os.path.join(os.path.dirname(__file__), f"calls-{os.getppid()}")
        n = int(open(path).read()) + 1 if os.path.exists(path) else 1
        with open(path, "w") as f:
            f.write(str(n))
        if n == 6:
            os.kill(_grandparent(), signal.SIGKILL)
    s = (q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
    return torch.softmax(s, dim=-1) @ v
"""

PROPS = ("forward_matches_reference", "inputs_unmodified", "value_scaling", "no_out_of_bounds")
RUN = ["run", "--adapter=mine", "--profile=ci", "--max-examples=4", "--seed=7", "-k", " or ".join(PROPS), "--no-html",
       "-q"]


def _attnverify(cwd, *args, **env_extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **env_extra)
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "attnverify.cli", *RUN, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def _examples(recs, event="case_start"):
    return {example_key(r) for r in recs if r.get("event") == event}


def _results(recs):
    """(adapter, property, example) of each result, through the case_start before it."""
    from attnverify.reports.attempts import pair_examples

    return [(k, recs[r]) for _, r, k in pair_examples(recs) if r >= 0]


def _matrix(folder):
    return {k: (c["status"], c["examples"]) for k, c in build_model(str(folder))["cells"].items()}


def _attempts(report):
    root = os.path.join(report, "attempts")
    (run,) = os.listdir(root)
    return {name: os.path.join(root, run, name) for name in sorted(os.listdir(os.path.join(root, run)))}


def test_four_ray_tasks_judge_what_one_run_judges_and_merge_to_its_matrix(tmp_path):
    (tmp_path / "conftest.py").write_text(MINE)
    one = _attnverify(tmp_path, "--report=single")
    assert one.returncode == 1, one.stdout + one.stderr  # the planted bug is found
    for f in (tmp_path / ".hypothesis").rglob("*"):  # the Ray run starts from a bare example database too
        if f.is_file():
            f.unlink()
    # CPU tasks also where Ray would find GPUs (RAY_OVERRIDE_RESOURCES: Ray's own resource override)
    res = _attnverify(tmp_path, "--ray", "--ray-shards=4", "--report=merged", RAY_OVERRIDE_RESOURCES='{"GPU": 0}')
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "4 shard(s) as Ray tasks (1 CPU each" in out and "merged 4 attempt(s) of 4 shard(s)" in out, out
    single = last_run(str(tmp_path / "single"))
    attempts = _attempts(str(tmp_path / "merged"))
    assert sorted(attempts) == [f"shard{k}of4-attempt1" for k in range(1, 5)]  # one attempt each, none lost
    slices = {}
    for name, folder in attempts.items():
        recs = last_run(folder)
        assert recs[0]["shard"]["count"] == 4 and recs[-1]["event"] == "run_end", name
        slices[name] = {tuple(p) for p in recs[0]["shard"]["pairs"]}
        assert {(a, p) for a, p, _ in _examples(recs)} <= slices[name]  # each task ran its own slice
    assert set().union(*slices.values()) == {("mine", p) for p in single[0]["properties"]}
    assert sum(map(len, slices.values())) == len(set().union(*slices.values()))  # no overlap
    merged = read_journal(str(tmp_path / "merged"))
    assert _examples(merged) == _examples(single) and _examples(single)
    assert sorted(k for k, _ in _results(merged)) == sorted(k for k, _ in _results(single))  # each judged once
    assert _matrix(tmp_path / "merged") == _matrix(tmp_path / "single")
    statuses = {s for s, _ in _matrix(tmp_path / "single").values()}
    assert "failed" in statuses and "passed" in statuses
    model = build_model(str(tmp_path / "merged"))
    for (a, p), c in model["cells"].items():  # where each result ran: its shard
        k = next(name for name, s in slices.items() if (a, p) in s)
        assert [lab for lab, _ in c["sources"]] == [k.split("-")[0]]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the planted kill finds the Ray worker in /proc (Linux)")
def test_a_killed_ray_task_is_retried_and_the_merge_keeps_what_it_journaled(tmp_path):
    """On a local instance with two GPUs (logical ones: Ray's RAY_OVERRIDE_RESOURCES, as its own fake
    clusters declare them; the adapter runs on the CPU): one shard per GPU, each on its own GPU."""
    (tmp_path / "conftest.py").write_text(KILLER)
    res = _attnverify(tmp_path, "--ray", "--report=merged", RAY_OVERRIDE_RESOURCES='{"GPU": 2}')
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "2 shard(s) as Ray tasks (1 GPU each" in out and "(attempt 2 on" in out, out
    attempts = _attempts(str(tmp_path / "merged"))
    merged = read_journal(str(tmp_path / "merged"))
    merged_results = _results(merged)
    keys = [k for k, _ in merged_results]
    assert len(keys) == len(set(keys))  # an example judged by both attempts is counted once
    merged_by_key = dict(merged_results)
    ended = set()
    for k in (1, 2):
        first, second = last_run(attempts[f"shard{k}of2-attempt1"]), last_run(attempts[f"shard{k}of2-attempt2"])
        # the first attempt died mid-run: no run_end, an example left running, results journaled before
        assert not any(r.get("event") == "run_end" for r in first)
        killed = _results(first)
        assert killed, f"shard {k}: the first attempt journaled nothing before it was killed"
        assert any(r.get("event") == "case_start" for r in first[-3:])
        # every result it journaled is in the merged report, as journaled by it (the earlier attempt on a tie)
        for key, rec in killed:
            kept = merged_by_key[key]
            assert kept["attempt"] == f"shard{k}of2-attempt1" and kept["status"] == rec["status"]
            assert [a["attempt"] for a in kept["attempts"]] == [f"shard{k}of2-attempt1", f"shard{k}of2-attempt2"]
        # the retried attempt completed the shard: every selected pair of its slice ended
        assert second[-1]["event"] == "run_end"
        pairs = {tuple(p) for p in second[0]["shard"]["pairs"]}
        ends = {(r["adapter"], r["property"]) for r in second if r.get("event") == "test_end"}
        assert ends == {("mine", p) for p in PROPS} & pairs
        assert {(a, p) for a, p, _ in _examples(first)} <= ends
        ended |= ends
    assert ended == {("mine", p) for p in PROPS}
    model = build_model(str(tmp_path / "merged"))
    assert model["cells"] and all(c["status"] in ("passed", "skipped") for c in model["cells"].values()), \
        {k: c["status"] for k, c in model["cells"].items()}  # the example the kill interrupted is no crash
    manifest = json.loads((tmp_path / "merged" / "merged.json").read_text())
    assert [len(s["attempts"]) for s in manifest["sources"]] == [2, 2]
    assert all(a["attempt"] in (1, 2) and a["node"] for s in manifest["sources"] for a in s["attempts"])
    gpus = [[a["cuda_visible_devices"] for a in s["attempts"]] for s in manifest["sources"]]
    assert all(g in ("0", "1") for each in gpus for g in each), gpus  # one GPU per task, set by Ray
    assert gpus[0][0] != gpus[1][0], gpus  # the two first attempts ran at once, each on its own GPU
