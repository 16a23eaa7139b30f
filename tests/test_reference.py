"""The float64 reference against an independent two-pass numpy/scipy implementation, the worked
example of the online softmax, invariances, and the explicit backward against autograd."""
import math

import numpy as np
import pytest
import torch
from scipy.special import logsumexp, softmax

from attnverify.reference import online_softmax, reference_backward, reference_forward, visible_counts
from attnverify.spec import Spec


def numpy_attention(q, k, v, *, scale, causal="none", window=None, softcap=None, slopes=None, mask=None,
                    keep=None, p_drop=0.0, segments=None):
    """Independent two-pass implementation: explicit loops over (b, h), scipy softmax/logsumexp."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    out = np.zeros((B, H, Lq, v.shape[-1]))
    lse = np.full((B, H, Lq), -np.inf)
    if segments is None:
        segments = [(0, Lq, 0, Lk)]
    for b in range(B):
        for h in range(H):
            hk = h // (H // Hk)
            for q0, q1, k0, k1 in segments:
                lq, lk = q1 - q0, k1 - k0
                if lq == 0:
                    continue
                s = (q[b, h, q0:q1] @ k[b, hk, k0:k1].T) * scale
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                i = np.arange(lq)[:, None]
                j = np.arange(lk)[None, :]
                if slopes is not None:
                    s = s - slopes[h] * np.abs(i + lk - lq - j)
                vis = np.ones((lq, lk), bool)
                if causal == "top_left":
                    vis &= j <= i
                if causal == "bottom_right":
                    vis &= j <= i + lk - lq
                if window is not None:
                    if window[0] >= 0:
                        vis &= j >= i + lk - lq - window[0]
                    if window[1] >= 0:
                        vis &= j <= i + lk - lq + window[1]
                if mask is not None:
                    m = np.broadcast_to(mask, (B, H, Lq, Lk))[b, h, q0:q1, k0:k1]
                    if m.dtype == bool:
                        vis &= m
                    else:
                        s = s + m
                s = np.where(vis, s, -np.inf)
                for r in range(lq):
                    if np.all(np.isneginf(s[r])):
                        continue
                    lse[b, h, q0 + r] = logsumexp(s[r])
                    p = softmax(s[r])
                    if keep is not None:
                        p = p * keep[b, h, q0 + r, k0:k1] / (1 - p_drop)
                    out[b, h, q0 + r] = p @ v[b, hk, k0:k1]
    return out, lse


def rnd(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


FEATURES = [
    dict(),
    dict(causal="top_left"),
    dict(causal="bottom_right"),
    dict(window=(3, 1)),
    dict(window=(-1, 0), causal="none"),
    dict(softcap=2.5),
    dict(alibi=True),
    dict(mask="bool"),
    dict(mask="float"),
    dict(mask="bool_keys"),
    dict(causal="bottom_right", window=(2, 2), softcap=5.0, alibi=True, mask="bool"),
    dict(scale=0.77, causal="top_left"),
]


@pytest.mark.parametrize("feat", FEATURES, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()) or "plain")
@pytest.mark.parametrize("lq,lk", [(7, 11), (11, 7), (1, 9), (9, 1), (16, 16)])
def test_forward_matches_two_pass_numpy(feat, lq, lk):
    B, H, Hk, D, Dv = 2, 4, 2, 8, 5
    q, k, v = rnd(B, H, lq, D, seed=1), rnd(B, Hk, lk, D, seed=2), rnd(B, Hk, lk, Dv, seed=3)
    slopes = torch.linspace(0.1, 0.9, H, dtype=torch.float64) if feat.get("alibi") else None
    mask = None
    if feat.get("mask") == "bool":
        mask = rnd(B, 1, lq, lk, seed=4) > -0.4
    elif feat.get("mask") == "float":
        mask = rnd(1, H, lq, lk, seed=5)
    elif feat.get("mask") == "bool_keys":
        mask = rnd(B, 1, 1, lk, seed=6) > -0.4  # broadcast over queries and heads
    spec = Spec(scale=feat.get("scale"), causal=feat.get("causal", "none"), window=feat.get("window"),
                softcap=feat.get("softcap"), alibi_slopes=slopes, attn_mask=mask)
    r = reference_forward(q, k, v, spec, block_q=3)
    o, l = numpy_attention(q, k, v, scale=spec.resolved_scale(D), causal=spec.causal, window=spec.window,
                           softcap=spec.softcap, slopes=None if slopes is None else slopes.numpy(),
                           mask=None if mask is None else mask.numpy())
    np.testing.assert_allclose(r.out.numpy(), o, rtol=1e-12, atol=1e-12)
    assert np.array_equal(np.isneginf(r.lse.numpy()), np.isneginf(l))
    fin = np.isfinite(l)
    np.testing.assert_allclose(r.lse.numpy()[fin], l[fin], rtol=1e-12, atol=1e-12)


def test_varlen_with_empty_segments_matches_numpy():
    H, Hk, D = 2, 1, 4
    sq, sk = [3, 0, 5, 2], [4, 3, 0, 6]
    cq, ck = np.cumsum([0] + sq), np.cumsum([0] + sk)
    q, k, v = rnd(1, H, sum(sq), D, seed=1), rnd(1, Hk, sum(sk), D, seed=2), rnd(1, Hk, sum(sk), D, seed=3)
    segs = list(zip(cq, cq[1:], ck, ck[1:]))
    for causal in ("none", "bottom_right"):
        spec = Spec(causal=causal, window=(1, 0) if causal != "none" else None,
                    cu_seqlens_q=torch.tensor(cq, dtype=torch.int32), cu_seqlens_k=torch.tensor(ck, dtype=torch.int32))
        r = reference_forward(q, k, v, spec)
        o, l = numpy_attention(q, k, v, scale=0.5, causal=causal, window=spec.window, segments=segs)
        np.testing.assert_allclose(r.out.numpy(), o, rtol=1e-12, atol=1e-12)
        # segment 2 has no keys: its queries are fully masked
        assert torch.isneginf(r.lse[0, :, 3:8]).all() and (r.out[0, :, 3:8] == 0).all()


def test_dropout_with_explicit_keep_mask():
    q, k, v = rnd(1, 2, 6, 4, seed=1), rnd(1, 2, 9, 4, seed=2), rnd(1, 2, 9, 3, seed=3)
    keep = rnd(1, 2, 6, 9, seed=4) > -0.5
    r = reference_forward(q, k, v, Spec(dropout_p=0.3), dropout_mask=keep)
    o, _ = numpy_attention(q, k, v, scale=0.5, keep=keep.numpy(), p_drop=0.3)
    np.testing.assert_allclose(r.out.numpy(), o, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="keep-mask"):
        reference_forward(q, k, v, Spec(dropout_p=0.3))


def test_worked_example_and_per_tile_average_differs():
    s = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)
    v = torch.tensor([[2.0], [6.0]], dtype=torch.float64)
    assert online_softmax(s, v, [0, 1, 2]).output().item() == pytest.approx(5.0, abs=1e-14)
    # averaging per-tile softmaxes gives 4, which must be told apart
    per_tile = (online_softmax(s[:, :1], v[:1]).output() + online_softmax(s[:, 1:], v[1:]).output()) / 2
    assert per_tile.item() == pytest.approx(4.0)
    # the reference agrees with the worked example through real q/k: q.k = s with scale 1
    q = torch.tensor([[[[1.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[0.0], [math.log(3.0)]]]], dtype=torch.float64)
    out = reference_forward(q, k, v.view(1, 1, 2, 1), Spec(scale=1.0)).out
    assert out.item() == pytest.approx(5.0, abs=1e-14)
    # forgetting the rescale gives a different (wrong) answer
    assert online_softmax(s, v, [0, 1, 2], rescale=False).output().item() != pytest.approx(5.0, abs=1e-3)


def test_common_shift_of_1000_changes_nothing_and_lse_moves_by_it():
    q, k, v = rnd(1, 1, 5, 4, seed=1), rnd(1, 1, 7, 4, seed=2), rnd(1, 1, 7, 4, seed=3)
    base = reference_forward(q, k, v, Spec())
    shifted = reference_forward(q, k, v, Spec(attn_mask=torch.full((5, 7), 1000.0, dtype=torch.float64)))
    torch.testing.assert_close(shifted.out, base.out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(shifted.lse, base.lse + 1000.0, rtol=1e-14, atol=1e-10)
    s = torch.tensor([[1000.0, 1000.0 + math.log(3.0)]], dtype=torch.float64)
    vals = torch.tensor([[2.0], [6.0]], dtype=torch.float64)
    assert online_softmax(s, vals, [0, 1, 2]).output().item() == pytest.approx(5.0, abs=1e-12)


def test_tile_with_no_eligible_key_adds_no_mass():
    s = torch.tensor([[0.5, -math.inf, -math.inf, 1.5]], dtype=torch.float64)
    v = torch.tensor([[1.0], [100.0], [-100.0], [3.0]], dtype=torch.float64)
    a = online_softmax(s, v, [0, 1, 3, 4])
    b = online_softmax(s[:, [0, 3]], v[[0, 3]])
    torch.testing.assert_close(a.output(), b.output(), rtol=0, atol=1e-15)
    torch.testing.assert_close(a.l, b.l, rtol=0, atol=1e-15)
    # a leading dead tile must not produce -inf - -inf
    dead_first = online_softmax(torch.tensor([[-math.inf, -math.inf, 0.0]], dtype=torch.float64),
                                torch.tensor([[1.0], [1.0], [7.0]], dtype=torch.float64), [0, 2, 3])
    assert dead_first.output().item() == 7.0
    fully = online_softmax(torch.full((1, 4), -math.inf, dtype=torch.float64), v, [0, 2, 4])
    assert fully.output().item() == 0.0 and torch.isneginf(fully.lse()).all()


@pytest.mark.parametrize("partition", ["one", "singletons", "uneven", "late_max"])
def test_online_model_equals_reference(partition):
    lq, lk = 5, 13
    q, k, v = rnd(1, 1, lq, 6, seed=7), rnd(1, 1, lk, 6, seed=8), rnd(1, 1, lk, 3, seed=9)
    if partition == "late_max":
        k[:, :, 10:] *= 40.0  # the last tile's max towers over every earlier one
    spec = Spec(causal="bottom_right")
    ref = reference_forward(q, k, v, spec)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(6)
    i, j = torch.arange(lq)[:, None], torch.arange(lk)[None]
    s = s.masked_fill(~(j <= i + lk - lq), -math.inf)
    bounds = {"one": [0, lk], "singletons": list(range(lk + 1)), "uneven": [0, 1, 4, 5, 11, 13],
              "late_max": [0, 4, 8, 10, 13]}[partition]
    st = online_softmax(s, v, bounds)
    torch.testing.assert_close(st.output(), ref.out, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(st.lse(), ref.lse, rtol=1e-12, atol=1e-12)
    if partition == "late_max":
        wrong = online_softmax(s, v, bounds, rescale=False).output()
        assert (wrong - ref.out).abs().max() > 1e-3


def _dense_autograd(q, k, v, spec, slopes=None):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ kk.transpose(-1, -2) * spec.resolved_scale(q.shape[-1])
    if spec.softcap:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    lq, lk = s.shape[-2:]
    i, j = torch.arange(lq)[:, None], torch.arange(lk)[None]
    if slopes is not None:
        s = s - slopes[None, :, None, None] * (i + lk - lq - j).abs().double()
    vis = torch.ones(lq, lk, dtype=torch.bool)
    if spec.causal == "bottom_right":
        vis = j <= i + lk - lq
    if spec.attn_mask is not None:
        vis = vis & spec.attn_mask
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    return p @ vv, lse


@pytest.mark.parametrize("with_lse_grad", [False, True])
def test_backward_matches_autograd_including_lse_gradient(with_lse_grad):
    B, H, Hk, lq, lk, D, Dv = 2, 4, 2, 6, 9, 5, 3
    q = rnd(B, H, lq, D, seed=1).requires_grad_()
    k = rnd(B, Hk, lk, D, seed=2).requires_grad_()
    v = rnd(B, Hk, lk, Dv, seed=3).requires_grad_()
    slopes = torch.linspace(0.2, 0.8, H, dtype=torch.float64)
    mask = rnd(B, 1, lq, lk, seed=4) > -0.6
    mask[:, :, 2] = False  # a fully-masked row: zero gradient, no NaN
    spec = Spec(causal="bottom_right", softcap=3.0, alibi_slopes=slopes, attn_mask=mask)
    o, lse = _dense_autograd(q, k, v, spec, slopes)
    do, dl = rnd(*o.shape, seed=5), rnd(*lse.shape, seed=6)
    loss = (o * do).sum()
    if with_lse_grad:
        loss = loss + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * dl).sum()
    loss.backward()
    g = reference_backward(q.detach(), k.detach(), v.detach(), spec, do, dl if with_lse_grad else None, block_q=2)
    for name, got, exp in (("dq", g.dq, q.grad), ("dk", g.dk, k.grad), ("dv", g.dv, v.grad)):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12, msg=name)
    assert (g.dq[:, :, 2] == 0).all()


def test_backward_gradcheck_finite_differences():
    q = rnd(1, 2, 3, 4, seed=1).requires_grad_()
    k = rnd(1, 1, 5, 4, seed=2).requires_grad_()
    v = rnd(1, 1, 5, 2, seed=3).requires_grad_()
    spec = Spec(causal="top_left", softcap=2.0)
    do = rnd(1, 2, 3, 2, seed=4)

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return reference_forward(q, k, v, spec).out

        @staticmethod
        def backward(ctx, g):
            q, k, v = ctx.saved_tensors
            r = reference_backward(q, k, v, spec, g)
            return r.dq, r.dk, r.dv

    assert torch.autograd.gradcheck(F.apply, (q, k, v), eps=1e-6, atol=1e-7)
    del do


def test_fully_masked_rows_and_chunking_invariance():
    q, k, v = rnd(1, 2, 10, 4, seed=1), rnd(1, 2, 4, 4, seed=2), rnd(1, 2, 4, 4, seed=3)
    spec = Spec(causal="bottom_right")  # Lq > Lk: the first Lq - Lk rows see nothing
    r1 = reference_forward(q, k, v, spec, block_q=1)
    r2 = reference_forward(q, k, v, spec)
    assert torch.equal(r1.out, r2.out) and torch.equal(r1.lse, r2.lse)
    assert (r1.out[:, :, :6] == 0).all() and torch.isneginf(r1.lse[:, :, :6]).all()
    assert torch.isfinite(r1.lse[:, :, 6:]).all()
    g = reference_backward(q, k, v, spec, torch.ones(1, 2, 10, 4, dtype=torch.float64))
    assert torch.isfinite(g.dq).all() and (g.dq[:, :, :6] == 0).all()
    assert visible_counts(10, 4, spec).squeeze().tolist() == [0] * 6 + [1, 2, 3, 4]


def test_nan_and_inf_propagate_as_the_mathematics_says():
    q, k, v = rnd(1, 1, 4, 3, seed=1), rnd(1, 1, 5, 3, seed=2), rnd(1, 1, 5, 2, seed=3)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[:, 4] = False  # key 4 hidden from everyone
    mask[0, 1] = False
    v[0, 0, 4, 0] = math.nan  # hidden: must not matter
    v[0, 0, 1, 1] = math.inf  # visible except for row 0
    q[0, 0, 2, 0] = math.nan  # row 2 becomes NaN
    r = reference_forward(q, k, v, Spec(attn_mask=mask))
    assert torch.isfinite(r.out[0, 0, 0]).all()  # row 0 sees neither poisoned value
    assert torch.isfinite(r.out[0, 0, [1, 3], 0]).all()
    assert torch.isposinf(r.out[0, 0, [1, 3], 1]).all()  # positive weight * inf = inf
    assert torch.isnan(r.out[0, 0, 2]).all() and torch.isnan(r.lse[0, 0, 2])
    # huge finite values in masked-out positions change nothing
    k2, v2 = k.clone(), v.clone()
    k2[0, 0, 4], v2[0, 0, 4] = 1e30, 1e30
    q2 = q.clone()
    q2[0, 0, 2, 0] = 0.3
    a = reference_forward(q2, k, torch.nan_to_num(v, posinf=1.0, nan=0.0), Spec(attn_mask=mask)).out
    b = reference_forward(q2, k2, torch.nan_to_num(v2, posinf=1.0, nan=0.0), Spec(attn_mask=mask)).out
    assert torch.equal(a, b)


def test_usage_errors_name_the_argument():
    q = rnd(1, 3, 4, 4)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        reference_forward(q, rnd(1, 2, 4, 4), rnd(1, 2, 4, 4), Spec())
    with pytest.raises(ValueError, match="window"):
        Spec(window=(-2, 0))
    with pytest.raises(ValueError, match="causal"):
        Spec(causal="upper")
    with pytest.raises(ValueError, match="tile_bounds"):
        online_softmax(torch.zeros(1, 4), torch.zeros(4, 1), [0, 3])
