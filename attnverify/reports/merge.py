"""Merge the report folders of several runs (shards, machines, GPUs) into one report folder.

    merge(["gpu0/reports", "gpu1/reports"], "merged")   # then render("merged")

The merged folder holds:
- results.jsonl: the last run of each source (every run of a source that is itself a merge), each
  record marked with `source` (the source's label: its folder name, made unique) and case files
  pointed at their copies;
- cases/<label>/...: each source's case files, evidence and tensors, copied unchanged;
- merged.json: {"v": 1, "sources": [{"label", "path", "run_ids"}]}, which tells the report to show
  every source's records instead of the last run only.

A source may also be a list of attempt folders of one shard, first attempt first (a Ray task retried
after its node was lost: attnverify/ray_run.py): their last runs become one source, one result per
(adapter, property, example) as attempts.py says, each record marked with its `attempt`; their case
files go to cases/<label>/<attempt>/, and the source's manifest entry lists its "attempts" ({"label",
"path", "run_ids"} and what the attempt folder's attempt.json says: node, pid). An `attempts/` folder
inside the output folder (where `attnverify run --ray` keeps them) is left alone.

Only files are read and written: nothing runs.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import List, Optional, Sequence, Union

from ..journal import CASES_DIR, JOURNAL_NAME, dumps, last_run, read_journal
from .model import MANIFEST, read_manifest, safe_id

_GENERATED = ("index.html",)
ATTEMPTS_DIR = "attempts"  # inside a merged folder: the attempt folders it was built from (never removed)
ATTEMPT_INFO = "attempt.json"  # in an attempt folder: {"shard", "attempt", "node", "pid", ...}
Source = Union[str, Sequence[str]]


class MergeError(ValueError):
    """A usage problem: a source that is no report folder, or an output folder that is not ours."""


def _labels(paths: Sequence[str]) -> List[str]:
    out: List[str] = []
    for p in paths:
        base = os.path.basename(os.path.normpath(p))
        parent = os.path.basename(os.path.dirname(os.path.abspath(p)))
        label = safe_id(base if base not in ("reports", "") else (parent or base)) or "run"
        shard = _shard_label(p)  # where each result ran: a shard's slice joins its label
        if shard and shard not in label:
            label = f"{label}-{shard}"
        cand, n = label, 2
        while cand in out:
            cand, n = f"{label}-{n}", n + 1
        out.append(cand)
    return out


def _shard_label(path: str) -> Optional[str]:
    from ..shards import label

    start = next((r for r in last_run(path) if r.get("event") == "run_start"), None) \
        if os.path.isfile(os.path.join(path, JOURNAL_NAME)) else None
    return label(start)


def _check_out(out: str, sources: Sequence[str]) -> None:
    out_abs = os.path.abspath(out)
    for src in sources:
        if os.path.abspath(src) == out_abs:
            raise MergeError(f"--out {out!r} is one of the folders to merge; give a new folder")
    if os.path.isdir(out) and set(os.listdir(out)) - {ATTEMPTS_DIR} and read_manifest(out) is None:
        raise MergeError(f"--out {out!r} is a folder that holds something else than a merged report; give an empty "
                         "or new folder (or an earlier merge's folder, which is rebuilt)")


def _attempt_source(paths: Sequence[str], label: str, out: str) -> tuple:
    """(records, manifest entry) of one shard's attempt folders, their case files copied under out."""
    from .attempts import combine

    names = _labels(paths)
    entries, attempts = [], []
    for path, name in zip(paths, names):
        recs = last_run(path)
        attempts.append((name, recs))
        entry = {"label": name, "path": os.path.abspath(path),
                 "run_ids": list(dict.fromkeys(r["run_id"] for r in recs if r.get("run_id") is not None))}
        try:
            with open(os.path.join(path, ATTEMPT_INFO)) as f:
                entry.update({k: v for k, v in json.load(f).items() if k not in entry})
        except (OSError, ValueError):
            pass
        entries.append(entry)
        if os.path.isdir(os.path.join(path, CASES_DIR)):
            shutil.copytree(os.path.join(path, CASES_DIR), os.path.join(out, CASES_DIR, label, name),
                            ignore=shutil.ignore_patterns("*.html", "*.tmp"))
    recs = []
    for r in combine(attempts):
        if r.get("case_file"):
            r["case_file"] = os.path.join(CASES_DIR, label, r["attempt"], os.path.basename(str(r["case_file"])))
        recs.append(dict(r, source=label))
    run_ids = [i for e in entries for i in e["run_ids"]]
    return recs, {"label": label, "path": os.path.abspath(paths[0]), "run_ids": run_ids, "attempts": entries}


def merge(sources: Sequence[Source], out: str, labels: Optional[Sequence[str]] = None) -> str:
    """Build the merged folder `out` from report folders `sources` (a list of folders: one shard's
    attempts); returns out (absolute)."""
    if not sources:
        raise MergeError("give at least one report folder to merge")
    for src in sources:
        for path in ([src] if isinstance(src, str) else src):
            if not os.path.isfile(os.path.join(path, JOURNAL_NAME)):
                raise MergeError(f"{path!r} is no report folder (no {JOURNAL_NAME} in it); give the report folder of a run")
        if not isinstance(src, str) and not src:
            raise MergeError("an empty list of attempt folders; give at least one")
    _check_out(out, [p for src in sources for p in ([src] if isinstance(src, str) else src)])
    labels = list(labels) if labels else _labels([src if isinstance(src, str) else src[0] for src in sources])
    out = os.path.abspath(out)
    if read_manifest(out) is not None:  # an earlier merge: rebuilt from scratch
        for name in (JOURNAL_NAME, MANIFEST, *_GENERATED):
            if os.path.exists(os.path.join(out, name)):
                os.unlink(os.path.join(out, name))
        shutil.rmtree(os.path.join(out, CASES_DIR), ignore_errors=True)
    os.makedirs(os.path.join(out, CASES_DIR), exist_ok=True)
    manifest = {"v": 1, "sources": []}
    lines = []
    for src, label in zip(sources, labels):
        if not isinstance(src, str):
            recs, entry = _attempt_source(src, label, out)
            lines += [dumps(r) for r in recs]
            manifest["sources"].append(entry)
            continue
        inner = read_manifest(src)
        recs = read_journal(src) if inner is not None else last_run(src)
        src_cases = os.path.join(src, CASES_DIR)
        dst_cases = os.path.join(out, CASES_DIR, label)
        if os.path.isdir(src_cases):
            shutil.copytree(src_cases, dst_cases, ignore=shutil.ignore_patterns("*.html", "*.tmp"))
        run_ids = []
        for r in recs:
            r = dict(r)
            inner_src = r.get("source")
            r["source"] = f"{label}/{inner_src}" if inner is not None and inner_src else label
            cf = r.get("case_file")
            if cf:
                rel = os.path.relpath(str(cf), CASES_DIR) if inner is not None and not os.path.isabs(str(cf)) \
                    else os.path.basename(str(cf))
                r["case_file"] = os.path.join(CASES_DIR, label, rel)
            if r.get("run_id") not in run_ids and r.get("run_id") is not None:
                run_ids.append(r["run_id"])
            lines.append(dumps(r))
        manifest["sources"].append({"label": label, "path": os.path.abspath(src), "run_ids": run_ids})
    with open(os.path.join(out, JOURNAL_NAME), "w") as f:
        f.write("".join(ln + "\n" for ln in lines))
    with open(os.path.join(out, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return out
