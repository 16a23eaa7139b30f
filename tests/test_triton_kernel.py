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
    assert set(c.dtypes) == {"float16", "bfloat16", "float32"}
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
    return max(fwd, bwd)


@pytest.mark.parametrize("d,dv", [(96, 160), (160, 96), (128, 128), (256, 256), (40, 256)])
def test_gpu_tiles_follow_the_larger_head_dim(monkeypatch, d, dv):
    # D = 96 with Dv = 160 got the D <= 128 tiles and asked 241 KiB of shared memory on the H200 (227 KiB)
    from attnverify.kernels import launch

    monkeypatch.setattr(launch, "interpreting", lambda: False)
    cfg = launch.default_config(d, torch.float16, "cuda", dv)
    assert cfg == launch.default_config(max(d, dv), torch.float16, "cuda")
    bd, bdv = launch.triton_next_pow2(d), launch.triton_next_pow2(dv)
    assert _smem_fwd_bwd(cfg, bd, bdv, 2) <= 227 * 1024


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
