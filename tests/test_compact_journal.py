"""benchmarks/compact_journal.py: the per-property counts kept in BENCHMARKS.md come from it, so they are checked
here on a journal whose statuses are known, read as a report folder and again from its own compact output."""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import compact_journal  # noqa: E402


def _result(i, status, message=""):
    return {"event": "result", "property": "lse_merge", "adapter": "k", "index": i, "status": status,
            "seconds": 0.1 * i, "message": message, "case": {"recipe": {"len_k": i}}}


def test_counts_by_status_and_again_from_its_own_output(tmp_path, capsys):
    recs = [{"event": "run_start", "env": {"python": "x"}},
            _result(1, "passed"), _result(2, "passed"), _result(3, "failed", "out: MISMATCH"),
            _result(4, "error", "backward: OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"),
            _result(5, "error", "the property raised ValueError: bad head dim"),
            _result(6, "stopped", "stopped (KeyboardInterrupt)")]
    (tmp_path / "rep").mkdir()
    (tmp_path / "rep" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"event": "res')
    out = tmp_path / "c.jsonl.gz"
    assert compact_journal.main([str(tmp_path / "rep"), "--out", str(out)]) == 0
    row = "| k | lse_merge | 5 | 2 | 1 | 1 | 1 | 0.30 |"  # the stopped example and the cut line left out
    assert row in capsys.readouterr().out
    assert compact_journal.main([str(out), str(out)]) == 0  # its own output, twice: counts add up
    assert "| k | lse_merge | 10 | 4 | 2 | 2 | 2 | 0.30 |" in capsys.readouterr().out
    kept, _ = compact_journal.compact([str(out)])
    assert [r.get("recipe") for r in kept if r.get("status") == "failed"] == [{"len_k": 3}]
