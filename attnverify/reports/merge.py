"""Merge the report folders of several runs (shards, machines, GPUs) into one report folder.

    merge(["gpu0/reports", "gpu1/reports"], "merged")   # then render("merged")

The merged folder holds:
- results.jsonl: the last run of each source (every run of a source that is itself a merge), each
  record marked with `source` (the source's label: its folder name, made unique) and case files
  pointed at their copies;
- cases/<label>/...: each source's case files, evidence and tensors, copied unchanged;
- merged.json: {"v": 1, "sources": [{"label", "path", "run_ids"}]}, which tells the report to show
  every source's records instead of the last run only.

Only files are read and written: nothing runs.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import List, Optional, Sequence

from ..journal import CASES_DIR, JOURNAL_NAME, dumps, last_run, read_journal
from .model import MANIFEST, read_manifest, safe_id

_GENERATED = ("index.html",)


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
    if os.path.isdir(out) and os.listdir(out) and read_manifest(out) is None:
        raise MergeError(f"--out {out!r} is a folder that holds something else than a merged report; give an empty "
                         "or new folder (or an earlier merge's folder, which is rebuilt)")


def merge(sources: Sequence[str], out: str, labels: Optional[Sequence[str]] = None) -> str:
    """Build the merged folder `out` from report folders `sources`; returns out (absolute)."""
    if not sources:
        raise MergeError("give at least one report folder to merge")
    for src in sources:
        if not os.path.isfile(os.path.join(src, JOURNAL_NAME)):
            raise MergeError(f"{src!r} is no report folder (no {JOURNAL_NAME} in it); give the report folder of a run")
    _check_out(out, sources)
    labels = list(labels) if labels else _labels(sources)
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
