"""The visibility rule's one home outside the reference (attnverify/visibility.py), against its definition
written out element by element, and against the reference's own, independent copy."""
import itertools

import pytest
import torch

from attnverify.reference import reference_forward
from attnverify.spec import Spec
from attnverify.visibility import positional_visibility, segments, varlen_visibility, visible, row_key_indices


def _by_definition(lq, lk, causal, window, strict=False):
    out = torch.zeros(lq, lk, dtype=torch.bool)
    for i, j in itertools.product(range(lq), range(lk)):
        diag = i + lk - lq
        ok = True
        if causal == "top_left":
            ok &= j < i if strict else j <= i
        if causal == "bottom_right":
            ok &= j < diag if strict else j <= diag
        if window is not None and window[0] >= 0:
            ok &= j >= diag - window[0]
        if window is not None and window[1] >= 0:
            ok &= j <= diag + window[1]
        out[i, j] = ok
    return out


@pytest.mark.parametrize("lq,lk", [(5, 5), (3, 7), (7, 3), (1, 6)])
@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("window", [None, (2, 0), (0, 1), (-1, 2), (3, -1)])
@pytest.mark.parametrize("strict", [False, True])
def test_visible_matches_the_definition(lq, lk, causal, window, strict):
    got = visible(*row_key_indices(lq, lk), causal, window, strict_diag=strict)
    assert torch.equal(got, _by_definition(lq, lk, causal, window, strict))
    if not strict:
        pv = positional_visibility(lq, lk, causal, window)
        assert (pv is None) == (causal == "none" and window is None)
        assert pv is None or torch.equal(pv, got)


def test_wrong_causal_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="causal='bottom-right'"):
        visible(*row_key_indices(2, 2), "bottom-right")


def test_varlen_sees_only_its_own_segment():
    cu_q, cu_k = torch.tensor([0, 2, 2, 5]), torch.tensor([0, 3, 4, 8])
    assert segments(cu_q, cu_k) == [(0, 2, 0, 3), (2, 2, 3, 4), (2, 5, 4, 8)]
    vis = varlen_visibility(cu_q, cu_k, 5, 8, "bottom_right", (1, -1))
    want = torch.zeros(5, 8, dtype=torch.bool)
    want[0:2, 0:3] = _by_definition(2, 3, "bottom_right", (1, -1))
    want[2:5, 4:8] = _by_definition(3, 4, "bottom_right", (1, -1))
    assert torch.equal(vis, want)


@pytest.mark.parametrize("causal,window", [("top_left", None), ("bottom_right", (2, 1)), ("none", (0, 3))])
def test_agrees_with_the_reference_own_copy(causal, window):
    """Keys this rule hides must not move the reference's output; keys it shows must (V one-hot per key)."""
    lq, lk = 4, 6
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, lq, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, lk, 8, generator=g, dtype=torch.float64)
    v = torch.eye(lk, dtype=torch.float64)[None, None]  # output row = the attention weights
    out = reference_forward(q, k, v, Spec(causal=causal, window=window)).out[0, 0]
    vis = positional_visibility(lq, lk, causal, window)
    assert torch.equal(out > 0, vis)
