"""Two edges of the bounds the H200 thorough run (2026-12-05) found. Flush-to-zero of float32 probabilities
(magnitudes.ftz_floors): a correct GPU kernel drops every P below float32's smallest normal; results only float32
subnormals could hold must not fail it, and nothing of normal size may hide behind the floor. Pairs of two rounded
values (tolerance_for's sides=2): an adapter's output held to another of its own outputs."""
from __future__ import annotations

import math

import pytest
import torch

import attnverify as av
from attnverify.case import CaseRecipe, build_case
from attnverify.check import check
from attnverify.magnitudes import FTZ_TINY, magnitudes
from attnverify.tolerances import tolerance_for

SINKS = {"kind": "normal", "level": 1.0, "seed": 3}


def _attend(q, k, v, spec, *, flush: bool, dv_scale: float = 1.0):
    """Float32 attention with a sink, P formed as a kernel forms it (max subtracted); flush=True drops every P below
    FTZ_TINY, as the GPU's flush-to-zero exp2 does. dv_scale scales the gradient reaching V (a wrong backward)."""
    scale = spec.resolved_scale(q.shape[-1])
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    sink = spec.sinks.float().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    m = torch.maximum(s.amax(-1, keepdim=True), sink).detach()
    p = torch.exp(s - m)
    if flush:
        p = torch.where(p < FTZ_TINY, torch.zeros_like(p), p)
    ps = torch.exp(sink - m)
    if flush:
        ps = torch.where(ps < FTZ_TINY, torch.zeros_like(ps), ps)
    l_ = p.sum(-1, keepdim=True) + ps
    vv = v.float()
    if dv_scale != 1.0 and vv.requires_grad:
        vv.register_hook(lambda g: g * dv_scale)  # the gradient reaching v, scaled
    out = (p @ vv) / l_
    lse = (m + torch.log(l_)).squeeze(-1)
    return out.to(q.dtype), lse


def _adapter(name, **kw):
    @av.adapter(name, register=False, dtypes=("float32",), lse=True, backward=True, sinks=True)
    def impl(q, k, v, spec):
        return _attend(q, k, v, spec, **kw)

    return impl


def _case(row_shift):
    return build_case(CaseRecipe(batch=1, heads_q=2, heads_kv=2, len_q=40, len_k=40, head_dim=16, dtype="float32",
                                 row_shift=row_shift, sinks=SINKS, return_lse=True, seed=4))


def test_a_flushing_kernel_passes_where_every_probability_is_below_float32s_normal_range():
    """Scores shifted by -100 under a sink: every P ~ e^-99, dV ~ 1e-41 (the H200 thorough run's failing shape)."""
    c = _case(-100.0)
    flushing = _adapter("ftz-kernel", flush=True)
    res = check(flushing, c, backward=True)
    assert res.passed, res.message()
    dv = next(x for x in res.comparisons if x.name == "dv")
    assert dv.max_abs > 0 and dv.max_abs < 1e-38  # dV was flushed: a real difference, held below float32's tiny


def test_the_floor_hides_no_error_of_normal_size():
    flushing = _adapter("ftz-kernel", flush=True)
    assert check(flushing, _case(0.0), backward=True).passed  # the same kernel on ordinary scores
    for c in (_case(0.0), _case(-100.0)):
        wrong = _adapter("dv-doubled", flush=True, dv_scale=2.0)
        res = check(wrong, c, backward=True)
        if c.recipe.row_shift == 0.0:
            assert not res.passed and any(x.name == "dv" and not x.passed for x in res.comparisons), res.message()
        else:  # every dV is below float32's smallest normal: no float32 kernel can be judged on it
            assert res.passed, res.message()
    # the output is judged as before: a kernel that ignores the sink fails on the shifted case
    no_sink = av.adapter("ignores-sink", register=False, dtypes=("float32",), lse=True, backward=True, sinks=True)(
        lambda q, k, v, spec: _attend(q, k, v, spec.replace(sinks=torch.full_like(spec.sinks, -math.inf)), flush=True))
    assert not check(no_sink, _case(-100.0), backward=False).passed


def test_the_floors_are_far_below_any_tolerance_of_ordinary_inputs():
    c = _case(0.0)
    f = {k[4:]: v for k, v in magnitudes(c).items() if k.startswith("ftz:")}
    assert set(f) == {"out", "dq", "dk", "dv", "dsinks", "lse"}
    assert 0 < max(f.values()) < 1e-33
    t = tolerance_for("dv", "float32", ftz_floor=f["dv"])
    plain = tolerance_for("dv", "float32")
    assert t.norm == plain.norm and t.elem_u == plain.elem_u and t.elem_floor == pytest.approx(f["dv"])


def test_a_reference_of_subnormals_admits_an_error_up_to_the_floor_and_no_more():
    from attnverify.compare import compare

    ref = torch.full((64,), 1e-41, dtype=torch.float64)
    t = tolerance_for("dv", "float32", ftz_floor=1e-39)
    assert compare("dv", torch.zeros(64), ref, t).passed
    assert not compare("dv", torch.full((64,), 2e-39), ref, t).passed
    assert not compare("dv", torch.zeros(64), ref, tolerance_for("dv", "float32")).passed


# ------------------------------------------------------------------ pairs of two rounded values (tolerance sides)

def test_two_rounded_sides_double_the_u_floors_and_not_the_baseline_terms():
    one = tolerance_for("out", "float32")
    two = tolerance_for("out", "float32", sides=2)
    assert two.norm == pytest.approx(2 * one.norm) and two.elem_u == pytest.approx(2 * one.elem_u)
    wide = tolerance_for("out", "float32", baseline_rel_l2=1e-3, baseline_max_abs=1e-3)
    wide2 = tolerance_for("out", "float32", baseline_rel_l2=1e-3, baseline_max_abs=1e-3, sides=2)
    assert wide2.norm == wide.norm and wide2.elem_floor == wide.elem_floor  # the baseline's pair is already a pair
    with pytest.raises(ValueError, match="sides"):
        tolerance_for("out", "float32", sides=3)


def test_a_pair_of_two_rounded_outputs_may_differ_by_both_errors_and_no_more():
    """The H200's lse_merge false positive: the full call and the merge of two partial calls, each a long float32
    sum of the kernel's, differed by 1.19x the bound of one output against the exact answer."""
    from attnverify.verdicts import compare_pairs

    g = torch.Generator().manual_seed(0)
    exact = torch.randn(4, 64, generator=g, dtype=torch.float64)
    one = tolerance_for("out", "float32")
    noise = torch.randn(4, 64, generator=g, dtype=torch.float64)
    noise = noise / noise.norm() * exact.norm()  # a relative L2 difference of 1 before scaling

    def pair(ratio):  # two outputs whose difference is `ratio` times one output's norm-wise bound
        a = exact + noise * one.norm * ratio / 2
        b = exact - noise * one.norm * ratio / 2
        return {"out": (a.float(), b)}

    kw = dict(score_max=0.0, scale_floors={})
    assert not compare_pairs(pair(1.5), "float32", **kw)[0].passed  # against one bound: fails
    assert compare_pairs(pair(1.5), "float32", sides=2, **kw)[0].passed
    assert not compare_pairs(pair(2.5), "float32", sides=2, **kw)[0].passed


def test_a_sink_far_below_the_scores_flushed_to_zero_leaves_dsinks_judged_at_the_floor():
    """The sink's gradient (properties.sinks.judge_dsinks) takes the same floor: a sink ~90 below every score has
    P_sink ~ e^-90, a float32 subnormal that a flushing exp2 drops (dsinks 0 against ~1e-39); one of normal size
    still fails."""
    from attnverify.properties import get_property
    from attnverify.properties.sinks import judge_dsinks, with_spec

    prop = get_property("sinks_match_reference")
    c = _case(0.0)
    far = with_spec(c, sinks=torch.full_like(c.spec.sinks, -88.0))  # P_sink ~ e^-90 ~ 1e-39: a float32 subnormal
    res = judge_dsinks(prop, _adapter("ftz-kernel", flush=True), far, {})
    assert res.passed, res.message
    assert judge_dsinks(prop, _adapter("exact-kernel", flush=False), far, {}).passed
    shifted = av.adapter("dsinks-off", register=False, dtypes=("float32",), lse=True, backward=True, sinks=True)(
        lambda q, k, v, spec: _attend(q, k, v, spec.replace(sinks=spec.sinks + 87.0), flush=True))
    assert not judge_dsinks(prop, shifted, far, {}).passed  # the sink read 87 too high: dsinks of normal size


def test_paged_equals_contiguous_takes_two_sides_only_where_both_calls_are_the_adapters(monkeypatch):
    """Against the adapter's own contiguous calls both sides are rounded (sides=2); where it does not claim them the
    float64 reference stands for them, exact (sides=1)."""
    import dataclasses

    from attnverify.adapters.registry import get
    from attnverify.properties import get_property
    from attnverify.properties import serving as sv

    sides = []
    real = sv.judge_pairs

    def spy(*a, **kw):
        sides.append(kw.get("sides", 1))
        return real(*a, **kw)

    monkeypatch.setattr(sv, "judge_pairs", spy)
    naive = get("naive")
    paged_only = dataclasses.replace(naive, name="naive-paged-only",
                                     refuses=lambda c: None if c.spec.cache_seqlens is not None else "paged calls only")
    case = build_case(CaseRecipe(batch=2, heads_q=2, heads_kv=1, len_q=1, len_k=20, head_dim=16, cache_lens=[20, 7],
                                 paged=True, page_size=4, num_pages=12, block_table=[[11, 3, 5, 0, 8], [2, 9, 1, 4, 6]],
                                 garbage="nan", dtype="float32", return_lse=True, seed=1))
    prop = get_property("paged_equals_contiguous")
    for adapter in (naive, paged_only):
        res = prop.judge(adapter, case, {})
        assert res.passed, res.message
    assert sides == [2, 1]


def test_property_pairs_take_the_flush_floor_from_the_magnitudes():
    """compare_pairs (every property's pairs) reads the floor from magnitudes' "ftz:<output>" entries, doubled for two sides."""
    from attnverify.verdicts import compare_pairs

    ref = torch.full((64,), 1e-41, dtype=torch.float64)
    pair = {"dv": (torch.zeros(64), ref)}
    floors = {"ftz:dv": 1e-39}
    assert compare_pairs(pair, "float32", score_max=0.0, scale_floors=floors)[0].passed
    assert not compare_pairs(pair, "float32", score_max=0.0, scale_floors={})[0].passed
    far = {"dv": (torch.full((64,), 1.5e-39), ref)}  # beyond one side's floor, within two sides'
    assert not compare_pairs(far, "float32", score_max=0.0, scale_floors=floors)[0].passed
    assert compare_pairs(far, "float32", score_max=0.0, scale_floors=floors, sides=2)[0].passed


def test_two_sides_per_pair_name_where_a_property_mixes_its_own_calls_with_the_reference(monkeypatch):
    """compare_pairs takes sides per pair name; sink_as_extra_key gives 2 to the pairs whose expected value is the
    adapter's own extra-key call, none where the reference stands for it (an adapter that refuses float masks)."""
    import dataclasses

    from attnverify.adapters.registry import get
    from attnverify.properties import get_property
    from attnverify.properties import serving as sv
    from attnverify.properties import sinks as sk
    from attnverify.properties.sinks import with_sinks
    from attnverify.verdicts import compare_pairs

    g = torch.Generator().manual_seed(0)
    exact = torch.randn(4, 64, generator=g, dtype=torch.float64)
    one = tolerance_for("out", "float32")
    off = exact * (1 + 1.5 * one.norm)  # 1.5x one side's norm-wise bound
    pairs = {"out": (off.float(), exact), "out_views_vs_copies": (off.float(), exact)}
    comps = compare_pairs(pairs, "float32", score_max=0.0, scale_floors={}, sides={"out_views_vs_copies": 2})
    assert [c.passed for c in comps] == [False, True]

    seen = []
    real = sv.judge_pairs

    def spy(*a, **kw):
        res = real(*a, **kw)
        seen.append(dict(kw.get("sides") or {}))
        return res

    monkeypatch.setattr(sk, "judge_pairs", spy)
    naive = get("naive")
    no_masks = dataclasses.replace(naive, name="naive-no-float-masks",
                                   refuses=lambda c: "no float masks" if c.spec.attn_mask is not None else None)
    case = with_sinks(_case(0.0), {"sinks": SINKS})
    prop = get_property("sink_as_extra_key")
    for adapter in (naive, no_masks):
        res = prop.judge(adapter, case, {"sinks": SINKS})
        assert res.passed, res.message
    assert seen == [{"out": 2, "lse": 2}, {}]
