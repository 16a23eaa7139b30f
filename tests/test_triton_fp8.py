"""fp8 inputs with descales in the bundled Triton forward kernel (issue 23; kernels/fp8.py, adapters/triton_fp8.py).

On a CPU the kernel runs under the Triton interpreter (3.9+), whose fp32 -> fp8 conversion does not round (the
kernel rounds P by hand there, `common._round_fp8`); on a GPU of compute capability 8.9+ the dots take fp8
operands. Tests: the hand rounding against torch's round-to-nearest-even, the kernel against naive's FA3-like fp8
path (the same arithmetic: bitwise on one tile) and the float64 reference, each descale applied where it belongs,
the claim decided at claim time (sm_89+ / interpreter 3.9+), no backward, a bf16 call launched exactly as before,
and a user's conftest adapter over the bundled kernel claiming e4m3 + descales only: its fp8 properties pass, and
the same kernel with v's descale dropped fails them.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the bundled kernel cannot run", allow_module_level=True)

import attnverify as av  # noqa: E402
from attnverify.adapters.registry import get  # noqa: E402
from attnverify.adapters.triton_fp8 import FP8_CLAIMS, fp8_claims  # noqa: E402

if not _CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1: the kernel cannot run here", allow_module_level=True)

from attnverify.kernels import fp8 as kfp8, launch  # noqa: E402
from attnverify.kernels.autograd import flash_attention  # noqa: E402
from attnverify.kernels.common import _lowp  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def cast(X, Z, N: tl.constexpr):  # fp32 -> Z's dtype as the kernel casts P under the interpreter
    o = tl.arange(0, N)
    tl.store(Z + o, _lowp(tl.load(X + o), Z.dtype.element_ty, True))

DEV = "cuda" if _CUDA else "cpu"
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
TRITON = get("triton")
FP8_HERE = E4M3 in TRITON.claims.dtypes
needs_fp8 = pytest.mark.skipif(not FP8_HERE, reason="the triton adapter claims no fp8 here (a GPU below sm_89, or a "
                                                    "Triton interpreter older than 3.9: adapters/triton_fp8.py)")


def _case(**kw):
    base = dict(batch=2, heads_q=4, heads_kv=2, len_q=9, len_k=37, head_dim=32, dtype=E4M3, descales="random",
                return_lse=True, device=DEV, seed=5)
    return av.build_case(av.CaseRecipe(**{**base, **kw}))


@pytest.mark.skipif(_CUDA, reason="the hand rounding runs only under the interpreter")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_interpreter_rounds_p_to_fp8_to_nearest_even(dtype):
    g = torch.Generator().manual_seed(0)
    n = 1 << 14
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0) & (grid <= 1)].sort().values
    ties = (grid[1:] + grid[:-1]) / 2  # halfway between neighbours: to the even one
    x = torch.cat([torch.rand(n, generator=g), torch.rand(n, generator=g) ** 12, grid, ties, -ties]).contiguous()
    m = 1 << (x.numel() - 1).bit_length()
    x = torch.cat([x, torch.zeros(m - x.numel())])
    z = torch.empty(m, dtype=dtype)
    cast[(1,)](x, z, m)
    want = x.to(dtype).float()
    bad = z.float() != want
    assert not bad.any(), (x[bad][:4].tolist(), z.float()[bad][:4].tolist(), want[bad][:4].tolist())


@needs_fp8
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("kw", [
    dict(),
    dict(descales="amax", layout="v_colmajor", causal="bottom_right"),
    dict(descales="pow2", dominant_key=3, dominant_gap=12.0, head_dim=72, softcap=5.0),
    dict(descales="uniform", head_dim=16, heads_q=2, heads_kv=1, window=(5, 0)),
    dict(descales=None, len_q=20, len_k=20),
], ids=["random", "colmajor-causal", "dominant-softcap-d72", "d16-gqa-window", "no-descales"])
def test_fp8_forward_is_naive_fa3_arithmetic_and_within_the_reference(dtype, kw):
    c = _case(dtype=dtype, **kw)
    out, lse = flash_attention(c.q, c.k, c.v, c.spec)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    nv = get("naive")(c.q, c.k, c.v, c.spec)
    # one key tile (Lk <= 64): the running max is the row max, so the same P is rounded: the same answer
    if _CUDA:
        _only_p_rounding_flips(out, nv.out.to(out.device), c)
    else:
        torch.testing.assert_close(out.float(), nv.out.float(), rtol=0, atol=1e-6)
    res = av.check(TRITON, c)
    assert res.passed, res.message()
    assert [x.name for x in res.comparisons] == ["out", "lse"]  # forward only


def _only_p_rounding_flips(out, nv_out, c):
    """On a GPU the fp8 dots sum in another order than naive's (Hopper's fp8 MMA accumulates with a shorter
    mantissa) and exp2 is the hardware's: a score that lands near a rounding boundary of P's fp8 grid rounds to the
    neighbouring fp8 value (measured on the H200: 2-16 elements of 2,304-5,120 beyond 1e-2, at most 0.033 off; on
    2026-12-05, 4-5 of the 72 rows of the 9-query cases had one). Such a flip moves one probability by one fp8
    step, below 1 at most 2^-4 (e4m3) or 2^-3 (e5m2), so an element of out by at most that step times the largest
    |V| (dequantised) over the row sum (>= 1): elsewhere two bf16 ulps. Flips are rare per element, so at most a
    quarter of the rows may have one; P rounded the wrong way everywhere (truncated, say) moves nearly every row."""
    a, b = out.float(), nv_out.float()
    bf16_ok = (a - b).abs() <= 2 * 2.0**-8 * b.abs() + 1e-6
    v = c.v.float() * (1.0 if c.spec.v_descale is None else c.spec.v_descale.float()[:, :, None, None].to(c.v.device))
    step = 2.0**-4 if c.q.dtype == torch.float8_e4m3fn else 2.0**-3
    flip = step * float(v.abs().max()) + 2 * 2.0**-8 * float(b.abs().max())
    assert float((a - b).abs().max()) <= flip, (float((a - b).abs().max()), flip)
    rows = (~bf16_ok).any(-1)
    assert int(rows.sum()) <= max(2, rows.numel() // 4), (int(rows.sum()), rows.numel())


@needs_fp8
def test_the_gpu_flip_allowance_rejects_a_small_error_on_every_row():
    """_only_p_rounding_flips (the GPU's comparison with naive) must not pass an output off by a few bf16 ulps on
    every row, though each element is within the flip bound."""
    c = _case(dtype=E4M3)
    nv = get("naive")(c.q, c.k, c.v, c.spec).out
    _only_p_rounding_flips(nv.clone(), nv, c)  # itself: passes
    few = nv.float().clone()
    few[0, 0, :2] *= 1 + 2.0**-5  # two rows moved by a flip-sized step: passes
    _only_p_rounding_flips(few.to(nv.dtype), nv, c)
    off = (nv.float() * (1 + 2.0**-5) + 1e-3).to(nv.dtype)  # every row a few bf16 ulps off
    with pytest.raises(AssertionError):
        _only_p_rounding_flips(off, nv, c)


@needs_fp8
def test_fp8_with_sinks_and_several_key_tiles_is_within_the_reference():
    for dtype in (E4M3, E5M2):
        c = _case(dtype=dtype, len_q=70, len_k=130, head_dim=128, sinks={"kind": "dominant", "level": 2.0, "seed": 3})
        res = av.check(TRITON, c)
        assert res.passed, res.message()


@needs_fp8
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_each_descale_is_applied(which):
    """Doubling one descale: the kernel matches the reference of the doubled values (v's: out exactly twice, the
    same LSE); the kernel with that descale dropped fails the check."""
    c = _case(descales="uniform")
    d = getattr(c.spec, f"{which}_descale")
    doubled = dataclasses.replace(c, spec=c.spec.replace(**{f"{which}_descale": d * 2}))
    res = av.check(TRITON, doubled)
    assert res.passed, res.message()
    if which == "v":
        out, lse = flash_attention(c.q, c.k, c.v, doubled.spec)
        same, lse1 = flash_attention(c.q, c.k, c.v, c.spec)
        assert torch.equal(out.float(), same.float() * 2) and torch.equal(lse, lse1)
    wrong = av.adapter(f"triton-drops-{which}", register=False, dtypes=(E4M3,), descales=True, gqa=True, lse=True,
                       devices=(DEV,))(
        lambda q, k, v, s: av.Output(*flash_attention(q, k, v, s.replace(**{f"{which}_descale": None}))))
    assert not av.check(wrong, doubled).passed


def test_fp8_claim_is_decided_at_claim_time(monkeypatch):
    from attnverify.adapters import triton_fp8

    assert fp8_claims(False, "3.9.0") == FP8_CLAIMS
    assert fp8_claims(False, "3.6.0") == {} and fp8_claims(False, None) == {}
    monkeypatch.setattr(triton_fp8, "cuda_capabilities", lambda: [(9, 0)])
    assert fp8_claims(True, "3.6.0") == FP8_CLAIMS
    monkeypatch.setattr(triton_fp8, "cuda_capabilities", lambda: [(9, 0), (8, 0)])  # every GPU must have fp8
    assert fp8_claims(True, "3.6.0") == {}
    monkeypatch.setattr(triton_fp8, "cuda_capabilities", lambda: None)  # unknown: not claimed
    assert fp8_claims(True, "3.9.0") == {}
    # importing the adapter module asks nothing of the machine (a fresh interpreter: the adapter is unresolved)
    import subprocess

    code = "import attnverify.adapters.triton_adapter as t; print(t.triton.resolved)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert r.stdout.split()[0] == "False", r.stdout + r.stderr


def test_no_backward_and_small_key_tiles_refused_naming_why():
    c = _case()
    with pytest.raises(NotImplementedError, match="forward only"):
        launch.backward(c.q, c.k, c.v, None, None, None, None, c.spec)
    with pytest.raises(ValueError, match="block_n >= 32"):
        launch.forward(c.q, c.k, c.v, c.spec, block_n=16)
    with pytest.raises(ValueError, match="float8_e4m3fn, float8_e5m2 forward only"):
        launch.prepare(c.q.to(torch.float64), c.k.to(torch.float64), c.v.to(torch.float64), c.spec)


def test_a_bf16_call_launches_the_kernel_as_before():
    """Without fp8 and descales the forward gets no extra argument: the compiled non-fp8 kernel is unchanged."""
    c = _case(dtype="bfloat16", descales=None)
    p = launch.prepare(c.q, c.k, c.v, c.spec)
    assert p.descales is None and kfp8.launch_kwargs(p, c.q.dtype, 64) == {}
    assert kfp8.min_tile(torch.bfloat16) == 16 and kfp8.out_dtype(torch.bfloat16) == torch.bfloat16
    assert launch._head_dims(p, kfp8.min_tile(c.q.dtype)) == launch._head_dims(p)


def test_fp8_v_goes_to_the_gpu_kernel_column_major():
    """Hopper's 8-bit wgmma reads K-major operands only: a row-major fp8 V is copied column-major on CUDA (same values),
    a column-major one and every non-fp8 or CPU V are passed as they are."""
    v8 = torch.randn(2, 3, 40, 32).to(torch.float8_e4m3fn)
    assert kfp8.v_for_dot(v8) is v8  # CPU: the interpreter reads any layout
    vb = torch.randn(2, 3, 40, 32, dtype=torch.bfloat16)
    assert kfp8.v_for_dot(vb) is vb
    if _CUDA:
        g = kfp8.v_for_dot(v8.cuda())
        assert g.stride(-2) == 1 and torch.equal(g.float().cpu(), v8.float())
        cm = v8.cuda().transpose(-1, -2).contiguous().transpose(-1, -2)
        assert kfp8.v_for_dot(cm) is cm


def test_fp8_serving_calls_are_refused_by_the_adapter():
    c = _case()
    for spec in (c.spec.replace(num_splits=2), c.spec.replace(q_descale=None, k_descale=None, v_descale=None,
                                                               num_splits=1)):
        assert "decode path" in (TRITON.refuses(dataclasses.replace(c, spec=spec)) or "")
    assert TRITON.refuses(c) is None


CONFTEST = '''
"""A user's fp8 kernel: attnverify's bundled Triton forward, claiming what its docstring says of fp8: e4m3fn with
FA3's descales, head dims 32..128, GQA, causal none/bottom-right, LSE; forward only."""
import torch
import attnverify as av
from attnverify.kernels import flash_attention

DEVICES = ("cuda",) if torch.cuda.is_available() else ("cpu",)


@av.adapter("my-triton-fp8", dtypes=("float8_e4m3fn",), descales=True, head_dims=lambda d: 32 <= d <= 128,
            causal=("none", "bottom_right"), gqa=True, lse=True, devices=DEVICES, max_seqlen=256)
def my_triton_fp8(q, k, v, spec):
    out, lse = flash_attention(q, k, v, spec)
    return av.Output(out, lse=lse if spec.return_lse else None)


@av.adapter("my-triton-fp8-broken", dtypes=("float8_e4m3fn",), descales=True, head_dims=lambda d: 32 <= d <= 128,
            causal=("none", "bottom_right"), gqa=True, lse=True, devices=DEVICES, max_seqlen=256)
def broken(q, k, v, spec):  # the v descale dropped on the way to the kernel (vllm #51363's garbage)
    out, lse = flash_attention(q, k, v, spec.replace(v_descale=None))
    return av.Output(out, lse=lse if spec.return_lse else None)
'''


@needs_fp8
def test_a_users_conftest_adapter_over_the_kernel_holds_and_a_dropped_descale_fails(pytester):
    pytester.makeconftest(CONFTEST)
    args = ("-v", "-k", "fp8 or descale", "--attn-only", "--attn-profile=ci", "--attn-max-examples=4", "-p", "no:randomly")
    res = pytester.runpytest_subprocess("--adapter=my-triton-fp8", *args)
    out = res.stdout.str()
    assert res.ret == 0, out
    res.stdout.fnmatch_lines(["*test_fp8_matches_reference?my-triton-fp8? PASSED*",
                              "*test_descale_linearity?my-triton-fp8? PASSED*"])
    res = pytester.runpytest_subprocess("--adapter=my-triton-fp8-broken", *args)
    out = res.stdout.str()
    assert res.ret == 1, out
    assert "test_fp8_matches_reference[my-triton-fp8-broken] FAILED" in out
