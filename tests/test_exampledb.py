"""One example database for every shard (--attn-db): a real redis-server started on 127.0.0.1 (no fake);
a failure found by one shard is replayed first by the next runs on bare machines and by a developer's run."""
import json
import shutil
import socket
import subprocess
import time

import pytest

from attnverify import exampledb, shards
from attnverify.journal import last_run

# a user's adapter (correct) and a user's property with a planted failure: n >= 13 fails. Hypothesis
# draws the simplest value (0) first, so a run whose first planted example is 13 replayed it.
CONFTEST = """
import torch, attnverify as av
from attnverify.properties.base import ExampleResult, Property
from hypothesis import strategies as st

@av.adapter("mine", dtypes=("float32", "float64"), devices=("cpu",), backward=False)
def mine(q, k, v, spec):
    return torch.softmax((q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1]), -1) @ v

class Planted(Property):
    name = "planted"
    def strategy(self, adapter, profile, device):
        return st.integers(0, 20).map(lambda n: {"n": n})
    def run_example(self, adapter, drawn):
        return ExampleResult(drawn["n"] < 13, message=f"n={drawn['n']}")

def pytest_attnverify_properties(config):
    return [Planted()]
"""
PROPS = "planted or forward_matches_reference or inputs_unmodified or causal"
ARGS = ("--adapter=mine", "--attn-profile=ci", "-p", "no:randomly", "-p", "no:cacheprovider", "-k", PROPS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_url(tmp_path):
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run installs it as root)")
    redis = pytest.importorskip("redis", reason="the redis client is not installed (pip install 'attnverify[redis]')")
    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(host="127.0.0.1", port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            if proc.poll() is not None:
                pytest.skip(f"redis-server exited with status {proc.returncode} on port {port}")
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.skip(f"redis-server did not answer on 127.0.0.1:{port} within 5 s")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def test_bad_database_urls_name_the_option_and_the_fix():
    assert exampledb.open_database(None) is ... and exampledb.open_database("") is ...
    for bad, why in (("mysql://x", "redis://HOST:PORT/DB"), ("github:onlyowner", "github:OWNER/REPO"),
                     ("redis://h:notaport/0", "redis://HOST:PORT/DB")):
        with pytest.raises(exampledb.DatabaseError, match=f"ATTNVERIFY_DB='.*'.*{why}"):
            exampledb.open_database(bad, "ATTNVERIFY_DB")


def test_github_artifact_database_is_read_only_beside_the_local_folder():
    from hypothesis.database import GitHubArtifactDatabase, MultiplexedDatabase, ReadOnlyDatabase

    db = exampledb.open_database("github:me/kernels/attn-db")
    assert isinstance(db, MultiplexedDatabase)
    shared = exampledb.shared_database("github:me/kernels/attn-db")
    assert isinstance(shared, ReadOnlyDatabase) and isinstance(shared._wrapped, GitHubArtifactDatabase)
    assert (shared._wrapped.owner, shared._wrapped.repo, shared._wrapped.artifact_name) == ("me", "kernels", "attn-db")


def test_plugin_rejects_a_bad_db_from_the_ini(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nattn_db = ftp://nowhere\n")
    res = pytester.runpytest(*ARGS)
    assert res.ret == 4 and "ini attn_db='ftp://nowhere'" in res.stderr.str() + res.stdout.str()


def _first_planted(folder):
    recs = last_run(str(folder))
    first = next((r for r in recs if r.get("event") == "case_start" and r.get("property") == "planted"), None)
    return recs, (first or {}).get("drawn")


def test_a_failure_one_shard_finds_replays_first_everywhere_through_redis(pytester, redis_url, monkeypatch):
    import redis

    pytester.makeconftest(CONFTEST)
    bare = lambda: shutil.rmtree(pytester.path / ".hypothesis", ignore_errors=True)  # noqa: E731 - a fresh runner
    # round 1: 4 shards, each on a bare machine; only the shard holding (mine, planted) draws the failure
    owners = []
    for k in range(1, 5):
        bare()
        res = pytester.runpytest(*ARGS, "--attn-max-examples=40", "--attn-seed=1", f"--attn-shard={k}/4",
                                 f"--attn-db={redis_url}", f"--attn-report=r1s{k}")
        recs, drawn = _first_planted(pytester.path / f"r1s{k}")
        if ["mine", "planted"] in recs[0]["shard"]["pairs"]:
            owners.append(k)
            assert res.ret == 1 and "n=13" in res.stdout.str(), res.stdout.str()
        else:
            assert drawn is None and res.ret in (0, 5), res.stdout.str()  # 5: -k left nothing in this slice
    assert len(owners) == 1
    assert redis.Redis.from_url(redis_url).keys(b"attnverify*")  # it went into the shared store
    # control: a bare machine without the shared database starts from the simplest example
    bare()
    pytester.runpytest(*ARGS, "--attn-max-examples=1", "--attn-seed=2", "--attn-report=control")
    assert _first_planted(pytester.path / "control")[1] == {"n": 0}
    # round 2: every shard's next run on a bare machine (new seed, one example); the planted pair replays first
    for k in range(1, 5):
        bare()
        res = pytester.runpytest(*ARGS, "--attn-max-examples=1", "--attn-seed=3", f"--attn-shard={k}/4",
                                 f"--attn-db={redis_url}", f"--attn-report=r2s{k}")
        recs, drawn = _first_planted(pytester.path / f"r2s{k}")
        assert drawn == ({"n": 13} if k in owners else None), (k, drawn)
        assert res.ret in ((1,) if k in owners else (0, 5)), res.stdout.str()
    # a developer's local run (unsharded, the database from the environment) replays it first too
    bare()
    monkeypatch.setenv("ATTNVERIFY_DB", redis_url)
    res = pytester.runpytest(*ARGS, "--attn-max-examples=1", "--attn-seed=4", "--attn-report=dev")
    assert _first_planted(pytester.path / "dev")[1] == {"n": 13} and res.ret == 1
    # and with another shard count the pair replays first wherever it lands
    bare()
    k2 = next(k for k in (1, 2) if ("mine", "planted") in shards.shard_pairs(
        ["mine"], json.loads(json.dumps(last_run(str(pytester.path / "dev"))[0]["properties"])), (k, 2)))
    res = pytester.runpytest(*ARGS, "--attn-max-examples=1", "--attn-seed=5", f"--attn-shard={k2}/2",
                             "--attn-report=n2")
    assert _first_planted(pytester.path / "n2")[1] == {"n": 13}
