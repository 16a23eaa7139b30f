"""`check` on a CPU twin (attnverify/judge_twin.py, issue 25 item 3): the judge's reference, magnitudes, baseline
and comparisons on a CPU copy of the case, the adapter on the case itself.

On this CPU-only machine the twin is forced (ATTNVERIFY_JUDGE_ON=cpu-twin) on CPU cases, where it is a distinct
CPU copy: every verdict, comparison error and bound must be the plain path's, bit for bit, on drawn cases and on
recipes that reach each feature (gradients, LSE gradients, masks, varlen, GQA, sinks, fp8, dropout's keep mask,
fully-masked rows, declared fully-masked conventions, layouts, a KV cache); wrong answers still fail and an in-place
write is still caught. Each comparison of the two paths also checks that the twin path was taken (`judged_on`, the
twin's note), so none passes by judging the plain way twice.
The GPU tests compare the device judge with the twin judge on drawn CUDA cases.
"""
from __future__ import annotations

import json

import pytest
import torch

from attnverify import judge_twin
from attnverify.case import CaseRecipe, build_case
from attnverify.check import check
from attnverify.judge_twin import ENV, cpu_twin, is_small, judge_mode, judge_work, judged_case, wants_twin

CUDA = torch.cuda.is_available()
GPU_REASON = "needs a CUDA GPU: the device judge and the twin judge are compared there; this machine has none"


def _naive():
    from attnverify.adapters.registry import get

    return get("naive")


def _key(res) -> str:
    """Everything a verdict is made of: status, every comparison (errors, bounds, worst element), the notes but
    the twin's own; as JSON (NaN == NaN)."""
    notes = [n for n in res.notes if not n.startswith("judged on a CPU twin")]
    return json.dumps({"status": res.status, "comparisons": [c.to_dict() for c in res.comparisons], "notes": notes,
                       "error": res.error}, sort_keys=True, default=str)


def _both(monkeypatch, adapter, case, **kw):
    monkeypatch.delenv(ENV, raising=False)
    plain = check(adapter, case, **kw)
    monkeypatch.setenv(ENV, "cpu-twin")
    twin = check(adapter, case, **kw)
    monkeypatch.delenv(ENV, raising=False)
    assert plain.judged_on == case.q.device.type and twin.judged_on == "cpu twin", (plain.judged_on, twin.judged_on)
    assert any(n.startswith("judged on a CPU twin") for n in twin.notes), twin.notes
    return plain, twin


# ------------------------------------------------------------------------------------------- the mode and the rule


def test_the_mode_is_read_at_each_call_and_an_unknown_one_is_refused(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert judge_mode() == "device"  # JUDGE_SMALL_ON_CPU is False until the GPU A/B
    monkeypatch.setattr(judge_twin, "JUDGE_SMALL_ON_CPU", True)
    assert judge_mode() == "auto"
    for m in ("device", "auto", "cpu-twin"):
        monkeypatch.setenv(ENV, m)
        assert judge_mode() == m
    monkeypatch.setenv(ENV, "gpu")
    with pytest.raises(ValueError, match=ENV):
        judge_mode()
    case = build_case(CaseRecipe(len_q=4, len_k=4, head_dim=8))
    with pytest.raises(ValueError, match=ENV):  # refused before the adapter is called
        check(_naive(), case)


def test_by_default_and_under_auto_a_cpu_case_is_judged_on_itself(monkeypatch):
    case = build_case(CaseRecipe(len_q=4, len_k=4, head_dim=8))
    for m in (None, "device", "auto"):
        if m is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, m)
        assert judged_case(case, False) is case
        assert check(_naive(), case).judged_on == "cpu"
    monkeypatch.setenv(ENV, "cpu-twin")
    assert judged_case(case, False) is not case


def _meta_case(b, h, lq, lk, d, **spec):
    """A case on the meta device: a stand-in for a GPU case where only shapes and the device are read."""
    from attnverify.case import Case
    from attnverify.spec import Spec

    return Case(torch.empty(b, h, lq, d, device="meta"), torch.empty(b, h, lk, d, device="meta"),
                torch.empty(b, h, lk, d, device="meta"), Spec(**spec))


def test_auto_twins_small_device_cases_and_leaves_big_ones_on_the_device(monkeypatch):
    monkeypatch.setenv(ENV, "auto")
    small = _meta_case(1, 2, 32, 32, 64)
    assert judge_work(small, False) == 2 * 32 * 32 * 128 and wants_twin(small, False)
    big = _meta_case(1, 16, 8192, 8192, 128)  # a thorough-profile length stays on the device
    assert not is_small(big, False) and not wants_twin(big, False)
    # at the bound: forward within it, the same case with gradients (x BACKWARD_PASSES) beyond it
    edge = _meta_case(1, 1, 64, 64, 128)
    assert judge_work(edge, False) <= judge_twin.SMALL_WORK < judge_work(edge, True)
    assert wants_twin(edge, False) and not wants_twin(edge, True)
    monkeypatch.setenv(ENV, "device")
    assert not wants_twin(small, False)
    monkeypatch.setenv(ENV, "cpu-twin")
    assert wants_twin(big, False)


def test_auto_leaves_a_kv_cache_case_on_its_device(monkeypatch):
    r = CaseRecipe(batch=1, heads_q=2, heads_kv=1, len_q=1, len_k=5, head_dim=16, cache_lens=[5], page_size=8,
                   num_pages=2)
    case = build_case(r)
    assert case.spec.cache_seqlens is not None and not is_small(case, False)


# --------------------------------------------------------------------------------------------------- the twin


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced", "offset", "expanded_kv"])
def test_the_twin_is_a_distinct_copy_with_the_same_values_and_strides(layout):
    r = CaseRecipe(batch=2, heads_q=4, heads_kv=2, len_q=9, len_k=11, head_dim=8, dtype="bfloat16", seed=3,
                   mask="float_random", alibi=True, sinks={"kind": "normal", "level": 1.0, "seed": 2}, layout=layout)
    case = build_case(r)
    twin = cpu_twin(case)
    pairs = [(getattr(case, n), getattr(twin, n)) for n in "qkv"]
    pairs += [(getattr(case.spec, n), getattr(twin.spec, n)) for n in ("attn_mask", "alibi_slopes", "sinks")]
    for a, b in pairs:
        assert isinstance(b, torch.Tensor) and b.device.type == "cpu" and b.dtype == a.dtype
        assert b.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
        assert b.shape == a.shape and b.stride() == a.stride()
        assert torch.equal(a, b)
    if layout == "expanded_kv":
        assert 0 in twin.k.stride()
    twin.q.zero_()
    assert not torch.equal(case.q, twin.q)  # writing the twin leaves the case alone
    assert twin.seed == case.seed and twin.recipe is case.recipe


def test_the_twin_copies_varlen_and_descale_tensors():
    case = build_case(CaseRecipe(batch=1, heads_q=2, heads_kv=2, len_q=10, len_k=12, head_dim=16, seqlens_q=[4, 6],
                                 seqlens_k=[5, 7], seed=1))
    twin = cpu_twin(case)
    for n in ("cu_seqlens_q", "cu_seqlens_k"):
        a, b = getattr(case.spec, n), getattr(twin.spec, n)
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    from attnverify.case import DTYPES

    if "float8_e4m3fn" not in DTYPES:
        pytest.skip("this torch has no float8_e4m3fn")
    case = build_case(CaseRecipe(heads_q=2, heads_kv=1, len_q=8, len_k=8, head_dim=16, dtype="float8_e4m3fn",
                                 descales="random", seed=2))
    twin = cpu_twin(case)
    assert torch.equal(case.spec.q_descale, twin.spec.q_descale)
    assert case.spec.q_descale.data_ptr() != twin.spec.q_descale.data_ptr()


# ---------------------------------------------------------------------------------- the same verdicts, bit for bit


FEATURES = {
    "plain-lse": dict(return_lse=True),
    "gqa-causal": dict(heads_q=4, heads_kv=2, causal="bottom_right", len_q=7, len_k=19),
    "bool-mask-fully-masked-rows": dict(mask="bool_random", masked_rows=(0, 3), return_lse=True),
    "float-mask-neg-inf": dict(mask="float_neg_inf", return_lse=True),
    "alibi-softcap-window": dict(alibi=True, softcap=5.0, window=(3, 2)),
    "varlen": dict(batch=1, len_q=10, len_k=12, seqlens_q=[4, 0, 6], seqlens_k=[5, 3, 4], return_lse=True),
    "sinks": dict(heads_q=2, heads_kv=2, sinks={"kind": "normal", "level": 2.0, "seed": 5}, return_lse=True),
    "dropout": dict(dropout_p=0.3),
    "key-block-hidden": dict(key_block=(2, 9), return_lse=True),
    "transposed": dict(layout="transposed", heads_q=4, heads_kv=1),
    "sliced": dict(layout="sliced"),
    "expanded-kv": dict(layout="expanded_kv", batch=3),
    "dv-ne-d-float16": dict(dtype="float16", head_dim_v=24),
    "float32-row-shift": dict(dtype="float32", row_shift=40.0),
    "float64": dict(dtype="float64"),
}


@pytest.mark.parametrize("name", sorted(FEATURES))
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_the_twin_judges_each_feature_alike(name, backward, monkeypatch):
    base = dict(batch=2, heads_q=2, heads_kv=1, len_q=12, len_k=16, head_dim=16, dtype="bfloat16", seed=7)
    case = build_case(CaseRecipe(**{**base, **FEATURES[name]}))
    plain, twin = _both(monkeypatch, _naive(), case, backward=backward)
    assert _key(plain) == _key(twin), f"{name}: the twin judged otherwise:\n{plain.message()}\n---\n{twin.message()}"
    assert plain.status == "passed", plain.message()
    if backward:
        assert {c.name for c in twin.comparisons} >= {"out", "dq", "dk", "dv"}
        for n in ("dq", "dk", "dv"):  # the gradients kept for diagnosis are the adapter's own
            assert twin.outputs[n].data_ptr() != 0 and twin.outputs[n].device == case.q.device


def test_the_twin_judges_fp8_alike(monkeypatch):
    from attnverify.case import DTYPES

    if "float8_e4m3fn" not in DTYPES:
        pytest.skip("this torch has no float8_e4m3fn")
    case = build_case(CaseRecipe(heads_q=2, heads_kv=1, len_q=9, len_k=17, head_dim=16, dtype="float8_e4m3fn",
                                 descales="random", seed=4, return_lse=True))
    plain, twin = _both(monkeypatch, _naive(), case)
    assert plain.status == "passed" and _key(plain) == _key(twin)


def test_the_twin_judges_a_kv_cache_case_alike(monkeypatch):
    r = CaseRecipe(batch=2, heads_q=2, heads_kv=1, len_q=3, len_k=6, head_dim=16, dtype="bfloat16", cache_lens=[6, 9],
                   cache_leftpad=[1, 3], page_size=16, num_pages=3, garbage="nan", seed=2, return_lse=True)
    case = build_case(r)
    plain, twin = _both(monkeypatch, _naive(), case, backward=False)  # KV-cache calls are forward only
    assert plain.status == "passed", plain.message()
    assert _key(plain) == _key(twin)


def _declaring(convention):
    """naive, with NaN in the rows that see no key (and -inf in their LSE), declaring fully_masked=`convention`."""
    from attnverify.adapters.base import adapter
    from attnverify.adapters.naive import naive_attention
    from attnverify.spec import Output

    @adapter(f"nan-rows-{convention}", register=False, dtypes=("float32", "bfloat16"), devices=("cpu",), attn_mask=True,
             lse=True, backward=True, gqa=True, fully_masked=convention)
    def fn(q, k, v, spec):
        o = naive_attention(q, k, v, spec.replace(return_lse=True))
        dead = torch.isneginf(o.lse.detach())
        out = torch.where(dead.unsqueeze(-1), torch.full_like(o.out, float("nan")), o.out)
        return Output(out, lse=o.lse if spec.return_lse else None)

    return fn


@pytest.mark.parametrize("convention", ["nan", "unsupported"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_the_twin_judges_declared_fully_masked_conventions_alike(convention, backward, monkeypatch):
    case = build_case(CaseRecipe(batch=2, heads_q=2, heads_kv=1, len_q=12, len_k=16, head_dim=16, dtype="float32", seed=5,
                                 mask="bool_random", masked_rows=(1, 4), return_lse=True))
    plain, twin = _both(monkeypatch, _declaring(convention), case, backward=backward)
    assert plain.status == "passed", plain.message()
    assert any("fully-masked" in n for n in plain.notes), plain.notes  # the convention's branch was taken
    assert _key(plain) == _key(twin)


def _drawn(adapter, prop_name, n, seed=8):
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    from attnverify.properties import get_property

    prop = get_property(prop_name)
    out = []

    @hseed(seed)
    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck),
              phases=(Phase.generate,))
    @given(prop.strategy(adapter, "dev", "cpu"))
    def collect(d):
        out.append(CaseRecipe.from_dict(d["recipe"]))

    collect()
    return out[:n]


@pytest.mark.parametrize("prop_name, backward", [("forward_matches_reference", False),
                                                 ("gradients_match_reference", True)])
def test_the_twin_judges_drawn_cases_alike(prop_name, backward, monkeypatch):
    naive = _naive()
    recipes = _drawn(naive, prop_name, 40)
    assert len(recipes) >= 30
    differ = []
    for r in recipes:
        case = build_case(r)
        plain, twin = _both(monkeypatch, naive, case, backward=backward)
        if _key(plain) != _key(twin):
            differ.append(case.describe())
    assert not differ, f"{len(differ)} of {len(recipes)} judged otherwise on the twin, first: {differ[:3]}"


def test_the_recorded_verdicts_judge_alike_on_the_twin(monkeypatch):
    """tests/data/verdicts_issue25.json's 84 examples (correct adapters, zoo members with known bugs: a precision bug
    only the per-case bound catches, an in-place write, a wrong backward, NaN fully-masked rows), judged through their
    properties: the same status and severity on the twin, bit for bit."""
    from test_same_verdicts import _adapter, _fixture

    from attnverify.properties import get_property

    rows, differ, twinned = _fixture(), [], 0
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as the records were made (two threads on a loaded 2-core machine: 25x slower)
    try:
        for r in rows:
            adapter, prop = _adapter(r["adapter"]), get_property(r["property"])
            got = {}
            for mode in ("device", "cpu-twin"):
                monkeypatch.setenv(ENV, mode)
                res = prop.run_example(adapter, r["drawn"])
                got[mode] = (res.status, float(res.severity))
                if mode == "cpu-twin":
                    twinned += any(isinstance(c, dict) and c.get("judged_on") == "cpu twin" for c in res.records)
            if got["device"] != got["cpu-twin"]:
                differ.append(f"{r['adapter']} / {r['property']}: {got}")
    finally:
        torch.set_num_threads(n)
    assert not differ, "\n".join(differ)
    assert twinned == len(rows), f"only {twinned} of {len(rows)} examples were judged on the twin"


# ------------------------------------------------------------------------------------------ wrong answers still fail


def _wrong(name):
    import wrong_impls

    return wrong_impls.WRONG[name][0]


@pytest.mark.parametrize("name, backward", [("zeros", False), ("mean_v", False), ("no_rescale", False),
                                            ("dk_factor", True), ("dv_not_summed_gqa", True)])
def test_wrong_answers_still_fail_on_the_twin(name, backward, monkeypatch):
    adapter = _wrong(name)
    case = build_case(CaseRecipe(batch=2, heads_q=4, heads_kv=2, len_q=20, len_k=40, head_dim=16, dtype="float32",
                                 seed=11, return_lse=True))
    plain, twin = _both(monkeypatch, adapter, case, backward=backward)
    assert twin.status == "failed", twin.message()
    assert _key(plain) == _key(twin)


def test_an_adapter_writing_into_its_input_is_still_caught_on_the_twin(monkeypatch):
    """The in-place check reads the adapter's own (device) tensors against the case's, never the twin."""
    case = build_case(CaseRecipe(heads_q=2, heads_kv=2, len_q=8, len_k=8, head_dim=16, dtype="float32", seed=1))
    plain, twin = _both(monkeypatch, _wrong("inplace"), case, backward=False)
    assert twin.status == "failed"
    assert any("modified its input" in p for c in twin.comparisons for p in c.problems), twin.message()
    assert _key(plain) == _key(twin)


# --------------------------------------------------------------------------------------------------------- GPU


def _gpu_pairs(adapter_name, prop_name, backward, monkeypatch, n=50):
    from attnverify.adapters.registry import get

    adapter = get(adapter_name)
    rows = []
    for r in _drawn_cuda(adapter, prop_name, n):
        case = build_case(r)
        monkeypatch.setenv(ENV, "device")
        dev = check(adapter, case, backward=backward)
        monkeypatch.setenv(ENV, "cpu-twin")
        twin = check(adapter, case, backward=backward)
        assert dev.judged_on == "cuda" and twin.judged_on == "cpu twin"
        rows.append((case.describe(), dev, twin))
    return rows


def _drawn_cuda(adapter, prop_name, n):
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    from attnverify.properties import get_property

    out = []

    @hseed(8)
    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck),
              phases=(Phase.generate,))
    @given(get_property(prop_name).strategy(adapter, "dev", "cuda"))
    def collect(d):
        out.append(CaseRecipe.from_dict(d["recipe"]))

    collect()
    return out[:n]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason=GPU_REASON)
@pytest.mark.parametrize("adapter_name, prop_name, backward", [
    ("sdpa-flash", "forward_matches_reference", False),
    ("naive", "forward_matches_reference", False),
    ("naive", "gradients_match_reference", True),
])
def test_device_judge_and_twin_judge_give_the_same_statuses_on_a_gpu(adapter_name, prop_name, backward, monkeypatch):
    """The twin's baseline accumulates in the CPU's order, so severities may move a little; statuses must not. The
    severities' spread is printed (pytest -s) for the A/B's record."""
    rows = _gpu_pairs(adapter_name, prop_name, backward, monkeypatch)
    assert len(rows) >= 30
    differ = [f"{d}: device {a.status}, twin {b.status}" for d, a, b in rows if a.status != b.status]
    ratios = sorted(b.severity() / a.severity() for _, a, b in rows if a.severity() > 0 and b.severity() > 0)
    if ratios:
        print(f"{adapter_name} {prop_name}: twin/device severity ratio min {ratios[0]:.3f} median "
              f"{ratios[len(ratios) // 2]:.3f} max {ratios[-1]:.3f} over {len(ratios)}")
    assert not differ, f"{len(differ)} of {len(rows)} statuses differ:\n" + "\n".join(differ[:5])
