"""benchmarks/repro_sdpa_dropout.py --flash (F13's H200 script), run on the CPU with the GPU call replaced by a
stand-in that keeps exactly FlashAttention-2's 8-bit probability: every part prints JSON (the H200 run of
2026-12-04 ended in 'Object of type int64 is not JSON serializable' after the repeats), and a part that fails
prints its error while the others still print, the exit status then 1."""
import importlib.util
import json
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("scipy")

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _load():
    spec = importlib.util.spec_from_file_location("repro_sdpa_dropout", BENCH / "repro_sdpa_dropout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _eight_bit(backend, dtype, n, p, seed, heads=2):
    """What the flash backend returns with q = 0, v = 1: each row's kept count / (n (1-p)), at the 8-bit keep rate."""
    keep = (int(255 * (1 - p)) + 1) / 256
    return torch.full((1, heads, n), keep / (1 - p), dtype=torch.float64)


def _lines(out):
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")]


def test_flash_repeats_prints_every_part_as_json(monkeypatch, capsys):
    mod = _load()
    monkeypatch.setattr(mod, "run", _eight_bit)
    assert mod.flash_repeats(1) == 0
    rows = _lines(capsys.readouterr().out)
    assert [r["p"] for r in rows if "f13_repeats" in r] == [0.9, 0.1, 0.5]
    tests = [r for r in rows if "property_test" in r]
    assert len(tests) == 4 and all(type(r["flagged"]) is int for r in tests)
    # the 1024 x 1024 draws at p = 0.9 see the bias in every seed; 18,818 draws at p = 0.1 in none
    assert {(r["p"], r["n"]): r["flagged"] for r in tests}[(0.9, 1024)] == 200
    assert {(r["p"], r["n"]): r["flagged"] for r in tests}[(0.1, 97)] == 0


def test_a_failing_part_does_not_hide_the_others(monkeypatch, capsys):
    mod = _load()

    def sometimes(backend, dtype, n, p, seed, heads=2):
        if heads == 4:
            raise RuntimeError("No available kernel")
        return _eight_bit(backend, dtype, n, p, seed, heads)

    monkeypatch.setattr(mod, "run", sometimes)
    assert mod.flash_repeats(1) == 1
    out = capsys.readouterr().out
    assert "ERROR in the property test at p=0.9 heads=4 n=383: RuntimeError: No available kernel" in out
    assert len([r for r in _lines(out) if "property_test" in r]) == 3
    assert "1 part(s) of the script failed" in out


def test_plain_turns_numpy_scalars_into_numbers():
    mod = _load()
    got = mod.plain({"flagged": np.int64(3), "ok": np.bool_(True), "zs": [np.float64(1.5)], "s": "x"})
    assert json.dumps(got) == '{"flagged": 3, "ok": true, "zs": [1.5], "s": "x"}'
    with pytest.raises(TypeError):
        json.dumps({"flagged": np.int64(3)})  # what the H200 run ended in
