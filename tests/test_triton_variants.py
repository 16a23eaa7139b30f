"""The Triton kernel's speed candidates (kernels/variants.py, issue 25) against the float64 reference.

Each candidate is switched on the way a developer would (ATTNVERIFY_TRITON_VARIANT, read when the adapter
makes its default configuration) and the built-in `triton` adapter is judged by attnverify.check, forward
and backward. The cases are the ones where a candidate could go wrong: a late key tile whose scores tower
over the earlier ones (lazy rescaling must rescale there, and must not before), a masked tail and a
padded head dim (TMA's zero fill), causal launches in reverse order (LPT), softcap (FMA must stand aside).
`benchmarks/perf_candidates.py`'s selection rule is checked on made-up timings.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the bundled kernel cannot run", allow_module_level=True)

import attnverify as av  # noqa: E402
from attnverify.adapters.triton_adapter import triton as triton_adapter  # noqa: E402

if not _CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1: the kernel cannot run here", allow_module_level=True)

from attnverify.kernels import launch, variants  # noqa: E402
from attnverify.spec import Spec  # noqa: E402

DEV = "cuda" if _CUDA else "cpu"
CASES = [
    # keys from 100 on scaled x6: the row max jumps by far more than 8 (log2) in the second key tile
    dict(heads_q=2, len_q=70, len_k=150, head_dim=32, dtype="float16", causal="bottom_right", late_from=100,
         late_boost=6.0),
    dict(heads_q=2, heads_kv=1, len_q=90, len_k=77, head_dim=40, head_dim_v=24, dtype="bfloat16", causal="top_left"),
    dict(heads_q=2, len_q=66, len_k=66, head_dim=32, dtype="float32", softcap=5.0),
]


@pytest.mark.parametrize("names", ["fma", "lazy", "tma", "lpt", "ws", "nospec", "fma,lazy,tma,lpt", "aligned,rtmask"])
def test_each_candidate_matches_the_reference(monkeypatch, names):
    monkeypatch.setenv(variants.ENV, names)
    cfg = launch.default_config(32, torch.float16, DEV)
    assert variants.names(cfg) == names  # the switch reached the configuration the adapter uses
    for i, fields in enumerate(CASES):
        res = av.check(triton_adapter, av.build_case(av.CaseRecipe(device=DEV, return_lse=True, seed=i, **fields)))
        assert res.status == "passed", (names, fields, res.message())
        assert {"out", "lse", "dq", "dk", "dv"} <= {c.name for c in res.comparisons}


def test_lazy_rescaling_differs_from_eager_only_by_rounding(monkeypatch):
    """A stale reference max changes P's scale (so its rounding), never the result beyond rounding; a lost
    rescale (the late tile's growth ignored) would be off by far more (its scores overflow past 2**8)."""
    monkeypatch.delenv(variants.ENV, raising=False)
    case = av.build_case(av.CaseRecipe(device=DEV, seed=3, **CASES[0]))
    eager, lse0, _ = launch.forward(case.q, case.k, case.v, case.spec)
    monkeypatch.setenv(variants.ENV, "lazy")
    lazy, lse1, _ = launch.forward(case.q, case.k, case.v, case.spec)
    fin = torch.isfinite(lse0)
    assert torch.equal(fin, torch.isfinite(lse1))
    torch.testing.assert_close(lse1[fin], lse0[fin], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lazy.float(), eager.float(), rtol=4e-3, atol=4e-3)


def test_unknown_variant_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(variants.ENV, "fma,fast")
    with pytest.raises(ValueError, match="ATTNVERIFY_TRITON_VARIANT: unknown variant 'fast'.*fma, lazy"):
        launch.default_config(64, torch.float16, DEV)
    assert variants.parse(" none ") == {}
    assert variants.parse("LPT,tma") == {"lpt": True, "fwd_tma": True}


def test_nospec_strides_zero_only_size_one_dims():
    t = torch.empty(1, 3, 1, 8)
    assert variants.strides(t) == (0, 8, 0, 1)
    assert variants.strides(torch.empty(2, 1, 5, 1)) == (5, 0, 1, 1)  # the last dim keeps its stride


def _switches(cfg_names, q, k, v, spec):
    from dataclasses import replace

    p = launch.prepare(q, k, v, spec)
    cfg = replace(launch.INTERPRETER_CONFIG, **variants.parse(cfg_names))  # whatever the environment says
    dims = dict(BLOCK_D=launch.triton_next_pow2(p.d), BLOCK_DV=launch.triton_next_pow2(p.dv))
    out = variants.fwd_switches(cfg, p, k, v, cfg.block_n, dims, True)
    return {n: x for n, x in out.items() if not n.startswith("DESC")}


def test_switches_apply_only_where_exact():
    q, k = torch.randn(1, 2, 20, 32), torch.randn(1, 2, 30, 32)
    every = "fma,lazy,tma,lpt"
    assert _switches(every, q, k, k, Spec(causal="top_left")) == dict(FMA=True, LAZY=True, TMA=True, WS=False,
                                                                         LPT=True)
    assert _switches(every, q, k, k, Spec())["LPT"] is False  # nothing to balance without a causal mask
    assert _switches(every, q, k, k, Spec(softcap=3.0))["FMA"] is False  # max(tanh) is not max * c
    assert _switches(every, q, k, k, Spec(scale=-0.5))["FMA"] is False  # max(x * c) != max(x) * c for c < 0
    assert _switches(every, q, k[:, :, :0], k[:, :, :0], Spec())["TMA"] is False  # TMA needs every dim >= 1
    odd = torch.randn(1, 2, 30, 33)[..., :32]  # row stride 33 elements: not 16-byte aligned
    assert _switches(every, q, odd, odd, Spec())["TMA"] is False
    assert _switches("", q, k, k, Spec(causal="top_left")) == dict(FMA=False, LAZY=False, TMA=False, WS=False,
                                                                   LPT=False)


def _perf_candidates():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                        "perf_candidates.py")
    spec = importlib.util.spec_from_file_location("perf_candidates", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(n, figs, wrong=(), sdpa=300.0):
    cands = {nm: dict(text=nm, errors={}, failure=None, correct=nm not in wrong, fwd=[f], fwd_bwd=[])
             for nm, f in figs.items()}
    return dict(group="fwd64", dtype="float16", d=64, causal=1, n=n, cands=cands, sdpa_fwd=[sdpa], sdpa_fwd_bwd=[])


def test_perf_candidates_recommends_only_a_correct_candidate_that_wins_everywhere():
    pc = _perf_candidates()
    rows = [_row(8192, {"default": 380.0, "fma": 400.0, "lazy": 450.0, "lpt": 420.0}, wrong={"lazy"}),
            _row(16384, {"default": 390.0, "fma": 405.0, "lazy": 460.0, "lpt": 375.0}, wrong={"lazy"})]
    rep = pc.summarise(rows)
    # lazy is fastest but wrong; lpt gains 10.5% once and loses 3.8% once; fma gains 4-5% on both
    assert rep["recommend"]["fwd64"]["candidate"] == "fma"
    assert "RECOMMEND fwd64: fma" in rep["text"]
    assert "lazy !" in rep["text"]
    flat = [_row(8192, {"default": 380.0, "fma": 381.0}), _row(16384, {"default": 390.0, "fma": 389.0})]
    assert pc.summarise(flat)["recommend"]["fwd64"]["candidate"] == "default"  # within noise: no change
