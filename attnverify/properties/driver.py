"""`run_property`: build and run the Hypothesis test of one property against one adapter.

The @example corpus runs first, then generated cases (targeted on error / tolerance); a failure
is shrunk, attributed (attnverify.attribution: which features it needs, judged by the runner), saved
to `<report_dir>/cases/<id>.json`; the search then goes on outside the needs found, up to the
profile's number of distinct bugs (MAX_BUGS: 1 in ci), each search with its own database key. The
bugs are raised as one PropertyFailed (an AssertionError) holding, per bug, the shrunk case, every
failing output, its needs and the command that replays it.
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

from ..origin import display_path as _rel
from ..timesplit import rounded, strategy_seconds
from .base import ExampleResult, Property
from .profiles import DEFAULT_PROFILE, MAX_BUGS, hypothesis_settings


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
    last_skip: str = ""  # the message of the last example turned down when judged


def default_runner(prop: Property, adapter, drawn) -> ExampleResult:
    return prop.run_example(adapter, drawn)


def _db_key(prop, adapter, profile, excluded=(), tag: str = "") -> bytes:
    """The example database's key; a continued search (cases of found bugs excluded) has its own,
    derived from the needs it excludes, so each distinct bug replays first on the next run."""
    key = f"attnverify/{prop.name}/{adapter.name}/{profile}"
    if excluded:
        key += "/outside:" + json.dumps([sorted(n["label"] for n in need) for need in excluded])
    if tag:
        key += "/" + tag
    return hashlib.sha256(key.encode()).digest()


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
    max_bugs: Optional[int] = None,
    on_bug: Optional[Callable[[dict], Optional[str]]] = None,
) -> PropertyRun:
    """Run `prop` against `adapter`; return a PropertyRun, raise PropertyFailed (an AssertionError) on a
    failure, PropertySkipped (a unittest.SkipTest) when the adapter does not claim what it needs.

    Every shrunk failure is attributed (attnverify.attribution: the features it needs); the search then
    goes on outside the needs found, up to `max_bugs` distinct bugs (default: the profile's, MAX_BUGS).
    `on_bug(bug)` is called as each bug is found (the plugin journals it there) and may return the
    path of the case file it saved."""
    why = prop.why_skipped(adapter)
    if why:
        raise PropertySkipped(why)
    runner = runner or default_runner
    limit = bugs_limit(profile, max_bugs)
    run = PropertyRun(prop.name, adapter.name, profile)
    t0 = time.perf_counter()
    bugs: List[dict] = []
    excluded: List[List[dict]] = []
    ctx = dict(prop=prop, adapter=adapter, profile=profile, seed=seed, max_examples=max_examples, device=device,
               runner=runner, journal=journal, database=database, on_first_failure=on_first_failure,
               use_corpus=use_corpus, shrink_budget_s=shrink_budget_s, run=run, t0=t0)
    while len(bugs) < limit:
        fail = _search(excluded, len(bugs), **ctx)
        if fail is None:
            break
        if limit > 1 and fail[2].get("explicit") and fail[0].get("recipe") is not None:
            # an @example failure is not shrunk and may show several bugs at once: let generation find
            # and shrink one (its own database key); the corpus failure stands if generation finds none
            fail = _search(excluded, len(bugs), **{**ctx, "use_corpus": False, "tag": "generated"}) or fail
        drawn, res, state = fail
        bug = _bug(prop, adapter, drawn, res, state, runner, profile, journal, report_dir, len(bugs), on_bug)
        bugs.append(bug)
        need = (bug.get("attribution") or {}).get("filter") or []
        if not need:
            break  # nothing to search outside of: every case could be this bug again
        excluded.append(need)
    if bugs:
        raise PropertyFailed(_failures_text(prop, adapter, bugs, profile), bugs)
    run.seconds = time.perf_counter() - t0
    if run.statuses and set(run.statuses) <= {"skipped", "generation_refused"}:
        # every example was turned down when judged (the real case, or a call derived from it): nothing judged
        first = (run.last_skip or "").strip().splitlines()[:1]
        raise PropertySkipped(f"{adapter.name}: none of the {run.examples} case(s) {prop.name} drew could be judged: "
                              + (first[0] if first else "refused"))
    return run


def bugs_limit(profile: str, max_bugs: Optional[int] = None) -> int:
    """Distinct bugs one property run looks for: `max_bugs`, else the profile's (MAX_BUGS)."""
    if max_bugs is None:
        return MAX_BUGS.get(profile, 1)
    if int(max_bugs) < 1:
        raise ValueError(f"max_bugs={max_bugs}: must be >= 1 (1 stops at the first failure)")
    return int(max_bugs)


class PropertyFailed(AssertionError):
    """A property's failure: the text (every bug found, the first one first) and `bugs`, one dict per
    distinct bug (property, adapter, drawn, result, case, case_file, attribution, signature, needs)."""

    def __init__(self, text: str, bugs: List[dict]):
        super().__init__(text)
        self.bugs = bugs


def _search(excluded, round_i, *, prop, adapter, profile, seed, max_examples, device, runner, journal, database,
            on_first_failure, use_corpus, shrink_budget_s, run, t0, tag=""):
    """One Hypothesis search; the cases of found bugs (`excluded`) are filtered out. -> None when it
    passes, else (drawn, result, state) of the shrunk failure."""
    from ..attribution import matches

    def fresh(drawn) -> bool:
        return not any(matches(n, drawn.get("recipe") if isinstance(drawn, dict) else None) for n in excluded)

    from ..strategies import Unclaimable, forget_refusal

    forget_refusal(adapter.name)  # a skip below says why *this* property's draws were refused
    try:
        st_ = prop.strategy(adapter, profile, device)
    except Unclaimable as e:  # certain from the claims: no Hypothesis budget spent finding it out, and the claim named
        raise PropertySkipped(f"{adapter.name} accepts none of the cases {prop.name} draws: {e}") from None
    if excluded:
        st_ = st_.filter(fresh)  # its own database key below, so a stored failure of this round replays
    corpus = list(prop.examples(adapter, profile, device)) if use_corpus else []
    corpus = [ex for ex in corpus if fresh(ex)]
    if not round_i:
        run.corpus = len(corpus)
    state = {"last_fail": None, "n": 0, "first": None, "failing": {}}
    budget = shrink_budget_s if shrink_budget_s is not None else SHRINK_BUDGET_S.get(profile, 60.0)
    t_round, s_round = time.perf_counter(), strategy_seconds()

    def body(drawn):
        if state["first"] is not None and time.perf_counter() - t_round - state["first"][1] > budget:
            # shrinking budget spent: judge only what is already known to fail, so the shrinker stops
            key = json.dumps(drawn, sort_keys=True, default=str)
            if key in state["failing"]:
                state["last_fail"] = (drawn, state["failing"][key])
                raise _ExampleFailed(state["failing"][key].message)
            return
        state["n"] += 1
        run.examples += 1
        idx = run.examples
        t1 = time.perf_counter()
        split = {"draw": t1 - state.get("t_out", t_round),  # in Hypothesis since the last example (timesplit)
                 "draw.strategy": strategy_seconds() - state.get("s_out", s_round)}
        if journal is not None:
            journal({"event": "case_start", "property": prop.name, "adapter": adapter.name, "profile": profile,
                     "index": idx, "drawn": drawn})
            split["journal"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        try:
            res = runner(prop, adapter, drawn)
        except Exception as e:  # a runner must not raise; if it does, it is this example's error
            res = ExampleResult(False, message=f"runner raised {type(e).__name__}: {e}", severity=1e30, status="error")
        if not res.seconds:
            res.seconds = time.perf_counter() - t1
        res.split = rounded({**(res.split or {}), **split})
        if journal is not None:
            journal({"event": "result", "property": prop.name, "adapter": adapter.name, "profile": profile,
                     "index": idx, **res.to_dict()})
        run.statuses[res.status] = run.statuses.get(res.status, 0) + 1
        if res.status == "skipped":
            state["skip"] = run.last_skip = res.message
        sev = float(res.severity) if res.severity == res.severity else 1e30
        sev = min(sev, 1e30) if math.isfinite(sev) else 1e30
        run.max_severity = max(run.max_severity, sev)
        try:
            target(sev, label="error / tolerance")
        except Exception:
            pass
        if not res.passed and res.status != "skipped":
            if state["first"] is None:
                state["first"] = (idx, time.perf_counter() - t_round)
                if on_first_failure is not None and not round_i:
                    on_first_failure(idx, time.perf_counter() - t0)
            state["last_fail"] = (drawn, res)
            state["failing"][json.dumps(drawn, sort_keys=True, default=str)] = res
            state["t_out"], state["s_out"] = time.perf_counter(), strategy_seconds()
            raise _ExampleFailed(res.message)
        state["t_out"], state["s_out"] = time.perf_counter(), strategy_seconds()

    test = given(st_)(body)
    for ex in reversed(corpus):  # decorators apply bottom-up: keep the corpus order
        test = example(ex)(test)
    if max_examples is None and getattr(prop, "cost", 1.0) > 1.0:
        max_examples = max(5, int(hypothesis_settings(profile).max_examples / float(prop.cost)))
    if seed is not None:
        # the seed fixes generation; hypothesis.seed also switches the example database off, so the
        # settings go on after it and keep the database on: a stored failure still replays first
        test = hyp_seed(int(seed))(test)
    test = hypothesis_settings(profile, max_examples=max_examples, seed=seed, database=database)(test)
    test._hypothesis_internal_database_key = _db_key(prop, adapter, profile, excluded, tag)
    try:
        test()
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise  # a stop is a stop, even with a failure in hand (its results are journaled already)
        if state["last_fail"] is not None:
            drawn, res = state["last_fail"]
            state["explicit"] = isinstance(drawn, dict) and any(drawn == ex for ex in corpus)
            return drawn, res, state
        if not isinstance(e, Unsatisfiable):
            raise
        if round_i:
            return None  # every case left is one of the bugs found: the search is done
        if state["n"] == 0:
            # every case the property draws lies outside what the adapter accepts (e.g. sdpa-cudnn and
            # causal_alignment, which needs causal with Lq != Lk): nothing to judge, so a skip that says why
            from ..strategies import last_refusal

            why = last_refusal(adapter.name) or (
                f"no draw satisfies what the property needs within the claims ({adapter.claims.summary()})")
            raise PropertySkipped(f"{adapter.name} accepts none of the cases {prop.name} draws: {why}") from None
        # the @example corpus was judged and passed; generation found nothing else the adapter accepts
        run.statuses["generation_refused"] = 1
    return None


def _bug(prop, adapter, drawn, res, state, runner, profile, journal, report_dir, index, on_bug) -> dict:
    """A shrunk failure, attributed, saved and handed to `on_bug`."""
    from ..attribution import attribute, signature

    desc = (res.case or {}).get("describe") or _describe(drawn)
    attr = None
    try:
        attr = attribute(prop, adapter, drawn, runner, profile=profile, describe=desc, journal=journal, result=res)
    except Exception as e:  # noqa: BLE001 - the failure matters more than its attribution
        attr_err = f"attribution failed: {type(e).__name__}: {e}"
    else:
        attr_err = "" if attr is not None else "attribution: the example holds no case to vary"
    if attr is not None and attr.reduced is not None:  # a simpler failing neighbour is the case now
        drawn, res = attr.reduced
        desc = attr.describe
    if attr is not None and attr.through:  # the needs are those of a call the property derived (a larger batch...)
        desc = f"{desc}, seen through {attr.through}"
    a = attr.to_dict() if attr is not None else None
    needs = a["needs"] if a else []
    bug = {"property": prop.name, "adapter": adapter.name, "index": index, "drawn": drawn, "result": res.to_dict(),
           "case": res.case, "describe": desc, "attribution": a, "needs": needs,
           "signature": a["signature"] if a else signature([], desc), "attribution_error": attr_err,
           "first": state.get("first"), "examples": state["n"], "case_file": None}
    path = None
    if on_bug is not None:
        try:
            path = on_bug(bug)
        except Exception as e:  # noqa: BLE001 - never hide the failure behind its recording
            bug["attribution_error"] = (attr_err + f"; recording the bug failed: {type(e).__name__}: {e}").lstrip("; ")
    if path is None:
        try:
            path = save_failure(prop, adapter, drawn, res, report_dir)
        except Exception as e:  # never hide the failure behind a saving problem
            bug["save_error"] = f"(could not save the case: {type(e).__name__}: {e})"
    bug["case_file"] = path
    return bug


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


def _failures_text(prop, adapter, bugs: List[dict], profile: str) -> str:
    """Every bug the property found, the first one first; each with its case, needs and replay line."""
    lines = []
    for i, bug in enumerate(bugs):
        if i:
            lines += ["", f"--- distinct bug {i + 1} of {len(bugs)} of {prop.name} for {adapter.name}: "
                      f"drawn outside the needs of the bug(s) above ---"]
        lines += _failure_lines(prop, adapter, bug, profile, head=not i)
    return "\n".join(lines)


def _failure_lines(prop, adapter, bug: dict, profile: str, head: bool) -> List[str]:
    res = ExampleResult.from_dict(bug["result"])
    drawn = bug["drawn"]
    lines = [f"{prop.name} failed for {adapter.name} (profile {profile})"] if head else []
    lines += [f"shrunk case: {bug['describe']}", res.message]
    a = bug.get("attribution")
    if a:
        lines.append(f"attribution: {a['text']} [bug {a['signature']}]")
        if a["untested"]:
            lines.append(f"untested: {'; '.join(a['untested'])}")
    elif bug.get("attribution_error"):
        lines.append(bug["attribution_error"])
    extras = {k: v for k, v in drawn.items() if k != "recipe"} if isinstance(drawn, dict) else {}
    if extras:
        lines.append(f"property parameters: {extras}")
    first = bug.get("first")
    if first:
        lines.append(f"first failing example: #{first[0]} after {first[1]:.2f} s; {bug['examples']} examples run "
                     f"with shrinking")
    if bug.get("case_file"):
        lines.append(f"replay: attnverify repro {_rel(bug['case_file'])}")
    else:
        lines.append(f"replay: {bug.get('save_error') or 'no recipe to save'}")
    return lines


def _describe(drawn) -> str:
    try:
        from ..case import CaseRecipe, build_probe

        return build_probe(CaseRecipe.from_dict(drawn["recipe"])).describe()  # no GPU in the parent
    except Exception:
        return repr(drawn)[:500]


