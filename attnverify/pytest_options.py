"""The plugin's options: each a command-line flag, an ini key and an environment variable (the command
line wins, then the environment, then the ini file), converted and checked once (option_values)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

import pytest

from .prewarm import DEFAULT_BUDGET_S  # the standard library only: this module stays light

PROFILES = ("ci", "dev", "thorough")
DEVICES = ("auto", "cpu", "cuda")
ISOLATES = ("auto", "subprocess", "none")
DEFAULT_PROFILE = "dev"
DEFAULT_REPORT = "reports"
DEFAULT_TIMEOUT = 60.0


# --------------------------------------------------------------------------------------- options


@dataclass(frozen=True)
class _Opt:
    dest: str
    flag: str
    ini: str
    env: str
    default: Any
    help: str
    choices: Optional[tuple] = None
    kind: str = "str"  # str | int | float | flag | list


OPTIONS = (
    _Opt("attn_adapter", "--adapter", "attn_adapter", "ATTNVERIFY_ADAPTER", None,
         "attention adapter to test: a built-in or registered name, package.module:attr, path/to/file.py:attr, "
         "or `all`; repeat or give a comma list", kind="list"),
    _Opt("attn_profile", "--attn-profile", "attn_profile", "ATTNVERIFY_PROFILE", DEFAULT_PROFILE,
         "how hard to search: ci (fast), dev (default), thorough", choices=PROFILES),
    _Opt("attn_report", "--attn-report", "attn_report", "ATTNVERIFY_REPORT", DEFAULT_REPORT,
         "report folder: results.jsonl journal and cases/ (default reports/)"),
    _Opt("attn_seed", "--attn-seed", "attn_seed", "ATTNVERIFY_SEED", None,
         "Hypothesis seed (default: a fresh one, printed in the header)", kind="int"),
    _Opt("attn_device", "--attn-device", "attn_device", "ATTNVERIFY_DEVICE", "auto",
         "device cases are made on: auto (cuda where claimed and present), cpu, cuda", choices=DEVICES),
    _Opt("attn_max_examples", "--attn-max-examples", "attn_max_examples", "ATTNVERIFY_MAX_EXAMPLES", None,
         "examples per property (overrides the profile)", kind="int"),
    _Opt("attn_isolate", "--attn-isolate", "attn_isolate", "ATTNVERIFY_ISOLATE", "auto",
         "judge each example in a forked child so a crash or hang costs one case: auto, subprocess, none",
         choices=ISOLATES),
    _Opt("attn_timeout", "--attn-timeout", "attn_timeout", "ATTNVERIFY_TIMEOUT", DEFAULT_TIMEOUT,
         "seconds one example may take under subprocess isolation before it fails as a timeout (0: none)",
         kind="float"),
    _Opt("attn_only", "--attn-only", "attn_only", "ATTNVERIFY_ONLY", False,
         "collect only the attnverify suite, not the repo's own tests", kind="flag"),
    _Opt("attn_allow_untested", "--attn-allow-untested", "attn_allow_untested", "ATTNVERIFY_ALLOW_UNTESTED", False,
         "let a run pass in which an adapter tested nothing (unavailable here, or every property skipped); "
         "by default such a run fails", kind="flag"),
    _Opt("attn_max_bugs", "--attn-max-bugs", "attn_max_bugs", "ATTNVERIFY_MAX_BUGS", None,
         "distinct bugs to look for per property: after a failure the search goes on outside the found bug's "
         "needs (default: the profile's, 1 in ci, 3 in dev and thorough)", kind="int"),
    _Opt("attn_shard", "--attn-shard", "attn_shard", "ATTNVERIFY_SHARD", None,
         "run only shard K of N (e.g. 2/4): a stable slice of the (adapter, property) pairs; N jobs cover the run"),
    _Opt("attn_prewarm", "--attn-prewarm", "attn_prewarm", "ATTNVERIFY_PREWARM", False,
         "before the run, compile what it will launch, in parallel on every core, for adapters with a JIT (the bundled "
         "triton on a GPU; attnverify.prewarm); changes no verdict", kind="flag"),
    _Opt("attn_prewarm_budget", "--attn-prewarm-budget", "attn_prewarm_budget", "ATTNVERIFY_PREWARM_BUDGET", None,
         f"seconds the pre-warm may take (default {DEFAULT_BUDGET_S:g}, or a quarter of --session-timeout if less); "
         "when they end the run starts and compiles the rest itself; on the command line it turns the pre-warm on, "
         "from the environment or the ini file it only bounds one"),
    _Opt("attn_db", "--attn-db", "attn_db", "ATTNVERIFY_DB", None,
         "shared example database beside the local one: redis://HOST:PORT/N or github:OWNER/REPO[/ARTIFACT]"),
)


def add_options(parser) -> None:
    """The options (group "attnverify") and their ini keys."""
    group = parser.getgroup("attnverify", "attnverify: attention correctness and fuzz testing")
    for o in OPTIONS:
        env = f" [env {o.env}, ini {o.ini}]"
        if o.kind == "list":
            group.addoption(o.flag, action="append", dest=o.dest, default=None, metavar="NAME", help=o.help + env)
        elif o.kind == "flag":
            group.addoption(o.flag, action="store_true", dest=o.dest, default=None, help=o.help + env)
        else:
            group.addoption(o.flag, dest=o.dest, default=None, choices=o.choices,
                            metavar=o.flag.split("-")[-1].upper() if not o.choices else None, help=o.help + env)
        parser.addini(o.ini, o.help, type="string", default="")


def _raw_value(config, o: _Opt):
    v = config.getoption(o.dest, default=None)
    if v not in (None, []):
        return v, o.flag
    ev = os.environ.get(o.env)
    if ev not in (None, ""):
        return ev, o.env
    try:
        iv = config.getini(o.ini)
    except (ValueError, KeyError):
        iv = ""
    if iv not in (None, ""):
        return iv, f"ini {o.ini}"
    return o.default, None


def _convert(o: _Opt, v, source):
    if v is None:
        return None
    try:
        if o.kind == "list":
            items = v if isinstance(v, list) else [v]
            out = []
            for x in items:
                out += [s.strip() for s in str(x).split(",") if s.strip()]
            return out
        if o.kind == "flag":
            return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on")
        if o.kind == "int":
            return int(v)
        if o.kind == "float":
            return float(v)
    except ValueError:
        raise pytest.UsageError(f"{source}={v!r}: expected {'an integer' if o.kind == 'int' else 'a number'}") from None
    v = str(v)
    if o.choices and v not in o.choices:
        raise pytest.UsageError(f"{source}={v!r}: choose from {', '.join(o.choices)}")
    return v


def option_values(config) -> Dict[str, Any]:
    out = {}
    for o in OPTIONS:
        raw, src = _raw_value(config, o)
        out[o.dest] = _convert(o, raw, src or o.flag)
    return out


class Hookspecs:
    @pytest.hookspec
    def pytest_attnverify_adapters(self, config):
        """Return an iterable of attnverify Adapters to register (so --adapter finds them by name)."""

    @pytest.hookspec
    def pytest_attnverify_properties(self, config):
        """Return an iterable of extra attnverify Property objects to run for every adapter."""
