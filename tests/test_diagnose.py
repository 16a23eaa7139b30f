"""The diagnosis names every deliberately wrong implementation of tests/_wrong_for_diagnosis.py, says
"no simple explanation" when nothing fits, and never accuses a correct implementation."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attnverify as av  # noqa: E402
import _wrong_for_diagnosis as W  # noqa: E402
from attnverify.adapters import registry  # noqa: E402
from attnverify.case import CaseRecipe, build_case  # noqa: E402
from attnverify.diagnose import NO_EXPLANATION, Variant, alternative_forward, diagnose, diagnose_result  # noqa: E402
from attnverify.reference import reference_forward  # noqa: E402

ZOO = W.zoo()


@pytest.mark.parametrize("w", ZOO, ids=[w.name for w in ZOO])
def test_wrong_implementation_is_named(w):
    res, diag = W.run_one(w)
    assert res.status == "failed", f"{w.name}: the check itself must catch the bug first ({res.message()})"
    assert W.named(diag, w.expected), f"{w.name}: expected {w.expected!r}, got:\n{diag.text()}"


ENGINE_RECIPES = [
    dict(), dict(causal="top_left", len_q=12, len_k=20), dict(causal="bottom_right", len_q=20, len_k=12),
    dict(window=(3, 2), len_q=10, len_k=17), dict(window=(0, -1), causal="bottom_right"),
    dict(softcap=5.0, scale=0.3), dict(alibi=True, heads_q=4, heads_kv=2, causal="bottom_right", len_q=9),
    dict(mask="bool_random", masked_rows=(1, 3)), dict(mask="float_neg_inf", mask_shape=(1, 1, 16, 16)),
    dict(mask="float_random"), dict(batch=2, heads_q=6, heads_kv=3, mask="bool_padding"),
    dict(len_q=12, len_k=15, seqlens_q=[5, 0, 7], seqlens_k=[6, 4, 5], causal="bottom_right", alibi=True, heads_q=2),
    dict(len_q=12, len_k=15, seqlens_q=[5, 3, 4], seqlens_k=[6, 4, 5], window=(2, 1)),
    dict(causal="bottom_right", len_q=20, len_k=8), dict(poison=(("v", 0, 0, 3, 1, "nan"),)),
]


@pytest.mark.parametrize("r", ENGINE_RECIPES, ids=[str(i) for i in range(len(ENGINE_RECIPES))])
def test_engine_default_equals_reference(r):
    """The diagnosis' own float64 engine with no alternative knob IS the reference (else its verdicts mean nothing)."""
    c = build_case(CaseRecipe(**r))
    ref = reference_forward(c.q, c.k, c.v, c.spec)
    out, lse = alternative_forward(c.q, c.k, c.v, c.spec)
    torch.testing.assert_close(out, ref.out, rtol=1e-12, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(lse, ref.lse, rtol=1e-12, atol=1e-12, equal_nan=True)


def test_engine_online_with_rescale_equals_reference():
    c = build_case(CaseRecipe(len_q=16, len_k=48, late_from=32, late_boost=3.0, causal="top_left"))
    from attnverify.diagnose import ONLINE_UPDATES, online_update

    ONLINE_UPDATES["full"] = online_update(True, True)
    try:
        out, _ = alternative_forward(c.q, c.k, c.v, c.spec, Variant(online=(16, "full")))
    finally:
        del ONLINE_UPDATES["full"]
    torch.testing.assert_close(out, reference_forward(c.q, c.k, c.v, c.spec).out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("recipe", [
    CaseRecipe(len_q=24, len_k=40, causal="bottom_right", seed=1),
    CaseRecipe(heads_q=4, heads_kv=2, window=(3, 3), seed=2, dtype="float16"),
    CaseRecipe(mask="bool_rows_off", masked_rows=(1,), seed=3, dtype="bfloat16"),
], ids=["br", "gqa-window-fp16", "masked-bf16"])
def test_correct_implementation_is_not_accused(recipe):
    """On a correct adapter's output no alternative fits (its error is rounding, not semantics)."""
    naive = registry.get("naive")
    case = build_case(recipe)
    res = av.check(naive, case, backward=False)
    assert res.passed
    d = diagnose(case, res.outputs, failing=["out"])
    assert not d.explained, d.text()


def test_unexplained_says_so():
    case = build_case(CaseRecipe(seed=5))
    ref = reference_forward(case.q, case.k, case.v, case.spec).out
    noisy = (ref + 0.05 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)).float()
    d = diagnose(case, {"out": noisy})
    assert d.summary == NO_EXPLANATION and not d.explained


def test_records_are_json_and_error_results_are_handled():
    import json

    w = next(w for w in ZOO if w.name == "no_scale")
    res, diag = W.run_one(w)
    json.dumps(diag.to_dict())
    assert diag.best.key == "scale_missing" and "scale missing" in diag.text()

    @av.adapter("raises_for_diag", register=False)
    def bad(q, k, v, spec):
        raise RuntimeError("boom")

    res = av.check(bad, build_case(CaseRecipe()))
    assert res.status == "error"
    assert diagnose_result(res).summary == NO_EXPLANATION


def test_docs_diagnosis_lists_every_wrong_implementation():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "diagnosis.md")
    text = open(path).read()
    for w in ZOO:
        assert f"| `{w.name}` |" in text, f"docs/diagnosis.md lacks {w.name}: regenerate it"
    assert "| NO |" not in text
