"""The bundled Triton kernel against the float64 reference (attnverify.check).

On a CPU the kernels run under the Triton interpreter: TRITON_INTERPRET=1 is set here, before the
kernel module is first imported (it must be set before the @triton.jit functions are defined).
Shapes are small and tiles large, because the interpreter costs milliseconds per loop iteration.
GPU tests (marker `gpu`) run the same checks on CUDA at larger sizes and skip without a GPU.
"""
from __future__ import annotations

import os
import subprocess
import sys

import importlib.util

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA and "triton" not in sys.modules:
    # must happen before triton itself is imported (triton reads it at import, not only at @jit)
    os.environ.setdefault("TRITON_INTERPRET", "1")
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the bundled kernel cannot run", allow_module_level=True)

import attnverify as av  # noqa: E402
from attnverify.adapters.triton_adapter import triton as triton_adapter  # noqa: E402

if not _CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1: the kernel cannot run here", allow_module_level=True)

from attnverify.kernels.autograd import flash_attention  # noqa: E402

DEV = "cuda" if _CUDA else "cpu"  # the CPU-sized checks run on the GPU too when there is one


def _check(**kw):
    recipe = av.CaseRecipe(device=kw.pop("device", DEV), **kw)
    res = av.check(triton_adapter, av.build_case(recipe))
    assert res.status == "passed", res.message()
    names = {c.name for c in res.comparisons}
    assert {"out", "dq", "dk", "dv"} <= names, names  # backward was compared too
    if recipe.return_lse:
        assert "lse" in names
    return res


# (id, recipe fields): a spread of features x dtypes, odd lengths, Lq != Lk both ways
CASES = [
    ("plain-f32-odd", dict(batch=2, heads_q=2, len_q=37, len_k=53, head_dim=32, dtype="float32")),
    ("plain-f16-lq>lk", dict(batch=1, heads_q=2, len_q=70, len_k=33, head_dim=64, dtype="float16")),
    ("plain-bf16-lq<lk", dict(batch=1, heads_q=2, len_q=19, len_k=81, head_dim=64, dtype="bfloat16")),
    ("d40-dv24-f32", dict(heads_q=2, len_q=45, len_k=67, head_dim=40, head_dim_v=24, dtype="float32")),
    ("d40-dv24-bf16-causalbr", dict(heads_q=2, len_q=45, len_k=67, head_dim=40, head_dim_v=24, dtype="bfloat16",
                                    causal="bottom_right")),
    ("d80-f16", dict(heads_q=1, len_q=33, len_k=33, head_dim=80, dtype="float16")),
    ("d8-f32", dict(heads_q=2, len_q=21, len_k=30, head_dim=8, dtype="float32")),
    ("d256-bf16", dict(heads_q=1, len_q=20, len_k=70, head_dim=256, head_dim_v=128, dtype="bfloat16")),
    ("lq1-f16", dict(heads_q=2, len_q=1, len_k=90, head_dim=32, dtype="float16", causal="bottom_right")),
    ("lk1-bf16", dict(heads_q=2, len_q=40, len_k=1, head_dim=32, dtype="bfloat16")),
    ("causal-tl-f32-lq>lk", dict(heads_q=2, len_q=75, len_k=50, head_dim=32, dtype="float32", causal="top_left")),
    ("causal-tl-bf16-lq<lk", dict(heads_q=2, len_q=50, len_k=75, head_dim=32, dtype="bfloat16", causal="top_left")),
    ("causal-br-f16-lq>lk", dict(heads_q=2, len_q=80, len_k=30, head_dim=32, dtype="float16", causal="bottom_right")),
    ("window-f32", dict(heads_q=2, len_q=70, len_k=70, head_dim=32, dtype="float32", window=(9, 4))),
    ("window-left-only-bf16", dict(heads_q=2, len_q=40, len_k=100, head_dim=32, dtype="bfloat16", window=(20, -1))),
    ("window-right-only-f16-causal", dict(heads_q=2, len_q=60, len_k=45, head_dim=32, dtype="float16",
                                          window=(-1, 3), causal="top_left")),
    ("softcap-f32", dict(heads_q=2, len_q=40, len_k=70, head_dim=32, dtype="float32", softcap=2.0, q_std=3.0)),
    ("softcap-bf16-causal", dict(heads_q=2, len_q=66, len_k=66, head_dim=64, dtype="bfloat16", softcap=10.0,
                                 causal="bottom_right")),
    ("alibi-f16", dict(heads_q=4, len_q=50, len_k=70, head_dim=32, dtype="float16", alibi=True)),
    ("alibi-bf16-window-softcap", dict(heads_q=2, len_q=70, len_k=50, head_dim=32, dtype="bfloat16", alibi=True,
                                       window=(12, 5), softcap=3.0)),
    ("gqa-f32", dict(batch=2, heads_q=4, heads_kv=2, len_q=35, len_k=67, head_dim=32, dtype="float32",
                     causal="bottom_right")),
    ("mqa-bf16", dict(heads_q=4, heads_kv=1, len_q=40, len_k=40, head_dim=48, dtype="bfloat16", causal="top_left")),
    ("scale-f16", dict(heads_q=2, len_q=30, len_k=30, head_dim=32, dtype="float16", scale=0.3)),
    ("varlen-f16", dict(heads_q=2, heads_kv=1, len_q=81, len_k=95, head_dim=32, dtype="float16",
                        seqlens_q=[10, 0, 41, 30, 0], seqlens_k=[0, 7, 41, 17, 30], causal="bottom_right")),
    ("varlen-bf16-window-alibi", dict(heads_q=2, len_q=90, len_k=90, head_dim=32, dtype="bfloat16",
                                      seqlens_q=[65, 25], seqlens_k=[65, 25], window=(10, 0), alibi=True)),
    ("varlen-f32-top-left", dict(heads_q=2, len_q=70, len_k=50, head_dim=24, dtype="float32",
                                 seqlens_q=[35, 35], seqlens_k=[20, 30], causal="top_left")),
    ("late-tile-f16", dict(heads_q=1, len_q=40, len_k=130, head_dim=32, dtype="float16", late_from=100,
                           late_boost=6.0)),
    # every score shifted by -150: LSE ~ -150, so a zero-loaded tail key would give exp(0 - lse) = inf
    ("row-shift-f32-tail", dict(heads_q=2, len_q=40, len_k=75, head_dim=32, dtype="float32", row_shift=-150.0)),
    ("row-shift-bf16-causal", dict(heads_q=2, len_q=75, len_k=75, head_dim=32, dtype="bfloat16", row_shift=-150.0,
                                   causal="top_left")),
    ("layout-transposed-bf16", dict(heads_q=2, len_q=33, len_k=47, head_dim=32, dtype="bfloat16",
                                    layout="transposed")),
    ("layout-expanded-kv-f16", dict(heads_q=2, heads_kv=2, len_q=33, len_k=47, head_dim=32, dtype="float16",
                                    layout="expanded_kv")),
]


@pytest.mark.parametrize("fields", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_matches_reference(fields):
    _check(return_lse=True, seed=len(str(fields)), **fields)


def test_lse_not_returned_unless_asked():
    res = _check(heads_q=2, len_q=20, len_k=20, head_dim=32, dtype="float32", return_lse=False)
    assert "lse" not in {c.name for c in res.comparisons}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_fully_masked_rows_are_zero_with_neg_inf_lse_and_zero_grads(dtype):
    # bottom-right causal with Lq > Lk: the first Lq - Lk rows see no key; plus a window that hides rows
    case = av.build_case(av.CaseRecipe(heads_q=2, heads_kv=1, len_q=50, len_k=20, head_dim=32, dtype=dtype,
                                       causal="bottom_right", window=(3, 0), return_lse=True, device=DEV))
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (case.q, case.k, case.v))
    out, lse = flash_attention(q, k, v, case.spec)
    dead = 50 - 20
    assert torch.equal(out[:, :, :dead], torch.zeros_like(out[:, :, :dead]))
    assert torch.isneginf(lse[:, :, :dead]).all()
    assert torch.isfinite(lse[:, :, dead:]).all()
    (out.float().sum() + lse[:, :, dead:].sum()).backward()
    assert torch.equal(q.grad[:, :, :dead], torch.zeros_like(q.grad[:, :, :dead]))
    assert all(torch.isfinite(g).all() for g in (q.grad, k.grad, v.grad))
    _check(heads_q=2, heads_kv=1, len_q=50, len_k=20, head_dim=32, dtype=dtype, causal="bottom_right",
           window=(3, 0), return_lse=True)


TILES = [(16, 16), (32, 64), (64, 16), (128, 32)]


@pytest.mark.parametrize("tiles", TILES, ids=[f"{m}x{n}" for m, n in TILES])
def test_tile_partition(tiles):
    """Every (BLOCK_M, BLOCK_N) gives the reference's answer (forward and backward tiles)."""

    @av.adapter("triton-tiles", register=False, **{f: getattr(triton_adapter.claims, f) for f in (
        "dtypes", "devices", "head_dims", "max_seqlen", "causal", "window", "softcap", "alibi", "gqa", "varlen",
        "backward", "lse", "dv_ne_d", "fully_masked")})
    def tiled(q, k, v, spec):
        out, lse = flash_attention(q, k, v, spec, tiles=tiles, bwd_tiles=tiles)
        return av.Output(out, lse if spec.return_lse else None)

    for fields in (
        dict(heads_q=2, heads_kv=1, len_q=77, len_k=61, head_dim=24, dtype="float32", causal="bottom_right",
             window=(20, 7), alibi=True),
        dict(heads_q=2, len_q=50, len_k=97, head_dim=32, dtype="bfloat16", causal="top_left", softcap=4.0),
        dict(heads_q=2, len_q=64, len_k=64, head_dim=32, dtype="float16",
             seqlens_q=[17, 0, 47], seqlens_k=[33, 15, 16], causal="bottom_right"),
    ):
        res = av.check(tiled, av.build_case(av.CaseRecipe(device=DEV, return_lse=True, **fields)))
        assert res.status == "passed", res.message()


def test_tile_choices_agree_closely():
    """Different partitions differ only by rounding (fp32): a dropped or doubled tile would not."""
    case = av.build_case(av.CaseRecipe(heads_q=2, len_q=70, len_k=90, head_dim=32, dtype="float32",
                                       causal="bottom_right", device=DEV))
    outs = [flash_attention(case.q, case.k, case.v, case.spec, tiles=t)[0] for t in TILES]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-5)


def test_backward_is_deterministic():
    assert triton_adapter.claims.deterministic
    case = av.build_case(av.CaseRecipe(heads_q=4, heads_kv=1, len_q=70, len_k=70, head_dim=32, dtype="float16",
                                       causal="top_left", device=DEV))
    runs = []
    for _ in range(2):
        q, k, v = (t.detach().clone().requires_grad_(True) for t in (case.q, case.k, case.v))
        out, lse = flash_attention(q, k, v, case.spec)
        out.backward(torch.ones_like(out))
        runs.append((out.detach(), q.grad, k.grad, v.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_wrong_semantics_are_caught():
    """The checks can fail: the kernel run with top-left alignment on a bottom-right case must fail."""

    @av.adapter("triton-wrong", register=False, dtypes=("float32",), devices=triton_adapter.claims.devices,
                causal=("bottom_right",), backward=True)
    def wrong(q, k, v, spec):
        return flash_attention(q, k, v, spec.replace(causal="top_left"))[0]

    res = av.check(wrong, av.build_case(av.CaseRecipe(heads_q=1, len_q=20, len_k=40, head_dim=16,
                                                      dtype="float32", causal="bottom_right", device=DEV)))
    assert res.status == "failed"


def test_claims_are_what_the_kernel_does():
    c = triton_adapter.claims
    fp8 = {"float8_e4m3fn", "float8_e5m2"}  # claimed where the fp8 path runs (sm_89+ GPUs, Triton's interpreter 3.9+)
    assert set(c.dtypes) - fp8 == {"float16", "bfloat16", "float32"}
    assert set(c.dtypes) & fp8 in (set(), fp8)
    assert bool(c.descales) == bool(set(c.dtypes) & fp8)
    assert set(c.causal) == {"none", "top_left", "bottom_right"}
    assert c.window and c.softcap and c.alibi and c.gqa and c.varlen and c.backward and c.lse and c.dv_ne_d
    assert not c.attn_mask and not c.dropout
    assert c.fully_masked == "zeros"
    from attnverify.kernels.launch import INTERPRETER_CONFIG, default_config

    cfg = default_config(128, torch.bfloat16, "cuda" if _CUDA else "cpu")
    assert c.tiles == (cfg.block_m, cfg.block_n)
    if not _CUDA:
        assert c.tiles == (INTERPRETER_CONFIG.block_m, INTERPRETER_CONFIG.block_n)
    assert triton_adapter.unavailable_reason() is None


def _smem_fwd_bwd(cfg, bd: int, bdv: int, elem: int) -> int:
    """Shared memory the pipelined tiles need, roughly as Triton allocates it (operand tiles per stage)."""
    fwd = (cfg.block_m * bd + cfg.num_stages * cfg.block_n * (bd + bdv)) * elem
    bwd = (cfg.bwd_block_n * (bd + bdv) + cfg.bwd_stages * cfg.bwd_block_m * (bd + bdv)) * elem
    qm, qn, _, qs = cfg.dq()
    dq = (qm * (bd + bdv) + qs * qn * (bd + bdv)) * elem
    return max(fwd, bwd, dq)


@pytest.mark.parametrize("d,dv", [(96, 160), (160, 96), (128, 128), (256, 256), (40, 256)])
def test_gpu_tiles_follow_the_larger_head_dim(monkeypatch, d, dv):
    # D = 96 with Dv = 160 got the D <= 128 tiles and asked 241 KiB of shared memory on the H200 (227 KiB)
    from attnverify.kernels import launch

    monkeypatch.setattr(launch, "interpreting", lambda: False)
    cfg = launch.default_config(d, torch.float16, "cuda", dv)
    assert cfg == launch.default_config(max(d, dv), torch.float16, "cuda")
    bd, bdv = launch.triton_next_pow2(d), launch.triton_next_pow2(dv)
    assert _smem_fwd_bwd(cfg, bd, bdv, 2) <= 227 * 1024


def test_gpu_configs_use_each_kernels_own_tiles(monkeypatch):
    """The dQ kernel has its own tiles where tuned (D <= 64, D = 256), else dK/dV's transposed; an explicit
    bwd_tiles override (the tile-partition test) sets both kernels, dQ transposed."""
    from attnverify.kernels import launch

    monkeypatch.setattr(launch, "interpreting", lambda: False)
    small, mid = launch.default_config(64, torch.bfloat16, "cuda"), launch.default_config(128, torch.bfloat16, "cuda")
    assert small.dq()[:2] != (small.bwd_block_n, small.bwd_block_m)
    assert mid.dq() == (mid.bwd_block_n, mid.bwd_block_m, mid.bwd_warps, mid.bwd_stages)
    assert launch.INTERPRETER_CONFIG.dq()[:2] == (64, 64)


def test_import_hygiene():
    code = ("import sys, attnverify, attnverify.kernels, attnverify.adapters.triton_adapter\n"
            "assert 'triton' not in sys.modules, 'importing attnverify imported triton'\n")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------- GPU (CUDA) ---------------------------------

gpu = pytest.mark.skipif(not _CUDA, reason="needs a CUDA GPU (the Triton kernels are compiled for it)")

GPU_FEATURES = [
    dict(),
    dict(causal="top_left"),
    dict(causal="bottom_right", len_q=700, len_k=1100),
    dict(causal="bottom_right", len_q=1100, len_k=700),
    dict(window=(100, 17)),
    dict(softcap=20.0, alibi=True, causal="bottom_right"),
    dict(heads_q=8, heads_kv=2),
    dict(head_dim=40, head_dim_v=24),
    dict(head_dim=256, len_q=300, len_k=500),
    dict(head_dim=96, causal="top_left"),
    dict(seqlens_q=[100, 0, 517, 400], seqlens_k=[333, 200, 0, 484], len_q=1017, len_k=1017, batch=1,
         causal="bottom_right"),
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("feat", GPU_FEATURES, ids=[str(i) for i in range(len(GPU_FEATURES))])
def test_gpu_matches_reference(dtype, feat):
    fields = dict(batch=2, heads_q=4, heads_kv=4, len_q=1000, len_k=1000, head_dim=128, dtype=dtype,
                  return_lse=True, device="cuda")
    fields.update(feat)
    _check(**fields)


@gpu
@pytest.mark.gpu
def test_gpu_backward_deterministic():
    case = av.build_case(av.CaseRecipe(batch=2, heads_q=8, heads_kv=2, len_q=1500, len_k=1500, head_dim=128,
                                       dtype="bfloat16", causal="top_left", device="cuda"))
    runs = []
    for _ in range(3):
        q, k, v = (t.detach().clone().requires_grad_(True) for t in (case.q, case.k, case.v))
        out, _ = flash_attention(q, k, v, case.spec)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out))
        runs.append((out.detach(), q.grad, k.grad, v.grad))
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a, b)


# ---------------------------------------------------------------- perf gate (benchmarks/perf_gate.py) ---------

def _perf_gate():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "perf_gate.py")
    spec = importlib.util.spec_from_file_location("perf_gate", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench_result(triton_fwd, triton_fb, flash=(100.0, 100.0), cudnn=(200.0, 200.0), triton_check="ok"):
    rows = [{"adapter": "triton", "n": 4096, "fwd_tflops": triton_fwd, "fwd+bwd_tflops": triton_fb},
            {"adapter": "sdpa-flash", "n": 4096, "fwd_tflops": flash[0], "fwd+bwd_tflops": flash[1]}]
    if cudnn:
        rows.append({"adapter": "sdpa-cudnn", "n": 4096, "fwd_tflops": cudnn[0], "fwd+bwd_tflops": cudnn[1]})
    else:
        rows.append({"adapter": "sdpa-cudnn", "n": 4096, "error": "RuntimeError: No available kernel"})
    adapters = [{"adapter": "triton", "check": {"status": triton_check, "text": triton_check}, "proof": {"ok": True}},
                {"adapter": "sdpa-flash", "check": {"status": "ok"}, "proof": {"ok": True}},
                {"adapter": "sdpa-cudnn", "check": {"status": "failed", "text": "FAILED (dq)"}, "proof": {"ok": True}}]
    return {"rows": rows, "adapters": adapters, "meta": {"date": "2026-12-04 12:00:00", "versions": {"gpu": "X"}}}


GATE_MINS = {"fwd vs sdpa-flash": 1.3, "fwd+bwd vs sdpa-flash": 1.0, "fwd vs sdpa-cudnn": 0.0,
             "fwd+bwd vs sdpa-cudnn": 0.0}


def test_perf_gate_judges_ratios_against_thresholds():
    pg = _perf_gate()
    ok = pg.rows_from_bench(_bench_result(130.0, 100.0), "bfloat16", 128, False)[0]
    assert ok["ratio"]["fwd vs sdpa-flash"] == pytest.approx(1.3)
    assert ok["ratio"]["fwd+bwd vs sdpa-cudnn"] == pytest.approx(0.5)
    assert pg.judge(ok, GATE_MINS) == []  # at the thresholds; cuDNN's failed check is only a note
    assert any("sdpa-cudnn" in n for n in ok["notes"])
    slow_fwd = pg.rows_from_bench(_bench_result(129.0, 150.0), "bfloat16", 128, False)[0]
    assert pg.judge(slow_fwd, GATE_MINS) == ["fwd vs sdpa-flash 1.29x < 1.30x"]
    slow_bwd = pg.rows_from_bench(_bench_result(200.0, 99.0), "bfloat16", 128, True)[0]
    assert pg.judge(slow_bwd, GATE_MINS) == ["fwd+bwd vs sdpa-flash 0.99x < 1.00x"]
    # the stretch targets gate only when asked for
    assert pg.judge(ok, dict(GATE_MINS, **{"fwd vs sdpa-cudnn": 0.9})) == ["fwd vs sdpa-cudnn 0.65x < 0.90x"]
    # a fast kernel whose correctness check failed does not pass
    wrong = pg.rows_from_bench(_bench_result(500.0, 500.0, triton_check="failed"), "bfloat16", 128, False)[0]
    assert pg.judge(wrong, GATE_MINS) and "triton check" in pg.judge(wrong, GATE_MINS)[0]
    # a baseline that did not run shows '-' and does not gate; triton not running fails
    no_cudnn = pg.rows_from_bench(_bench_result(130.0, 100.0, cudnn=None), "float16", 256, True)[0]
    assert no_cudnn["ratio"]["fwd vs sdpa-cudnn"] is None and pg.judge(no_cudnn, GATE_MINS) == []
    unmeasured = pg.rows_from_bench(_bench_result(None, None), "float16", 64, False)[0]
    assert pg.judge(unmeasured, GATE_MINS) == ["triton not measured"]
    for r in (ok, slow_fwd, no_cudnn):
        r["why"] = pg.judge(r, GATE_MINS)
    md = pg.to_markdown([ok, slow_fwd, no_cudnn], {"date": "2026-12-04 12:00", "versions": {"gpu": "NVIDIA H200"}},
                        GATE_MINS)
    assert md.startswith("### Perf gate 2026-12-04 12:00")
    head = md.splitlines()[4]
    for col in ("fwd vs sdpa-flash", "fwd+bwd vs sdpa-flash", "fwd vs sdpa-cudnn", "fwd+bwd vs sdpa-cudnn"):
        assert f" {col} |" in head
    assert "| 1.30x | 1.00x | 0.65x | 0.50x | pass |" in md
    assert "**FAIL** fwd vs sdpa-flash 1.29x < 1.30x" in md and "| - | - | pass |" in md
    assert "2 of 3 configurations pass" in md


@pytest.mark.skipif(_CUDA, reason="with a GPU the triton adapter claims only CUDA; this reads a CPU bench run")
def test_perf_gate_reads_a_real_bench_run(tmp_path):
    """The gate's reading of `attnverify bench` output, on a real (tiny, CPU) run: the interpreted kernel is
    far slower than CPU SDPA, so the gate must fail it; cuDNN is unavailable and shows as '-'."""
    pg = _perf_gate()
    cmd = pg.bench_command("float32", 16, False, [32], str(tmp_path), ["--device", "cpu", "--batch", "1", "--heads",
                                                                         "1", "--rep", "3", "--warmup", "1"])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    with open(tmp_path / "bench.json") as f:
        rows = pg.rows_from_bench(json.load(f), "float32", 16, False)
    assert [row["n"] for row in rows] == [32]
    row = rows[0]
    assert row["tflops"]["triton fwd"] > 0 and row["tflops"]["sdpa-flash fwd+bwd"] > 0
    assert row["ratio"]["fwd vs sdpa-cudnn"] is None
    assert row["ratio"]["fwd vs sdpa-flash"] < 1.0
    assert any(w.startswith("fwd vs sdpa-flash") for w in pg.judge(row, GATE_MINS))


def test_perf_gate_says_why_it_skips_without_a_gpu(capsys):
    pg = _perf_gate()
    if _CUDA:
        assert pg.gpu_absent_reason() is None
        return
    assert pg.main(["--dims", "64"]) == 0
    out = capsys.readouterr().out
    assert "SKIPPED" in out and "no CUDA GPU" in out
    assert pg.main(["--require-gpu"]) == 2
    assert pg.main(["--dtypes", "fp8"]) == 2  # a usage error names the arguments


# ------------------------------------------------------------------------------ sinks (issue 23)


def _sink_case(seed, **kw):
    from attnverify.properties.sinks import with_sinks

    fields = dict(heads_q=4, heads_kv=2, len_q=37, len_k=53, head_dim=32, dtype="float32", return_lse=True)
    fields.update(kw)
    c = av.build_case(av.CaseRecipe(device=DEV, seed=seed, **fields))
    return with_sinks(c, {"sinks": {"kind": "mixed", "level": 2.0, "seed": seed}})


@pytest.mark.parametrize("kw", [dict(), dict(causal="bottom_right", dtype="bfloat16"),
                                dict(len_k=0), dict(len_q=60, len_k=60, seqlens_q=[20, 0, 40], seqlens_k=[30, 10, 20],
                                                    causal="bottom_right", dtype="float16")],
                         ids=["plain-f32", "causal-bf16", "no-keys", "varlen-f16"])
def test_sinks_forward_and_sink_gradient_match_the_reference(kw):
    """out, LSE and every gradient (the sink's included) against the float64 reference, -inf sinks among them."""
    from attnverify.reference import reference_backward, reference_forward

    c = _sink_case(len(str(kw)), **kw)
    sinks = c.spec.sinks.clone().requires_grad_(True)
    spec = c.spec.replace(sinks=sinks)
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (c.q, c.k, c.v))
    out, lse = flash_attention(q, k, v, spec)
    ref = reference_forward(c.q, c.k, c.v, c.spec)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref.lse))
    fin = torch.isfinite(ref.lse)
    assert torch.allclose(lse[fin].double(), ref.lse[fin], atol=1e-3, rtol=1e-3)
    tol = 1e-4 if c.q.dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double(), ref.out, atol=tol, rtol=tol)
    g = torch.Generator().manual_seed(1)
    d_out = torch.randn(out.shape, generator=g).to(out)
    d_lse = torch.where(fin, torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.device),
                        torch.zeros((), dtype=torch.float64, device=lse.device))
    gq, gk, gv, gs = torch.autograd.grad((out * d_out).sum() + (lse.nan_to_num(0, 0, 0) * d_lse.float()).sum(),
                                         (q, k, v, sinks))
    rg = reference_backward(c.q, c.k, c.v, c.spec, d_out.double(), d_lse)
    for got, want in ((gq, rg.dq), (gk, rg.dk), (gv, rg.dv)):
        assert torch.allclose(got.double(), want, atol=10 * tol, rtol=10 * tol)
    assert torch.allclose(gs.double(), rg.dsinks.nan_to_num(0.0), atol=1e-3, rtol=1e-3), (gs, rg.dsinks)


@pytest.mark.parametrize("prop", ["sinks_match_reference", "sink_limits"])
def test_sink_properties_hold_and_reject_a_kernel_that_drops_the_sink(prop):
    import warnings

    from attnverify.properties import get_property
    from attnverify.properties.driver import run_property

    def run(adapter):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return run_property(get_property(prop), adapter, profile="ci", seed=0, database=None,
                                report_dir="reports/test", max_examples=4)

    res = run(triton_adapter)
    assert res.statuses.get("passed", 0) >= 3, res.statuses

    @av.adapter("triton-no-sink", register=False, dtypes=("float32",), devices=triton_adapter.claims.devices,
                causal=("none", "bottom_right"), lse=True, backward=True, sinks=True, head_dims=(16, 32, 64))
    def dropped(q, k, v, spec):
        out, lse = flash_attention(q, k, v, spec.replace(sinks=None))
        return av.Output(out, lse=lse if spec.return_lse else None)

    if prop == "sinks_match_reference":  # (sink_limits needs rows without keys, which 4 examples may not draw)
        with pytest.raises(AssertionError, match=prop):
            run(dropped)
