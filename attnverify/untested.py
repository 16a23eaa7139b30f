"""A run that tests nothing fails: the rule and its message (used by the pytest plugin).

An adapter was requested (`--adapter mine`), its properties were collected, and not one of them ran:
the adapter is unavailable here (no claimed device present, its library missing), or its claims leave
every collected property skipped. A CI job in that state would be green while checking nothing, so
the session's exit status becomes non-zero (pytest's NO_TESTS_COLLECTED, 5; `attnverify run` exits 2)
with a message that says why and how to fix it, unless the user asks for the old behaviour with
`--attn-allow-untested` (ini `attn_allow_untested`, environment `ATTNVERIFY_ALLOW_UNTESTED=1`).
"""
from __future__ import annotations

from typing import Dict, Iterable, List

import pytest

# outcomes of a property that ran (a known finding ran too: it was judged, shrunk and saved)
RAN = ("passed", "failed", "known", "error")
EXIT_UNTESTED = pytest.ExitCode.NO_TESTS_COLLECTED
ALLOW_HINT = ("to accept a run that tests nothing, pass --attn-allow-untested "
              "(ini attn_allow_untested, environment ATTNVERIFY_ALLOW_UNTESTED=1)")


def untested_adapters(outcomes: Iterable[dict]) -> Dict[str, List[str]]:
    """adapter name -> the distinct skip reasons, for every adapter none of whose collected properties ran.

    `outcomes` are the plugin's per-item records ({"adapter", "outcome", "message", ...}); adapters
    whose items were all deselected (-k) never appear in them and are not counted."""
    seen: Dict[str, List[str]] = {}
    ran = set()
    for info in outcomes:
        name = info.get("adapter")
        if name is None:
            continue
        reasons = seen.setdefault(name, [])
        if info.get("outcome") in RAN:
            ran.add(name)
        elif info.get("outcome") == "skipped":
            why = _reason(info.get("message"))
            if why and why not in reasons:
                reasons.append(why)
    return {n: r for n, r in seen.items() if n not in ran}


def _reason(message) -> str:
    text = str(message or "").strip()
    for prefix in ("Skipped: ", "PropertySkipped: ", "SkipTest: "):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text


def _fixes(reasons: List[str], allowed: bool) -> List[str]:
    text = " ".join(reasons)
    device = any(w in text for w in ("unavailable", "device", "cuda", "CUDA", "GPU"))
    out = []
    if device:
        out += [
            "run it where a claimed device is present (a GPU runner for a CUDA-only kernel, --attn-device=cuda);",
            "or claim every device the kernel really runs on: a Triton kernel runs on a CPU under Triton's "
            "interpreter (export TRITON_INTERPRET=1 before anything imports triton, and add \"cpu\" to devices=);",
        ]
    out.append("or claim what the kernel implements (dtypes, head_dims, causal, backward, ...): a property needs "
               "its features claimed; `attnverify adapters` prints each adapter's claims and docs/adapters.md "
               "lists the keywords;")
    if not allowed:
        out.append(ALLOW_HINT + ".")
    return out


def untested_message(untested: Dict[str, List[str]], counts: Dict[str, int], allowed: bool = False) -> List[str]:
    """The lines printed at the end of a run in which `untested` adapters tested nothing."""
    lines = []
    for name, reasons in untested.items():
        n = counts.get(name, 0)
        verdict = ("allowed by --attn-allow-untested" if allowed
                   else "so this run fails (a gate that checks nothing must not pass)")
        lines.append(f"NOTHING WAS TESTED for adapter {name}: all {n} of its properties were skipped; {verdict}.")
        for why in reasons[:5] or ["(no reason recorded)"]:
            lines.append(f"  why: {why}")
        if len(reasons) > 5:
            lines.append(f"  ... and {len(reasons) - 5} other reasons (the report's matrix lists them all)")
        for i, fix in enumerate(_fixes(reasons, allowed)):
            lines.append(("  fix: " if i == 0 else "       ") + fix)
    return lines


def fail_if_untested(session, outcomes: List[dict], allowed: bool) -> List[str]:
    """Set the session's exit status when an adapter tested nothing (unless `allowed`); returns the
    lines that say so (empty when every adapter ran at least one property)."""
    untested = untested_adapters(outcomes)
    if not untested:
        return []
    counts: Dict[str, int] = {}
    for info in outcomes:
        counts[info.get("adapter")] = counts.get(info.get("adapter"), 0) + 1
    if not allowed and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = EXIT_UNTESTED
    return untested_message(untested, counts, allowed=allowed)
