"""Distinct bugs with every property (issue 21): a property that sees a planted bug in its own way must
give it the planted bug's needs, so that `attnverify selftest` reports found == planted on the multi-bug
members. Users' adapters with known bugs, the rules of attnverify.attribution_calls, the selftest's count;
the runs of every property on every member are `slow`."""
from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from attnverify import adapter
from attnverify.attribution import attribute
from attnverify.case import CaseRecipe
from attnverify.compare import compare
from attnverify.isolation import make_runner
from attnverify.properties import get_property
from attnverify.spec import Output
from attnverify.tolerances import tolerance_for
from attnverify.zoo import ZOO, get_member
from attnverify.zoo._eager import attend

F = get_property("forward_matches_reference")
CLAIMS = dict(dtypes=("float32", "float16"), devices=("cpu",), head_dims=(16, 32), causal=("none", "bottom_right"),
              gqa=True, tiles=(32, 32), max_seqlen=256, lse=True)
TAIL = "Lk not a multiple of 32"


def _multi(q, k, v, spec, bugs):
    from attnverify.zoo._multi import multi_attend

    return multi_attend(q, k, v, spec, bugs)


# users' kernels, each claiming a 32-wide key tile as its documentation says
@adapter("tail-only", register=False, **CLAIMS)
def tail_only(q, k, v, spec):  # keys past Lk up to a multiple of 32 are read as zeros
    return _multi(q, k, v, spec, ("pad_tail",))


@adapter("tail-and-rows", register=False, **CLAIMS)
def tail_and_rows(q, k, v, spec):  # and batch b > 0 is written at batch b - 1's rows
    return _multi(q, k, v, spec, ("pad_tail", "batch_rows"))


@adapter("scale-dropped", register=False, **CLAIMS)
def scale_dropped(q, k, v, spec):  # the softmax_scale argument never reaches the kernel
    return _multi(q, k, v, spec, ("scale_ignored",))


@adapter("gqa-repeat", register=False, **CLAIMS)
def gqa_repeat(q, k, v, spec):  # query head h reads KV head h % Hkv (repeat() for repeat_interleave())
    return attend(q, k, v, spec, "gqa_interleaved")


@adapter("lse-base2", register=False, **CLAIMS)
def lse_base2(q, k, v, spec):  # the LSE returned in base 2 (the kernel's exp2 domain); the output is right
    res = attend(q, k, v, spec)
    return res if res.lse is None else Output(res.out, lse=res.lse / math.log(2.0))


@pytest.fixture(autouse=True)
def _block(monkeypatch):
    monkeypatch.setattr("attnverify.zoo._multi.BLOCK", 32)


@pytest.fixture
def runner():
    r = make_runner("auto")
    yield r
    r.close()


def _attr(prop, a, drawn, runner):
    res = runner(prop, a, drawn)
    assert not res.passed, (prop.name, a.name, res.message)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return attribute(prop, a, drawn, runner, profile="dev", result=res)


def _fwd_signature(a, runner, **kw):
    return _attr(F, a, {"recipe": CaseRecipe(**{"head_dim": 16, **kw}).to_dict()}, runner).signature()


def test_compare_counts_the_elements_it_judged():
    tol = tolerance_for("out", "float32")
    x = torch.randn(2, 3, 4)
    assert compare("out", x, x.double(), tol).judged == x.numel()
    rows = torch.tensor([True, False, True]).view(1, 3, 1)
    assert compare("out", x, x.double(), tol, ignore=rows).judged == 2 * 1 * 4
    assert compare("out", x, x.double(), tol, ignore=torch.ones(1, 1, 1, dtype=torch.bool)).judged == 0


def test_a_neighbour_that_judges_nothing_of_what_failed_proves_nothing(runner):
    """nonfinite_inputs_propagate, NaN in query row 0 of head 0, one query row: with one head every row the
    output comparison judges is NaN in the reference and excluded, so the heads neighbour passes having
    compared nothing. It used to read 'needs Hq >= 2' (an entry of its own beside the tail bug's)."""
    nf = get_property("nonfinite_inputs_propagate")
    drawn = {"recipe": CaseRecipe(heads_q=2, heads_kv=2, len_q=1, len_k=1, head_dim=16, dtype="float16",
                                  poison=(("q", 0, 0, 0, 0, "nan"),)).to_dict()}
    a = _attr(nf, tail_only, drawn, runner)
    assert a.needs == [TAIL], a.text()
    v = next(v for v in a.verdicts if v.feature == "heads")
    assert v.verdict == "untested" and "judges none of out" in v.why, v
    assert a.signature() == _fwd_signature(tail_only, runner, len_q=3, len_k=5)


def test_a_need_implied_by_another_is_not_listed(runner):
    """Hkv < Hq implies Hq >= 2. nonfinite_inputs_propagate's one-head neighbour (NaN query row, one query
    row) judges nothing, so Hq >= 2 is untested there, while forward_matches_reference proves it: the same
    GQA bug must carry the same needs (it was 'needs Hkv < Hq (GQA)' beside 'needs Hq >= 2; needs Hkv < Hq
    (GQA)', two entries)."""
    nf = get_property("nonfinite_inputs_propagate")
    drawn = {"recipe": CaseRecipe(heads_q=4, heads_kv=2, len_q=1, len_k=1, head_dim=16, dtype="float16",
                                  poison=(("q", 0, 0, 0, 0, "nan"),)).to_dict()}
    a = _attr(nf, gqa_repeat, drawn, runner)
    fwd = _attr(F, gqa_repeat, {"recipe": CaseRecipe(heads_q=4, heads_kv=2, len_q=3, len_k=5, head_dim=16).to_dict()},
                runner)
    assert a.needs == fwd.needs == ["Hkv < Hq (GQA)"], (a.text(), fwd.text())
    assert next(v for v in fwd.verdicts if v.feature == "heads").verdict == "needed"  # proved, not listed
    assert a.signature() == fwd.signature()


def test_return_lse_is_not_needed_on_one_key_where_the_output_cannot_show_a_score_bug(runner):
    """One key: the output is that key's value whatever the scale, so only the LSE shows a dropped scale;
    judged again with a key tile of keys the output is wrong, so the LSE is how the property saw it. An LSE
    that is wrong on its own (base 2) still needs return_lse there."""
    lm = get_property("lse_matches_reference")
    one_key = CaseRecipe(len_q=1, len_k=1, head_dim=16, scale=1.0, return_lse=True)
    a = _attr(lm, scale_dropped, {"recipe": one_key.to_dict()}, runner)
    assert a.needs == ["a custom scale"], a.text()
    assert a.signature() == _fwd_signature(scale_dropped, runner, len_q=3, len_k=5, scale=1.0)
    b = _attr(lm, lse_base2, {"recipe": one_key.to_dict()}, runner)
    assert "return_lse" in b.needs, b.text()


def test_a_relation_between_calls_is_attributed_through_the_calls(runner):
    """lse_merge and repeat_and_interleave_stable compare the adapter with itself across calls of other
    shapes; no feature of their case explains the failure ('needs nothing': an entry per shrunk case before).
    lse_merge's Lk = 2 case has the key tail, which its one-key subsets repeat with other tails: the tail bug.
    repeat_and_interleave_stable's one-request case differs from its in-batch call by the batch: moved out of
    the key tail that both share, the in-batch call shows the batch bug."""
    merge = get_property("lse_merge")
    a = _attr(merge, tail_only, {"recipe": CaseRecipe(len_q=2, len_k=2, head_dim=16, return_lse=True).to_dict(),
                                 "cut_seed": 0}, runner)
    assert a.needs == [TAIL] and a.through.startswith("its own call"), a.text()
    assert a.filter_needs() == []  # the case's features do not select the bug: the search stops
    assert a.signature() == _fwd_signature(tail_only, runner, len_q=3, len_k=5)
    rep = get_property("repeat_and_interleave_stable")
    drawn = {"recipe": CaseRecipe(len_q=1, len_k=1, head_dim=16).to_dict(), "extra": 1, "pos": 0}
    b = _attr(rep, tail_and_rows, drawn, runner)
    assert b.needs == ["B >= 2"] and b.through.startswith("its in_batch call"), b.text()
    assert b.signature() == _fwd_signature(tail_and_rows, runner, batch=2, len_q=4, len_k=32)


def test_multi_members_plant_only_their_bugs():
    """The eager engine's GQA bug raises on Hq not a multiple of Hkv, as the repeat() it stands for does (it
    computed silently: contract's entry on multi-gqa-scale); the members claim the memory the eager engine
    uses (memory='linear' planted memory_scaling's entry)."""
    from attnverify.spec import Spec

    q, k = torch.randn(1, 3, 2, 16), torch.randn(1, 2, 2, 16)
    with pytest.raises(RuntimeError):
        attend(q, k, k, Spec(), "gqa_interleaved")
    q4 = torch.randn(1, 4, 2, 16)
    assert not torch.allclose(attend(q4, k, k, Spec(), "gqa_interleaved").out, attend(q4, k, k, Spec()).out)
    ms = get_property("memory_scaling")
    for m in [m for m in ZOO if m.planted]:
        assert m.adapter.claims.memory == "quadratic" and ms.why_skipped(m.adapter), m.name


def test_the_count_says_found_equals_planted_and_maps_each_entry():
    from attnverify.zoo.bugcount import BugCount, row_text

    ok = BugCount("m", ["a", "b"], found=[{"signature": "s1", "needs": ["x"], "properties": ["p"], "describe": "c"},
                                          {"signature": "s2", "needs": ["y"], "properties": ["p", "q"], "describe": "d"}],
                  matched={"a": "s1", "b": "s2"})
    assert ok.exact and ok.planted_of == {"s1": "a", "s2": "b"}
    text = row_text(ok)
    assert "found 2: found == planted" in text and "-> planted a" in text and "-> planted b" in text
    extra = BugCount("m", ["a", "b"], found=ok.found + [{"signature": "s3", "needs": [], "properties": ["r"],
                                                          "describe": "e"}], matched=dict(ok.matched))
    assert not extra.exact and "FOUND != PLANTED" in row_text(extra) and "NOT PLANTED: e" in row_text(extra)
    missed = BugCount("m", ["a", "b"], found=ok.found[:1], matched={"a": "s1", "b": None})
    assert not missed.exact and "planted b: MISSED" in row_text(missed)


def test_selftest_rejects_an_unknown_property(capsys):
    from attnverify.zoo.selftest import main

    assert main(["--member", "multi-gqa-scale", "--property", "forward_matches_reference,no_such"]) == 2
    assert "--property no_such: no such property" in capsys.readouterr().err


def test_selftest_reports_found_equals_planted_on_the_properties_that_gave_extra_entries(tmp_path, monkeypatch,
                                                                                          capsys):
    """The fast variant of the slow test below: multi-gqa-scale (two bugs, forward only) under dev with the
    properties that reported entries of their own (lse_matches_reference: the scale seen only through the LSE
    on one key; contract: Hq=3, Hkv=2 computed silently) beside forward_matches_reference."""
    from attnverify.zoo.selftest import main

    monkeypatch.undo()  # the member's own 64-key block
    out = tmp_path / "st.json"
    rc = main(["--member", "multi-gqa-scale", "--profile", "dev", "--max-examples", "12", "--shrink-budget", "3",
               "--property", "forward_matches_reference,lse_matches_reference,contract", "--json", str(out)])
    text = capsys.readouterr().out
    c = json.loads(out.read_text())["bug_counts"][0]
    assert rc == 0 and c["exact"], text
    assert sorted(c["planted_of"].values()) == ["gqa_interleaved", "scale_ignored"], text
    assert "found == planted" in text


@pytest.mark.slow
@pytest.mark.parametrize("name", [m.name for m in ZOO if m.planted])
def test_every_property_reports_each_planted_bug_once_and_nothing_else(name, monkeypatch):
    """What `attnverify selftest --profile dev` runs on a multi-bug member: every property."""
    from attnverify.zoo.bugcount import count_bugs

    monkeypatch.undo()
    m = get_member(name)
    c = count_bugs(m, profile="dev", max_examples=20, shrink_budget_s=15)
    found = [(g["needs"], g["properties"], g["describe"]) for g in c.found]
    assert c.exact, (c.matched, found, c.errors)
    assert sorted(v for v in c.planted_of.values()) == sorted(p.name for p in m.planted), found
