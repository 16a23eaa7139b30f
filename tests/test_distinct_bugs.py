"""Distinct bugs (issue 21): attribution of shrunk failures, the continued search, grouping, the zoo's
multi-bug members. The wide runs (every property of every multi-bug member under dev) are `slow`."""
from __future__ import annotations

import json
import os
import warnings

import pytest

from attnverify import adapter
from attnverify.attribution import FEATURES, attribute, matches, signature
from attnverify.case import CaseRecipe
from attnverify.isolation import make_runner
from attnverify.properties import get_property
from attnverify.properties.driver import PropertyFailed, bugs_limit, run_property
from attnverify.zoo import ZOO, get_member
from attnverify.zoo._eager import attend

F = get_property("forward_matches_reference")
G = get_property("gradients_match_reference")
CLAIMS = dict(dtypes=("float32", "float16"), devices=("cpu",), head_dims=(16, 32), causal=("none", "bottom_right"),
              gqa=True, backward=True, tiles=(32, 32), max_seqlen=256)


# a user's adapter with two independent bugs: batch b > 0 reads batch 0's values; keys past Lk up to a
# multiple of 32 count with score 0 when Lk % 32 != 0 (claims a 32-wide tile, as its kernel documents)
@adapter("two-bugs", register=False, **CLAIMS)
def two_bugs(q, k, v, spec):
    from attnverify.zoo._multi import forward

    v = v.clone()
    v[1:] = v[:1]
    return forward(q, k, v, spec.replace(return_lse=False), ("pad_tail",)) if k.shape[2] % 32 else attend(q, k, v, spec)


# a user's adapter with two bugs that differ only by the batch: keys past Lk up to a multiple of 32 count
# with score 0 when Lk % 32 != 0 (in every batch, so batch_head_independence cannot see it); and on such a
# partial key tile, batch b > 0 reads batch 0's values (only batch_head_independence's kind of check sees
# that apart from the first bug)
@adapter("tail-and-tail-batch", register=False, **CLAIMS)
def tail_and_tail_batch(q, k, v, spec):
    from attnverify.zoo._multi import forward

    if k.shape[2] % 32 == 0:
        return attend(q, k, v, spec)
    v = v.clone()
    v[1:] = v[:1]
    return forward(q, k, v, spec.replace(return_lse=False), ("pad_tail",))


@adapter("correct-eager", register=False, **CLAIMS)
def correct(q, k, v, spec):
    return attend(q, k, v, spec)


def _run(prop, a, **kw):
    runner = make_runner("auto")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return run_property(prop, a, seed=0, database=None, runner=runner, **kw)
    finally:
        runner.close()


@pytest.fixture(autouse=True)
def _block(monkeypatch):
    monkeypatch.setattr("attnverify.zoo._multi.BLOCK", 32)


def test_profiles_limit_bugs_and_reject_a_bad_override():
    assert (bugs_limit("ci"), bugs_limit("dev"), bugs_limit("thorough"), bugs_limit("ci", 4)) == (1, 3, 3, 4)
    with pytest.raises(ValueError, match="max_bugs=0"):
        bugs_limit("dev", 0)


def test_matches_is_the_filter_of_found_needs():
    r = CaseRecipe(batch=2, len_q=5, len_k=33, causal="bottom_right")
    need_b = {"feature": "batch", "arg": None, "label": "B >= 2"}
    need_lk = {"feature": "lk_partial", "arg": 32, "label": "Lk not a multiple of 32"}
    assert matches([need_b, need_lk], r) and matches([need_b], r.to_dict())
    assert not matches([need_b], CaseRecipe(batch=1)) and not matches([need_lk], CaseRecipe(len_k=64))
    assert not matches([], r)  # nothing needed: no filter (the search stops instead)
    assert FEATURES["causal"].present(r, "bottom_right") and not FEATURES["causal"].present(CaseRecipe(), "none")
    assert signature(["B >= 2", "x"]) == signature(["x", "B >= 2"]) != signature(["x"])
    assert signature([], "case A") != signature([], "case B")


def test_attribution_names_what_a_failure_needs_and_what_it_does_not():
    runner = make_runner("auto")
    try:
        drawn = {"recipe": CaseRecipe(batch=2, heads_q=2, heads_kv=2, len_q=4, len_k=32, head_dim=16).to_dict()}
        a = attribute(F, two_bugs, drawn, runner, profile="ci")
        assert a.needs == ["B >= 2"], a.text()
        # one head still fails: the case is reduced to it, and its verdicts are about the reduced case
        assert a.reduced is not None and a.reduced[0]["recipe"]["heads_q"] == 1 and "Hq >= 2" not in a.needs
        assert a.reduced[1].status == "failed" and "Hq=1" in a.describe
        drawn = {"recipe": CaseRecipe(len_q=3, len_k=5, head_dim=16).to_dict()}
        a = attribute(F, two_bugs, drawn, runner, profile="ci")
        assert a.needs == ["Lk not a multiple of 32"] and "Lq = Lk" in a.holds, a.text()
        # the words say which way each verdict went: the neighbour with Lk a multiple of 32 passed, Lq = Lk still failed
        assert a.text().startswith("fails only with Lk not a multiple of 32; still fails with"), a.text()
        assert "needs" not in a.text() and "holds with" not in a.text(), a.text()
        a = attribute(G, two_bugs, drawn, runner, profile="ci")
        assert "the forward alone" in a.holds, a.text()  # the bug is in the forward
    finally:
        runner.close()


BHI = get_property("batch_head_independence")


def _bhi_drawn(**kw):  # pick=1: the second batch alone against its rows of the full call
    return {"recipe": CaseRecipe(**{"len_q": 1, "len_k": 1, "head_dim": 16, **kw}).to_dict(), "pick": 1}


def test_a_feature_the_property_forces_is_judged_with_a_stand_in_so_one_bug_stays_one_entry():
    """batch_head_independence needs B >= 2 or Hkv >= 2. Its failure on B=2 with keys past the tile is the
    batch bug alone (the tail bug is the same in both calls): B -> 1 is judged by the property itself with
    two heads in its place, so it needs B >= 2, as forward_matches_reference's sighting of the batch bug.
    (forward_matches_reference on B=1 would have failed on the tail bug: 'holds with B=1', a 4th entry.)"""
    runner = make_runner("auto")
    try:
        a = attribute(BHI, two_bugs, _bhi_drawn(batch=2), runner, profile="dev")
        assert a.needs == ["B >= 2"], a.text()
        v = next(v for v in a.verdicts if v.feature == "batch")
        assert v.judged_by == "batch_head_independence" and "Hq=2 Hkv=2 in its place" in v.holds, v
        fwd = attribute(F, two_bugs, {"recipe": CaseRecipe(batch=2, len_q=32, len_k=32, head_dim=16).to_dict()},
                        runner, profile="dev")
        assert fwd.needs == ["B >= 2"] and fwd.signature() == a.signature(), (fwd.text(), a.text())
        assert not runner(F, two_bugs, {"recipe": CaseRecipe(len_q=1, len_k=1, head_dim=16).to_dict()}).passed
    finally:
        runner.close()


def test_two_bugs_that_differ_only_by_a_forced_feature_stay_apart():
    """What is provable: the tail bug needs only the partial tile (forward_matches_reference varies B);
    batch_head_independence's bug there needs B >= 2 too, proved by the property itself with a stand-in.
    Dropping the forced feature from its needs, or reading forward_matches_reference's failure on B=1 (the
    tail bug) as 'holds with B=1', would merge the two."""
    from attnverify.bugs import group

    runner = make_runner("auto")
    try:
        tail = attribute(F, tail_and_tail_batch, {"recipe": CaseRecipe(batch=2, len_q=1, len_k=1, head_dim=16)
                                                  .to_dict()}, runner, profile="dev")
        assert tail.needs == ["Lk not a multiple of 32"], tail.text()
        both = attribute(BHI, tail_and_tail_batch, _bhi_drawn(batch=2), runner, profile="dev")
        assert sorted(both.needs) == ["B >= 2", "Lk not a multiple of 32"], both.text()
        assert not runner(F, tail_and_tail_batch, {"recipe": CaseRecipe(len_q=1, len_k=1, head_dim=16)
                                                   .to_dict()}).passed  # the substitute sees the tail bug
        rows = [{"signature": x.signature(), "needs": x.needs, "property": p.name, "adapter": "tail-and-tail-batch",
                 "describe": x.describe} for x, p in ((tail, F), (both, BHI))]
        assert len(group(rows)) == 2
    finally:
        runner.close()


def test_a_failing_substitute_judge_leaves_the_forced_feature_untested():
    """Without a stand-in (causal_alignment always draws causal), forward_matches_reference judges causal=none;
    its failure there (the tail bug) may be another bug: 'untested', never 'holds with causal=none'."""
    runner = make_runner("auto")
    try:
        ca = get_property("causal_alignment")
        a = attribute(ca, two_bugs, {"recipe": CaseRecipe(len_q=2, len_k=33, head_dim=16, causal="bottom_right")
                                     .to_dict()}, runner, profile="dev")
        v = next(v for v in a.verdicts if v.feature == "causal")
        assert v.verdict == "untested" and "maybe another bug" in v.why and v.judged_by == F.name, v
        assert "causal=none" not in a.holds and a.needs == ["Lk not a multiple of 32"], a.text()
    finally:
        runner.close()


def test_dev_goes_on_after_the_first_bug_and_ci_stops_there():
    with pytest.raises(PropertyFailed) as ei:
        _run(F, two_bugs, profile="dev", max_examples=25, shrink_budget_s=5)
    got = sorted(tuple(b["needs"]) for b in ei.value.bugs)
    assert got == [("B >= 2",), ("Lk not a multiple of 32",)], got
    text = str(ei.value)
    assert "distinct bug 2 of 2" in text and text.count("replay: attnverify repro") == 2
    for b in ei.value.bugs:  # each saved and replayable
        assert b["case_file"] and os.path.exists(b["case_file"])
    with pytest.raises(PropertyFailed) as ei:
        _run(F, two_bugs, profile="ci", max_examples=25, shrink_budget_s=5)
    assert len(ei.value.bugs) == 1 and "distinct bug" not in str(ei.value)


def test_a_correct_adapter_pays_nothing_for_the_continued_search():
    run = _run(F, correct, profile="ci", max_examples=10, max_bugs=3)
    assert run.examples >= 10 and not run.statuses.get("failed")


def test_plugin_journals_each_bug_when_found_and_leads_the_summary(pytester):
    pytester.makeconftest("""
import attnverify
from attnverify.zoo._multi import forward
from attnverify.zoo._eager import attend

@attnverify.adapter("mine", register=True, dtypes=("float32",), devices=("cpu",), head_dims=(16,),
                    causal=("none",), tiles=(32, 32), max_seqlen=128)
def mine(q, k, v, spec):
    v = v.clone()
    v[1:] = v[:1]   # batch b > 0 reads batch 0's values
    return attend(q, k, v, spec)
""")
    r = pytester.runpytest("--adapter=mine", "--attn-only", "--attn-profile=dev", "--attn-max-examples=15",
                           "--attn-seed=3", "-k", "forward_matches or batch_head", "-p", "no:cacheprovider")
    out = r.stdout.str()
    assert "1 distinct bug (seen by 2 properties)" in out, out[-3000:]
    assert "bug 1 [" in out and "]: fails only with B >= 2" in out, out[-3000:]
    recs = [json.loads(x) for x in (pytester.path / "reports" / "results.jsonl").read_text().splitlines()]
    bugs = [x for x in recs if x["event"] == "bug"]
    assert len(bugs) == 1 and bugs[0]["needs"] == ["B >= 2"] and bugs[0]["adapter"] == "mine"
    assert {"properties", "case", "signature"} <= set(bugs[0])
    seen = [x for x in recs if x["event"] == "bug_seen"]
    assert len(seen) == 1 and seen[0]["signature"] == bugs[0]["signature"]
    # written when found: before the test_end of the property that found it
    first_end = next(i for i, x in enumerate(recs) if x["event"] == "test_end" and x["outcome"] == "failed")
    assert recs.index(bugs[0]) < first_end
    html = (pytester.path / "reports" / "index.html").read_text()
    assert "1 distinct bug (seen by 2 properties)" in html and "fails only with B &gt;= 2" in html


def test_max_bugs_option_is_checked(pytester):
    r = pytester.runpytest("--adapter=naive", "--attn-only", "--attn-max-bugs=0", "-p", "no:cacheprovider")
    assert "--attn-max-bugs=0" in r.stderr.str() + r.stdout.str()


MULTI = [m for m in ZOO if m.planted]


@pytest.mark.slow
@pytest.mark.parametrize("name", [m.name for m in MULTI])
def test_dev_reports_each_planted_bug_with_its_needs(name, monkeypatch):
    from attnverify.zoo.bugcount import count_bugs

    monkeypatch.undo()  # the members' own 64-key block
    m = get_member(name)
    c = count_bugs(m, profile="dev", max_examples=40, shrink_budget_s=15,
                   properties=list(m.expected) + ["batch_head_independence"])
    found = [(g["needs"], g["properties"], g["describe"]) for g in c.found]
    assert c.all_found and not c.errors, (c.matched, found, c.errors)
    assert len(c.found) == len(c.planted), found  # each planted bug its own entry, and nothing else
    for p in m.planted:  # with exactly its needs
        g = next(g for g in c.found if g["signature"] == c.matched[p.name])
        assert sorted(g["needs"]) == sorted(p.needs), (p.name, g["needs"], found)


@pytest.mark.slow
@pytest.mark.parametrize("name", [m.name for m in MULTI])
def test_ci_stops_each_property_at_its_first_bug(name, monkeypatch):
    monkeypatch.undo()
    m = get_member(name)
    for prop in m.expected:
        with pytest.raises(PropertyFailed) as ei:
            _run(get_property(prop), m.adapter, profile="ci", shrink_budget_s=5)
        assert len(ei.value.bugs) == 1 and "distinct bug" not in str(ei.value), (prop, str(ei.value)[:2000])


# two user adapters with a batch bug seen through the LSE: one writes batch b > 0's output and LSE at batch
# b - 1's rows; the other gets the output right and only the LSE wrong
@adapter("rows-out-and-lse", register=False, **dict(CLAIMS, lse=True))
def rows_out_and_lse(q, k, v, spec):
    from attnverify.zoo._multi import forward

    return forward(q, k, v, spec, ("batch_rows",))


@adapter("rows-lse-only", register=False, **dict(CLAIMS, lse=True))
def rows_lse_only(q, k, v, spec):
    import torch

    from attnverify.spec import Output

    res = attend(q, k, v, spec)
    if res.lse is None or q.shape[0] < 2:
        return res
    return Output(res.out, lse=torch.cat([res.lse[1:], torch.zeros_like(res.lse[:1])], 0))


def test_the_lse_is_needed_only_where_the_output_is_right():
    """row_shift_invariance sees a batch bug only through the LSE (the output is wrong by the same amount in
    both calls). Where forward_matches_reference fails on the output of the same case, return_lse is how the
    property sees the bug, not what it needs: the same entry as forward_matches_reference's; where the output
    is right, the bug is the LSE's and needs it."""
    rs = get_property("row_shift_invariance")
    drawn = {"recipe": CaseRecipe(batch=2, len_q=4, len_k=4, head_dim=16, return_lse=True).to_dict(), "shift": 100.0}
    runner = make_runner("auto")
    try:
        a = attribute(rs, rows_out_and_lse, drawn, runner, profile="dev")
        v = next(v for v in a.verdicts if v.feature == "lse")
        assert v.verdict == "untested" and "only through the LSE" in v.why, v
        assert a.needs == ["B >= 2"], a.text()
        fwd = attribute(F, rows_out_and_lse, {"recipe": CaseRecipe(batch=2, len_q=4, len_k=4, head_dim=16).to_dict()},
                        runner, profile="dev")
        assert fwd.signature() == a.signature(), (fwd.text(), a.text())
        b = attribute(rs, rows_lse_only, drawn, runner, profile="dev")
        assert sorted(b.needs) == ["B >= 2", "return_lse"], b.text()
    finally:
        runner.close()


@adapter("dk-unscaled", register=False, **CLAIMS)
def dk_unscaled(q, k, v, spec):  # a user's fused kernel whose backward leaves dK without the softmax scale
    from attnverify.zoo._multi import multi_attend

    return multi_attend(q, k, v, spec, ("dk_missing_scale",))


def test_a_property_judging_gradients_beside_other_things_says_a_backward_bug_needs_the_backward():
    """outputs_fully_written checks the gradients too (the adapter claims backward): its failure whose output
    matched and whose dK did not needs the backward, the same entry as gradients_match_reference's; its
    failure on a forward bug does not."""
    ofw = get_property("outputs_fully_written")
    drawn = {"recipe": CaseRecipe(len_q=4, len_k=4, head_dim=16).to_dict()}
    runner = make_runner("auto")
    try:
        res = runner(ofw, dk_unscaled, drawn)
        assert not res.passed
        a = attribute(ofw, dk_unscaled, drawn, runner, profile="dev", result=res)
        assert "the backward" in a.needs, a.text()
        g = attribute(G, dk_unscaled, drawn, runner, profile="dev")
        assert g.signature() == a.signature(), (g.text(), a.text())
        drawn2 = {"recipe": CaseRecipe(batch=2, len_q=4, len_k=32, head_dim=16).to_dict()}
        res2 = runner(ofw, two_bugs, drawn2)
        assert not res2.passed
        b = attribute(ofw, two_bugs, drawn2, runner, profile="dev", result=res2)
        assert b.needs == ["B >= 2"], b.text()
    finally:
        runner.close()
