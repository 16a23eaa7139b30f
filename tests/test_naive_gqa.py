"""naive (the same-dtype baseline) sums a GQA group's dK / dV shares without overflowing, and rounds them as the
calibrated bounds were measured (issue 20; benchmarks/repro_naive_gqa_dk_overflow.py).

Found by the CPU calibration of 2026-12-04: `B=2 Hq=4 Hkv=2 Lq=128 Lk=5 D=160 float16 causal=top_left
row_shift=-1000` gave dK = -inf where the exact dK fits in fp16, because each query head's share was rounded to
fp16 (and one share passed 65504) before the shares were summed.
"""
import random
import sys
from pathlib import Path

import pytest
import torch

import attnverify as av
from attnverify.adapters import registry
from attnverify.adapters.naive import naive_attention
from attnverify.reference import reference_backward

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _dk(case, do, repeat_first: bool):
    """naive's dK; `repeat_first`: K and V repeated to the query heads in the input dtype before naive sees
    them (the order naive had before the fix)."""
    g = case.q.shape[1] // case.k.shape[1]
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (case.q, case.k, case.v))
    kk, vv = (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)) if repeat_first else (k, v)
    o = naive_attention(q, kk, vv, case.spec).out
    return torch.autograd.grad(o, (q, k, v), do.to(o.dtype))


@pytest.mark.parametrize("seed", [0, 3])
def test_gqa_dk_does_not_overflow_where_the_exact_dk_fits(seed):
    recipe = av.CaseRecipe(batch=2, heads_q=4, heads_kv=2, len_q=128, len_k=5, head_dim=160, dtype="float16",
                           causal="top_left", row_shift=-1000.0, seed=seed)
    case = av.build_case(recipe)
    do = torch.randn(case.q.shape[:3] + (160,), generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    exact = reference_backward(case.q, case.k, case.v, case.spec, do.half(), None).dk
    fits = exact.abs() <= torch.finfo(torch.float16).max
    old = _dk(case, do, repeat_first=True)[1]
    assert bool((~torch.isfinite(old) & fits).any()), "the old order no longer overflows here: the test proves nothing"
    new = _dk(case, do, repeat_first=False)[1]
    assert bool(torch.isfinite(new[fits]).all())
    res = av.check(registry.get("naive"), case)
    assert res.passed, res.message()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gqa_shares_are_rounded_as_before_where_nothing_overflows(dtype):
    """The fix changes no finite gradient: the bounds of every calibrated GQA case (naive is the baseline) stand."""
    from calibrate_tolerances import random_recipe

    rng = random.Random(f"gqa-{dtype}")
    naive = registry.get("naive")
    n = 0
    while n < 12:
        r = random_recipe(rng, naive, dtype, "cpu", False, 64, 0)
        if r.heads_q == r.heads_kv or r.dropout_p:
            continue
        n += 1
        case = av.build_case(r)
        do = torch.randn(case.q.shape[:3] + (case.v.shape[-1],), generator=torch.Generator().manual_seed(n),
                         dtype=torch.float64)
        for a, b in zip(_dk(case, do, True), _dk(case, do, False)):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()), case.describe()
