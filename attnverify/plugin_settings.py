"""One run's settings as the plugin resolved them (stashed on the config), the adapters and properties it
resolved, and the small helpers the items and the summary share."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import pytest


@dataclass
class Settings:
    adapter_names: List[str]
    profile: str
    report: str  # absolute
    report_arg: str  # as given (relative paths stay relative in messages)
    seed: int
    seed_given: bool
    device: str
    max_examples: Optional[int]
    isolate: str  # subprocess | none (resolved)
    timeout: float
    only: bool
    run_id: str
    worker: Optional[str]
    adapters: list = field(default_factory=list)
    properties: list = field(default_factory=list)
    properties_note: str = ""
    journal: Any = None
    runner: Any = None
    t0: float = field(default_factory=time.time)
    outcomes: Dict[str, dict] = field(default_factory=dict)  # nodeid -> info (controller side)
    allow_untested: bool = False
    untested_lines: List[str] = field(default_factory=list)  # "nothing was tested" (attnverify.untested)
    probed: set = field(default_factory=set)  # (adapter, device) whose conventions this process journaled
    cwd: str = ""  # the folder pytest was invoked from (adapter origins are recorded relative to it)
    max_bugs: Optional[int] = None  # --attn-max-bugs (None: the profile's, attnverify.properties.profiles.MAX_BUGS)
    shard: Optional[tuple] = None  # --attn-shard (K, N) (attnverify.shards); database: --attn-db's (attnverify.exampledb)
    database: Any = ...
    prewarm: bool = False  # --attn-prewarm (attnverify.prewarm): compile the run's kernels before it starts
    prewarm_budget: Optional[float] = None  # --attn-prewarm-budget's seconds (None: prewarm.DEFAULT_BUDGET_S)

    @property
    def is_worker(self) -> bool:
        return self.worker is not None


settings_key = pytest.StashKey[Settings]()


def get_settings(config) -> Optional[Settings]:
    return config.stash.get(settings_key, None)


class _XdistHooks:
    def __init__(self, s: Settings):
        self.s = s

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node):
        node.workerinput["attnverify_seed"] = self.s.seed
        node.workerinput["attnverify_run_id"] = self.s.run_id
        from .lifeline import controller_identity  # the worker dies with this process (attnverify.lifeline)

        node.workerinput["attnverify_controller"] = controller_identity()

    def pytest_keyboard_interrupt(self, excinfo):
        if not self.s.is_worker:  # the controller stops: so do its workers, now (attnverify.lifeline)
            from .lifeline import interrupt_children

            interrupt_children()


def _load_properties(config, s: Settings) -> None:
    props: list = []
    try:
        from .properties import PROPERTIES  # written beside the strategies

        props = list(PROPERTIES)
    except ImportError as e:
        s.properties_note = f"built-in properties unavailable ({e})"
    for extra in config.hook.pytest_attnverify_properties(config=config):
        props += list(extra or [])
    seen, out = set(), []
    for p in props:
        if p.name not in seen:
            seen.add(p.name)
            out.append(p)
    s.properties = out


def _resolve_adapters(config, s: Settings) -> None:
    from .adapters.base import Adapter
    from .adapters.registry import UnknownAdapterError, register_adapter, resolve

    for extra in config.hook.pytest_attnverify_adapters(config=config):
        for a in extra or []:
            if not isinstance(a, Adapter):
                raise pytest.UsageError(f"pytest_attnverify_adapters returned {a!r}, not an attnverify adapter")
            register_adapter(a)
    try:
        s.adapters = resolve(s.adapter_names)
    except UnknownAdapterError as e:
        raise pytest.UsageError(str(e)) from None
    except Exception as e:  # the user's adapter module failed to import: a usage problem, said plainly
        raise pytest.UsageError(f"--adapter {','.join(s.adapter_names)}: loading failed: {type(e).__name__}: {e}") from None
    if not s.adapters:
        raise pytest.UsageError(f"--adapter {','.join(s.adapter_names)}: no available adapter matched")
    for a in s.adapters:
        # before any property runs in this process (forked judges inherit what it did): e.g. the bundled Triton
        # kernel switches the interpreter on, which triton reads when it is first imported
        if a.prepare is not None:
            try:
                a.prepare()
            except Exception as e:
                raise pytest.UsageError(f"--adapter {a.name}: its prepare() raised {type(e).__name__}: {e}") from None


def _adapter_info(a, s: Settings) -> dict:
    why = a.unavailable_reason()
    try:
        dev = a.run_device(s.device) if why is None else None
    except Exception:
        dev = None
    return {"name": a.name, "available": why is None, "reason": why, "claims": a.claims.summary(), "device": dev,
            "origin": _origin(a, s)}


def _origin(adapter, s: Settings) -> dict:
    from .recording import origin_of

    return origin_of(adapter, s.adapter_names, s.cwd or None)


def _bugs():
    from . import bugs  # distinct bugs: journaled as found, grouped, summarised

    return bugs


def _record():
    from . import recording  # what the run stores for its report: evidence, convention probes, origins

    return recording




def _report_for_messages(s: Settings) -> str:
    return s.report_arg if not os.path.isabs(s.report_arg) and os.path.abspath(s.report_arg) == s.report else s.report
