"""The one home of the verdict rules (attnverify/verdicts.py): severity, bitwise equality, the
compare-and-message loop of pair-comparing properties; and `attnverify.check` / `attnverify.compare`
being modules that are also callable (so `mock.patch("attnverify.check.…")` works)."""
import math
from unittest import mock

import pytest
import torch

import attnverify as av
from attnverify.compare import compare
from attnverify.tolerances import tolerance_for
from attnverify.verdicts import (
    INFINITE_SEVERITY, bitwise_difference, bitwise_equal, compare_pairs, comparison_verdict, severity,
)


def _cmp(got, exp, name="out", dtype="float32"):
    return compare(name, got, exp.double(), tolerance_for(name, dtype))


def test_severity_is_the_worst_error_over_its_tolerance():
    exp = torch.randn(64, dtype=torch.float64)
    ok = _cmp(exp.float(), exp)
    bad = _cmp((exp * 1.01).float(), exp)
    assert severity([ok]) < 1.0 and ok.passed
    assert severity([ok, bad]) > 1.0 and not bad.passed
    assert severity([ok, bad]) == max(severity([ok]), severity([bad]))
    assert severity([]) == 0.0


def test_severity_reports_infinite_and_error_as_a_finite_ceiling():
    exp = torch.randn(8, dtype=torch.float64)
    got = exp.clone().float()
    got[3] = math.nan
    nan_cmp = _cmp(got, exp)
    assert not nan_cmp.passed
    assert severity([nan_cmp]) == INFINITE_SEVERITY
    assert severity([_cmp(exp.float(), exp)], error=True) == INFINITE_SEVERITY


def test_check_result_severity_uses_the_same_rule():
    from attnverify.adapters import registry

    case = av.build_case(av.CaseRecipe(len_q=8, len_k=8, seed=3))
    res = av.check(registry.get("naive"), case, backward=False)
    assert res.severity() == severity(res.comparisons) < 1.0


def test_bitwise_equal_and_difference():
    a = torch.tensor([1.0, math.nan, 3.0])
    assert bitwise_equal(a, a.clone()) and bitwise_difference(a, a.clone()) is None
    b = a.clone()
    b[2] = 3.0 + 2**-20
    assert not bitwise_equal(a, b)
    assert bitwise_difference(a, b).startswith("in 1 element(s), max difference")
    c = a.clone()
    c[1] = 0.0  # NaN where the other is a number
    assert not bitwise_equal(a, c)
    assert not bitwise_equal(a, a[:2])
    assert "shape" in bitwise_difference(a, a[:2])
    assert bitwise_difference(a, None) is None  # nothing to compare is not a difference


def test_compare_pairs_and_verdict_reject_a_wrong_pair():
    exp = torch.randn(2, 2, 8, 16, dtype=torch.float64)
    lse = torch.randn(2, 2, 8, dtype=torch.float64)
    pairs = {"out:shifted": (exp.float(), exp), "lse:shifted": (lse.float() + 0.5, lse)}
    comps = compare_pairs(pairs, "float32", score_max=1.0, scale_floors={})
    assert [c.name for c in comps] == ["out:shifted", "lse:shifted"]
    assert comps[0].passed and not comps[1].passed
    passed, sev, msg = comparison_verdict(comps, "[me] prop FAILED: case", "the doc", {"k": 1})
    assert not passed and sev > 1.0
    assert msg.splitlines()[:2] == ["[me] prop FAILED: case", "the doc"]
    assert "lse:shifted: MISMATCH" in msg and "out:shifted" not in msg and msg.endswith("parameters: {'k': 1}")
    assert comparison_verdict(comps[:1], "head") == (True, severity(comps[:1]), "")


def test_compare_pairs_missing_expected_fails_or_is_skipped():
    exp = torch.randn(4, dtype=torch.float64)
    pairs = {"dq:x": (exp.float(), None), "out": (exp.float(), exp)}
    comps = compare_pairs(pairs, "float32", score_max=0.0, scale_floors={})
    assert not comps[0].passed and "returned nothing" in comps[0].problems[0]
    assert [c.name for c in compare_pairs(pairs, "float32", score_max=0.0, scale_floors={}, missing="skip")] == ["out"]
    with pytest.raises(ValueError, match="missing"):
        compare_pairs(pairs, "float32", score_max=0.0, scale_floors={}, missing="ignore")


def test_compare_pairs_baseline_widens_the_bound():
    exp = torch.randn(256, dtype=torch.float64)
    got = (exp * (1 + 1e-4)).float()
    assert not compare_pairs({"out": (got, exp)}, "float32", score_max=0.0, scale_floors={})[0].passed
    widened = compare_pairs({"out": (got, exp)}, "float32", score_max=0.0, scale_floors={}, baseline={"out": (1e-4, 1e-3)})
    assert widened[0].passed


def test_check_and_compare_stay_modules_and_stay_callable():
    import attnverify.check as check_mod
    import attnverify.compare as compare_mod

    assert check_mod.check.__name__ == "check" and callable(check_mod) and av.check is check_mod
    assert compare_mod.compare.__name__ == "compare" and av.compare is compare_mod
    exp = torch.ones(3, dtype=torch.float64)
    assert av.compare("out", exp.float(), exp, tolerance_for("out", "float32")).passed
    import inspect

    assert list(inspect.signature(av.check).parameters)[:2] == ["adapter", "case"]
    with mock.patch("attnverify.check.check", return_value="patched"):
        assert av.check(None, None) == "patched"
    with pytest.raises(av.UsageError, match="adapter"):
        av.check("not an adapter", None)
