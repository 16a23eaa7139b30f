"""Adapters of FlexAttention and external libraries (issue 6).

- every built-in loads without its library; a missing library or device is "unavailable: <reason>",
  never an ImportError, and importing the adapter modules imports no library and starts no CUDA;
- the availability probe turns a library that imports but cannot run (xformers' operators that do
  not load, a crash at import) into a reason;
- `flex` (torch.compile'd flex_attention, forward only on the CPU) and `jax` (jax.nn.dot_product_attention
  on XLA:CPU) hold against the float64 reference on hand-picked cases of every claimed feature, and
  under the ci profile for every property they claim.

Cost on 2 CPU cores: flex compiles a C++ kernel per (shape, dtype, graph variant): 20-50 s cold,
1-5 s from inductor's cache (~/.cache/attnverify/inductor). The fast flex test uses one shape per
graph variant (4 compiles); its ci-profile runs are @slow. JAX compiles in ~0.1 s per shape.
"""
from __future__ import annotations

import dataclasses as _dc
import importlib
import importlib.util
import json
import math as _math
import os
import re
import subprocess
import sys
import textwrap
import types as _types

import pytest
import torch

from attnverify.adapters import _external, flash_attn4
from attnverify.adapters.base import Adapter as _Adapter
from attnverify.adapters.registry import BUILTINS, all_adapters, get
from attnverify.case import CaseRecipe, build_case
from attnverify.check import check, unclaimed
from attnverify.properties import PROPERTIES, get_property
from attnverify.properties.driver import run_property
from attnverify.spec import Spec as _Spec

from _fa4_mask import fa4_keep
from _judged import judged

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

EXTERNAL = ("flex", "flash-attn", "flash-attn-kvcache", "flash-attn3", "flash-attn3-kvcache", "flash-attn4", "xformers",
            "flashinfer", "jax", "te")
LIBRARY = {  # adapter -> the module whose absence makes it unavailable
    "flash-attn": "flash_attn", "flash-attn-kvcache": "flash_attn", "xformers": "xformers",
    "flashinfer": "flashinfer", "jax": "jax", "te": "transformer_engine",
}  # flash-attn4 is not here: FA2 alone also provides `flash_attn`; FA4 is flash_attn/cute (flash_attn4._fa4_dir)
# cutlass, quack, tvm_ffi: the CuTe-DSL runtime that flash_attn.cute imports
LIB_MODULES = ("jax", "jaxlib", "xformers", "flash_attn", "flash_attn_interface", "flash_attn_3", "flashinfer",
               "transformer_engine", "cutlass", "quack", "tvm_ffi")
HAS_JAX = importlib.util.find_spec("jax") is not None and importlib.util.find_spec("jaxlib") is not None
CPU_ONLY = not torch.cuda.is_available()


# ------------------------------------------------------------------------------------- listing


def test_external_builtins_are_registered():
    for name in EXTERNAL:
        assert name in BUILTINS, name
        a = get(name)
        assert a.name == name and a.availability is not None


def test_adapter_modules_import_no_library_and_no_cuda():
    code = textwrap.dedent("""
        import json, os, sys
        import attnverify
        import attnverify.adapters.flex, attnverify.adapters.flash_attn, attnverify.adapters.xformers_adapter
        import attnverify.adapters.flashinfer_adapter, attnverify.adapters.jax_adapter, attnverify.adapters.te_adapter
        import attnverify.adapters.flash_attn4, attnverify.adapters.flash_attn_kvcache, attnverify.adapters.flash_attn3_kvcache
        from attnverify.adapters.registry import get
        for n in %r:
            get(n)
        # flash-attn4 decides availability by find_spec alone (with FA2 installed, importing flash_attn
        # would load FA2's CUDA extension); the GPU probe, which does import it, runs in a child
        os.environ["ATTNVERIFY_SKIP_PROBE"] = "1"
        get("flash-attn4").unavailable_reason()
        import torch
        libs = sorted(m for m in sys.modules if m.split('.')[0] in %r)
        print(json.dumps({"libs": libs, "cuda": torch.cuda.is_initialized()}))
    """ % (EXTERNAL, LIB_MODULES))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res == {"libs": [], "cuda": False}


def test_missing_libraries_are_unavailable_with_a_reason():
    rows = {a.name: a.unavailable_reason() for a in all_adapters()}  # never raises
    for name in EXTERNAL:
        why = rows[name]
        assert why is None or (isinstance(why, str) and why.strip()), (name, why)
        lib = LIBRARY.get(name)
        if (lib and not _external.installed(lib)) or (name == "flash-attn4" and flash_attn4._fa4_dir() is None):
            assert why and "not installed" in why and "pip install" in why, (name, why)
        elif name in ("flash-attn", "flash-attn-kvcache", "flash-attn3", "flash-attn3-kvcache", "flash-attn4", "xformers",
                      "flashinfer", "te") and CPU_ONLY:
            assert why and ("not installed" in why or "no CUDA device" in why), (name, why)
    if HAS_JAX:
        assert rows["jax"] is None, rows["jax"]
    assert rows["flex"] is None, rows["flex"]


def test_cli_adapters_lists_external_adapters(capsys):
    from attnverify.cli import main

    assert main(["adapters", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    for name in EXTERNAL:
        assert name in rows
        st = rows[name]["status"]
        assert st == "available" or st.startswith("unavailable: "), st
    assert rows["flex"]["status"] == "available"
    if CPU_ONLY:
        for name in ("flash-attn", "flash-attn4", "xformers", "flashinfer", "te"):
            assert rows[name]["status"].startswith("unavailable: ")


def test_default_run_on_this_machine_includes_jax_and_flex_on_request_on_a_cpu():
    """The README's main command must fit 10 minutes on a 2-core CPU: flex (a compile per new shape, about
    21 minutes cold) is left out there and listed with the command that adds it; with a GPU it runs."""
    import io

    from attnverify.cli import default_adapters

    out = io.StringIO()
    names = default_adapters(out, gpu=False)
    assert "flex" not in names and "naive" in names and "triton" in names
    if HAS_JAX:
        assert "jax" in names
    lines = out.getvalue().splitlines()
    assert ("attnverify run: on request: flex (compiles every new shape: about 21 min cold (1,256 s), 3 min with a "
            "warm compile cache, on a 2-core CPU (BENCHMARKS.md)); add it with: attnverify run --adapter flex") in lines
    for line in lines:
        assert line.startswith(("attnverify run: skipping ", "attnverify run: on request: ")), line
    assert "flex" in default_adapters(io.StringIO(), gpu=True)


# --------------------------------------------------------------------------------- availability


def test_probe_turns_failures_into_reasons():
    ok, why, info = _external.probe("t", '_done(True, answer=42)')
    assert ok and why == "" and info == {"answer": 42}
    ok, why, _ = _external.probe("t", 'raise NotImplementedError("No operator found for `memory_efficient_attention_forward`")')
    assert not ok and why.startswith("NotImplementedError: No operator found")
    ok, why, _ = _external.probe("t", "import os\nos.abort()")
    assert not ok and "killed by signal" in why
    ok, why, _ = _external.probe("t", "import time\ntime.sleep(30)", timeout=3)
    assert not ok and "did not finish within 3 s" in why


def _fake_xformers(root, *, operators_load: bool):
    pkg = root / "xformers"
    (pkg / "ops" / "fmha").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '0.0.35+fake'\n")
    (pkg / "ops" / "__init__.py").write_text(textwrap.dedent("""
        def memory_efficient_attention(*a, **k):
            raise NotImplementedError("No operator found for `memory_efficient_attention_forward` with inputs: ...")
    """))
    (pkg / "ops" / "fmha" / "__init__.py").write_text(textwrap.dedent(f"""
        class _Op:
            @classmethod
            def is_available(cls):
                return {operators_load!r}
        class cutlass:
            FwOp = _Op
        class flash:
            FwOp = _Op
    """))


def test_xformers_whose_operators_do_not_load_is_unavailable(tmp_path, monkeypatch):
    from attnverify.adapters import xformers_adapter

    _fake_xformers(tmp_path, operators_load=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(_external, "cuda_present", lambda: True)  # as on the H200
    _external.reset_cache()
    try:
        why = xformers_adapter._available()
    finally:
        _external.reset_cache()
    assert why and "none of its attention operators loaded" in why and "0.0.35+fake" in why


def test_installed_library_without_gpu_is_unavailable(tmp_path, monkeypatch):
    from attnverify.adapters import xformers_adapter

    _fake_xformers(tmp_path, operators_load=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_external, "cuda_present", lambda: False)
    _external.reset_cache()
    try:
        assert xformers_adapter._available() == "no CUDA device here (xformers runs only on NVIDIA GPUs)"
    finally:
        _external.reset_cache()


def test_flash_attn4_availability_needs_flash_attn_cute_and_its_runtime(tmp_path, monkeypatch):
    """FA2's `flash_attn` alone is not FA4; then the CuTe-DSL runtime; then the GPU -- each with its reason,
    and none of it imports flash_attn (FA2's __init__ would load its CUDA extension)."""
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('availability must not import flash_attn')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in ("flash_attn", "flash_attn.cute"):  # find_spec answers from sys.modules for an imported one
        monkeypatch.delitem(sys.modules, m, raising=False)
    monkeypatch.setattr(_external, "cuda_present", lambda: False)
    # a found FA4 sets these with setdefault; set here, they are restored afterwards
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(tmp_path / "cache"))
    _external.reset_cache()
    try:
        why = flash_attn4._available()  # FA2 only
        assert "flash_attn.cute (FlashAttention-4) is not installed" in why and "pip install" in why, why
        (pkg / "cute").mkdir()
        (pkg / "cute" / "interface.py").write_text("")
        importlib.invalidate_caches()
        assert flash_attn4._fa4_dir() == str(pkg / "cute")
        why = flash_attn4._available()
        if not _external.installed("cutlass") and _external.dist_version("nvidia-cutlass-dsl") is None:
            assert why.startswith("nvidia-cutlass-dsl is not installed") and "pip install" in why, why
        for mod in ("cutlass", "quack", "tvm_ffi"):
            (tmp_path / mod).mkdir()
            (tmp_path / mod / "__init__.py").write_text("")
        importlib.invalidate_caches()
        assert flash_attn4._available() == "no CUDA device here (flash-attn4 runs only on NVIDIA GPUs)"
    finally:
        _external.reset_cache()
    assert not [m for m in ("flash_attn", "cutlass", "quack", "tvm_ffi")
                if str(tmp_path) in str(getattr(sys.modules.get(m), "__file__", ""))]


# ------------------------------------------------------------------------------------------ flex


def _check_all(adapter, recipes, backward=False):
    """Every recipe matches the reference (and with backward=True its gradients too). The recipes are the
    CPU's claims; on a GPU they run on the GPU, in a claimed dtype, and those the GPU's claims exclude (e.g.
    flex's head dim 40) are left out."""
    bad, ran, left_out = [], 0, []
    dev = adapter.run_device()
    for r in recipes:
        r = {**r, "device": dev}
        if dev != "cpu" and r.get("dtype", "float32") not in adapter.claims.dtypes:
            r["dtype"] = adapter.claims.dtypes[-1]
        case = build_case(CaseRecipe(**r))
        why = unclaimed(adapter, case)
        if dev != "cpu" and why is not None:
            left_out.append(why)
            continue
        assert why is None, (r, why)
        ran += 1
        res = check(adapter, case, backward=backward)
        if not res.passed:
            bad.append(res.message()[:2000])
    assert not bad, "\n\n".join(bad)
    assert ran >= len(recipes) // 2, left_out


FLEX_SHAPE = dict(batch=2, heads_q=4, heads_kv=2, len_q=150, len_k=100, head_dim=64, dtype="float32", seed=3)
FLEX_CASES = [  # one shape per graph variant: plain, bool mask, float mask, varlen -> 4 compiles
    {}, dict(causal="top_left"), dict(causal="bottom_right"),  # bottom-right with Lq > Lk: 50 fully-masked rows
    dict(window=(3, 2)), dict(window=(16, -1)), dict(window=(0, 0), causal="bottom_right"), dict(window=(-1, 4)),
    dict(softcap=5.0), dict(softcap=0.5, causal="top_left"), dict(alibi=True), dict(alibi=True, causal="bottom_right"),
    dict(scale=0.01), dict(scale=2.0, q_std=3.2, k_std=3.2), dict(late_from=64, late_boost=30.0),
    dict(row_shift=1000.0), dict(row_shift=-120.0, q_std=0.5, k_std=0.5), dict(equal_scores=True),
    dict(layout="transposed"), dict(layout="offset"),
    dict(mask="bool_random", mask_shape=(2, 1, 150, 100)), dict(mask="bool_rows_off", masked_rows=(0, 77, 149)),
    dict(mask="bool_padding", causal="top_left"), dict(mask="bool_random", key_block=(64, 100)),
    dict(mask="float_random"), dict(mask="float_neg_inf", mask_density=0.3),
    dict(batch=1, seqlens_q=[40, 0, 70, 40], seqlens_k=[30, 20, 0, 50], causal="bottom_right"),
    dict(batch=1, seqlens_q=[40, 0, 70, 40], seqlens_k=[30, 20, 0, 50], window=(4, 1), alibi=True),
    dict(batch=1, seqlens_q=[40, 0, 70, 40], seqlens_k=[30, 20, 0, 50], causal="top_left", softcap=2.0),
]


def test_flex_cpu_claims_are_the_measured_ones():
    c = get("flex").claims
    if not CPU_ONLY:
        pytest.skip("CPU claims")
    assert c.devices == ("cpu",) and not c.backward and not c.lse and c.fully_masked == "zeros"
    assert set(c.dtypes) == {"float16", "bfloat16", "float32"}
    assert all(c.head_dim_ok(d) for d in (8, 16, 40, 59, 72, 128, 256, 512))


def test_flex_holds_on_every_feature():
    recipes = []
    for kw in FLEX_CASES:
        r = dict(FLEX_SHAPE, **kw)
        if "seqlens_q" in kw:
            r["len_q"], r["len_k"] = sum(kw["seqlens_q"]), sum(kw["seqlens_k"])
        recipes.append(r)
    _check_all(get("flex"), recipes)


@pytest.mark.slow
def test_flex_holds_in_half_precision_and_odd_head_dims():
    shape = dict(FLEX_SHAPE, len_q=70, len_k=90)
    recipes = [dict(shape, dtype=dt, causal="bottom_right", window=(8, -1), alibi=True) for dt in ("float16", "bfloat16")]
    recipes += [dict(shape, head_dim=d, softcap=5.0) for d in (8, 59, 256)]
    recipes += [dict(shape, head_dim=64, head_dim_v=40)]
    _check_all(get("flex"), recipes)


@pytest.mark.slow
def test_flex_cpu_backward_is_refused_by_torch():
    """How backward=False and lse=False were established on the CPU: torch refuses both."""
    from attnverify.adapters.flex import _compiled

    q = torch.randn(1, 1, 16, 16, requires_grad=True)
    with pytest.raises(Exception, match="does not support backward on CPU"):
        _compiled()(q, q, q)
    x = q.detach()
    with pytest.raises(Exception, match="return_lse. is not supported"):
        _compiled()(x, x, x, return_lse=True)


@pytest.mark.slow
@pytest.mark.parametrize("prop", [p.name for p in PROPERTIES])
def test_flex_ci_profile(prop, tmp_path):
    _run_profile("flex", prop, tmp_path)


# ------------------------------------------------------------------------------------------- jax

needs_jax = pytest.mark.skipif(not HAS_JAX, reason="jax is not installed (pip install jax jaxlib)")


# Findings about a library are declared on its adapter (known_failures) and judged by the adapter's
# classifier (tests/_judged.py): a failure its declaration does not match is new; a declaration that does
# not reproduce fails the test (strict XPASS).
# (F6, jax's NaN on rows whose scores an Inf made all -inf, was one until nonfinite_inputs_propagate
# applied the declared fully_masked convention to such rows.)


def _run_profile(name, prop, tmp_path, max_examples=None):
    a = get(name)
    why = a.unavailable_reason()
    if why:
        pytest.skip(f"{name} unavailable: {why}")
    p = get_property(prop)
    if p.skip_reason(a):
        pytest.skip(p.skip_reason(a))
    judged(a, prop, lambda: run_property(p, a, profile="ci", seed=0, max_examples=max_examples, database=None,
                                         report_dir=str(tmp_path)))


@needs_jax
def test_jax_holds_on_every_feature():
    base = dict(batch=2, heads_q=4, heads_kv=2, len_q=33, len_k=47, head_dim=32, dtype="float32", seed=5)
    recipes = [dict(base, **kw) for kw in (
        {}, dict(causal="top_left"), dict(len_q=47, window=(3, 2)), dict(len_q=47, window=(-1, 0), causal="top_left"),
        dict(scale=0.5, head_dim=40), dict(mask="bool_random", mask_shape=(2, 1, 33, 47)), dict(mask="float_random"),
        dict(return_lse=True), dict(return_lse=True, causal="top_left", row_shift=1000.0), dict(dtype="bfloat16"),
        dict(layout="sliced"), dict(layout="expanded_kv"), dict(layout="transposed"),
        dict(batch=1, len_q=33, len_k=40, seqlens_q=[5, 0, 28], seqlens_k=[7, 10, 23], causal="top_left", return_lse=True),
        dict(batch=1, len_q=33, len_k=33, seqlens_q=[5, 0, 28], seqlens_k=[5, 0, 28], window=(2, 1)),
        dict(batch=1, heads_q=1, heads_kv=1, len_q=1, len_k=1, dtype="bfloat16"),  # eager path (F5)
    )]
    _check_all(get("jax"), recipes)


@needs_jax
def test_jax_refuses_what_its_api_does_not_express():
    a = get("jax")
    assert a.claims.causal == ("none", "top_left")  # is_causal is tril((T, S)): top-left
    if CPU_ONLY:
        assert a.claims.dtypes == ("bfloat16", "float32")  # fp16 does not compile under jit on XLA:CPU (F4)
        with pytest.raises(TypeError, match="float64"):  # JAX without x64 would compute it in float32
            x = torch.randn(1, 1, 4, 8, dtype=torch.float64)
            a(x, x, x, build_case(CaseRecipe()).spec)
    dev = a.run_device()
    win = build_case(CaseRecipe(len_q=10, len_k=20, window=(2, 2), dtype="bfloat16", device=dev))
    # XLA (CPU) expresses windows top-left aligned only; the cuDNN implementation (GPU) is not claimed with them
    assert ("top-left aligned" if CPU_ONLY else "does not claim window") in unclaimed(a, win)
    lse16 = build_case(CaseRecipe(dtype="bfloat16", return_lse=True, device=dev))
    # XLA returns the residual in the key dtype; on a GPU the adapter claims no LSE at all
    assert ("key dtype" if CPU_ONLY else "does not claim lse") in unclaimed(a, lse16)


@needs_jax
def test_jax_forward_property_quick(tmp_path):
    _run_profile("jax", "forward_matches_reference", tmp_path, max_examples=12)


@needs_jax
@pytest.mark.slow
@pytest.mark.parametrize("prop", [p.name for p in PROPERTIES])
def test_jax_ci_profile(prop, tmp_path):
    _run_profile("jax", prop, tmp_path)


# ----------------------------------------------------------------- glue of the GPU adapters (CPU)
# flash-attn and FlashInfer cannot run here. These tests put plain-torch stand-ins with the
# libraries' documented signatures, layouts and conventions (BSHD / NHD, FA's +inf LSE of empty
# rows, FlashInfer's base-2 LSE, cache_seqlens, paged caches) in sys.modules and run the adapters'
# own code against the reference on the CPU: what they test is the glue (argument mapping, layouts,
# dispatch, LSE conversion), not the kernels -- the stand-ins compute with attnverify's naive.



def _naive(q_bhsd, k_bhsd, v_bhsd, *, scale, causal, window=(-1, -1), softcap=0.0, alibi=None, mask=None):
    from attnverify.adapters.naive import naive_attention

    w = None if tuple(window) == (-1, -1) else tuple(int(x) for x in window)
    spec = _Spec(scale=scale, causal="bottom_right" if causal else "none", window=w, softcap=softcap or None,
                 alibi_slopes=alibi, attn_mask=mask, return_lse=True)
    o = naive_attention(q_bhsd, k_bhsd, v_bhsd, spec)
    return o.out, o.lse


def _fake_flash_attn():
    m = _types.ModuleType("flash_attn")
    m.__version__ = "2.8.0+standin"

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, deterministic=False, return_attn_probs=False):
        assert dropout_p == 0.0 and q.dim() == 4 and q.shape[0] == k.shape[0]
        out, lse = _naive(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=softmax_scale, causal=causal,
                          window=window_size, softcap=softcap, alibi=alibi_slopes)
        lse = torch.where(torch.isneginf(lse), torch.full_like(lse, _math.inf), lse)  # FA stores +inf
        out = out.transpose(1, 2)
        return (out, lse, torch.empty(0)) if return_attn_probs else out

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
        assert cu_seqlens_q.dtype == torch.int32 and q.dim() == 3
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert max_seqlen_q == max(b - a for a, b in zip(cq, cq[1:]))
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        lse = torch.full((q.shape[1], q.shape[0]), _math.inf)
        for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
            if q1 > q0:
                o, l_ = _naive(q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None], v[k0:k1].transpose(0, 1)[None],
                               scale=softmax_scale, causal=causal, window=window_size, softcap=softcap, alibi=alibi_slopes)
                out[q0:q1] = o[0].transpose(0, 1)
                lse[:, q0:q1] = torch.where(torch.isneginf(l_[0]), torch.full_like(l_[0], _math.inf), l_[0])
        return (out, lse, torch.empty(0)) if return_attn_probs else out

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                                cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                                causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                                alibi_slopes=None, num_splits=0, return_softmax_lse=False):
        assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        outs, lses = [], []
        for b, n in enumerate(cache_seqlens.tolist()):  # only the first cache_seqlens[b] rows are the sequence
            al = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b]
            o, l_ = _naive(q[b:b + 1].transpose(1, 2), k_cache[b:b + 1, :n].transpose(1, 2),
                           v_cache[b:b + 1, :n].transpose(1, 2), scale=softmax_scale, causal=causal,
                           window=window_size, softcap=softcap, alibi=al)
            outs.append(o.transpose(1, 2))
            lses.append(torch.where(torch.isneginf(l_), torch.full_like(l_, _math.inf), l_))
        out, lse = torch.cat(outs), torch.cat(lses)
        return (out, lse) if return_softmax_lse else out

    m.flash_attn_func, m.flash_attn_varlen_func, m.flash_attn_with_kvcache = (
        flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache)
    return m


def _fake_flashinfer():
    m = _types.ModuleType("flashinfer")
    m.__version__ = "0.6.0+standin"
    ln2 = _math.log(2.0)

    def _one(q, k, v, causal, sm_scale, window_left, logits_soft_cap, mask=None):  # NHD -> (out NHD, lse base 2 (L, H))
        o, l_ = _naive(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=sm_scale,
                       causal=causal, window=(window_left, -1), softcap=logits_soft_cap,
                       mask=None if mask is None else mask.view(1, 1, *mask.shape))
        return o[0].transpose(0, 1), (l_[0] / ln2).transpose(0, 1)

    def single_prefill_with_kv_cache(q, k, v, custom_mask=None, causal=False, kv_layout="NHD", sm_scale=None,
                                     window_left=-1, logits_soft_cap=None, return_lse=False, **kw):
        assert kv_layout == "NHD" and q.dim() == 3
        o, l_ = _one(q, k, v, causal, sm_scale, window_left, logits_soft_cap, custom_mask)
        return (o, l_) if return_lse else o

    def single_decode_with_kv_cache(q, k, v, kv_layout="NHD", sm_scale=None, window_left=-1, logits_soft_cap=None,
                                    return_lse=False, **kw):
        assert q.dim() == 2  # (num_qo_heads, head_dim)
        o, l_ = _one(q[None], k, v, False, sm_scale, window_left, logits_soft_cap)
        return (o[0], l_[0]) if return_lse else o[0]

    class BatchPrefillWithRaggedKVCacheWrapper:
        def __init__(self, workspace, kv_layout="NHD"):
            assert workspace.dtype == torch.uint8 and kv_layout == "NHD"

        def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, custom_mask=None, causal=False,
                 sm_scale=None, window_left=-1, logits_soft_cap=None, q_data_type=None, kv_data_type=None, **kw):
            self.p = dict(qo=qo_indptr.tolist(), kv=kv_indptr.tolist(), mask=custom_mask, causal=causal,
                          sm_scale=sm_scale, window_left=window_left, cap=logits_soft_cap)

        def run(self, q, k, v, return_lse=False):
            p = self.p
            out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
            lse = torch.full((q.shape[0], q.shape[1]), -_math.inf)
            off = 0
            for q0, q1, k0, k1 in zip(p["qo"], p["qo"][1:], p["kv"], p["kv"][1:]):
                mask = None
                if p["mask"] is not None:  # flattened per request, (q_len x k_len) each
                    n = (q1 - q0) * (k1 - k0)
                    mask = p["mask"][off:off + n].view(q1 - q0, k1 - k0)
                    off += n
                if q1 > q0:
                    out[q0:q1], lse[q0:q1] = _one(q[q0:q1], k[k0:k1], v[k0:k1], p["causal"], p["sm_scale"],
                                                  p["window_left"], p["cap"], mask)
            return (out, lse) if return_lse else out

    class BatchDecodeWithPagedKVCacheWrapper:
        def __init__(self, workspace, kv_layout="NHD"):
            assert kv_layout == "NHD"

        def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, sm_scale=None,
                 window_left=-1, logits_soft_cap=None, q_data_type=None, kv_data_type=None, **kw):
            self.p = (indptr.tolist(), indices.tolist(), last_page_len.tolist(), page_size, sm_scale, window_left,
                      logits_soft_cap)

        def run(self, q, paged_kv_cache, return_lse=False):
            indptr, indices, last, ps, sm, wl, cap = self.p
            kc, vc = paged_kv_cache
            outs, lses = [], []
            for b in range(q.shape[0]):
                pages = indices[indptr[b]:indptr[b + 1]]
                n = (len(pages) - 1) * ps + last[b]
                kb = torch.cat([kc[i] for i in pages])[:n]
                vb = torch.cat([vc[i] for i in pages])[:n]
                o, l_ = _one(q[b:b + 1], kb, vb, False, sm, wl, cap)
                outs.append(o[0])
                lses.append(l_[0])
            out, lse = torch.stack(outs), torch.stack(lses)
            return (out, lse) if return_lse else out

    m.single_prefill_with_kv_cache = single_prefill_with_kv_cache
    m.single_decode_with_kv_cache = single_decode_with_kv_cache
    m.BatchPrefillWithRaggedKVCacheWrapper = BatchPrefillWithRaggedKVCacheWrapper
    m.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    return m


def _on_cpu(a):
    """The adapter's own function and claims, widened to the CPU and float32 for the stand-ins."""
    dts = tuple(dict.fromkeys(a.claims.dtypes + ("float32",)))
    return _Adapter(name=a.name + "-glue", fn=a.fn, refuses=a.refuses,
                    claims=_dc.replace(a.claims, devices=("cpu",), dtypes=dts, dropout=False))


GLUE_BASE = dict(batch=2, heads_q=4, heads_kv=2, len_q=37, len_k=53, head_dim=64, dtype="float32", seed=11, return_lse=True)


def test_flash_attn_glue(monkeypatch):
    from attnverify.adapters import flash_attn as fa

    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn())
    recipes = [dict(GLUE_BASE, **kw) for kw in (
        {}, dict(causal="bottom_right"), dict(causal="bottom_right", len_q=60, len_k=20),  # 40 empty rows: LSE +inf -> -inf
        dict(window=(3, 5)), dict(window=(8, -1), causal="bottom_right"), dict(softcap=5.0), dict(alibi=True),
        dict(scale=0.5), dict(layout="transposed"), dict(layout="sliced"), dict(dtype="bfloat16"),
        dict(batch=1, len_q=40, len_k=45, seqlens_q=[10, 0, 30], seqlens_k=[15, 10, 20], causal="bottom_right"),
        dict(batch=1, len_q=40, len_k=35, seqlens_q=[10, 5, 25], seqlens_k=[15, 0, 20], alibi=True, window=(4, 2)),
    )]
    _check_all(_on_cpu(fa.flash_attn), recipes)
    kv = [r for r in recipes if "seqlens_q" not in r]
    _check_all(_on_cpu(fa.flash_attn_kvcache), kv + [dict(GLUE_BASE, len_q=1, len_k=300, causal="bottom_right")])


def _fake_flash_attn_cute(*, lse_base2=False):
    """flash_attn (package) and flash_attn.cute with FA4 4.0.0b36's signatures: BSHD / (total, H, D); `qv` the
    4th positional parameter of both functions; a tuple (out, lse) always, lse None unless asked for or
    needed by a gradient; natural-log LSE, -inf for rows without a key, (H, total) for varlen. lse_base2:
    a wrong stand-in (base-2 LSE) that the check must catch. Calls are recorded in `.calls`."""
    pkg = _types.ModuleType("flash_attn")
    pkg.__path__ = []
    cute = _types.ModuleType("flash_attn.cute")
    calls = []
    ln2 = _math.log(2.0)

    def one(q, k, v, scale, causal, window, softcap):  # (1, L, H, D) each
        lq, lk = q.shape[1], k.shape[1]
        o, l_ = _naive(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, causal=False,
                       softcap=softcap, mask=fa4_keep(lq, lk, causal, *window).view(1, 1, lq, lk))
        return o.transpose(1, 2), (l_ / ln2 if lse_base2 else l_)

    def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                        window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                        deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                        aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False,
                        gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
        assert qv is None and q.dim() == 4 and q.shape[0] == k.shape[0]
        q, k, v = [t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v)]  # maybe_contiguous
        calls.append(dict(kind="dense", causal=causal, window=tuple(window_size), det=deterministic, lse=return_lse))
        outs, lses = zip(*[one(q[b:b + 1], k[b:b + 1], v[b:b + 1], softmax_scale, causal, window_size, softcap)
                           for b in range(q.shape[0])])
        needs = return_lse or any(t.requires_grad for t in (q, k, v))
        return torch.cat(outs), (torch.cat(lses) if needs else None)

    def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                               gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                               window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1,
                               pack_gqa=None, deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
                               block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
                               scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
                               gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
        assert qv is None and q.dim() == 3
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.is_contiguous() and cu_seqlens_k.dtype == torch.int32
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        # the backward sizes its semaphores from these: they must be the true maxima
        assert max_seqlen_q == max(b - a for a, b in zip(cq, cq[1:])), max_seqlen_q
        assert max_seqlen_k == max(b - a for a, b in zip(ck, ck[1:])), max_seqlen_k
        calls.append(dict(kind="varlen", causal=causal, window=tuple(window_size), det=deterministic, lse=return_lse))
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        lse = torch.full((q.shape[1], q.shape[0]), -_math.inf)
        for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
            if q1 > q0:
                o, l_ = one(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale, causal, window_size,
                            softcap)
                out[q0:q1], lse[:, q0:q1] = o[0], l_[0]
        needs = return_lse or any(t.requires_grad for t in (q, k, v))
        return out, (lse if needs else None)

    cute.flash_attn_func, cute.flash_attn_varlen_func, cute.calls = flash_attn_func, flash_attn_varlen_func, calls
    pkg.cute = cute
    return pkg, cute


FA4_GLUE = [dict(GLUE_BASE, **kw) for kw in (
    {}, dict(causal="bottom_right"), dict(causal="bottom_right", len_q=60, len_k=20),  # 40 rows see no key
    dict(window=(3, 5)), dict(window=(8, -1), causal="bottom_right"), dict(window=(-1, 4)), dict(window=(6, -1)),
    dict(window=(-1, -1)), dict(window=(0, 0)), dict(softcap=5.0), dict(scale=0.5), dict(layout="transposed"),
    dict(layout="sliced"), dict(layout="offset"), dict(dtype="bfloat16"), dict(head_dim=128, head_dim_v=64, heads_kv=4),
    dict(return_lse=False),
    dict(batch=1, len_q=40, len_k=45, seqlens_q=[10, 0, 30], seqlens_k=[15, 10, 20], causal="bottom_right"),
    dict(batch=1, len_q=40, len_k=35, seqlens_q=[10, 5, 25], seqlens_k=[15, 0, 20], window=(4, 2)),
)]


def _install_fake_fa4(monkeypatch, tmp_path, **kw):
    pkg, cute = _fake_flash_attn_cute(**kw)
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    for var in ("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
        monkeypatch.setenv(var, "x")  # so that monkeypatch restores (removes) what the adapter sets
        monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(tmp_path))
    return cute


def test_flash_attn4_glue(monkeypatch, tmp_path):
    """flash-attn4's glue against a stand-in with FA4's conventions, forward and backward; a stand-in with a
    base-2 LSE and an adapter that passed -1 (FA2's 'unbounded') as a window side are caught."""
    from attnverify.adapters import flash_attn as fa2

    a = _on_cpu(flash_attn4.flash_attn4)
    cute = _install_fake_fa4(monkeypatch, tmp_path)
    _check_all(a, FA4_GLUE)
    _check_all(a, FA4_GLUE, backward=True)
    calls = cute.calls
    assert {c["kind"] for c in calls} == {"dense", "varlen"} and all(c["det"] is True for c in calls)
    windows = {c["window"] for c in calls}
    assert all(w is None or w >= 0 for ws in windows for w in ws), windows  # FA4: a lone -1 is a real bound
    assert {(None, None), (None, 4), (6, None), (8, None), (0, 0)} <= windows, windows
    # the compile cache is turned on before flash_attn.cute is used (a user's setting would win)
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(tmp_path / ".cache" / "attnverify" / "flash_attn_cute")
    # claims the SM90 backward cannot keep are refused
    refused = {kw: a.refuses(build_case(CaseRecipe(**dict(GLUE_BASE, **dict(kw)))))
               for kw in ((("head_dim", 64), ("head_dim_v", 128), ("heads_kv", 4)),
                          (("head_dim", 128), ("head_dim_v", 64), ("heads_kv", 2)))}
    assert [("Dv > D" in r, "GQA backward requires head_dim == head_dim_v" in r) for r in refused.values()] == [
        (True, False), (False, True)], refused
    # a hand-made varlen Spec without max_seqlen_*: the true maxima, not 0
    vcase = build_case(CaseRecipe(**FA4_GLUE[-2]))
    assert _external.varlen_args(_dc.replace(vcase.spec, max_seqlen_q=None, max_seqlen_k=None), "cpu")[2:] == (30, 20)

    # negative 1: the adapter passing -1 through (FA2's convention, FA2's _window) must fail the check
    monkeypatch.setattr(flash_attn4, "_window", fa2._window)
    for w in ((-1, 4), (6, -1)):
        res = check(a, build_case(CaseRecipe(**dict(GLUE_BASE, window=w))), backward=False)
        assert not res.passed and "out" in [c.name for c in res.failing()], (w, res.message()[:1000])
    monkeypatch.undo()

    # negative 2: a library whose LSE is base 2 (FlashInfer's) must fail on the LSE, and only there
    _install_fake_fa4(monkeypatch, tmp_path, lse_base2=True)
    for kw in ({}, dict(batch=1, len_q=40, len_k=45, seqlens_q=[10, 0, 30], seqlens_k=[15, 10, 20])):
        res = check(a, build_case(CaseRecipe(**dict(GLUE_BASE, **kw))), backward=False)
        assert not res.passed and [c.name for c in res.failing()] == ["lse"], (kw, res.message()[:1000])


def test_flash_attn4_declares_its_h200_findings():
    kf, pats = get("flash-attn4").known_failures, get("flash-attn4").known_patterns
    grads = {"gradients_match_reference", "fully_masked_rows", "gqa_equals_repeated_kv", "outputs_fully_written",
             "non_default_stream"}
    # the serving declarations (FA4's documented TMA-page NaN; F18 and F37 on the sink properties, not strict) are
    # tested in tests/test_fa4_serving.py and tests/test_h200_serving_findings.py
    serving = {"paged_equals_contiguous", "sinks_match_reference", "sink_as_extra_key", "sinks_paged"}
    assert set(kf) == grads | {"no_out_of_bounds"} | serving and set(pats) == set(kf)
    assert set(kf) <= {p.name for p in PROPERTIES}
    kf = {p: w for p, w in kf.items() if p not in serving}
    assert "docs/compatibility.md F17" in kf["no_out_of_bounds"]
    assert all("docs/compatibility.md F18" in kf[p] and "benchmarks/repro_fa4.py" in kf[p] for p in kf)
    # every failure of the H200 run (journal messages, verbatim) is the declared finding ...
    with open(os.path.join(os.path.dirname(__file__), "data", "h200_fa4_failures.json")) as f:
        seen = json.load(f)["messages"]
    assert set(seen) == set(kf)
    for prop, msg in seen.items():
        assert re.search(pats[prop], msg), prop
    # ... and the declaration hides nothing else: the same failure at an unaffected head dim, with a wrong
    # output, or another kind of failure is new
    dq = seen["gradients_match_reference"]
    assert "D=16 " in dq and "dq: MISMATCH" in dq
    for other in (dq.replace("D=16 ", "D=64 "), dq.replace("D=16 ", "D=160 "),
                  dq.replace("dq: MISMATCH", "out: MISMATCH\ndq: MISMATCH"), dq.replace("dq: MISMATCH", "lse: MISMATCH"),
                  "gradients_match_reference failed for flash-attn4 (profile thorough)\nshrunk case: B=1 D=16\n"
                  "the property raised RuntimeError: CUDA error: an illegal memory access was encountered"):
        assert not any(re.search(pats[p], other) for p in kf), other[:300]
    assert not re.search(pats["no_out_of_bounds"], seen["no_out_of_bounds"].replace("varlen segment leak", "leak"))
    repro = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "repro_fa4.py")
    with open(repro) as f:
        src = f.read()
    compile(src, repro, "exec")  # it needs a GPU to run; here it must at least compile
    assert "import attnverify" not in src and "from attnverify" not in src  # standalone


def test_flashinfer_glue_every_entry_point(monkeypatch):
    from attnverify.adapters import flashinfer_adapter as fi

    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer())
    base = dict(GLUE_BASE, head_dim=64)
    recipes = [dict(base, **kw) for kw in (
        dict(batch=1), dict(batch=1, causal="bottom_right", window=(5, 2)), dict(batch=1, softcap=3.0),  # single prefill
        dict(batch=1, mask="bool_random", mask_shape=(1, 1, 37, 53)),
        dict(batch=1, len_q=1), dict(batch=1, len_q=1, window=(7, -1)),                                 # single decode
        dict(batch=3, len_q=1, len_k=50), dict(batch=2, len_q=1, len_k=16, softcap=2.0),                # batch decode (pages)
        dict(), dict(causal="bottom_right"), dict(mask="bool_random", mask_shape=(2, 1, 37, 53)),       # batch prefill
        dict(batch=1, len_q=40, len_k=45, seqlens_q=[10, 0, 30], seqlens_k=[15, 10, 20], causal="bottom_right"),
    )]
    _check_all(_on_cpu(fi.flashinfer), recipes)
    refused = build_case(CaseRecipe(**dict(base, batch=1, mask="float_random")))
    assert "boolean" in fi.flashinfer.refuses(refused)


def test_shared_finding_patterns_match_only_their_finding():
    """flex's F2 and CPU flash's NaN-row finding are narrowed to "a NaN in q swallowed, the rest right"; the
    message is the verbatim one of `attnverify run --adapter flex --profile ci --seed 774565857` (CPU, torch 2.13)."""
    from attnverify.adapters._findings import DIFFERENT_KV, NAN_Q_ROW_SWALLOWED

    seen = ("nonfinite_inputs_propagate failed for flex (profile ci)\n"
            "shrunk case: B=1 Hq=2 Hkv=1 Lq=1 Lk=129 D=64 float32 poison=[('q', 0, 0, 0, 0, 'nan')]\n"
            "1 row(s) finite where the reference is non-finite (e.g. (b, h, i) = (0, 0, 0): the NaN/Inf was swallowed)\n"
            "out: ok (rel L2 5.67e-08 <= 4.05e-06, max abs 8.81e-08)\n"
            "poison: [('q', 0, 0, 0, 0, 'nan')]\n")
    assert re.search(NAN_Q_ROW_SWALLOWED, seen)
    assert re.search(NAN_Q_ROW_SWALLOWED, seen.replace("'nan')]\n", "'nan'), ('q', 0, 1, 0, 3, 'nan')]\n"))
    for other in (seen.replace("poison: [('q'", "poison: [('k'"), seen.replace("'nan')]\n", "'inf')]\n"),
                  seen.replace("out: ok", "out: MISMATCH"),
                  seen.replace("'nan')]\n", "'nan'), ('v', 0, 0, 3, 1, 'nan')]\n")):
        assert not re.search(NAN_Q_ROW_SWALLOWED, other), other
    from attnverify.adapters._findings import CPU_FLASH_SWALLOWED

    for name in ("flex", "sdpa", "sdpa-flash"):
        a = get(name)
        if "nonfinite_inputs_propagate" in a.known_failures:
            want = NAN_Q_ROW_SWALLOWED if name == "flex" else CPU_FLASH_SWALLOWED
            assert a.known_patterns["nonfinite_inputs_propagate"] == want
        if "contract" in a.known_failures:
            assert a.known_patterns["contract"] == DIFFERENT_KV


def test_cpu_flash_inf_key_pattern_matches_only_its_finding():
    """CPU flash (torch 2.13, fp16/bf16) returns finite rows where a key holding +inf scores +inf in every row
    (benchmarks/repro_sdpa_flash_inf_key.py); the message is the verbatim one of `attnverify run --adapter sdpa-flash
    --profile ci --max-examples 1` on the corpus entry backward-dominant-key-wide-head."""
    from attnverify.adapters._findings import CPU_FLASH_SWALLOWED, INF_KEY_SWALLOWED

    seen = ("nonfinite_inputs_propagate failed for sdpa-flash (profile ci)\n"
            "shrunk case: B=1 Hq=1 Hkv=1 Lq=16 Lk=64 D=16 float16 poison=[('k', 0, 0, 63, 0, 'inf')] key 0 dominant (+8)\n"
            "16 row(s) finite where the reference is non-finite (e.g. (b, h, i) = (0, 0, 0): the NaN/Inf was swallowed)\n"
            "out: ok (rel L2 0.00e+00 <= 7.47e-04, max abs 0.00e+00)\n"
            "poison: [('k', 0, 0, 63, 0, 'inf')]")
    assert re.search(INF_KEY_SWALLOWED, seen) and re.search(CPU_FLASH_SWALLOWED, seen)
    for other in (seen.replace("'inf')]", "'-inf')]"), seen.replace("'inf')]", "'nan')]"),
                  seen.replace("out: ok", "out: MISMATCH"), seen.replace("poison: [('k'", "poison: [('v'"),
                  seen.replace("'inf')]", "'inf'), ('v', 0, 0, 3, 1, 'nan')]")):
        assert not re.search(INF_KEY_SWALLOWED, other), other
    for name in ("sdpa-flash", "keras-torch", "hf-sdpa"):
        a = get(name)
        if "nonfinite_inputs_propagate" in a.known_failures:
            assert a.classify("nonfinite_inputs_propagate", seen)[0] == "known"
