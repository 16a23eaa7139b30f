"""`run_property`: build and run the Hypothesis test of one property against one adapter.

The @example corpus runs first, then generated cases (targeted on error / tolerance); a failure
is shrunk, saved to `<report_dir>/cases/<id>.json`, and raised as an AssertionError that holds the
shrunk case, every failing output and the command that replays it.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
import unittest
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

from hypothesis import example, given, seed as hyp_seed, target
from hypothesis.errors import Unsatisfiable

from .base import ExampleResult, Property
from .profiles import DEFAULT_PROFILE, hypothesis_settings


# Seconds of shrinking after the first failure, per profile; then the smallest failure so far is reported.
SHRINK_BUDGET_S = {"ci": 20.0, "dev": 60.0, "thorough": 300.0}


class PropertySkipped(unittest.SkipTest):
    """The adapter does not claim what the property needs (pytest reports it as a skip)."""


class _ExampleFailed(AssertionError):
    pass


@dataclass
class PropertyRun:
    """What a completed (passing) run did."""

    property: str
    adapter: str
    profile: str
    examples: int = 0
    corpus: int = 0
    seconds: float = 0.0
    max_severity: float = 0.0
    statuses: dict = field(default_factory=dict)


def default_runner(prop: Property, adapter, drawn) -> ExampleResult:
    return prop.run_example(adapter, drawn)


def _db_key(prop, adapter, profile) -> bytes:
    return hashlib.sha256(f"attnverify/{prop.name}/{adapter.name}/{profile}".encode()).digest()


def run_property(
    prop: Property,
    adapter,
    *,
    profile: str = DEFAULT_PROFILE,
    seed: Optional[int] = None,
    max_examples: Optional[int] = None,
    device: str = "auto",
    runner: Optional[Callable[[Property, Any, Any], ExampleResult]] = None,
    journal: Optional[Callable[[dict], None]] = None,
    report_dir: str = "reports",
    database=...,
    on_first_failure: Optional[Callable[[int, float], None]] = None,
    use_corpus: bool = True,
    shrink_budget_s: Optional[float] = None,
) -> PropertyRun:
    """Run `prop` against `adapter`; return a PropertyRun, raise AssertionError on a failure,
    PropertySkipped (a unittest.SkipTest) when the adapter does not claim what it needs."""
    why = prop.skip_reason(adapter)
    if why:
        raise PropertySkipped(why)
    runner = runner or default_runner
    from ..strategies._cases import LAST_REFUSAL

    LAST_REFUSAL.pop(adapter.name, None)  # a skip below says why *this* property's draws were refused
    st_ = prop.strategy(adapter, profile, device)
    corpus = list(prop.examples(adapter, profile, device)) if use_corpus else []
    run = PropertyRun(prop.name, adapter.name, profile, corpus=len(corpus))
    state = {"last_fail": None, "n": 0, "first": None, "failing": {}}
    budget = shrink_budget_s if shrink_budget_s is not None else SHRINK_BUDGET_S.get(profile, 60.0)
    t0 = time.perf_counter()

    def body(drawn):
        if state["first"] is not None and time.perf_counter() - t0 - state["first"][1] > budget:
            # shrinking budget spent: judge only what is already known to fail, so the shrinker stops
            key = json.dumps(drawn, sort_keys=True, default=str)
            if key in state["failing"]:
                state["last_fail"] = (drawn, state["failing"][key])
                raise _ExampleFailed(state["failing"][key].message)
            return
        state["n"] += 1
        idx = state["n"]
        if journal is not None:
            journal({"event": "case_start", "property": prop.name, "adapter": adapter.name, "profile": profile,
                     "index": idx, "drawn": drawn})
        t1 = time.perf_counter()
        try:
            res = runner(prop, adapter, drawn)
        except Exception as e:  # a runner must not raise; if it does, it is this example's error
            res = ExampleResult(False, message=f"runner raised {type(e).__name__}: {e}", severity=1e30, status="error")
        if not res.seconds:
            res.seconds = time.perf_counter() - t1
        if journal is not None:
            journal({"event": "result", "property": prop.name, "adapter": adapter.name, "profile": profile,
                     "index": idx, **res.to_dict()})
        run.statuses[res.status] = run.statuses.get(res.status, 0) + 1
        if res.status == "skipped":
            state["skip"] = res.message
        sev = float(res.severity) if res.severity == res.severity else 1e30
        sev = min(sev, 1e30) if math.isfinite(sev) else 1e30
        run.max_severity = max(run.max_severity, sev)
        try:
            target(sev, label="error / tolerance")
        except Exception:
            pass
        if not res.passed and res.status != "skipped":
            if state["first"] is None:
                state["first"] = (idx, time.perf_counter() - t0)
                if on_first_failure is not None:
                    on_first_failure(idx, time.perf_counter() - t0)
            state["last_fail"] = (drawn, res)
            state["failing"][json.dumps(drawn, sort_keys=True, default=str)] = res
            raise _ExampleFailed(res.message)

    test = given(st_)(body)
    for ex in reversed(corpus):  # decorators apply bottom-up: keep the corpus order
        test = example(ex)(test)
    if max_examples is None and getattr(prop, "cost", 1.0) > 1.0:
        max_examples = max(5, int(hypothesis_settings(profile).max_examples / float(prop.cost)))
    test = hypothesis_settings(profile, max_examples=max_examples, seed=seed, database=database)(test)
    if seed is not None:
        test = hyp_seed(int(seed))(test)
    test._hypothesis_internal_database_key = _db_key(prop, adapter, profile)
    try:
        test()
    except BaseException as e:
        if state["last_fail"] is not None:
            drawn, res = state["last_fail"]
            raise AssertionError(_failure_text(prop, adapter, drawn, res, report_dir, profile, state)) from None
        if not isinstance(e, Unsatisfiable):
            raise
        if state["n"] == 0:
            # every case the property draws lies outside what the adapter accepts (e.g. sdpa-cudnn and
            # causal_alignment, which needs causal with Lq != Lk): nothing to judge, so a skip that says why
            why = LAST_REFUSAL.get(adapter.name) or (
                f"no draw satisfies what the property needs within the claims ({adapter.claims.summary()})")
            raise PropertySkipped(f"{adapter.name} accepts none of the cases {prop.name} draws: {why}") from None
        # the @example corpus was judged and passed; generation found nothing else the adapter accepts
        run.statuses["generation_refused"] = 1
    run.examples = state["n"]
    run.seconds = time.perf_counter() - t0
    if run.statuses and set(run.statuses) <= {"skipped", "generation_refused"}:
        # every example was turned down when judged (the real case, or a call derived from it): nothing judged
        first = (state.get("skip") or "").strip().splitlines()[:1]
        raise PropertySkipped(f"{adapter.name}: none of the {state['n']} case(s) {prop.name} drew could be judged: "
                              + (first[0] if first else "refused"))
    return run


def save_failure(prop, adapter, drawn, res: ExampleResult, report_dir: str = "reports") -> Optional[str]:
    """Save the case of a failing example where `attnverify repro` finds it; returns the path."""
    from ..case import CaseRecipe, build_probe

    recipe = drawn.get("recipe") if isinstance(drawn, dict) else None
    if recipe is None:
        return None
    # a CPU probe: the parent that drives Hypothesis must never start CUDA (forked judges need it); the
    # recipe keeps its real device
    case = build_probe(CaseRecipe.from_dict(recipe), label=f"{prop.name}[{adapter.name}]")
    os.makedirs(os.path.join(report_dir, "cases"), exist_ok=True)
    # one file per (property, adapter, case): two adapters failing the same case must not clobber
    tag = hashlib.sha1(f"{prop.name}|{adapter.name}|{case.case_id()}".encode()).hexdigest()[:12]
    path = os.path.join(report_dir, "cases", f"{tag}.json")
    case.save(path)
    with open(path) as f:
        d = json.load(f)
    d.update({"property": prop.name, "adapter": adapter.name, "drawn": drawn, "message": res.message,
              "status": res.status, "severity": res.severity})
    with open(path, "w") as f:
        json.dump(d, f, indent=1, default=str)
    return path


def _failure_text(prop, adapter, drawn, res: ExampleResult, report_dir, profile, state) -> str:
    path = None
    try:
        path = save_failure(prop, adapter, drawn, res, report_dir)
    except Exception as e:  # never hide the failure behind a saving problem
        path = None
        save_err = f"(could not save the case: {type(e).__name__}: {e})"
    else:
        save_err = ""
    desc = (res.case or {}).get("describe") or _describe(drawn)
    first = state.get("first")
    lines = [
        f"{prop.name} failed for {adapter.name} (profile {profile})",
        f"shrunk case: {desc}",
        res.message,
    ]
    extras = {k: v for k, v in drawn.items() if k != "recipe"} if isinstance(drawn, dict) else {}
    if extras:
        lines.append(f"property parameters: {extras}")
    if first:
        lines.append(f"first failing example: #{first[0]} after {first[1]:.2f} s; {state['n']} examples run with shrinking")
    if path:
        lines.append(f"replay: attnverify repro {path}")
    else:
        lines.append(f"replay: {save_err or 'no recipe to save'}")
    return "\n".join(lines)


def _describe(drawn) -> str:
    try:
        from ..case import CaseRecipe, build_probe

        return build_probe(CaseRecipe.from_dict(drawn["recipe"])).describe()  # no GPU in the parent
    except Exception:
        return repr(drawn)[:500]
