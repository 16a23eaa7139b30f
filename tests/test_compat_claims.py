"""docs/compatibility.md's claims audit and the built-in adapters' declared claims stay in step (issue 24).

Under "## Claims audit" every built-in adapter has a section "### `NAME`" (or "### `NAME` (CPU)" /
"### `NAME` (CUDA)" for the SDPA adapters, whose claims follow the device) with a table
`| claim | what the library documents | what was measured |`; the claim cell is `` `key=value` ``. Every
claim (each field of Claims but the head-dim predicate, the length cap and the tiles) has exactly one row --
a feature left unclaimed too, since a claim narrower than the library's documentation is what the audit
is for -- and the row's value is the adapter's. The claims are computed here
for the device a section names (CUDA ones with cuda_present patched), so the table cannot drift from code.
One test per table: on a GPU machine the tables of adapters that fix their device at import (triton, flex, jax)
document the CPU CI's claims and are skipped there, saying so; every other table is compared on any machine.
"""
from __future__ import annotations

import dataclasses
import os
import re

import pytest

from attnverify.adapters import base as adapters_base
from attnverify.adapters.base import Claims
from attnverify.adapters.registry import BUILTINS, get

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "compatibility.md")
NOT_TABLED = ("head_dims", "max_seqlen", "tiles", "page_sizes")  # predicates and caps: said in the module docstrings
SDPA_DEVICE = {"sdpa", "sdpa-math", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn"}


def _fmt(value) -> str:
    if isinstance(value, tuple):
        return ",".join(str(x) for x in value)
    return str(value)


def expected_rows(c: Claims) -> dict:
    return {f.name: _fmt(getattr(c, f.name)) for f in dataclasses.fields(Claims) if f.name not in NOT_TABLED}


def parse_audit(text: str) -> dict:
    """{(name, device or None): {claim: value}} from the "## Claims audit" section."""
    start = text.index("## Claims audit")
    end = text.find("\n## ", start + 10)
    section = text[start:end if end > 0 else None]
    out, current = {}, None
    for line in section.splitlines():
        m = re.match(r"^### `([^`]+)`(?: \((CPU|CUDA)\))?", line)
        if m:
            current = (m.group(1), m.group(2))
            if current in out:
                raise AssertionError(f"two claims tables for {current}")
            out[current] = {}
            continue
        m = re.match(r"^\| `([a-z_]+)=([^`]*)` \|", line)
        if m and current is not None:
            key, value = m.group(1), m.group(2)
            if key in out[current]:
                raise AssertionError(f"{current}: the claim {key} has two rows")
            out[current][key] = value
    return out


def claims_for(name: str, device, monkeypatch) -> Claims:
    from attnverify.adapters import sdpa as sdpa_mod

    if name in SDPA_DEVICE:
        monkeypatch.setattr(sdpa_mod, "cuda_present", lambda: device == "CUDA")
        return sdpa_mod._claims(get(name)._backend)
    return get(name).claims


def _tables() -> dict:
    with open(DOC, encoding="utf-8") as f:
        return parse_audit(f.read())


def test_every_builtin_has_a_claims_table():
    tables = _tables()
    names = {n for n, _ in tables}
    assert set(BUILTINS) <= names, f"no claims table for {sorted(set(BUILTINS) - names)}"
    assert names <= set(BUILTINS), f"claims tables for unknown adapters {sorted(names - set(BUILTINS))}"
    for name in SDPA_DEVICE:
        assert any(n == name and d for n, d in tables), f"{name}: say the device in its heading, (CPU) or (CUDA)"


@pytest.mark.parametrize("key", sorted(_tables(), key=lambda k: (k[0], k[1] or "")),
                         ids=lambda k: f"{k[0]}-{k[1] or 'any'}")
def test_a_claims_table_rows_are_the_declared_claims(key, monkeypatch):
    name, device = key
    rows = _tables()[key]
    want = expected_rows(claims_for(name, device, monkeypatch))
    if rows != want and name not in SDPA_DEVICE and rows.get("devices") != want.get("devices"):
        from attnverify.devices import cuda_present

        if cuda_present():
            # the SDPA tables are computed per device (cuda_present patched); triton, flex and jax pick their device
            # (and with it dtypes and findings) once, at import, from the GPU present: their table documents the
            # claims of the CPU CI, which this GPU machine cannot compute. The CPU CI runs this comparison.
            pytest.skip(f"{name}: its table documents devices={rows.get('devices')} (the CPU CI's claims); on this "
                        f"GPU machine the adapter claims devices={want.get('devices')}, chosen at import")
    extra = {k: v for k, v in rows.items() if want.get(k) != v}
    missing = {k: v for k, v in want.items() if rows.get(k) != v}
    assert rows == want, f"{name} ({device or 'any'}): the table says {extra}, the adapter claims {missing}"


def test_the_parser_sees_a_drifted_table(monkeypatch):
    """The check fails when a row disagrees with the code, when a claim has no row and when a row names a claim the
    adapter does not make."""
    want = expected_rows(get("naive").claims)
    good = "## Claims audit\n\n### `naive`\n\n| claim | documents | measured |\n|---|---|---|\n" + "".join(
        f"| `{k}={v}` | x | y |\n" for k, v in want.items())
    assert parse_audit(good)[("naive", None)] == want
    assert parse_audit(good.replace("`gqa=True`", "`gqa=False`"))[("naive", None)] != want
    assert parse_audit(good.replace("| `gqa=True` | x | y |\n", ""))[("naive", None)] != want
    with pytest.raises(AssertionError, match="two rows"):
        parse_audit(good + "| `gqa=True` | x | y |\n")
    narrowed = dataclasses.replace(get("naive").claims, gqa=False)
    assert expected_rows(narrowed) != want  # narrowing a claim in code breaks the table too


def test_sdpa_claims_follow_the_torch_version_lazily(monkeypatch):
    """The claims are computed on first use for the installed torch: 2.3 has no enable_gqa and NaN fully-masked
    rows; the CPU flash kernel of 2.5 refuses enable_gqa; its declared findings of torch 2.3 are present only there."""
    from attnverify.adapters import sdpa as sdpa_mod

    monkeypatch.setattr(sdpa_mod, "cuda_present", lambda: False)
    for tv, gqa_default, gqa_flash, fm in (((2, 3), False, False, "nan"), ((2, 5), True, False, "zeros"),
                                           ((2, 13), True, True, "zeros")):
        monkeypatch.setattr(sdpa_mod, "_torch_version", lambda tv=tv: tv)
        assert sdpa_mod._claims("default").gqa is gqa_default, tv
        assert sdpa_mod._claims("flash").gqa is gqa_flash, tv
        assert sdpa_mod._claims("math").fully_masked == fm, tv
        old = "forward_matches_reference" in sdpa_mod._known_failures("flash")
        assert old is (tv < (2, 4)), tv
    fresh = sdpa_mod._SdpaAdapter("flash", name="t", fn=lambda *a: None)
    assert not fresh.resolved  # nothing computed until asked
    monkeypatch.setattr(sdpa_mod, "_torch_version", lambda: (2, 3))
    assert fresh.claims.gqa is False and fresh.resolved
    assert "fully_masked_rows" in fresh.known_failures and "fully_masked_rows" in fresh.known_patterns


def test_cuda_claims_widened_to_what_pytorch_documents(monkeypatch):
    from attnverify.adapters import sdpa as sdpa_mod

    monkeypatch.setattr(sdpa_mod, "cuda_present", lambda: True)
    assert sdpa_mod._claims("cudnn").attn_mask is True
    assert sdpa_mod._claims("default").fully_masked == "zeros"
    assert sdpa_mod._claims("cudnn").fully_masked == "zeros"
    for backend in ("cudnn", "default"):
        kf = sdpa_mod._known_failures(backend)
        assert "F26" in kf["fully_masked_rows"]["why"]
    assert adapters_base  # the module the patterns are validated by
