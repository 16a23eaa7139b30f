"""The test items of the suite: one PropertyItem per (property, adapter) under the virtual `attnverify` node."""
from __future__ import annotations

import re
import sys
import time
from typing import Any, Dict

import pytest

from .origin import display_path as _rel
from .plugin_settings import _bugs, _origin, _record, _report_for_messages, get_settings


class AttnSuite(pytest.Collector):
    """The virtual module holding the property items (node id `attnverify`)."""

    def collect(self):  # items are made in pytest_collection_modifyitems
        return []

    def reportinfo(self):
        return self.path, 0, "attnverify"


class AttnFailure(AssertionError):
    pass


class KnownFinding(AssertionError):
    """Only the target of the strict xfail marker a declared finding gets: a pass is a strict XPASS, and any
    other failure (AttnFailure) stays a failure."""


class PropertyItem(pytest.Item):
    def __init__(self, *, prop, adapter, **kw):
        super().__init__(**kw)
        self.prop = prop
        self.adapter = adapter
        self.extra_keyword_matches.update({prop.name, adapter.name, "attnverify"})
        self.add_marker(pytest.mark.attnverify)

    def reportinfo(self):
        return self.path, 0, f"attnverify: {self.name}"

    def runtest(self):
        s = get_settings(self.config)
        from .journal import save_case
        from .properties.driver import run_property

        if s.runner is None:
            start_runner(s, backward=bool(getattr(self.prop, "backward_cases", False)))
        t0 = time.perf_counter()
        in_process0 = getattr(s.runner, "in_process_fallback", 0)
        drawn_by_index: Dict[Any, Any] = {}
        state: Dict[str, Any] = {"examples": 0, "last_fail": None}

        def journal(ev: dict) -> None:
            ev = dict(ev)
            ev.setdefault("property", self.prop.name)
            ev.setdefault("adapter", self.adapter.name)
            ev["test"] = self.nodeid
            if ev.get("event") == "case_start":
                state["examples"] += 1
                drawn_by_index[ev.get("index", state["examples"])] = ev.get("drawn")
                state["last_start"] = ev
            elif ev.get("event") == "result":
                state["judged"] = state.get("judged", 0) + 1
                if not ev.get("passed", True) and ev.get("status") != "skipped":
                    state["last_fail"] = ev
            s.journal.write(ev)

        info = {"property": self.prop.name, "adapter": self.adapter.name, "test": self.nodeid,
                "outcome": "passed", "examples": 0, "message": None, "case_file": None, "repro": None, "status": None}
        try:
            run_property(self.prop, self.adapter, profile=s.profile, seed=s.seed, max_examples=s.max_examples,
                         device=s.device, runner=s.runner, journal=journal, report_dir=_report_for_messages(s),
                         database=s.database, max_bugs=s.max_bugs, on_bug=lambda bug: _bugs().record_bug(
                             bug, s=s, prop=self.prop, adapter=self.adapter, journal_write=journal,
                             origin=_origin(self.adapter, s)))
            outcome, note = self.adapter.classify(self.prop.name, None)
            if outcome == "xpass":  # pytest's strict xfail marker (collection) fails the test: XPASS(strict)
                info.update(outcome="xpass", status="xpass", message=f"XPASS(strict): {note}")
        except AssertionError as e:
            msg = str(e)
            fail = state["last_fail"] or {}
            drawn = drawn_by_index.get(fail.get("index"), (state.get("last_start") or {}).get("drawn"))
            bugs = getattr(e, "bugs", None) or []
            if bugs:  # distinct bugs found (attnverify.bugs): the first one is the item's case
                fail, drawn = dict(bugs[0]["result"], index=None), bugs[0]["drawn"]
                info["bugs"] = [_bugs().brief(b) for b in bugs]
            info.update(outcome="failed", message=msg, status=fail.get("status"))
            try:
                path = save_case(s.report, prop_name=self.prop.name, adapter_name=self.adapter.name, drawn=drawn,
                                 result=fail, run_id=s.run_id, seed=s.seed,
                                 extra={"adapter_origin": _origin(self.adapter, s), "records": fail.get("records")})
                info["case_file"] = path
                info["repro"] = f"attnverify repro {_rel(path)}"
                # point the replay line at the file keyed by (property, adapter, example)
                msg, n = re.subn(r"(?m)^replay: .*$", lambda m: f"replay: {info['repro']}", msg, count=1)
                if not n:
                    msg += f"\nreplay: {info['repro']}"
            except Exception as se:  # noqa: BLE001 - the failure matters more than its saving
                msg += f"\n(could not save the case: {type(se).__name__}: {se})"
            outcome, note = self.adapter.classify(self.prop.name, msg)  # the adapter's one classifier
            if outcome == "failed" and note:  # a declared finding narrower than this failure: new, said so
                msg += "\n" + note
            info["message"] = msg
            known = note if outcome == "known" else None
            if known:  # a documented finding: reported, not a new failure (a strict XPASS once it is fixed)
                info.update(outcome="known", status="known", message=f"known finding: {known}\n{msg}")
                pytest.xfail(f"known finding: {known}")
            _record().store_evidence(s.runner, self.adapter, fail, info.get("case_file"))
            raise AttnFailure(msg) from None
        except KeyboardInterrupt as e:  # Ctrl-C, or `attnverify run` stopped by SIGTERM: the results so far stand
            info.update(outcome="stopped", status="stopped", message=(
                f"stopped ({type(e).__name__}{': ' + str(e) if str(e) else ''}) after {state.get('judged', 0)} judged "
                "example(s); the results judged before the stop are in the journal, the example being judged then "
                "was not finished"))
            raise
        except BaseException as e:
            skipped = isinstance(e, pytest.skip.Exception) or type(e).__name__ in ("PropertySkipped", "SkipTest")
            info.update(outcome="skipped" if skipped else "error", message=f"{type(e).__name__}: {e}")
            raise
        finally:
            info["examples"] = state["examples"]
            info["seconds"] = time.perf_counter() - t0
            # examples judged in this process because CUDA was initialised here: no crash isolation for them
            n_in_process = getattr(s.runner, "in_process_fallback", 0) - in_process0
            if n_in_process:
                info["judged_in_process"] = n_in_process
            s.journal.write({"event": "test_end", **info})
            self.user_properties.append(("attnverify", info))
            # a stopped run calls no adapter again (a stop may also come while a failure is being recorded)
            if info["outcome"] != "stopped" and not isinstance(sys.exc_info()[1], KeyboardInterrupt):
                _record().probe_conventions(s.runner, s.journal, self.adapter, s.device, s.probed)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, AttnFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)


def start_runner(s, *, backward: bool) -> None:
    """The session's runner, made once: at the end of collection (plugin.pytest_collection_finish) or by the
    first property item. The judging child holds every job, property and adapter of the session from its first
    fork: one child serves them all (a fork per new property re-imported the adapter's libraries and, on a GPU,
    started CUDA and reloaded compiled kernels each time); a child that dies is still replaced. It forks at once
    and warms the judge (attnverify.judge_warmup; gradients too when `backward`) while this process goes on."""
    if s.runner is not None:
        return
    from .evidence import EVIDENCE_JOB
    from .isolation import make_runner
    from .judge_warmup import warm_plan
    from .probes import CONVENTIONS_JOB
    from .properties import PROPERTIES

    s.runner = make_runner(s.isolate, s.timeout)
    s.runner.prepare(EVIDENCE_JOB, CONVENTIONS_JOB, *s.properties, *PROPERTIES, *s.adapters)
    if hasattr(s.runner, "warm"):
        s.runner.warm(warm_plan(s.adapters, s.device, backward))
