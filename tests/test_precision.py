"""Precision bugs (issue 20): the per-case tolerance catches kernels that are wrong by a few roundings,
passes a correct FlashAttention-style kernel written the way a user would write one, and the
diagnosis names precision rather than semantics.

The zoo members of the precision class (attnverify/zoo/_precision.py) are each run through the ci
profile by `attnverify selftest`'s engine: caught within 60 s, by an expected property, with a
diagnosis naming precision.
"""
import math

import pytest
import torch

import attnverify as av
from attnverify.adapters import registry
from attnverify.tolerances import (PER_CASE_FACTOR, ROUNDING_FACTOR, expected_rounding, tolerance_for,
                                   unit_roundoff)
from attnverify.zoo import get_member
from attnverify.zoo._precision import PRECISION_MEMBERS, precision_attention
from attnverify.zoo.selftest import run_member


# ------------------------------------------------------------------------------------------------
# the rule


def test_per_case_rule_follows_the_case_and_keeps_the_constant_floor_where_the_baseline_says_nothing():
    u16 = unit_roundoff("float16")
    t = tolerance_for("out", "float16", baseline_rel_l2=1e-5, rounding_rel_l2=2e-5)
    assert t.norm == pytest.approx(max(PER_CASE_FACTOR["out"] * 1e-5, ROUNDING_FACTOR["out"] * 2e-5))
    assert t.norm < 0.2 * 1.5 * u16  # far below the old constant floor
    # the score-conditioning term joins the rounding floor
    s = tolerance_for("out", "float16", baseline_rel_l2=1e-5, rounding_rel_l2=2e-5, score_max=1000.0)
    assert s.norm > t.norm
    # degenerate: a baseline of exactly 0, no baseline, float32 inputs, no rounding given -> the constant floor
    for kw in ({"baseline_rel_l2": 0.0, "rounding_rel_l2": 2e-5}, {"rounding_rel_l2": 2e-5},
               {"baseline_rel_l2": 1e-5}):
        assert tolerance_for("out", "float16", **kw).norm >= 1.5 * u16
    assert tolerance_for("out", "float32", baseline_rel_l2=1e-9, rounding_rel_l2=1e-9).norm == pytest.approx(
        tolerance_for("out", "float32").norm)
    # gradients keep the constant floor (a 2-key dQ is a cancellation the baseline cannot speak for) and follow
    # the case only upwards
    for o in ("dq", "dk", "dv"):
        const = tolerance_for(o, "float16").norm
        assert tolerance_for(o, "float16", baseline_rel_l2=1e-6, rounding_rel_l2=1e-6).norm == pytest.approx(const)
        big = tolerance_for(o, "float16", baseline_rel_l2=1e-2, rounding_rel_l2=1e-6).norm
        assert big == pytest.approx(PER_CASE_FACTOR[o] * 1e-2) and big > const
    # the LSE is float32 whatever the input dtype: the float32 floor, not fp16's
    lse = tolerance_for("lse", "float16", baseline_rel_l2=1e-8, rounding_rel_l2=1e-8)
    assert lse.norm < 1e-5 < tolerance_for("lse", "float16").norm


def test_expected_rounding_is_the_expectation_not_the_realisation():
    ref = torch.full((4, 64), 3.0, dtype=torch.float64)  # exactly representable: realised rounding 0
    r = expected_rounding(ref, "float16")
    assert r == pytest.approx(2 * unit_roundoff("float16") / math.sqrt(12) * 2 / 3, rel=1e-6)  # gap 2^-9 at 3
    assert expected_rounding(ref, "float16", scale_floor=30.0) == pytest.approx(r / 10, rel=1e-6)
    assert expected_rounding(ref, "float64") == 0.0
    ign = torch.zeros(4, 1, dtype=torch.bool)
    ign[0] = True
    assert expected_rounding(ref, "float16", ignore=ign) == pytest.approx(r, rel=1e-6)


# ------------------------------------------------------------------------------------------------
# a correct FlashAttention-style kernel passes; its one-rounding-off variants fail


def _recipe(dtype, **kw):
    base = dict(batch=1, heads_q=2, heads_kv=2, len_q=64, len_k=192, head_dim=64, dtype=dtype, return_lse=True)
    base.update(kw)
    return av.CaseRecipe(**base)


@av.adapter("user-flash-fp32acc", register=False, dtypes=("float16", "bfloat16"), head_dims=lambda d: d % 8 == 0,
            causal=("none", "bottom_right"), gqa=True, lse=True, backward=True, alibi=True, softcap=True,
            fully_masked="zeros")
def user_flash(q, k, v, spec):
    """A user's FlashAttention-2-style kernel (tiles of 16 keys, exp2, P rounded, float32 accumulators)."""
    return precision_attention(q, k, v, spec, None)


CORRECT_CASES = [
    {}, {"v_mean": 10.0}, {"q_std": 3.2, "k_std": 3.2}, {"len_q": 1, "len_k": 200}, {"row_shift": -1000.0},
    {"causal": "bottom_right", "alibi": True}, {"softcap": 5.0, "heads_kv": 1}, {"late_from": 150, "late_boost": 8.0},
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kw", CORRECT_CASES, ids=lambda kw: ",".join(kw) or "plain")
def test_a_correct_flash_style_kernel_passes_the_per_case_bound(dtype, kw):
    res = av.check(user_flash, av.build_case(_recipe(dtype, len_k=kw.pop("len_k", 192), **kw)), backward=True)
    assert res.passed, res.message()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tile_wise_half_accumulation_is_caught_on_plain_inputs(dtype):
    """The issue's measurement: P@V accumulated in the input dtype (16-key tiles) on zero-mean inputs was
    6x inside the constant floor at every length; with the per-case bound it fails from ~128 keys, while
    the same kernel with a float32 accumulator passes."""
    bad = get_member("flash-pv-acc-half").adapter
    for lk in (200, 1024):
        case = av.build_case(_recipe(dtype, len_k=lk))
        res = av.check(bad, case, backward=False)
        assert res.status == "failed" and not res.comparisons[0].passed, res.message()
        assert av.check(user_flash, case, backward=False).passed
        assert av.check(registry.get("naive"), case, backward=False).passed


# ------------------------------------------------------------------------------------------------
# the zoo members, through the ci profile


@pytest.mark.parametrize("name", PRECISION_MEMBERS)
def test_precision_member_is_caught_by_the_ci_profile_within_60s_and_diagnosed_as_precision(name, tmp_path):
    m = get_member(name)
    r = run_member(m, profile="ci", seed=0, report_dir=str(tmp_path), shrink_budget_s=3.0)
    assert r.status == "caught", (r.status, r.reason, r.finding)
    assert r.expected, f"caught by {r.caught_by}, not by one of {m.expected}"
    assert r.first_seconds is not None and r.first_seconds <= 60.0, r.first_seconds
    assert r.diagnosis.startswith("precision, not semantics"), r.diagnosis


def test_the_bug_free_precision_kernel_is_not_flagged_by_the_same_machinery(tmp_path):
    """The control: the members' engine with no bug, through the same ci properties (corpus first)."""
    from attnverify.zoo import ZooMember

    props = ("forward_matches_reference", "lse_matches_reference", "gradients_match_reference")
    ctl = ZooMember("control-flash", "no bug", "control", user_flash, props, "eager")
    r = run_member(ctl, profile="ci", seed=0, report_dir=str(tmp_path), max_examples=8, properties=props)
    assert r.status == "missed", f"the bug-free kernel was flagged: {r.caught_by}: {r.finding} ({r.case})"


def test_a_semantic_bug_is_not_called_precision():
    from attnverify.diagnose import diagnose_result

    m = get_member("scale-missing")
    res = av.check(m.adapter, av.build_case(_recipe("float16", len_k=64, return_lse=False)), backward=False)
    assert res.status == "failed"
    assert not diagnose_result(res, adapter=m.adapter).summary.startswith("precision")


@pytest.mark.parametrize("name", ["bwd-dk-missing-scale", "bwd-always-causal"])
def test_a_backward_semantic_bug_is_not_called_precision(name):
    """The diagnosis counts a gradient error within PRECISION_MAX_BOUND times its bound as precision (against a
    cancelling sum a few roundings read as tens of u); a backward semantic bug is far outside that."""
    from attnverify.diagnose import diagnose_result

    m = get_member(name)
    res = av.check(m.adapter, av.build_case(_recipe("float16", len_k=64, return_lse=False)), backward=True)
    assert res.status == "failed"
    assert not diagnose_result(res, adapter=m.adapter).summary.startswith("precision")


def test_the_backward_members_corpus_entries_catch_them_and_pass_a_correct_kernel():
    """The two backward corpus entries (attnverify/strategies/_corpus.py): each catches its member (over its bound,
    within PRECISION_MAX_BOUND of it), and a user's kernel with float32 accumulators and naive pass both."""
    from attnverify.precision_diagnosis import PRECISION_MAX_BOUND
    from attnverify.strategies import corpus

    entries = {r.tags[0]: r for r in corpus(user_flash, profile="ci")}
    for label, member in (("backward-dominant-first-key-offset", "flash-bwd-ds-acc-half"),
                          ("backward-dominant-key-wide-head", "flash-bwd-delta-half")):
        case = av.build_case(entries[label])
        bad = av.check(get_member(member).adapter, case, backward=True)
        assert bad.status == "failed", (label, member)
        worst = max(max(c.rel_l2 / c.tol_norm, c.max_abs / c.allowed_at_worst) for c in bad.comparisons if not c.passed)
        assert 1.0 < worst and all(c.rel_l2 <= PRECISION_MAX_BOUND * c.tol_norm for c in bad.comparisons), label
        for good in (user_flash, registry.get("naive")):
            res = av.check(good, case, backward=True)
            assert res.passed, (label, good.name, res.message())


def test_rows_declared_nan_are_left_out_of_the_baseline_too():
    """A user's kernel that returns NaN on rows with no visible key (declared): those rows are not compared,
    so they must not dilute the baseline's error either (half the rows counted would tighten the bound by
    sqrt(2) and fail a kernel exactly as accurate as naive)."""
    from attnverify.adapters.naive import naive_attention

    @av.adapter("user-nan-rows", register=False, dtypes=("float16", "bfloat16"), attn_mask=True, fully_masked="nan")
    def nan_rows(q, k, v, spec):
        o = naive_attention(q, k, v, spec).out
        dead = ~spec.attn_mask.any(-1, keepdim=True)
        return torch.where(dead.expand_as(o), torch.full_like(o, math.nan), o)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g).half() for n in (64, 96, 96))
    mask = torch.rand(1, 1, 64, 96, generator=g) > 0.3
    mask[..., ::2, :] = False  # every other row sees nothing
    res = av.check(nan_rows, av.Case(q, k, v, av.Spec(attn_mask=mask)), backward=False)
    assert res.passed, res.message()
    out = res.comparisons[0]
    assert out.rel_l2 <= out.tol_norm / PER_CASE_FACTOR["out"] * 1.0001  # naive's own error: 1/Kc of the bound at most


# ------------------------------------------------------------------------------------------------
# a norm over a few elements: the constant floor (tolerances.PER_CASE_MIN_N)


@av.adapter("user-one-ulp-off", register=False, dtypes=("bfloat16",), head_dims=lambda d: True)
def one_ulp_off(q, k, v, spec):
    """A kernel whose output is the exact answer rounded to bf16, every other element then one bf16 ulp further
    away: within a spacing of the answer everywhere, as a correct kernel that rounds P may be."""
    o = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5, -1) @ v.double()
    r = o.to(torch.bfloat16)
    away = torch.nextafter(r, torch.where(r.double() >= o, math.inf, -math.inf).to(r.dtype))
    return torch.where(torch.arange(r.numel()).view(r.shape) % 2 == 0, away, r)


def test_a_norm_over_few_elements_is_held_to_the_constant_floor(monkeypatch):
    """The H200 calibration's one false positive (sdpa-efficient bf16, Lq=1 D=16: 16 elements, 2.33x the expected
    rounding, every element within its bound): the norm of a few roundings does not concentrate, so below
    PER_CASE_MIN_N elements the per-case factor gives way to the constant floor. Larger cases keep the per-case
    rule: the same kernel fails there."""
    from attnverify import tolerances

    u = unit_roundoff("bfloat16")
    few = tolerance_for("out", "bfloat16", baseline_rel_l2=1e-4, rounding_rel_l2=8e-4, judged_n=16)
    many = tolerance_for("out", "bfloat16", baseline_rel_l2=1e-4, rounding_rel_l2=8e-4, judged_n=64)
    assert few.norm == pytest.approx(tolerance_for("out", "bfloat16").norm) and few.norm >= 1.5 * u
    assert many.norm == pytest.approx(ROUNDING_FACTOR["out"] * 8e-4)
    for o in ("lse", "dq"):  # the LSE and the gradients keep their own rules whatever the count
        assert tolerance_for(o, "float16", baseline_rel_l2=1e-2, rounding_rel_l2=1e-6, judged_n=4).norm == \
            pytest.approx(tolerance_for(o, "float16", baseline_rel_l2=1e-2, rounding_rel_l2=1e-6).norm)

    def case(lq, seed):
        return av.build_case(av.CaseRecipe(batch=1, heads_q=1, heads_kv=1, len_q=lq, len_k=17, head_dim=16,
                                           dtype="bfloat16", seed=seed))

    tiny = [case(1, s) for s in (1, 2)]
    for c in tiny:
        assert av.check(one_ulp_off, c).passed
    monkeypatch.setattr(tolerances, "PER_CASE_MIN_N", 0)  # the rule before: the same tiny cases fail
    for c in tiny:
        res = av.check(one_ulp_off, c)
        assert not res.passed and "norm-wise error is not" in res.message(), res.message()
    monkeypatch.undo()
    for s in (0, 1, 2):  # 1,024 elements: the per-case rule holds the same kernel to the rounding it should meet
        res = av.check(one_ulp_off, case(64, s))
        assert not res.passed and res.comparisons[0].judged >= tolerances.PER_CASE_MIN_N
