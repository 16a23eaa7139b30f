"""The `nospec` twins' compile-count variants (issue 25): `aligned` (tile strides not specialised; the host says whether
they are 16-byte multiples) and `rtmask` (causal, bottom-right, window and sinks at run time). Opt-in, each implies `nospec`.

- Switches: each implies nospec, `spec` with one is refused, a Config with one and not nospec is refused; no default
  configuration has either (the perf gate times them first).
- The host's alignment rule (`variants.align`): 16 bytes in elements only for unit last strides and multiples.
- Bit-identical out, LSE, dQ, dK, dV (and dsinks) to the default kernels under the interpreter, across the feature
  flags (causal both ways, window, softcap, ALiBi, sinks, varlen, GQA, dLSE) and layouts the alignment rule refuses;
  the comparison fails when the run-time flags or the alignment are wrong (so it can catch a broken variant).
- The point, through Triton's real binder for sm_90 (the stand-in driver; nothing compiled): calls that differ only in
  mask flags launch one forward kernel with `rtmask`; in lengths and head counts that change the stride classes, one
  with `aligned`.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the bundled kernel cannot run", allow_module_level=True)

from attnverify.kernels import launch, variants  # noqa: E402
from attnverify.spec import Spec  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTERP = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="compares under the interpreter (CPU)")


def test_each_implies_nospec_and_spec_with_one_is_refused(monkeypatch):
    assert variants.parse("aligned") == {"aligned": True, "nospec": True}
    assert variants.parse("rtmask,fma") == {"rtmask": True, "fwd_fma": True, "nospec": True}
    with pytest.raises(ValueError, match="spec"):
        variants.parse("spec,aligned")
    with pytest.raises(ValueError, match="needs nospec"):
        replace(launch.INTERPRETER_CONFIG, rtmask=True)
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setenv(variants.ENV, "aligned,rtmask")
    cfg = launch.default_config(128, torch.bfloat16, "cuda")
    assert cfg.nospec and cfg.aligned and cfg.rtmask and variants.names(cfg) == "aligned,rtmask"
    monkeypatch.delenv(variants.ENV)
    for d, dt in ((64, torch.float16), (128, torch.bfloat16), (256, torch.bfloat16), (40, torch.float32)):
        cfg = launch.default_config(d, dt, "cuda")
        assert not cfg.aligned and not cfg.rtmask, (d, dt)  # opt-in until the perf gate has timed them
    assert not launch.default_config(64, torch.float16, "cpu").aligned


def test_alignment_is_16_bytes_of_unit_stride_rows():
    x = torch.empty(2, 3, 5, 64, dtype=torch.float16)
    assert variants.align([x], [variants.strides(x)]) == 8
    assert variants.align([x.float()], [variants.strides(x.float())]) == 4
    odd = torch.empty(2, 3, 5, 68, dtype=torch.float16)[..., :64]  # rows of 68 elements: 136 bytes
    assert variants.align([odd], [variants.strides(odd)]) == 0
    t = x.transpose(-1, -2)  # head dim not contiguous
    assert variants.align([t], [variants.strides(t)]) == 0
    assert variants.align([x], [(2 ** 31, 8, 8, 1)]) == 0  # divided, it would change Triton's int type
    assert variants.align([x, x.float()], [variants.strides(x)] * 2) == 0  # one element size per launch
    cfg = replace(launch.INTERPRETER_CONFIG, nospec=True, aligned=True)
    st, kw = variants.tile_args(cfg, [x])
    assert st == [5 * 64 * 3 // 8, 5 * 64 // 8, 64 // 8, 1] and kw == {"ALIGNED": 8}
    assert variants.tile_args(cfg, [odd]) == ([3 * 5 * 68, 5 * 68, 68, 1], {"ALIGNED": 0})
    assert variants.tile_args(replace(cfg, aligned=False), [x]) == ([960, 320, 64, 1], {})


def test_rtmask_bits_and_flags():
    cfg = replace(launch.INTERPRETER_CONFIG, nospec=True, rtmask=True)
    flags = dict(IS_CAUSAL=True, CAUSAL_BR=False, HAS_WINDOW=False, HAS_SOFTCAP=True, HAS_ALIBI=False, IS_VARLEN=True,
                 HAS_SINKS=True)
    kw, rt = variants.rtmask_args(cfg, flags)
    assert rt == {"RTF": 0b1001}  # causal, sinks
    assert all(kw[n] is True for n in ("IS_CAUSAL", "CAUSAL_BR", "HAS_WINDOW", "HAS_SINKS"))
    # compile-time still: softcap and ALiBi (a branch in the key loop fails Triton 3.6's pipeliner), varlen
    assert kw["HAS_SOFTCAP"] is True and kw["HAS_ALIBI"] is False and kw["IS_VARLEN"] is True
    assert variants.rtmask_args(replace(cfg, rtmask=False), flags) == (flags, {})
    assert variants.lpt(replace(launch.INTERPRETER_CONFIG, lpt=True), flags) is True
    assert variants.lpt(replace(launch.INTERPRETER_CONFIG, lpt=True), dict(flags, IS_CAUSAL=False)) is False
    assert variants.lpt(replace(cfg, lpt=True), dict(flags, IS_CAUSAL=False)) is True  # no split on causality


# (B, Hq, Hkv, Lq, Lk, D, Dv, dtype, spec keywords, layout): layout "odd" = views with 16-byte-unaligned row strides
# (ALIGNED = 0), "t" = K and V with a non-unit head-dim stride
CASES = [
    (1, 2, 1, 48, 64, 24, 16, torch.bfloat16, dict(causal="bottom_right"), ""),
    (1, 4, 2, 65, 40, 32, 32, torch.float16, dict(causal="top_left", return_lse=True), ""),
    (2, 3, 3, 17, 70, 16, 32, torch.float32, dict(window=(5, 3)), ""),
    (2, 2, 2, 33, 50, 32, 32, torch.float16, dict(softcap=4.0, alibi=True, window=(-1, 7)), "odd"),
    (1, 2, 2, 40, 31, 16, 16, torch.float16, dict(sinks=True, causal="top_left"), "t"),
    (1, 2, 1, 0, 0, 32, 32, torch.bfloat16, dict(varlen=True, causal="bottom_right", alibi=True), ""),
]


def _inputs(case):
    b, hq, hkv, lq, lk, d, dv, dt, kw, layout = CASES[case]
    g = torch.Generator().manual_seed(case)
    kw = dict(kw)
    if kw.pop("varlen", False):
        cu_q, cu_k = [0, 17, 40, 41], [0, 30, 30, 66]
        lq, lk = cu_q[-1], cu_k[-1]
        kw.update(cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32), cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
                  max_seqlen_q=23, max_seqlen_k=36)
    pad = 3 if layout == "odd" else 0

    def make(*shape):
        return torch.randn(*shape[:-1], shape[-1] + pad, generator=g).to(dt)[..., :shape[-1]]

    q, k, v = make(b, hq, lq, d), make(b, hkv, lk, d), make(b, hkv, lk, dv)
    if layout == "t":
        k = k.transpose(-1, -2).contiguous().transpose(-1, -2)
        v = v.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(hq, generator=g)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(hq, generator=g)
    d_out = make(b, hq, lq, dv)
    d_lse = torch.randn(b, hq, lq, generator=g) if kw.get("return_lse") else None
    return q, k, v, d_out, d_lse, Spec(**kw)


def _run(case, cfg):
    q, k, v, d_out, d_lse, spec = _inputs(case)
    out, lse, p = launch.forward(q, k, v, spec, config=cfg)
    d_sinks = torch.zeros(q.shape[1]) if spec.sinks is not None else None
    grads = launch.backward(q, k, v, out, lse, d_out, d_lse, spec, prep=p, config=cfg, d_sinks=d_sinks)
    return dict(zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse, *grads, d_sinks)))


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return torch.equal(a, b) or (torch.isnan(a).equal(torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def _differing(got, want) -> list:
    return [n for n in want if not _same(got[n], want[n])]


VARIANTS = {"aligned": dict(nospec=True, aligned=True), "rtmask": dict(nospec=True, rtmask=True),
            "both": dict(nospec=True, aligned=True, rtmask=True)}


@INTERP
@pytest.mark.parametrize("case", range(len(CASES)))
def test_variants_give_bit_identical_outputs(case):
    want = _run(case, launch.INTERPRETER_CONFIG)
    for name, fields in VARIANTS.items():
        got = _run(case, replace(launch.INTERPRETER_CONFIG, lpt=True, **fields))  # lpt: any program order, same
        assert not _differing(got, want), (name, _differing(got, want))


@INTERP
def test_the_comparison_fails_on_wrong_run_time_flags_or_a_wrong_alignment(monkeypatch):
    """The identity above is not vacuous: the rtmask twins read their flags from RTF (a dropped causal bit, or an added
    bottom-right bit flipped, changes the outputs) and the aligned twins trust the host's ALIGNED (claimed for rows of 35 elements,
    the strides are divided and multiplied back wrong)."""
    real = variants.rtmask_args
    want = _run(0, launch.INTERPRETER_CONFIG)  # causal bottom-right
    rt = replace(launch.INTERPRETER_CONFIG, **VARIANTS["rtmask"])
    for wrong in (lambda bits: bits & ~1, lambda bits: bits ^ 2):
        monkeypatch.setattr(variants, "rtmask_args", lambda cfg, flags, w=wrong: (
            lambda kw, r: (kw, {"RTF": w(r["RTF"])} if r else r))(*real(cfg, flags)))
        assert {"out", "dq", "dk", "dv"} <= set(_differing(_run(0, rt), want))
    monkeypatch.setattr(variants, "rtmask_args", real)
    want = _run(3, launch.INTERPRETER_CONFIG)  # "odd" layout: ALIGNED = 0 by the rule
    monkeypatch.setattr(variants, "align", lambda tensors, sts: max(1, 16 // tensors[0].element_size()))
    assert {"out", "dq", "dk", "dv"} <= set(_differing(_run(3, replace(launch.INTERPRETER_CONFIG, **VARIANTS["aligned"])),
                                                       want))


_KEYS = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import standin_driver; standin_driver.install(cuda_tiles=True)
from triton import knobs
from attnverify.kernels import launch
from attnverify.spec import Spec
keys = {}
def hook(*, key, fn, **_):
    keys.setdefault(fn.name, set()).add(key); return True  # record, compile nothing
knobs.runtime.jit_cache_hook = hook
out = {}
for name, calls in (
        ("masks", [(1, 64, 64, 128, {}), (1, 64, 64, 128, dict(causal="top_left")),
                   (1, 64, 64, 128, dict(causal="bottom_right")), (1, 64, 64, 128, dict(window=(7, 0))),
                   (1, 64, 64, 128, dict(sinks=torch.zeros(1), causal="top_left"))]),
        # D = 72 and 80 share BLOCK_D = 128 (padded); their rows (and 65 rows of them) fall in other stride classes
        ("strides", [(1, 64, 64, 80, {}), (3, 65, 97, 72, {}), (2, 64, 64, 72, {})])):
    keys.clear()
    for h, lq, lk, d, kw in calls:
        q = torch.randn(1, h, lq, d, dtype=torch.float16)
        k = torch.randn(1, h, lk, d, dtype=torch.float16)
        launch.forward(q, k, k, Spec(**kw))
    out[name] = len(keys["_attn_fwd"])
print(json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="needs Triton's NVIDIA backend (the pip wheel has it) to bind for sm_90 without a GPU")
def test_mask_flags_and_stride_classes_stop_splitting_the_forward():
    got = {}
    for variant in ("nospec", "rtmask", "aligned"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(PYTHONPATH=os.pathsep.join([ROOT] + sys.path), TRITON_DEFAULT_FP_FUSION="1",
                   ATTNVERIFY_TRITON_VARIANT=variant)
        res = subprocess.run([sys.executable, "-c", _KEYS, os.path.join(ROOT, "benchmarks")], env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        got[variant] = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["nospec"]["masks"] == 5 and got["rtmask"]["masks"] == 1
    assert got["nospec"]["strides"] >= 2 and got["aligned"]["strides"] == 1
