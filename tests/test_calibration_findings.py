"""Calibration failures that are declared findings (benchmarks/calibration_findings.py) against the H200 calibration of
2026-12-05 (benchmarks/results/h200_2026-12-05/session6/sdpa_calibration.json.gz: every failure of naive and the five
SDPA backends, fp16/bf16, 1,200 cases each).

Each sdpa-cudnn / sdpa failure there is one of the CUDA findings its backend declares (F26 fully-masked rows, F10 NaN
gradients under scores far below 0, F39 NaN dQ where the exact dQ is ~0), so the calibration counts it apart, not as
a false positive; sdpa-efficient's one failure is no finding (a norm over 16 elements: tolerances.PER_CASE_MIN_N).
And the two new patterns refuse their message with the feature they are narrowed to changed. Runs on the CPU.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import os

import pytest

from attnverify.adapters import _sdpa_cuda_findings as F

ROOT = os.path.join(os.path.dirname(__file__), "..")
DATA = os.path.join(ROOT, "benchmarks", "results", "h200_2026-12-05", "session6", "sdpa_calibration.json.gz")


def _module():
    spec = importlib.util.spec_from_file_location("calibration_findings",
                                                  os.path.join(ROOT, "benchmarks", "calibration_findings.py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


CF = _module()
BACKEND = {"sdpa-cudnn": "cudnn", "sdpa": "default", "sdpa-efficient": "efficient", "sdpa-flash": "flash"}


def _failures():
    with gzip.open(DATA, "rt", encoding="utf-8") as f:
        runs = json.load(f)["runs"]
    return [f for r in runs.values() for f in r["failures"]]


def _declared(f, findings=None):
    table = F.CUDA_FINDINGS.get(BACKEND[f["adapter"]], {}) if findings is None else findings
    return CF.declared(CF.table_matcher(table), f["case"], f["message"])


def test_every_cudnn_failure_of_the_calibration_is_a_declared_finding():
    fails = [f for f in _failures() if f["adapter"] in ("sdpa-cudnn", "sdpa")]
    assert len(fails) == 209  # 55 + 76 (sdpa-cudnn bf16, fp16) + 38 + 40 (sdpa)
    undeclared = [f["case"] for f in fails if not _declared(f)]
    assert not undeclared, undeclared[:5]
    # which finding: F26 (fully-masked rows) most, F10 and F39 the rest; each of the three needed
    whys = [_declared(f) for f in fails]
    assert sum("F26" in w for w in whys) > 150
    assert any("F10" in w and "F26" not in w for w in whys) and any("F39" in w and "F26" not in w for w in whys)


def test_the_efficient_backends_failure_is_no_finding():
    (f,) = [f for f in _failures() if f["adapter"] == "sdpa-efficient"]
    assert "Lq=1 Lk=17 D=16 bfloat16" in f["case"] and "norm-wise error is not" in f["message"]
    assert _declared(f) is None  # a bound too tight (fixed in tolerances), not a library's finding


def _f39_cases():
    return [f for f in _failures() if f["adapter"] in ("sdpa-cudnn", "sdpa") and _declared(f, {"gradients_match_reference": F.F39})]


def test_F39_covers_the_five_cases_and_refuses_each_changed_feature():
    cases = _f39_cases()
    assert len(cases) == 5 and all("float16" in f["case"] and "mask=" in f["case"] for f in cases)
    only = {"gradients_match_reference": F.F39}
    f = cases[0]
    for changed in (dict(f, case=f["case"].replace("float16", "bfloat16")),  # seen in fp16 only
                    dict(f, message=f["message"].replace("got nan, expected", "got nan, expected 0.5; was")),  # dQ not ~0
                    dict(f, message=f["message"] + "\ndk: MISMATCH\n  3 non-finite value(s) where the reference differs"),
                    dict(f, message=f["message"] + "\nout: MISMATCH\n  Mismatched elements: 1 / 4"),
                    dict(f, case=f["case"].split(" mask=")[0]),  # no mask
                    dict(f, case=f["case"] + " row_shift=-1000")):  # scores far below 0: F10's
        assert _declared(changed, only) is None, changed["case"]


def test_F10_now_covers_nan_dk_dv_under_a_row_shift_but_not_without_one():
    f = [f for f in _failures() if "row_shift=-1000" in f["case"] and "dk: MISMATCH" in f["message"]
         and "dq: MISMATCH" not in f["message"]]
    assert f, "the calibration's Lq=1 case with NaN dK/dV"
    only = {"gradients_match_reference": F.F10}
    assert _declared(f[0], only)
    assert _declared(dict(f[0], case=f[0]["case"].replace(" row_shift=-1000", "")), only) is None


@pytest.mark.parametrize("prop", ["gradients_match_reference", "outputs_fully_written"])
def test_F39_is_not_strict_where_it_is_declared(prop):
    for backend in ("cudnn", "default"):
        d = F.CUDA_FINDINGS[backend][prop]
        assert "F39" in d["why"] and d.get("strict") is False
