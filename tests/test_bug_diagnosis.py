"""A bug seen by several properties is summarised with a diagnosis that explains it when any of its cases has one
(the terminal summary and the report's bug list alike): a stranger's paged kernel that reads its partial last block
whole was shown as "no simple explanation" because the smallest case was a causal one (padding hidden by the mask
in the engine), while its forward_matches_reference case said "padded tail keys counted"."""
from __future__ import annotations

import json
import os

from attnverify.bugs import diagnosis_for, group, summary_lines
from attnverify.reports.bugs import bug_section

PADDED = {"summary": "padded tail keys counted: keys 63..63", "explained": True}
NOTHING = {"summary": "no simple explanation", "explained": False}


def _group(*sightings):
    return group([{"signature": "s1", "needs": [], "property": p, "adapter": "mine", "describe": d, "case_file": f}
                  for p, d, f in sightings])[0]


def test_the_smallest_explained_case_wins_and_an_unexplained_one_defers():
    g = _group(("causal_alignment", "B=1 Lq=1 Lk=63", "a.json"), ("forward_matches_reference", "B=2 Lq=1 Lk=63", "b.json"))
    assert g["case_file"] == "a.json" and [c for _, c in g["cases"]] == ["a.json", "b.json"]
    text = diagnosis_for(g, {"a.json": NOTHING, "b.json": PADDED}.get)
    assert text.startswith("padded tail keys counted") and "from the forward_matches_reference case" in text
    assert "no simple explanation" in text  # the smallest case's own verdict is still said
    assert diagnosis_for(g, {"a.json": PADDED, "b.json": NOTHING}.get) == PADDED["summary"]
    assert diagnosis_for(g, {"a.json": NOTHING, "b.json": NOTHING}.get) == "no simple explanation"
    assert diagnosis_for(g, {}.get) == ""
    assert diagnosis_for(g, {"b.json": PADDED}.get) == PADDED["summary"] + " (from the forward_matches_reference case)"


def _write(folder, name, diag):
    os.makedirs(os.path.join(folder, "cases"), exist_ok=True)
    path = os.path.join(folder, "cases", name)
    with open(path, "w") as f:
        json.dump({"property": "x"}, f)
    with open(path[:-5] + ".evidence.json", "w") as f:
        json.dump({"diagnosis": diag}, f)
    return path


def test_terminal_summary_and_report_read_the_other_case(tmp_path):
    a = _write(str(tmp_path), "a.json", NOTHING)
    b = _write(str(tmp_path), "b.json", PADDED)
    bug = {"signature": "s1", "needs": [], "property": "causal_alignment", "adapter": "mine",
           "describe": "B=1 Hq=1 Lq=1 Lk=63", "case_file": a}
    seen = {"signature": "s1", "needs": [], "property": "forward_matches_reference", "adapter": "mine",
            "describe": "B=2 Hq=1 Lq=1 Lk=63", "case_file": b}
    lines = summary_lines([{"bugs": [bug]}, {"bugs": [seen]}])
    diag = next(x for x in lines if x.strip().startswith("diagnosis:"))
    assert "padded tail keys counted" in diag and "forward_matches_reference" in diag, lines
    recs = [{"event": "bug", **bug, "properties": ["causal_alignment"]},
            {"event": "bug_seen", "signature": "s1", "adapter": "mine", "property": "forward_matches_reference",
             "case_file": b}]
    section = bug_section(str(tmp_path), recs, [])
    assert section["bugs"][0]["diagnosis"].startswith("padded tail keys counted"), section


def test_a_failure_row_shows_the_saved_case_not_an_earlier_failing_one(tmp_path):
    """The failures table showed the journal's last failing result (B=1 Hq=2 ... Lk=130) beside a message and a
    repro about the saved case the attribution had reduced it to (Hq=1 ... Lk=63)."""
    from attnverify.reports.artifact import failure_context

    path = _write(str(tmp_path), "707133642973.json", PADDED)
    with open(path, "w") as f:
        json.dump({"describe": "B=1 Hq=1 Hkv=1 Lq=17 Lk=63 D=64 float8_e4m3fn", "shapes": {"q": [1, 1, 17, 64]},
                   "recipe": {"len_k": 63}}, f)
    row = {"id": "707133642973", "adapter": "mine", "property": "fp8_matches_reference", "case_file": path,
           "case": {"describe": "B=1 Hq=2 Hkv=2 Lq=17 Lk=130 D=64 float8_e4m3fn", "recipe": {"len_k": 130}}}
    failure_context(str(tmp_path), row, {})
    assert row["case"]["describe"].startswith("B=1 Hq=1 Hkv=1 Lq=17 Lk=63"), row["case"]
    orphan = {"id": "0123456789ab", "adapter": "mine", "property": "x", "case": {"describe": "B=2"}}
    failure_context(str(tmp_path), orphan, {})  # no case file saved (a crash): the journal's case stays
    assert orphan["case"] == {"describe": "B=2"}
