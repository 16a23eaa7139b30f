"""Declared findings that are hangs, and findings declared not strict (`known_failures={p: {..., "strict": False}}`).

A hang is judged like any failure: the judge child is killed after the timeout and the example's message says
`TIMEOUT: <adapter> on <property> did not finish within N s` after its shrunk case. A declaration whose `match`
covers that message reports it as the known finding (xfail, `known` in the journal, the summary and the report), not
as a timeout; any other hang of the property stays a failure with status `timeout`. A finding a run may not show
(seen once, or only on rare draws) is declared `"strict": False`: a run that does not show it passes the property
instead of failing it with a strict XPASS.
"""
from __future__ import annotations

import re

import pytest

from attnverify.adapters.base import validate_known_failures
from attnverify.journal import read_journal


FAST = ("--attn-profile=ci", "--attn-max-examples=4", "-p", "no:randomly", "--attn-timeout=2")

HANGERS = r'''
import time, torch, attnverify as av

def _ok(q, k, v, spec):
    return torch.softmax((q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1]), dim=-1) @ v

def _hangs_from_two_queries(q, k, v, spec):
    if q.shape[2] >= 2:
        time.sleep(600)
    return _ok(q, k, v, spec)

HANG = r"shrunk case: [^\n]*\bLq=(?:[2-9]|\d\d+) [^\n]*\nTIMEOUT: {name} on forward_matches_reference did not finish"

av.adapter("hang-declared", known_failures={"forward_matches_reference": {
    "why": "hangs from two queries on (upstream #9)", "match": HANG.format(name="hang-declared")}})(
    _hangs_from_two_queries)
# declared for another failure: the hang is new
av.adapter("hang-other", known_failures={"forward_matches_reference": {
    "why": "faults on odd Lk (upstream #10)", "match": r"CUDA error: misaligned address"}})(_hangs_from_two_queries)
# declared not strict and correct: a pass is a pass
av.adapter("right-not-strict", known_failures={"forward_matches_reference": {
    "why": "hangs once in a while (seen once)", "match": HANG.format(name="right-not-strict"), "strict": False}})(_ok)
# declared not strict and shown: still the known finding
av.adapter("hang-not-strict", known_failures={"forward_matches_reference": {
    "why": "hangs once in a while (seen once)", "match": HANG.format(name="hang-not-strict"), "strict": False}})(
    _hangs_from_two_queries)
'''


def _ends(pytester):
    return {r["adapter"]: r for r in read_journal(str(pytester.path / "reports")) if r["event"] == "test_end"}


def test_a_declared_hang_is_its_known_finding_and_another_hang_a_timeout(pytester):
    pytester.makeconftest(HANGERS)
    res = pytester.runpytest("--adapter=hang-declared,hang-other", "-k", "forward_matches_reference", *FAST)
    out = res.stdout.str()
    res.assert_outcomes(xfailed=1, failed=1)
    ends = _ends(pytester)
    known, other = ends["hang-declared"], ends["hang-other"]
    assert known["outcome"] == "known" and known["status"] == "known", known
    assert known["message"].startswith("known finding: hangs from two queries on (upstream #9)")
    assert "TIMEOUT: hang-declared on forward_matches_reference did not finish within 2 s" in known["message"]
    assert other["outcome"] == "failed" and other["status"] == "timeout", other
    assert "does not match it" in other["message"] and "it is a new failure" in other["message"]
    # the summary table: the declared hang is `known`, the other one TIMEOUT
    # (its row, not the text after the last "property": with CI set, pytest prints the failure's whole message,
    # which mentions "the property's cost", in the short summary after the table)
    assert re.search(r"^forward_matches_reference +known +TIMEOUT", out, re.M), out
    # the report shows the declared hang as known, the other as a timeout
    from attnverify.reports.model import build_model

    cells = build_model(str(pytester.path / "reports"))["cells"]
    assert cells[("hang-declared", "forward_matches_reference")]["status"] == "known"
    assert cells[("hang-other", "forward_matches_reference")]["status"] == "timeout"


def test_a_finding_declared_not_strict_passes_when_it_does_not_show_and_is_known_when_it_does(pytester):
    pytester.makeconftest(HANGERS)
    res = pytester.runpytest("--adapter=right-not-strict,hang-not-strict", "-k", "forward_matches_reference", *FAST)
    out = res.stdout.str()
    res.assert_outcomes(passed=1, xfailed=1)
    assert res.ret == 0 and "XPASS" not in out, out
    ends = _ends(pytester)
    assert ends["right-not-strict"]["outcome"] == "passed"
    assert ends["hang-not-strict"]["outcome"] == "known"


def test_strict_must_be_a_bool_and_defaults_to_true():
    reasons, patterns, not_strict = validate_known_failures("mine", {
        "dropout": {"why": "biased keep rate (upstream #1)", "match": "kept fraction", "strict": False},
        "determinism": {"why": "atomics (upstream #2)", "strict": True},
        "contract": "accepts k and v of different lengths (upstream #3)"})
    assert not_strict == ("dropout",) and set(reasons) == {"dropout", "determinism", "contract"}
    assert patterns == {"dropout": "kept fraction"}
    with pytest.raises(TypeError, match=r"known_failures\['dropout'\]\['strict'\]='no'.*give True"):
        validate_known_failures("mine", {"dropout": {"why": "x", "strict": "no"}})
    with pytest.raises(TypeError, match=r"unknown key\(s\) \['stric'\]"):
        validate_known_failures("mine", {"dropout": {"why": "x", "stric": False}})
