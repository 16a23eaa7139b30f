"""The results journal: `reports/results.jsonl`, one JSON object per line, append-only.

Every record is written with a single `os.write` on a file opened with O_APPEND, so a process that is
killed (SIGKILL, a segfaulting adapter) leaves every record written so far in the file: the write is
the kernel's once it returns. Against a lost machine (power, a kernel panic) the file is fsynced: after
every record but the per-example ones (case_start, result), and after those at most once a second
(`fsync_every`; an fsync per example cost 6 ms on this project's CI disk, a third of an example's
judging time on the H200), so a lost machine loses at most the last second of examples; at worst the
last line is cut short: `read_journal` skips it, and the next
run's writer ends that line first, so none of its own records is lost. Several
processes (pytest-xdist workers) append to the same file safely: each record is one write.
The file is never rewritten: runs follow one another, told apart by `run_id`.

Record format (version 1). Every record has these keys:

    v         1 (this format's version)
    event     run_start | case_start | result | test_end | run_end  (readers ignore unknown events)
    run_id    str, shared by every record of one run (the xdist controller hands it to its workers)
    t         float, time.time() when written
    pid       int, the writing process
    worker    str | null, the pytest-xdist worker id ("gw0", ...) or null outside xdist

Per event:

    run_start   (one per run, written by the controlling process)
        env         {"python", "torch", "triton", "hypothesis", "pytest", "attnverify", "platform",
                     "cuda": torch.version.cuda | null, "gpu": nvidia-smi name | null}  (versions as str | null)
        seed        int, the Hypothesis seed of the run (replays the whole run: --attn-seed N)
        profile     "ci" | "dev" | "thorough"
        device      "auto" | "cpu" | "cuda" (the --attn-device preference)
        isolate     "subprocess" | "none";  timeout: float seconds per example (subprocess only)
        adapters    [{"name", "available": bool, "reason": str | null, "claims": str, "device": str,
                      "origin": attnverify.origin.adapter_origin(): kind builtin | file | module | registered,
                                target (what --adapter takes), file, attr, sha256 of the file, ...}]
        properties  [str]  names of the properties collected
        argv        [str]  the pytest command line
    case_start  (before each example is judged: a crash leaves this record without a `result`)
        property, adapter   names;  test: the pytest node id;  profile: str;  index: int (1, 2, ...
                    within the test, Hypothesis shrinking included)
        drawn       the JSON-able example drawn by Hypothesis ({"recipe": CaseRecipe dict, ...property
                    parameters}); with `property` and `adapter` it replays the example exactly
    result      (after each example; the keys of ExampleResult.to_dict() at top level)
        property, adapter, test, profile, index   as above
        passed      bool;  status: passed | failed | error | crashed | timeout | skipped
        message     str (for a failure: every failing output);  severity: float, worst error / tolerance
        seconds     float;  records: [CheckResult.to_dict()] the error table of every check made
        split       {phase: seconds}, where the example's time went: draw, journal, transfer, case, adapter,
                    compile, reference, baseline, compare, oom_wait, other (attnverify.timesplit; phases without
                    time left out; draw and journal only for a crash or timeout, whose judge died with its
                    timer); beside them the parts of a phase (draw.strategy, transfer.to_judge,
                    transfer.judge_tail, transfer.from_judge: inside their phase, not added to it);
                    benchmarks/time_split.py tabulates it
        retried     int, only when > 0: judged again that often after running out of device memory
                    (attnverify.device_memory)
        case        Case.to_dict() | null: id, seed, describe, shapes, dtype, device, recipe
    test_end    (one per (property, adapter) pytest item)
        property, adapter, test
        outcome     "passed" | "failed" | "skipped" | "error" | "known" | "xpass" | "stopped" (Ctrl-C or SIGTERM:
                    the examples judged before it are in the journal, the one being judged was not finished)
        seconds     wall time of the item;  examples: int, examples judged
        message     str, the failure (shrunk case, every failing output) or the skip reason
        case_file   str | null, reports/cases/<id>.json of the shrunk failing case
        repro       str | null, the command that replays it (`attnverify repro <case_file>`)
        status      the failing example's status (failed | error | crashed | timeout), "stopped", or null
    conventions (once per adapter and device in each process that judged it: probed by the judging child)
        adapter, device;  declared, observed: {"causal", "fully_masked", "lse", "nan"} -> str
        note        str: why the probe failed ("" when it ran)
    run_end     (one per run, written by the controlling process)
        exit_status int (pytest's), seconds float, counts {"passed": n, "failed": n, "skipped": n, ...}

A run stopped by Ctrl-C or SIGTERM has a run_end with exit_status 2; a run that was killed has none,
and a case_start with no later result of the same test in that
run names the example that killed it (`dangling_cases`).

Saved cases: `reports/cases/<id>.json`, <id> = sha1(property, adapter, drawn)[:12], holds
`Case.to_dict()` (seed, describe, shapes, dtype, device, recipe; its own id as "case_id") plus "id",
"adapter", "adapter_origin" (as in run_start, so repro and the report name it), "property", "drawn",
"status", "message", "records" (the failing example's comparison records), "run_id", "seed_run",
"repro", "env"; and, when no recipe can rebuild the tensors, "tensors": "<id>.pt" beside it
(written by `Case.save`). `attnverify repro FILE` reads these files (and a journal, where it
replays the dangling case). Beside each: `<id>.evidence.json` and `<id>.evidence.npz`, the failure's
diagnosis, heatmap arrays and worst rows, computed during the run by the judging child
(attnverify/evidence.py). A merged report folder (attnverify/reports/merge.py) adds `source` to
every record and a `merged.json` manifest; where a source is a shard's Ray attempts, `attempt` too, and
`attempts` (each attempt's status) on a result that several attempts judged (reports/attempts.py).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import sys
import time
import uuid
from typing import Any, Dict, Iterator, List, Optional

FORMAT_VERSION = 1
JOURNAL_NAME = "results.jsonl"
CASES_DIR = "cases"


def _jsonable(x: Any) -> Any:
    """Best-effort JSON value: tensors become lists (small) or summaries, inf/nan become strings."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else repr(x)  # 'inf', '-inf', 'nan': strict JSON stays valid
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in x]
    mod = type(x).__module__ or ""
    if mod.startswith("torch") and hasattr(x, "shape"):
        if x.numel() <= 64:
            return _jsonable(x.detach().cpu().tolist())
        return f"<tensor {tuple(x.shape)} {x.dtype}>"
    if mod.startswith("numpy") and hasattr(x, "tolist"):
        return _jsonable(x.tolist())
    if hasattr(x, "to_dict"):
        try:
            return _jsonable(x.to_dict())
        except Exception:
            pass
    return str(x)


def dumps(record: dict) -> str:
    return json.dumps(_jsonable(record), sort_keys=False, allow_nan=False)


def _version(dist: str) -> Optional[str]:
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(dist)
        except PackageNotFoundError:
            return None
    except Exception:
        return None


def env_info() -> dict:
    """Versions and machine, without importing optional libraries or touching a GPU."""
    torch_v = cuda_v = None
    if "torch" in sys.modules:
        t = sys.modules["torch"]
        torch_v = getattr(t, "__version__", None)
        cuda_v = getattr(getattr(t, "version", None), "cuda", None)
    return {
        "python": platform.python_version(),
        "torch": torch_v or _version("torch"),
        "triton": _version("triton"),
        "hypothesis": _version("hypothesis"),
        "pytest": _version("pytest"),
        "attnverify": _version("attnverify"),
        "platform": platform.platform(),
        "cuda": cuda_v,
        "gpu": list(gpu_names()) or None,
    }


@functools.lru_cache(maxsize=1)
def gpu_names() -> tuple:
    """GPU names from `nvidia-smi -L` (never initialises CUDA); [] without one."""
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if not exe:
        return ()
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10).stdout
    except Exception:
        return ()
    return tuple(ln.split(":", 1)[1].split("(UUID")[0].strip() for ln in out.splitlines() if ln.startswith("GPU ") and ":" in ln)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


_EXAMPLE_EVENTS = ("case_start", "result")  # fsynced at most every fsync_every seconds


class Journal:
    """Append records to `<report_dir>/results.jsonl`; callable, so it is the driver's `journal`."""

    def __init__(self, report_dir: str, *, run_id: Optional[str] = None, worker: Optional[str] = None,
                 fsync: bool = True, fsync_every: float = 1.0):
        self.report_dir = os.path.abspath(report_dir)
        os.makedirs(self.report_dir, exist_ok=True)
        self.path = os.path.join(self.report_dir, JOURNAL_NAME)
        self.run_id = run_id or new_run_id()
        self.worker = worker
        self.fsync = fsync
        self.fsync_every = float(fsync_every)  # seconds between fsyncs of per-example records (0: every one)
        self._synced = 0.0
        self._fd: Optional[int] = None

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            _end_torn_line(self.path, self._fd)
        return self._fd

    def write(self, record: dict) -> dict:
        rec = {"v": FORMAT_VERSION, "event": record.get("event", "note"), "run_id": self.run_id,
               "t": time.time(), "pid": os.getpid(), "worker": self.worker}
        rec.update({k: v for k, v in record.items() if k not in ("v", "run_id", "t", "pid", "worker")})
        line = (dumps(rec) + "\n").encode("utf-8")
        fd = self._open()
        n = os.write(fd, line)  # one write per record: whole lines even with several writers
        while n < len(line):  # a short write (rare): finish it
            n += os.write(fd, line[n:])
        if self.fsync:
            now = time.monotonic()
            if rec["event"] not in _EXAMPLE_EVENTS or now - self._synced >= self.fsync_every:
                os.fsync(fd)
                self._synced = now
        return rec

    __call__ = write

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            finally:
                self._fd = None

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


def _end_torn_line(path: str, fd: int) -> None:
    """A run killed mid-write leaves a last line without its newline: end it before appending, so the
    next record starts a line of its own (the torn line stays, and readers skip it). Racing writers
    are safe: each record is one O_APPEND write, so at worst this adds an empty line."""
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return
        with open(path, "rb") as f:
            f.seek(size - 1)
            last = f.read(1)
        if last != b"\n":
            os.write(fd, b"\n")
    except OSError:
        pass


def read_journal(path: str, *, run_id: Optional[str] = None) -> List[dict]:
    """All records (of one run, if `run_id`), in order. Skips a truncated or corrupt line
    (the last line of a killed run) instead of failing; accepts the report dir or the file."""
    if os.path.isdir(path):
        path = os.path.join(path, JOURNAL_NAME)
    out = []
    for rec in iter_journal(path):
        if run_id is None or rec.get("run_id") == run_id:
            out.append(rec)
    return out


def iter_journal(path: str) -> Iterator[dict]:
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        for raw in f:
            raw = raw.strip()
            if not raw:
                continue
            yield from _parse_line(raw.decode("utf-8", errors="replace"))


_RECORD_START = '{"v": '


def _parse_line(text: str) -> Iterator[dict]:
    """The record(s) of one line. A line cut short by a kill is skipped; where an older writer appended
    the next run's record to such a line (no newline between), that record is recovered."""
    try:
        rec = json.loads(text)
    except ValueError:
        rec = None
    if isinstance(rec, dict):
        yield rec
        return
    dec = json.JSONDecoder()
    i = text.find(_RECORD_START, 1)
    while i != -1:
        try:
            rec, end = dec.raw_decode(text, i)
        except ValueError:
            i = text.find(_RECORD_START, i + 1)
            continue
        if isinstance(rec, dict):
            yield rec
        i = text.find(_RECORD_START, end)


def runs(path: str) -> List[str]:
    """Run ids in the order they first appear."""
    seen: Dict[str, None] = {}
    for rec in read_journal(path):
        if rec.get("run_id") is not None:
            seen.setdefault(rec["run_id"], None)
    return list(seen)


def last_run(path: str) -> List[dict]:
    ids = runs(path)
    return read_journal(path, run_id=ids[-1]) if ids else []


def dangling_cases(records: List[dict]) -> List[dict]:
    """case_start records with no later result of the same (run, worker, pid, test): the examples that
    were running when the process died."""
    open_: Dict[tuple, dict] = {}
    for rec in records:
        key = (rec.get("run_id"), rec.get("pid"), rec.get("test") or (rec.get("property"), rec.get("adapter")))
        if rec.get("event") == "case_start":
            open_[key] = rec
        elif rec.get("event") == "result":
            open_.pop(key, None)
    return list(open_.values())


# ----------------------------------------------------------------------------------------- cases


def case_hint(drawn: Any) -> Optional[dict]:
    """A Case.to_dict()-like record from a drawn example without building any tensor (so a parent
    process can describe a case that crashed its child): the recipe when the draw holds one."""
    recipe = None
    if isinstance(drawn, dict):
        cand = drawn.get("recipe") if isinstance(drawn.get("recipe"), dict) else drawn
        try:
            from .case import CaseRecipe

            recipe = CaseRecipe.from_dict(cand).to_dict()
        except Exception:
            recipe = None
    if recipe is None:
        return None
    cid = hashlib.sha1(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:12]
    shapes = {
        "q": [recipe["batch"], recipe["heads_q"], recipe["len_q"], recipe["head_dim"]],
        "k": [recipe["batch"], recipe["heads_kv"], recipe["len_k"], recipe["head_dim"]],
        "v": [recipe["batch"], recipe["heads_kv"], recipe["len_k"], recipe.get("head_dim_v") or recipe["head_dim"]],
    }
    return {"id": cid, "label": "", "seed": recipe.get("seed", 0), "shapes": shapes, "dtype": recipe.get("dtype"),
            "device": recipe.get("device"), "recipe": recipe, "describe": describe_recipe(recipe)}


def describe_recipe(r: dict) -> str:
    """Case.describe()'s wording from a recipe dict, without building tensors."""
    d, dv = r.get("head_dim"), r.get("head_dim_v")
    parts = [f"B={r.get('batch')} Hq={r.get('heads_q')} Hkv={r.get('heads_kv')} Lq={r.get('len_q')} Lk={r.get('len_k')} D={d}"
             + (f" Dv={dv}" if dv and dv != d else ""), str(r.get("dtype"))]
    for key, neutral in (("scale", None), ("causal", "none"), ("window", None), ("softcap", None), ("alibi", False),
                         ("mask", "none"), ("seqlens_q", None), ("seqlens_k", None), ("dropout_p", 0.0),
                         ("late_from", None), ("equal_scores", False), ("row_shift", 0.0), ("poison", ()),
                         ("layout", "contiguous"), ("return_lse", False)):
        v = r.get(key, neutral)
        if v not in (neutral, None, [], ()) and not (isinstance(v, (list, tuple)) and not v):
            parts.append(key if v is True else f"{key}={v}")
    parts.append(f"seed={r.get('seed')}")
    return " ".join(parts)


def example_id(prop_name: str, adapter_name: str, drawn: Any) -> str:
    """Id of a failing example: unique per (property, adapter, drawn example), stable across runs."""
    blob = json.dumps(_jsonable([prop_name, adapter_name, drawn]), sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def repro_command(case_file: str) -> str:
    rel = os.path.relpath(case_file) if not os.path.relpath(case_file).startswith("..") else case_file
    return f"attnverify repro {rel}"


def save_case(report_dir: str, *, prop_name: str, adapter_name: str, drawn: Any, result: Optional[dict] = None,
              run_id: Optional[str] = None, seed: Optional[int] = None, env: Optional[dict] = None,
              extra: Optional[dict] = None) -> str:
    """Write `<report_dir>/cases/<id>.json` for a failing example and return its path.

    The file holds what `attnverify repro` needs: the drawn example with its property and adapter
    (replays the very check that failed, crash included), and the case record (recipe) when the
    result carries one. A file already there (written by the driver with tensors, say) is kept, and
    these keys are added to it where missing."""
    result = result or {}
    case = result.get("case") or case_hint(drawn)
    cid = example_id(prop_name, adapter_name, drawn)
    cases = os.path.join(os.path.abspath(report_dir), CASES_DIR)
    os.makedirs(cases, exist_ok=True)
    path = os.path.join(cases, f"{cid}.json")
    d: Dict[str, Any] = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                d = json.load(f)
        except ValueError:
            d = {}
    base = dict(case or {})
    base.update({
        "id": cid, "case_id": (case or {}).get("id"), "adapter": adapter_name, "property": prop_name, "drawn": drawn,
        "status": result.get("status"), "message": result.get("message"), "run_id": run_id,
        "seed_run": seed, "repro": repro_command(path), "env": env or env_info(),
    })
    base.update(extra or {})
    for k, v in base.items():
        if d.get(k) is None:  # keep what is there already (the driver's own record, say)
            d[k] = v
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(_jsonable(d), indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
