"""The tolerances are tight: `check` rejects every classic wrong answer, for every dtype where the
wrong answer differs from the right one by more than rounding, and passes correct implementations
on random cases spanning every claimed feature (zero false positives).

Runs on the CPU; on a machine with a GPU the same tests also run with device="cuda".
"""
import math
import random

import pytest
import torch

import attnverify as av
from attnverify.adapters import registry
from attnverify.adapters._features import score_bias_and_visibility
from attnverify.adapters.naive import naive_attention
from attnverify.tolerances import tolerance_for, unit_roundoff

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = ["float32", "float16", "bfloat16"]


def _claims(**kw):
    base = dict(dtypes=("float16", "bfloat16", "float32"), devices=("cpu", "cuda"), head_dims=lambda d: d <= 256,
                max_seqlen=8192, causal=("none", "top_left", "bottom_right"), gqa=True, backward=True,
                fully_masked="zeros")
    base.update(kw)
    return base


def wrong(name, **claims):
    return av.adapter(f"wrong-{name}", register=False, **_claims(**claims))


def _expand(q, t):
    g = q.shape[1] // t.shape[1]
    return t.repeat_interleave(g, 1) if g > 1 else t


def _probs(q, k, spec, scale=None):
    """float32 probabilities of a correct softmax (masks honoured)."""
    kk = _expand(q, k)
    s = (q.float() @ kk.float().transpose(-1, -2)) * (spec.resolved_scale(q.shape[-1]) if scale is None else scale)
    bias, vis = score_bias_and_visibility(spec, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
    if bias is not None:
        s = s + bias
    if vis is not None:
        s = s.masked_fill(~vis, -math.inf)
    return torch.softmax(s, -1).nan_to_num(0.0), vis


@wrong("zeros")
def zeros(q, k, v, spec):
    return torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)


@wrong("mean-of-v")
def mean_of_v(q, k, v, spec):
    return _expand(q, v).float().mean(2, keepdim=True).expand(*q.shape[:3], v.shape[-1]).to(q.dtype)


@wrong("copy-of-v")
def copy_of_v(q, k, v, spec):
    vv = _expand(q, v)
    idx = torch.arange(q.shape[2], device=q.device) % v.shape[2]
    return vv[:, :, idx].clone()


@wrong("uniform")
def uniform(q, k, v, spec):
    p, vis = _probs(q, k, spec)
    w = torch.ones_like(p) if vis is None else vis.float().expand_as(p)
    w = w / w.sum(-1, keepdim=True).clamp_min(1)
    return (w @ _expand(q, v).float()).to(q.dtype)


@wrong("diagonal-excluded")
def diagonal_excluded(q, k, v, spec):
    lq, lk = q.shape[2], k.shape[2]
    i, j = torch.arange(lq, device=q.device)[:, None], torch.arange(lk, device=q.device)[None]
    off = 0 if spec.causal == "top_left" else lk - lq
    return naive_attention(q, k, v, spec.replace(causal="none", attn_mask=(j < i + off))).out


@wrong("diagonal-plus-one")
def diagonal_plus_one(q, k, v, spec):
    lq, lk = q.shape[2], k.shape[2]
    i, j = torch.arange(lq, device=q.device)[:, None], torch.arange(lk, device=q.device)[None]
    off = 0 if spec.causal == "top_left" else lk - lq
    return naive_attention(q, k, v, spec.replace(causal="none", attn_mask=(j <= i + off + 1))).out


@wrong("top-left-for-bottom-right")
def top_left_for_bottom_right(q, k, v, spec):
    c = "top_left" if spec.causal == "bottom_right" else spec.causal
    return naive_attention(q, k, v, spec.replace(causal=c)).out


@wrong("no-scale")
def no_scale(q, k, v, spec):
    return naive_attention(q, k, v, spec.replace(scale=1.0)).out


@wrong("per-tile-average")
def per_tile_average(q, k, v, spec):
    """softmax inside each 32-key tile, tile outputs averaged (the seed's wrong answer 4)."""
    vv = _expand(q, v).float()
    outs = []
    for j0 in range(0, k.shape[2], 32):
        p, _ = _probs(q, k[:, :, j0:j0 + 32], spec.replace(causal="none"))
        outs.append(p @ vv[:, :, j0:j0 + 32])
    return torch.stack(outs).mean(0).to(q.dtype)


@wrong("pv-accumulated-in-input-dtype")
def pv_low_precision(q, k, v, spec):
    """P@V summed 16 keys at a time into an accumulator kept in the input dtype (no fp32 accumulation)."""
    p, _ = _probs(q, k, spec)
    vv = _expand(q, v)
    acc = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    for j0 in range(0, k.shape[2], 16):
        acc = (acc.float() + p[..., j0:j0 + 16].to(q.dtype).float() @ vv[:, :, j0:j0 + 16].float()).to(q.dtype)
    return acc


def _case(dtype, device, *, lq=128, lk=128, causal="none", seed=0, d=64, v_mean=0.0):
    return av.build_case(av.CaseRecipe(batch=1, heads_q=4, heads_kv=2, len_q=lq, len_k=lk, head_dim=d, dtype=dtype,
                                       device=device, seed=seed, causal=causal, v_mean=v_mean))


WRONG_CASES = [
    (zeros, {}),
    (mean_of_v, {}),
    (copy_of_v, {}),
    (uniform, {}),
    (diagonal_excluded, {"causal": "top_left"}),
    (diagonal_plus_one, {"causal": "bottom_right"}),
    (top_left_for_bottom_right, {"causal": "bottom_right", "lq": 96, "lk": 128}),
    (no_scale, {}),
    (per_tile_average, {}),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl,kw", WRONG_CASES, ids=[w.name for w, _ in WRONG_CASES])
def test_check_rejects_wrong_answers(impl, kw, dtype, device):
    res = av.check(impl, _case(dtype, device, **kw))
    assert res.status == "failed", res.message()
    assert res.comparisons[0].name == "out" and not res.comparisons[0].passed
    with pytest.raises(AssertionError, match="out: MISMATCH"):
        av.assert_attention_close(res)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_check_rejects_low_precision_pv_accumulation_at_4096_keys(dtype, device):
    # with mean(V) = 1 the running sum grows to |out| and each chunk's rounding accumulates (3.6 u);
    # with zero-mean V the same code stays within rounding (0.25 u) and is not a wrong answer there
    case = _case(dtype, device, lq=64, lk=4096, d=64, v_mean=1.0)
    assert av.check(pv_low_precision, case, backward=False).status == "failed"
    # and the same function with fp32 accumulation (one chunk) would pass: the bound is not trivially tight
    ok = av.check(registry.get("naive"), case, backward=False)
    assert ok.status == "passed", ok.message()


def test_every_failing_output_is_reported():
    case = _case("float32", "cpu")
    res = av.check(zeros, case)
    names = {c.name for c in res.failing()}
    assert names == {"out", "dq", "dk", "dv"}
    msg = res.message()
    for n in ("out", "dq", "dk", "dv"):
        assert f"{n}: MISMATCH" in msg
    assert "Mismatched elements" in msg and "Greatest absolute difference" in msg


def test_nan_where_reference_is_finite_is_a_mismatch_and_vice_versa():
    case = _case("float32", "cpu", lq=8, lk=8)

    @wrong("nan-row")
    def nan_row(q, k, v, spec):
        o = naive_attention(q, k, v, spec).out.clone()
        o[0, 0, 3] = math.nan
        return o

    res = av.check(nan_row, case, backward=False)
    assert res.status == "failed" and res.comparisons[0].nonfinite_mismatches == 64


@pytest.mark.parametrize("backward", [False, True])
def test_in_place_writes_to_inputs_fail_but_do_not_corrupt_the_reference(backward):
    case = _case("float32", "cpu", lq=8, lk=8)
    q0 = case.q.clone()

    @wrong("zeroes-q-after")
    def zeroes_q_after(q, k, v, spec):
        o = naive_attention(q, k, v, spec).out
        with torch.no_grad():
            q.zero_()  # a correct answer, then the caller's q is wiped
        return o

    res = av.check(zeroes_q_after, case, backward=backward)
    by_name = {c.name: c for c in res.comparisons}
    assert res.status == "failed" and not by_name["inputs"].passed
    assert by_name["out"].passed, res.message()  # judged against the inputs the adapter was given
    assert torch.equal(case.q, q0)  # the case itself is untouched


def test_zero_baseline_error_cannot_fail_a_correct_kernel():
    # all-equal scores and V = constant: the baseline is exact, the floor must still admit rounding
    r = av.CaseRecipe(len_q=16, len_k=16, head_dim=32, equal_scores=True, v_std=0.0, v_mean=3.0, dtype="float16")
    case = av.build_case(r)

    @wrong("rounds-differently")
    def off_by_one_ulp(q, k, v, spec):
        o = naive_attention(q, k, v, spec).out
        return torch.nextafter(o.float(), torch.full_like(o.float(), 10.0)).to(o.dtype)

    res = av.check(off_by_one_ulp, case, backward=False)
    assert res.status == "passed", res.message()


def test_tolerance_rule_and_its_validation():
    t = tolerance_for("out", "float16")
    assert t.norm == pytest.approx(1.5 * unit_roundoff("float16"))
    assert tolerance_for("out", "float16", baseline_rel_l2=0.01).norm == pytest.approx(0.02)
    assert tolerance_for("lse", "float16").u == unit_roundoff("float16")
    assert tolerance_for("lse", "float64").u == unit_roundoff("float32")  # an LSE is float32 (SPEC)
    with pytest.raises(ValueError, match="output="):
        tolerance_for("dx", "float16")
    with pytest.raises(ValueError, match="loosen"):
        tolerance_for("out", "float16", loosen=0.5)


@pytest.fixture(scope="module")
def sampler():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "calibrate_tolerances.py"
    spec = importlib.util.spec_from_file_location("calibrate_tolerances", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.random_recipe


N_RANDOM = 25  # per adapter and dtype in CI; benchmarks/calibrate_tolerances.py runs 1,000 (docs/tolerances.md)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["naive", "sdpa-math", "sdpa-flash"])
def test_zero_false_positives_on_random_cases(name, dtype, sampler):
    a = registry.get(name)
    if a.unavailable_reason():
        pytest.skip(f"{name} unavailable here: {a.unavailable_reason()}")
    if dtype not in a.claims.dtypes:
        pytest.skip(f"{name} does not claim {dtype}")
    rng = random.Random(f"ci-{name}-{dtype}")
    dev = a.run_device("auto")
    failures = []
    for _ in range(N_RANDOM):
        res = av.check(a, av.build_case(sampler(rng, a, dtype, dev, False)), keep_tensors=False)
        if res.status != "passed":
            failures.append(res.message())
    assert not failures, "\n\n".join(failures[:3])


def _softcap_attention(q, k, v, spec, qk):
    """fp32 attention from given raw q.k products (softcap, no mask): the rest as naive does it."""
    scale, c = spec.resolved_scale(q.shape[-1]), spec.softcap
    s = c * torch.tanh(qk * (scale / c))
    return (torch.softmax(s, -1) @ _expand(q, v).float()).to(q.dtype)


@wrong("sequential-dot", softcap=True)
def sequential_dot(q, k, v, spec):
    # correct, only rounded differently: q.k accumulated one dimension at a time, last to first
    kk = _expand(q, k).float()
    qk = torch.zeros(*q.shape[:3], k.shape[2])
    for d in reversed(range(q.shape[-1])):
        qk = qk + q[..., d, None].float() * kk[..., d][:, :, None, :]
    return _softcap_attention(q, k, v, spec, qk)


@wrong("tf32-dot", softcap=True)
def tf32_dot(q, k, v, spec):
    # fp32 inputs multiplied as TF32 (10 mantissa bits), as a GPU matmul does when TF32 is allowed
    def t(x):
        return (x.float().view(torch.int32) & ~0x1FFF).view(torch.float32)

    return _softcap_attention(q, k, v, spec, t(q) @ t(_expand(q, k)).transpose(-1, -2))


def test_softcap_score_rounding_is_judged_through_the_cap_and_tf32_is_still_caught():
    # large |q||k| under a small cap: every score lies in +-0.5, but the rounding of q.k (~u |q||k|)
    # passes through the cap's slope; a bound set by the cap alone failed a correct fp32 kernel (the
    # bundled Triton kernel at 80 u on a case like this one). TF32 products err 8000x more: caught.
    r = av.CaseRecipe(heads_q=2, len_q=64, len_k=96, head_dim=72, dtype="float32", seed=3, q_std=3.2, k_std=3.2,
                      scale=0.5, softcap=0.5)
    case = av.build_case(r)
    from attnverify.magnitudes import magnitudes

    S = magnitudes(case)["S"]
    norms = 0.5 * float(case.q.norm(dim=-1).max()) * float(case.k.norm(dim=-1).max())
    assert 0.5 < S <= norms  # between the cap and the uncapped bound
    for seed in range(3):
        case = av.build_case(av.CaseRecipe(**{**r.__dict__, "seed": seed}))
        ok = av.check(sequential_dot, case, backward=False)
        assert ok.status == "passed", ok.message()
        assert av.check(tf32_dot, case, backward=False).status == "failed"


def test_an_infinite_score_bound_gives_an_infinite_tolerance_not_nan():
    # FLOOR_SCALE splits the u-term from the score term as a ratio; inf / inf must not turn the bound
    # into NaN (every comparison would fail)
    t = tolerance_for("out", "float32", score_max=math.inf)
    assert t.norm == math.inf and t.elem_u * t.u == math.inf


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_additive_bias_that_lifts_every_score_is_judged_at_the_rows_level(dtype):
    """ALiBi and float masks move a row's scores by their own size, which scale |q||k| does not bound:
    float64 naive failed on the H200 at 1.6x its bound on a varlen ALiBi row whose keys all sat ~400
    positions back (m ~ -185). A constant +3000 mask reproduces it on the CPU (float64 naive failed
    before |lse| + log(Lk) entered the score bound); a wrong answer under the same mask still fails."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g, dtype=torch.float64).to(dtype) for n in (64, 96, 96))
    case = av.Case(q, k, v, av.Spec(attn_mask=torch.full((1, 1, 64, 96), 3000.0, dtype=dtype)))
    naive = registry.get("naive")
    res = av.check(naive, case)
    assert res.passed, res.message()

    def no_scale(q, k, v, spec):  # forgets the 1/sqrt(D) scale
        return naive_attention(q, k, v, spec.replace(scale=1.0))

    wrong = av.adapter("bias-no-scale", register=False, dtypes=("float32", "float64"), attn_mask=True,
                       backward=True)(no_scale)
    bad = av.check(wrong, case)
    assert bad.status == "failed" and not bad.comparisons[0].passed  # numbers came back, and out is wrong


def test_score_bound_is_the_one_rule_for_every_comparison():
    """check() and the properties that compare an adapter with itself (batch, GQA, interleaving) share
    score_bound: S from |q||k| alone without a bias, the reference rows' level with one."""
    from attnverify.magnitudes import magnitudes, score_bound

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64) for n in (8, 12, 12))
    plain = av.Case(q, k, v, av.Spec())
    assert score_bound(plain) == magnitudes(plain)["S"]
    lifted = av.Case(q, k, v, av.Spec(attn_mask=torch.full((1, 1, 8, 12), -500.0, dtype=torch.float64)))
    assert score_bound(lifted) >= 500.0 > magnitudes(lifted)["S"]


@pytest.mark.parametrize("fill", [-1e9, float(torch.finfo(torch.float32).min)])
def test_one_row_lifted_by_a_huge_finite_mask_does_not_widen_the_other_rows(fill):
    """A padding row filled with a huge finite negative (HF-style -1e9 or finfo.min) has an LSE near the
    fill. Taken as the whole tensor's score bound, it let an adapter that forgets the scale pass (review
    of 2026-12-03); the bound is per query row now."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g) for n in (16, 24, 24))
    mask = torch.zeros(1, 1, 16, 24)
    mask[..., 5, :] = fill
    case = av.Case(q, k, v, av.Spec(attn_mask=mask))

    def no_scale(q, k, v, spec):
        return naive_attention(q, k, v, spec.replace(scale=1.0))

    wrong = av.adapter("mask-no-scale", register=False, attn_mask=True, backward=True)(no_scale)
    bad = av.check(wrong, case)
    assert bad.status == "failed" and not bad.comparisons[0].passed
    assert av.check(registry.get("naive"), case).passed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares a CUDA output; this machine has no GPU")
def test_compare_on_the_gpu_gives_the_cpu_verdict():
    """compare() works in float64 where the output lives (a big case compared on one CPU thread timed out
    on the H200): the verdict and the figures are those of the CPU comparison, a wrong answer included."""
    from attnverify.compare import compare

    g = torch.Generator().manual_seed(0)
    exp = torch.randn(2, 3, 40, 16, generator=g, dtype=torch.float64)
    tol = tolerance_for("out", "float16")
    for act in (exp.half(), (exp * 1.01).half()):
        on_cpu, on_gpu = compare("out", act, exp, tol), compare("out", act.cuda(), exp, tol)
        assert on_gpu.passed == on_cpu.passed and on_gpu.mismatched == on_cpu.mismatched
        assert on_gpu.worst_index == on_cpu.worst_index and math.isclose(on_gpu.rel_l2, on_cpu.rel_l2, rel_tol=1e-9)
    assert not compare("out", (exp * 1.01).half().cuda(), exp, tol).passed
