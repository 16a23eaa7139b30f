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

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from attnverify.adapters import _external
from attnverify.adapters.registry import BUILTINS, all_adapters, get
from attnverify.case import CaseRecipe, build_case
from attnverify.check import check, unclaimed
from attnverify.properties import PROPERTIES, get_property
from attnverify.properties.driver import run_property

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

EXTERNAL = ("flex", "flash-attn", "flash-attn-kvcache", "flash-attn3", "xformers", "flashinfer", "jax", "te")
LIBRARY = {  # adapter -> the module whose absence makes it unavailable
    "flash-attn": "flash_attn", "flash-attn-kvcache": "flash_attn", "xformers": "xformers",
    "flashinfer": "flashinfer", "jax": "jax", "te": "transformer_engine",
}
LIB_MODULES = ("jax", "jaxlib", "xformers", "flash_attn", "flash_attn_interface", "flash_attn_3", "flashinfer",
               "transformer_engine")
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
        import json, sys
        import attnverify.adapters.flex, attnverify.adapters.flash_attn, attnverify.adapters.xformers_adapter
        import attnverify.adapters.flashinfer_adapter, attnverify.adapters.jax_adapter, attnverify.adapters.te_adapter
        from attnverify.adapters.registry import get
        for n in %r:
            get(n)
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
        if lib and not _external.installed(lib):
            assert why and "not installed" in why and "pip install" in why, (name, why)
        elif name in ("flash-attn", "flash-attn-kvcache", "flash-attn3", "xformers", "flashinfer", "te") and CPU_ONLY:
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
        for name in ("flash-attn", "xformers", "flashinfer", "te"):
            assert rows[name]["status"].startswith("unavailable: ")


def test_default_run_on_this_machine_includes_flex_and_jax():
    import io

    from attnverify.cli import default_adapters

    out = io.StringIO()
    names = default_adapters(out)
    assert "flex" in names
    if HAS_JAX:
        assert "jax" in names
    for line in out.getvalue().splitlines():
        assert line.startswith("attnverify run: skipping ") and ": " in line[len("attnverify run: skipping "):]


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


# ------------------------------------------------------------------------------------------ flex


def _check_all(adapter, recipes):
    bad = []
    for r in recipes:
        case = build_case(CaseRecipe(**r))
        why = unclaimed(adapter, case)
        assert why is None, (r, why)
        res = check(adapter, case, backward=False)
        if not res.passed:
            bad.append(res.message()[:2000])
    assert not bad, "\n\n".join(bad)


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
    """How backward=False was established: inductor refuses to lower flex_attention with gradients."""
    from attnverify.adapters.flex import _compiled

    q = torch.randn(1, 1, 16, 16, requires_grad=True)
    with pytest.raises(Exception, match="only supports inference"):
        _compiled()(q, q, q)


@pytest.mark.slow
@pytest.mark.parametrize("prop", [p.name for p in PROPERTIES])
def test_flex_ci_profile(prop, tmp_path):
    _run_profile("flex", prop, tmp_path)


# ------------------------------------------------------------------------------------------- jax

needs_jax = pytest.mark.skipif(not HAS_JAX, reason="jax is not installed (pip install jax jaxlib)")


def _run_profile(name, prop, tmp_path, max_examples=None):
    a = get(name)
    why = a.unavailable_reason()
    if why:
        pytest.skip(f"{name} unavailable: {why}")
    p = get_property(prop)
    if p.skip_reason(a):
        pytest.skip(p.skip_reason(a))
    run_property(p, a, profile="ci", seed=0, max_examples=max_examples, database=None, report_dir=str(tmp_path))


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
    )]
    _check_all(get("jax"), recipes)


@needs_jax
def test_jax_refuses_what_its_api_does_not_express():
    a = get("jax")
    assert a.claims.causal == ("none", "top_left") and "float16" not in a.claims.dtypes or not CPU_ONLY
    win = build_case(CaseRecipe(len_q=10, len_k=20, window=(2, 2)))
    assert "top-left aligned" in unclaimed(a, win)
    lse16 = build_case(CaseRecipe(dtype="bfloat16", return_lse=True))
    assert "key dtype" in unclaimed(a, lse16)


@needs_jax
@pytest.mark.parametrize("prop", [p.name for p in PROPERTIES])
def test_jax_ci_profile(prop, tmp_path):
    _run_profile("jax", prop, tmp_path)
