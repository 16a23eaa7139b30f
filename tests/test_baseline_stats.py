"""baseline_stats (issue 25): the one-pass statistics of check's baseline are the three functions they replace
(error_stats, the re-basing on the scale floor, expected_rounding) bit for bit, NaN/Inf, ignored rows and
floors included; and a baseline further from the reference gets a larger error (the statistic is not constant)."""
import math

import pytest
import torch

from attnverify.baseline_stats import three_passes, baseline_stats


def _pair(seed, shape=(2, 3, 17, 8), nonfinite=True):
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(shape, generator=g, dtype=torch.float64) * 3
    a = (b + 1e-3 * torch.randn(shape, generator=g, dtype=torch.float64)).to(torch.bfloat16)
    if nonfinite:
        b.view(-1)[5] = math.inf
        b.view(-1)[7] = math.nan
        a.view(-1)[11] = math.nan
        a.view(-1)[13] = -math.inf
    b.view(-1)[min(20, b.numel() - 1)] = 0.0  # an exact zero: the rounding's clamp to the dtype's tiny
    return a, b


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("floor", [0.0, 0.3, 50.0])
@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_one_pass_is_thethree_passes_bit_for_bit(seed, floor, rows, dtype):
    a, b = _pair(seed)
    ign = None
    if rows:  # query rows left out, zeroed in both as check._baseline does
        r = torch.zeros(2, 3, 17, dtype=torch.bool)
        r[0, 1, 3] = r[1, 2, 16] = True
        ign = r.unsqueeze(-1)
        a, b = a.masked_fill(ign, 0), b.masked_fill(ign, 0)
    got = baseline_stats(a, b, dtype, floor=floor, ignore=ign)
    want = three_passes(a, b, dtype, floor, ign, True)
    assert got == want or all(x == y or (x != x and y != y) for x, y in zip(got, want)), (got, want)


def test_lse_shape_and_no_rounding():
    a, b = _pair(3, shape=(1, 2, 9), nonfinite=False)
    assert baseline_stats(a.float(), b, "float32", floor=1.0, rounding=False) == three_passes(a.float(), b, "float32", 1.0, None, False)
    assert baseline_stats(a.float(), b, "float32", rounding=False)[2] is None


def test_empty_and_mismatched_shapes_fall_back():
    e = torch.zeros(1, 1, 0, 4, dtype=torch.float64)
    assert baseline_stats(e.float(), e, "float16") == (0.0, 0.0, 0.0, 0)
    rel, mx, _, n = baseline_stats(torch.zeros(3), torch.zeros(4, dtype=torch.float64), "float16")
    assert rel != rel and mx != mx and n == 0  # NaN: no statistic of a wrong shape, no element judged


def test_a_worse_baseline_has_a_larger_error():
    _, b = _pair(4, nonfinite=False)
    near = baseline_stats(b.to(torch.bfloat16), b, "bfloat16")
    far = baseline_stats((b * 1.01).to(torch.bfloat16), b, "bfloat16")
    assert far[0] > 2 * near[0] and far[1] > near[1] and far[2] == near[2]  # the rounding is the reference's
    assert near[3] == far[3] == b.numel()  # every element judged


def test_the_judged_count_leaves_out_nonfinite_and_ignored_elements():
    a, b = _pair(5)  # 2 non-finite references, 2 non-finite baseline values, distinct elements
    r = torch.zeros(2, 3, 17, dtype=torch.bool)
    r[1, 0, 2] = True  # one query row of 8 elements, none of them non-finite
    ign = r.unsqueeze(-1)
    a, b = a.masked_fill(ign, 0), b.masked_fill(ign, 0)
    for got in (baseline_stats(a, b, "bfloat16", ignore=ign), three_passes(a, b, "bfloat16", 0.0, ign, True)):
        assert got[3] == b.numel() - 4 - 8
