"""fp8 inputs with descales (issue 23): the Spec fields and their errors, the float64 reference against an
independent formula, naive's FA3-like path, recipes (descales drawn per (batch, kv head), saturating quantization,
V column-major) that replay from a saved case, the fp8 tolerance, the properties fp8_matches_reference and
descale_linearity (which must reject an adapter that ignores descales), the zoo's fp8 members (each caught by the
ci profile within 60 s), a user's file adapter claiming fp8 + descales only, and sinks / chunks replayed from a
saved case."""
from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

import attnverify as av
from attnverify.adapters.naive import naive_attention
from attnverify.adapters.registry import get
from attnverify.case import CaseRecipe, build_case, load_case
from attnverify.check import check
from attnverify.fp8 import DESCALE_KINDS, quantize
from attnverify.properties import get_property
from attnverify.properties.driver import PropertySkipped, run_property
from attnverify.properties.fp8 import DescaleLinearity
from attnverify.reference import reference_backward, reference_forward
from attnverify.strategies import attention_cases
from attnverify.tolerances import UNIT_ROUNDOFF, tolerance_for
from attnverify.zoo import get_member
from attnverify.zoo._fp8 import FP8, FP8_BUGS, fp8_attend
from attnverify.zoo.selftest import run_member

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
E4M3 = "float8_e4m3fn"
E5M2 = "float8_e5m2"
MEMBERS = ("fp8-descale-dropped", "fp8-descale-twice", "fp8-v-descale-on-p", "fp8-p-cast-before-max")
FP8_PROPS = ("fp8_matches_reference", "descale_linearity")


def _run(prop, adapter, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_property(get_property(prop), adapter, profile="ci", seed=0, database=None,
                            report_dir="reports/test", **kw)


def _case(**kw):
    base = dict(batch=2, heads_q=4, heads_kv=2, len_q=9, len_k=37, head_dim=32, dtype=E4M3, descales="random",
                return_lse=True, seed=5)
    return build_case(CaseRecipe(**{**base, **kw}))


# ------------------------------------------------------------------------------------------ Spec, reference

@pytest.mark.parametrize("value, match", [
    ([[1.0]], "q_descale"), (torch.ones(2), "q_descale"), (torch.ones(2, 2, dtype=torch.int32), "q_descale"),
    (-torch.ones(1, 1), "finite and > 0"), (torch.tensor([[math.nan]]), "finite and > 0"),
    (torch.zeros(1, 1), "finite and > 0"),
])
def test_spec_rejects_bad_descales_by_name(value, match):
    with pytest.raises(ValueError, match=match):
        av.Spec(q_descale=value)


def test_reference_rejects_a_descale_of_the_wrong_shape_naming_it():
    c = _case()
    bad = c.spec.replace(k_descale=torch.ones(2, 4))  # (B, Hq) instead of (B, Hkv)
    with pytest.raises(ValueError, match=r"k_descale has shape \(2, 4\); expected \(B, Hkv\) = \(2, 2\)"):
        reference_forward(c.q, c.k, c.v, bad)
    with pytest.raises(ValueError, match="forward only"):
        reference_backward(c.q, c.k, c.v, c.spec, torch.ones(2, 4, 9, 32))


@pytest.mark.parametrize("causal", ["none", "bottom_right"])
def test_reference_applies_descales_per_batch_and_kv_head(causal):
    """The contract's formula written out with explicit loops over (b, h) and torch.softmax."""
    c = _case(causal=causal)
    s = c.spec
    assert s.q_descale.shape == (2, 2) and len(set(s.k_descale.flatten().tolist())) == 4  # varies per (b, h)
    res = reference_forward(c.q, c.k, c.v, s)
    b, hq, lq, d = c.q.shape
    g = hq // c.k.shape[1]
    for bi in range(b):
        for h in range(hq):
            kh = h // g
            q = c.q[bi, h].double() * float(s.q_descale[bi, kh])
            k = c.k[bi, kh].double() * float(s.k_descale[bi, kh])
            v = c.v[bi, kh].double() * float(s.v_descale[bi, kh])
            sc = q @ k.T / math.sqrt(d)
            if causal == "bottom_right":
                sc = sc.masked_fill(torch.ones(lq, k.shape[0], dtype=torch.bool).tril(k.shape[0] - lq).logical_not(),
                                    -math.inf)
            torch.testing.assert_close(res.out[bi, h], torch.softmax(sc, -1) @ v, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(res.lse[bi, h], torch.logsumexp(sc, -1), rtol=1e-12, atol=1e-12)
    # a descale ignored is a different answer: the reference does read them
    plain = reference_forward(c.q, c.k, c.v, s.replace(v_descale=None))
    assert not torch.allclose(plain.out, res.out)


# ----------------------------------------------------------------------------------------- recipes, naive

@pytest.mark.parametrize("kind", DESCALE_KINDS)
def test_recipes_quantize_per_kv_head_and_replay_from_a_saved_case(kind, tmp_path):
    c = _case(descales=kind, layout="v_colmajor", dominant_key=30, dominant_gap=8.0)
    assert c.q.dtype == torch.float8_e4m3fn and c.v.stride(-2) == 1 and c.k.is_contiguous()
    if kind == "amax":  # amax / 448: the largest element of each (b, kv head) lands on 448
        amax = c.k.float().abs().reshape(2, 2, -1).amax(-1)
        assert torch.equal(amax, torch.full_like(amax, 448.0))
    if kind == "pow2":
        e = torch.log2(c.spec.v_descale.double())
        assert torch.equal(e, e.round())
    c2 = load_case(c.save(str(tmp_path / "case.json")))
    for n in ("q", "k", "v"):
        assert torch.equal(getattr(c, n).view(torch.uint8), getattr(c2, n).view(torch.uint8))
        assert torch.equal(getattr(c.spec, f"{n}_descale"), getattr(c2.spec, f"{n}_descale"))


def test_quantize_saturates_and_recipes_refuse_descales_without_fp8():
    x = torch.tensor([1000.0, -1000.0, 1.0], dtype=torch.float64).view(1, 1, 1, 3)
    assert quantize(x, None, E4M3).float().flatten().tolist() == [448.0, -448.0, 1.0]
    with pytest.raises(ValueError, match="descales"):
        build_case(CaseRecipe(dtype="float16", descales="amax"))
    with pytest.raises(ValueError, match="descales"):
        build_case(CaseRecipe(dtype=E4M3, descales="per_token"))


@pytest.mark.parametrize("dtype", [E4M3, "float8_e5m2"])
def test_naive_fp8_is_close_to_the_reference_forward_only(dtype):
    c = _case(dtype=dtype, causal="bottom_right", layout="v_colmajor")
    res = check(get("naive"), c)
    assert res.passed, res.message()
    assert [x.name for x in res.comparisons] == ["out", "lse"]  # forward only, whatever backward claims
    assert any("forward only" in n for n in res.notes)
    assert res.outputs["out"].dtype == torch.bfloat16
    u = UNIT_ROUNDOFF[dtype]
    assert 0 < res.comparisons[0].rel_l2 < u  # P's rounding shows, below one u


def test_fp8_tolerance_follows_p_for_out_and_float32_for_the_lse():
    out, lse = tolerance_for("out", E4M3), tolerance_for("lse", E4M3)
    assert out.norm == pytest.approx(0.5 * 2.0**-4) and out.elem_u == pytest.approx(3.0)
    assert tolerance_for("out", E4M3, baseline_rel_l2=0.1).norm == pytest.approx(0.3)  # 3x naive's own error
    assert lse.norm == pytest.approx(4.0 * 4.0 * 2.0**-24)  # the float32 floor, not fp8's u
    assert tolerance_for("out", "float8_e5m2").norm == pytest.approx(2 * out.norm)


def test_the_fp8_bound_rejects_an_output_off_by_a_few_percent():
    """naive within the bound; the same output 10% off (a descale rounded to a power of two, say) is not."""
    c = _case(descales="amax")
    good = check(get("naive"), c)
    assert good.passed

    @av.adapter("off10", register=False, dtypes=(E4M3,), descales=True, gqa=True, lse=True)
    def off(q, k, v, spec):
        o = naive_attention(q, k, v, spec)
        return av.Output(o.out * 1.1, lse=o.lse)

    assert not check(off, c).passed


def test_general_draws_leave_fp8_to_the_fp8_properties():
    from hypothesis import given, settings

    seen = set()

    @settings(max_examples=40, database=None, deadline=None)
    @given(attention_cases(adapter=get("naive"), profile="ci"))
    def draw(r):
        seen.add(r.dtype)

    draw()
    assert not any(d.startswith("float8") for d in seen)
    fp8_only = av.adapter("fp8only", register=False, dtypes=(E4M3,), descales=True)(lambda *a: None)
    with pytest.raises(Exception, match="fp8 dtypes are drawn only when named"):
        attention_cases(adapter=fp8_only, profile="ci")


# ------------------------------------------------------------------------------------------- properties

@pytest.mark.parametrize("prop", FP8_PROPS)
def test_naive_and_an_fa3_like_engine_hold(prop):
    run = _run(prop, get("naive"), max_examples=8)
    assert run.statuses.get("passed", 0) >= 5
    ok = av.adapter("zoo-fp8-ok", register=False, **FP8)(lambda q, k, v, s: fp8_attend(q, k, v, s))
    run = _run(prop, ok, max_examples=8)
    assert run.statuses.get("passed", 0) >= 5


def _ignores(which, dtype=E4M3):
    @av.adapter(f"ignores-{which}", register=False, dtypes=(dtype,), descales=True, gqa=True, lse=True,
                causal=("none", "bottom_right"))
    def impl(q, k, v, spec):
        return naive_attention(q, k, v, spec.replace(**{f"{which}_descale": None}))

    return impl


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_descale_linearity_rejects_an_adapter_that_ignores_a_descale(which):
    c = _case(descales="uniform", q_std=0.5, k_std=0.5, v_std=0.5)  # room to scale both ways exactly
    prop = DescaleLinearity()
    held = prop.judge(get("naive"), c, {"tensor": which, "factor": 0.5})
    assert held.passed, held.message
    res = prop.judge(_ignores(which), c, {"tensor": which, "factor": 0.5})
    assert not res.passed and "differs from the first" in res.message, res.message
    with pytest.raises(AssertionError, match="descale_linearity"):
        _run("descale_linearity", _ignores(which))


@pytest.mark.parametrize("which", ["k", "v"])
def test_descale_linearity_scales_an_expanded_kv_input(which):
    """k and v of layout expanded_kv are stride-0 views over the batch: the scaled input keeps that layout (it used
    to raise 'more than one element of the written-to tensor refers to a single memory location')."""
    c = _case(descales="uniform", layout="expanded_kv", dominant_key=0, dominant_gap=30.0)
    assert 0 in getattr(c, which).stride()
    prop = DescaleLinearity()
    held = prop.judge(get("naive"), c, {"tensor": which, "factor": 2.0})
    assert held.passed, held.message
    res = prop.judge(_ignores(which), c, {"tensor": which, "factor": 2.0})
    assert not res.passed and "descale_linearity FAILED" in res.message, res.message


def _flushes_subnormals():
    """A correct engine whose matrix unit flushes subnormal fp8 operands to 0 (as the H200's fp8 dots appear to)."""
    @av.adapter("flushes-fp8-subnormals", register=False, dtypes=(E4M3, E5M2), descales=True, gqa=True, lse=True,
                causal=("none", "bottom_right"))
    def impl(q, k, v, spec):
        def flush(x):
            a = x.float().abs()
            return torch.where((a > 0) & (a < torch.finfo(x.dtype).tiny), 0.0, x.float()).to(x.dtype)

        return naive_attention(flush(q), flush(k), flush(v), spec)

    return impl


@pytest.mark.parametrize("factor", [2.0, 4.0, 0.25])
def test_descale_linearity_keeps_subnormal_operands_out_of_the_bitwise_comparison(factor):
    """On the H200 every descale_linearity failure of the bundled kernel (31, e5m2) scaled a v holding subnormal
    elements; a scaling that turns one normal changes what a flushing matrix unit sees. The drawn input's subnormals
    are set to 0 in both calls, so such an engine holds, while one that ignores v's descale still fails."""
    c = _case(dtype=E5M2, descales="uniform", v_std=0.5)
    v = c.v.float().clone()
    v[..., 0] = 0.0
    v[:, :, 3, 0] = 2.0**-16  # e5m2's smallest subnormal, alone in column 0: out[..., 0] is its contribution only
    c = dataclasses.replace(c, v=v.to(torch.float8_e5m2))
    prop = DescaleLinearity()
    res = prop.judge(_flushes_subnormals(), c, {"tensor": "v", "factor": factor})
    assert res.passed, res.message
    assert prop.judge(get("naive"), c, {"tensor": "v", "factor": factor}).passed
    bad = prop.judge(_ignores("v", E5M2), c, {"tensor": "v", "factor": factor})
    assert not bad.passed and "subnormal element(s) of the drawn v set to 0" in bad.message, bad.message


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_descale_linearity_catches_a_descale_read_for_the_wrong_batch_and_kv_head(which):
    """One factor for the whole tensor cannot see it (x f d[b', h'] / f = x d[b', h'] in both calls); a power of two
    that differs per (batch, kv head) does. Before: an adapter reading each descale flipped passed at f = 2."""
    c = _case(descales="uniform", q_std=0.5, k_std=0.5, v_std=0.5)

    @av.adapter(f"flips-{which}", register=False, dtypes=(E4M3,), descales=True, gqa=True, lse=True,
                causal=("none", "bottom_right"))
    def flips(q, k, v, spec):
        d = getattr(spec, f"{which}_descale")
        return naive_attention(q, k, v, spec.replace(**{f"{which}_descale": d.flip(0).flip(1)}))

    prop = DescaleLinearity()
    assert prop.judge(get("naive"), c, {"tensor": which, "factor": 2.0}).passed
    res = prop.judge(flips, c, {"tensor": which, "factor": 2.0})
    assert not res.passed and "differs from the first" in res.message and "mod 3" in res.message, res.message


def test_descale_linearity_judges_a_re_rounded_input_against_the_reference():
    """A factor of 1.5 re-rounds the input: not bitwise, but the scaled call must still match the reference."""
    c = _case(descales="random")
    prop = DescaleLinearity()
    assert prop.judge(get("naive"), c, {"tensor": "q", "factor": 1.5}).passed
    res = prop.judge(_ignores("q"), c, {"tensor": "q", "factor": 1.5})
    assert not res.passed and "not exact" in res.message


def test_fp8_properties_skip_naming_the_missing_claim():
    plain = av.adapter("plain32", register=False)(lambda q, k, v, s: q)
    with pytest.raises(PropertySkipped, match="plain32 does not claim an fp8 dtype"):
        _run("fp8_matches_reference", plain)
    nodesc = av.adapter("fp8-nodesc", register=False, dtypes=(E4M3,))(lambda q, k, v, s: naive_attention(q, k, v, s).out)
    with pytest.raises(PropertySkipped, match="fp8-nodesc does not claim descales"):
        _run("descale_linearity", nodesc)
    assert _run("fp8_matches_reference", nodesc, max_examples=5).statuses.get("passed", 0) >= 3


@pytest.mark.parametrize("bug", FP8_BUGS)
def test_each_fp8_bug_is_live(bug):
    c = _case(descales="amax", dominant_key=3, dominant_gap=12.0, head_dim=64)
    good, bad = fp8_attend(c.q, c.k, c.v, c.spec), fp8_attend(c.q, c.k, c.v, c.spec, bug)
    assert not (torch.allclose(good.out.float(), bad.out.float(), rtol=0.05, atol=0.01)
                and torch.allclose(good.lse, bad.lse, rtol=1e-3, atol=1e-3))


@pytest.mark.parametrize("name", MEMBERS)
def test_fp8_member_caught_by_the_ci_profile_within_60s(name):
    m = get_member(name)
    res = run_member(m, profile="ci", seed=0, diagnose=False)
    assert res.status == "caught" and res.caught_by in m.expected, (res.status, res.caught_by, res.reason)
    assert res.first_seconds < 60, f"{name}: first failure after {res.first_seconds:.1f} s"


# ---------------------------------------------------------------------------------- a user's file adapter

STRANGER = '''
"""A user's fp8 kernel: dequantizes with its per-(batch, kv head) descales and calls SDPA in float32; claims what
its docstring says: e4m3 only, descales, head dims 64/128, bottom-right causal only, GQA; no LSE."""
import torch
import attnverify as av


@av.adapter("my-fp8", dtypes=("float8_e4m3fn",), descales=True, head_dims=(64, 128), causal=("bottom_right",),
            gqa=True)
def my_fp8(q, k, v, spec):
    g = q.shape[1] // k.shape[1]

    def deq(x, d, rep):  # the descale of (batch, kv head) over that head's rows
        x = x.float()
        return x if d is None else x * d.float().repeat_interleave(rep, 1)[..., None, None]

    qf, kf, vf = deq(q, spec.q_descale, g), deq(k, spec.k_descale, 1), deq(v, spec.v_descale, 1)
    kf, vf = kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1)
    L, M = q.shape[2], k.shape[2]
    mask = torch.ones(L, M, dtype=torch.bool).tril(M - L)
    out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=spec.scale)
    return torch.nan_to_num(out).to(torch.bfloat16)  # rows that see no key: 0
'''


def test_a_file_adapter_claiming_only_fp8_and_descales_passes_and_a_broken_one_fails(pytester):
    pytester.makefile(".py", my_kernel=STRANGER)
    broken = STRANGER.replace('"my-fp8"', '"my-fp8-broken"').replace("deq(v, spec.v_descale, 1)", "deq(v, None, 1)")
    pytester.makefile(".py", my_broken=broken)
    args = ("-v", "-rs", "-k", "fp8 or descale or forward_matches", "--attn-profile=ci", "--attn-max-examples=6",
            "-p", "no:randomly")
    res = pytester.runpytest("--adapter=my_kernel.py:my_fp8", *args)
    out = res.stdout.str()
    assert res.ret == 0, out
    res.stdout.fnmatch_lines(["*test_fp8_matches_reference?my-fp8? PASSED*", "*test_descale_linearity?my-fp8? PASSED*"])
    assert "test_forward_matches_reference[my-fp8] SKIPPED" in out or "forward_matches_reference" not in out
    res = pytester.runpytest("--adapter=my_broken.py:my_fp8", *args)
    out = res.stdout.str()
    assert res.ret != 0, out
    assert "test_fp8_matches_reference[my-fp8-broken] FAILED" in out
    assert "test_descale_linearity[my-fp8-broken] FAILED" in out


# ----------------------------------------------------------------------------- sinks and chunks replay

def test_a_saved_sink_and_chunk_case_replays_with_them(tmp_path):
    from attnverify.properties.sinks import with_chunk, with_sinks
    from attnverify.zoo._sinks import SINKS, sinks_attend

    c = build_case(CaseRecipe(heads_q=2, len_q=12, len_k=12, head_dim=16, return_lse=True, seed=4))
    c = with_sinks(with_chunk(c, 4), {"sinks": {"kind": "normal", "level": 2.0, "seed": 1}})
    c2 = load_case(c.save(str(tmp_path / "sinks.json")))
    assert torch.equal(c2.spec.sinks, c.spec.sinks) and c2.spec.attention_chunk == 4
    assert check(get("naive"), c2).passed
    # a kernel wrong only in its sinks is still caught on the replayed case (the sinks came back)
    wrong = av.adapter("sinks-wrong", register=False, **dict(SINKS, attention_chunk=True))(
        lambda q, k, v, s: sinks_attend(q, k, v, s, "sink_numerator"))
    assert not check(wrong, c2).passed
    assert check(wrong, load_case(c.save(str(tmp_path / "plain.json")))).passed is False
    plain = build_case(c.recipe.__class__(**{**c.recipe.to_dict(), "sinks": None}))
    assert check(wrong, plain).passed  # without its sinks the case could not show the bug


def test_sinks_match_reference_draws_chunks_with_the_sinks_for_naive():
    from hypothesis import given, settings

    prop = get_property("sinks_match_reference")
    seen = []

    @settings(max_examples=40, database=None, deadline=None)
    @given(prop.strategy(get("naive"), "ci", "cpu"))
    def draw(d):
        seen.append(d.get("attention_chunk"))

    draw()
    assert any(x for x in seen) and any(x is None for x in seen)
    keys = set()

    @settings(max_examples=5, database=None, deadline=None)
    @given(prop.params(get_member("sink-in-numerator").adapter))  # claims sinks, not attention_chunk
    def params(d):
        keys.update(d)

    params()
    assert keys == {"sinks"}
