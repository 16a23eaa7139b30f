"""Attribution from what a failing example's calls show, beside its single-feature neighbours.

- `comparisons(result)`: the comparison dicts of an ExampleResult (records that are comparisons, or hold
  them).
- `judged_nothing(failing, passed)`: a neighbour's pass that compared none of the elements of what failed
  (each excluded by a declared convention: nonfinite_inputs_propagate with one head, where a poisoned key
  makes every row NaN) proves nothing about the feature it removed.
- `backward_only(result)`: a failing call whose output matched and only its gradients did not.
- `through_calls(...)`: a property that compares the adapter with itself across calls of other shapes than
  its case (lse_merge: the two key subsets; repeat_and_interleave_stable: the case inside a larger batch)
  names those calls (`Property.derived_recipes(recipe, params)`; a failing pair "out:<label>" involves
  the call of that label only). When no feature of its case explains its failure, forward_matches_reference
  judges them: a bug of a derived call that the case's own call lacks (the derived call moved outside the
  needs of the case's own bug first: the request inside a batch, which the request alone lacks) comes
  first; else the case's own call's bug (lse_merge's key tail, which its key subsets repeat with other
  tails). Its needs are the failure's, so it groups with forward_matches_reference's sighting; the
  property's case stays the case of record (its repro replays the property), and the continued search
  stops there (the case's features do not select the bug).
"""
from __future__ import annotations

import dataclasses

from typing import List, Optional


def comparisons(result) -> List[dict]:
    """The comparison dicts of an ExampleResult: its records are comparisons, or hold them."""
    out = []
    for rec in list(getattr(result, "records", None) or []):
        if not isinstance(rec, dict):
            continue
        if "comparisons" in rec:
            out += [c for c in rec.get("comparisons") or [] if isinstance(c, dict)]
        elif "name" in rec and "passed" in rec:
            out.append(rec)
    return out


def judged_nothing(failing, passed) -> Optional[str]:
    """The names of what failed in `failing` when the passing `passed` compared none of their elements
    (each excluded by a declared convention, e.g. rows non-finite in the reference), else None."""
    bad = {c.get("name") for c in comparisons(failing) if not c.get("passed")}
    seen = [c for c in comparisons(passed) if c.get("name") in bad]
    if seen and all(c.get("judged") == 0 for c in seen):
        return ", ".join(sorted({str(c.get("name")) for c in seen}))
    return None


def backward_only(result) -> bool:
    """Whether a failing result compared the output fine and only gradients (dq, dk, dv) wrong."""
    recs = list(getattr(result, "records", None) or [])
    if not recs or any(r.get("error") or r.get("status") in ("error", "crashed", "timeout") for r in recs):
        return False
    comps = [c for r in recs for c in (r.get("comparisons") or [])]
    bad = [c.get("name") for c in comps if not c.get("passed")]
    return bool(bad) and set(bad) <= {"dq", "dk", "dv"} and any(c.get("name") == "out" and c.get("passed")
                                                               for c in comps)


def _relevant(calls, failing) -> list:
    """The calls a failure involves: a failing comparison named "out:<label>" (a pair of the property's)
    involves the call of that label only; plain names ("out", "lse") involve every call."""
    bad = [str(c.get("name")) for c in comparisons(failing) if not c.get("passed")]
    labels = {n.split(":", 1)[1] for n in bad if ":" in n}
    if not bad or any(":" not in n for n in bad):
        return calls
    return [(lab, d) for lab, d in calls if lab in labels]


def through_calls(prop, adapter, recipe, params: dict, runner, *, kit: dict, failing=None, profile: str = "dev",
                  journal=None):
    """(the Attribution of forward_matches_reference that explains `prop`'s failure through its own calls,
    what it is about), or None. The relation compares the case's call with calls of other shapes: a bug of
    a derived call that the case's call lacks (judged outside the needs of the case's own bug, if any) comes
    first; else the case's own call's bug, which the calls of other shapes do not repeat the same way (the
    key tail of lse_merge's subsets). `kit`: attnverify.attribution's attribute, fix, claims_why, fits,
    features and context."""
    from .case import build_probe
    from .properties import get_property

    base = get_property("forward_matches_reference")
    if base is prop or base.why_skipped(adapter):
        return None
    try:
        calls = _relevant(list(prop.derived_recipes(recipe, params) or []), failing)
    except Exception:  # noqa: BLE001 - no call named: nothing to attribute through
        return None
    if not calls:
        return None

    def judged(r, what):  # -> (drawn, failing result) where forward_matches_reference fails on r, else None
        if kit["claims_why"](adapter, r) or kit["fits"](base, adapter, r):
            return None
        nd = {"recipe": r.to_dict()}
        res = runner(base, adapter, nd)
        if journal is not None:
            journal({"event": "neighbour", "property": prop.name, "judged_by": base.name, "feature": f"call:{what}",
                     "drawn": nd, "status": res.status, "passed": res.passed})
        return None if res.passed or res.status == "skipped" else (nd, res)

    def attributed(r, what):
        hit = judged(r, what)
        if hit is None:
            return None
        try:
            desc = build_probe(r).describe()
        except Exception:  # noqa: BLE001
            desc = what
        sub = kit["attribute"](base, adapter, hit[0], runner, profile=profile, describe=desc, journal=journal,
                               result=hit[1])
        return sub if sub is not None and sub.needs else None

    own = attributed(recipe, "case")
    ctx = kit["context"](adapter, profile)
    for label, d in calls:
        d = kit["fix"](recipe, d)
        for need in (own.filter_needs() if own is not None else []):  # outside the case's own bug
            f = kit["features"][need["feature"]]
            d = f.neighbour(d, need["arg"], ctx) if f.present(d, need["arg"]) else d
            if d is None:
                break
        sub = attributed(d, label) if d is not None else None
        if sub is not None:
            return sub, f"its {label} call ({sub.describe})"
    if own is not None:
        return own, f"its own call ({own.describe}; compared with its {', '.join(lab for lab, _ in calls)} call)"
    return None


def with_params(r, params: dict, adapter):
    """A neighbour recipe `r` as its property judged it, for another property to judge: the sinks a sink property
    draws beside its recipe join the recipe (else forward_matches_reference judged the case without them, passed,
    and a sink bug read 'needs return_lse'), as `adapter` takes them (sink_logits.for_adapter)."""
    if params.get("sinks") is not None and r.cache_lens is None and r.sinks is None:
        from .sink_logits import for_adapter

        return dataclasses.replace(r, sinks=for_adapter(adapter, r.dtype, dict(params["sinks"])))
    return r
