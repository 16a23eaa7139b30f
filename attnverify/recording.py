"""What a run records beside its journal so that its report needs nothing but the report folder.

Called by the plugin; the work that calls the adapter goes through the run's runner, i.e. the forked
judging child under crash isolation (the process that drives the run never calls an adapter or
builds a case on its device):

- `store_evidence`: a failure's diagnosis, heatmap arrays and worst rows, beside its case file
  (attnverify/evidence.py);
- `probe_conventions`: the adapter's observed conventions, once per (adapter, device) and process, as a
  `conventions` journal record (attnverify/probes.py);
- `origin_of`: where the adapter comes from (attnverify/origin.py), for run_start and the case files.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence


def origin_of(adapter, adapter_names: Sequence[str], cwd: Optional[str]) -> dict:
    """The adapter's origin, from the --adapter value that named it (a name, module:attr or file.py:attr)."""
    from .adapters.registry import get
    from .origin import adapter_origin

    requested = None
    for n in adapter_names:
        if n == adapter.name:
            requested = n
            break
        if ":" in n:
            try:
                if get(n) is adapter:
                    requested = n
                    break
            except Exception:  # noqa: BLE001 - an origin is information, never a failure
                continue
    return adapter_origin(adapter, requested, cwd=cwd)


def store_evidence(runner, adapter, fail: dict, case_file: Optional[str]) -> None:
    """The failing example's evidence, computed by the judging child and stored beside its case file."""
    if not case_file or runner is None:
        return
    from .evidence import record_evidence

    try:
        record_evidence(runner, adapter, status=fail.get("status") or "failed", case=fail.get("case"),
                        case_file=case_file)
    except Exception as e:  # noqa: BLE001 - the failure matters more than its evidence
        print(f"attnverify: no evidence stored for {case_file}: {type(e).__name__}: {e}", file=sys.stderr)


def probe_conventions(runner, journal, adapter, device_pref: str, probed: set) -> None:
    """Journal the adapter's observed conventions once per (adapter, device) in this process."""
    try:
        dev = adapter.run_device(device_pref)
    except ValueError:
        return
    if runner is None or journal is None or (adapter.name, dev) in probed:
        return
    probed.add((adapter.name, dev))
    from .probes import probe_record

    try:
        journal.write(probe_record(runner, adapter, dev))
    except Exception as e:  # noqa: BLE001 - a probe is information, never a failure
        print(f"attnverify: conventions of {adapter.name} not probed: {type(e).__name__}: {e}", file=sys.stderr)
