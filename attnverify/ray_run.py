"""`attnverify run --ray [ADDRESS]`: one Ray task per shard, one merged report.

    attnverify run --ray --adapter mine                  # a local Ray instance: one task per CPU (per GPU)
    attnverify run --ray auto --ray-shards 16 ...        # the Ray cluster this machine belongs to
    attnverify run --ray ray://head:10001 ...            # a remote cluster through Ray Client

Ray (pip install 'attnverify[ray]') is only the scheduler: every task runs `attnverify run --shard K/N`
in its own process, exactly as a CI job would, so crash isolation is what it is in any run. The driver

1. picks the shard count N (--ray-shards; default: the cluster's GPUs, else its CPUs) and one seed for
   all shards (--seed, else a fresh one, printed);
2. submits N tasks, each `num_gpus=1` where the cluster has GPUs (Ray sets CUDA_VISIBLE_DEVICES: one
   worker per GPU), else `num_cpus=1`; a task whose worker or node is lost, or whose run was killed by
   a signal, is retried up to --ray-retries times;
3. each task attempt takes a new folder REPORT/attempts/RUN/shardKofN-attemptM (M = 1, 2, ...: the
   first free one), the report folder of its run (its journal is written record by record, so what an
   attempt judged before it died is on disk), with attempt.json (shard, attempt, node, pid, the GPU) and
   output.log (the run's output) beside the journal; the run sees ATTNVERIFY_RAY_ATTEMPT=M;
4. merges every attempt folder into REPORT (attnverify/reports/merge.py; one source per shard, the
   attempts of a shard combined as reports/attempts.py says) and renders it.

Without an address a local Ray instance is started with as many CPUs as shards (so every shard runs at
once, as N CI jobs would) and the GPUs Ray finds. On a cluster of several machines, REPORT must be a
folder every node sees at the same path (a shared filesystem), and attnverify and the adapters' code
must be importable on every node; the tasks run in the driver's working directory where it exists on
the node (so ./conftest.py adapters are found), else in their attempt folder.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Sequence

LOCAL = "local"  # the const of a bare --ray
_ATTEMPT = re.compile(r"^shard(\d+)of(\d+)-attempt(\d+)$")


class RayUnavailable(RuntimeError):
    """ray is not installed here."""


class AttemptLost(RuntimeError):
    """The shard's run was killed by a signal (its process, not its verdicts): Ray retries the task."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailable("--ray: ray is not installed; pip install 'attnverify[ray]' (or: pip install "
                             "'ray[default]'), or run without --ray") from None
    return ray


def run_argv(ns, extra: Sequence[str]) -> List[str]:
    """The `attnverify run` arguments every shard gets (the parsed options less --ray, --shard, --report)."""
    argv: List[str] = []
    for a in ns.adapter or []:
        argv.append(f"--adapter={a}")
    for flag, val in (("--profile", ns.profile), ("--seed", ns.seed), ("--device", ns.device),
                      ("--max-examples", ns.max_examples), ("--isolate", ns.isolate), ("--timeout", ns.timeout),
                      ("--max-bugs", ns.max_bugs), ("--db", ns.db), ("-n", ns.numprocesses), ("-k", ns.keyword)):
        if val is not None:
            argv.append(f"{flag}={val}")
    if ns.allow_untested:
        argv.append("--allow-untested")
    if getattr(ns, "prewarm", False):  # each shard pre-warms what its slice will launch, on its node
        argv.append("--prewarm")
    if getattr(ns, "prewarm_budget", None) is not None:
        argv.append(f"--prewarm-budget={ns.prewarm_budget:.15g}")
    if ns.quiet:
        argv.append("-q")
    return argv + (["--", *extra] if extra else [])


def new_attempt_dir(root: str, k: int, n: int) -> tuple:
    """(folder, attempt number): the first shardKofN-attemptM under root that this call creates."""
    os.makedirs(root, exist_ok=True)
    m = 1
    while True:
        path = os.path.join(root, f"shard{k}of{n}-attempt{m}")
        try:
            os.mkdir(path)  # atomic: two attempts never share a folder
            return path, m
        except FileExistsError:
            m += 1


def attempt_groups(root: str) -> Dict[int, List[str]]:
    """shard K -> its attempt folders that hold a journal, first attempt first."""
    found: Dict[int, List[tuple]] = {}
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = _ATTEMPT.match(name)
        if m and os.path.isfile(os.path.join(root, name, "results.jsonl")):
            found.setdefault(int(m.group(1)), []).append((int(m.group(3)), os.path.join(root, name)))
    return {k: [p for _, p in sorted(v)] for k, v in sorted(found.items())}


def _child_cmd(args: Sequence[str]) -> List[str]:
    # the run dies with the task's worker (SIGKILL on parent death, Linux), as it would with its node
    return [sys.executable, "-m", "attnverify.ray_run", str(os.getpid()), *args]


def run_shard(args: Sequence[str], root: str, k: int, n: int, cwd: str, env: Dict[str, str]) -> dict:
    """A Ray task's body: one attempt of shard k/n in a subprocess; returns what the driver prints."""
    folder, attempt = new_attempt_dir(root, k, n)
    info = {"shard": f"{k}/{n}", "attempt": attempt, "node": socket.gethostname(), "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}  # a GPU task's GPU, set by Ray
    try:
        import ray

        info["node_ip"] = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside a Ray worker (tests): the host name says enough
        pass
    with open(os.path.join(folder, "attempt.json"), "w") as f:
        json.dump(info, f)
    cmd = _child_cmd(["run", *args[: _split(args)], f"--shard={k}/{n}", f"--report={folder}", "--no-html",
                      *args[_split(args):]])
    child_env = {**os.environ, **env, "ATTNVERIFY_RAY_ATTEMPT": str(attempt)}
    with open(os.path.join(folder, "output.log"), "wb") as log:
        rc = subprocess.call(cmd, cwd=cwd if os.path.isdir(cwd) else folder, env=child_env, stdout=log,
                             stderr=subprocess.STDOUT)
    if rc < 0:
        raise AttemptLost(f"shard {k}/{n} attempt {attempt}: its run was killed by signal {-rc}; see {folder}/output.log")
    return dict(info, rc=rc, folder=folder)


def _split(args: Sequence[str]) -> int:
    return list(args).index("--") if "--" in args else len(args)


def _overall(codes: Sequence[int]) -> int:
    """The run's exit status from the shards': 3 > 1 > 0 > 2 (a shard whose slice is empty says 2)."""
    for code in (3, 1, 0):
        if code in codes:
            return code
    return 2 if codes else 3


def cmd_run_ray(ns, extra: Sequence[str]) -> int:
    """`attnverify run --ray`: see the module doc. Returns the CLI exit status."""
    from .cli import CliUsageError, _render
    from .reports.merge import ATTEMPTS_DIR, MergeError, merge
    from .reports.model import read_manifest

    ray = import_ray()
    if ns.shard:
        raise CliUsageError("--shard with --ray: Ray runs every shard itself; give --ray-shards N instead")
    if ns.ray_shards is not None and ns.ray_shards < 1:
        raise CliUsageError(f"--ray-shards={ns.ray_shards}: give at least 1 (default: the cluster's GPUs, else CPUs)")
    if ns.ray_retries < 0:
        raise CliUsageError(f"--ray-retries={ns.ray_retries}: give 0 or more")
    report = os.path.abspath(ns.report or "reports")
    if os.path.isdir(report) and set(os.listdir(report)) - {ATTEMPTS_DIR} and read_manifest(report) is None:
        raise CliUsageError(f"--report {ns.report or 'reports'!r} holds a run that is not a merged report; give "
                            "a new folder for the Ray run's merged report")
    if ns.seed is None:
        ns.seed = random.randrange(2**31)
        print(f"attnverify run --ray: seed {ns.seed} for every shard (replay with --seed {ns.seed})", flush=True)
    local = ns.ray in (None, LOCAL)
    if local:
        shards = ns.ray_shards or os.cpu_count() or 1
        ray.init(address="local", num_cpus=shards, include_dashboard=False, log_to_driver=False,
                 object_store_memory=100 * 1024 * 1024)
    else:
        ray.init(address=ns.ray, log_to_driver=False)
    try:
        res = ray.cluster_resources()
        gpus = int(res.get("GPU", 0))
        shards = ns.ray_shards or gpus or int(res.get("CPU", 1)) or 1
        run_id = f"{int(time.time())}-{os.getpid()}"
        root = os.path.join(report, ATTEMPTS_DIR, run_id)
        task = ray.remote(run_shard).options(
            num_gpus=1 if gpus else 0, num_cpus=0 if gpus else 1, max_retries=ns.ray_retries,
            retry_exceptions=[AttemptLost])
        env = {k: v for k, v in os.environ.items() if k.startswith(("ATTNVERIFY_", "TRITON_", "HYPOTHESIS_"))
               or k == "PYTEST_PLUGINS" or (local and k == "PYTHONPATH")}
        args = run_argv(ns, extra)
        print(f"attnverify run --ray: {shards} shard(s) as Ray tasks ({'1 GPU' if gpus else '1 CPU'} each, "
              f"up to {ns.ray_retries} retries) on {'a local Ray instance' if local else ns.ray}; attempts in "
              f"{root}", flush=True)
        refs = {k: task.remote(args, root, k, shards, os.getcwd(), env) for k in range(1, shards + 1)}
        codes = []
        for k, ref in refs.items():
            try:
                out = ray.get(ref)
                codes.append(_shard_code(out["rc"]))
                print(f"  shard {k}/{shards}: exit {out['rc']} (attempt {out['attempt']} on {out['node']})", flush=True)
            except Exception as e:  # noqa: BLE001 - a task lost for good: what its attempts journaled is merged
                codes.append(3)
                print(f"  shard {k}/{shards}: LOST after {ns.ray_retries} retries: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}", flush=True)
    finally:
        ray.shutdown()
    groups = attempt_groups(root)
    if not groups:
        print(f"attnverify run --ray: no shard journaled anything; see {root}/*/output.log", file=sys.stderr)
        return 3
    try:
        merge([groups[k] for k in groups], report, labels=[f"shard{k}of{shards}" for k in groups])
    except MergeError as e:
        raise CliUsageError(str(e)) from None
    print(f"attnverify run --ray: merged {sum(len(v) for v in groups.values())} attempt(s) of {len(groups)} "
          f"shard(s) into {report}", flush=True)
    if not ns.no_html:
        _render(report)
    return _overall(codes)


def _shard_code(rc: int) -> int:
    return rc if rc in (0, 1, 2, 3) else 3


def _child_main(argv: List[str]) -> int:  # python -m attnverify.ray_run PARENT_PID run ...
    parent = int(argv[0])
    from .lifeline import parent_death_signal

    parent_death_signal(signal.SIGKILL)  # best effort: without it a lost worker's run may go on alone
    if os.getppid() != parent:  # the worker died before the line above
        return 3
    from .cli import main

    return main(argv[1:])


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
