"""MLA in the absorbed form (issue 23): mla_latent_views passes correct kernels, catches a backward that drops the
dK path when K and V are views of one latent, and skips adapters without the head dims, naming why."""
from __future__ import annotations

import warnings

import pytest
import torch

import attnverify as av
from attnverify.adapters.naive import naive_attention
from attnverify.adapters.registry import get
from attnverify.properties import get_property
from attnverify.properties.driver import PropertySkipped, run_property
from attnverify.properties.mla import latent_call
from attnverify.zoo import get_member
from attnverify.zoo._sinks import MLA
from attnverify.zoo.selftest import run_member


def _run(adapter, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_property(get_property("mla_latent_views"), adapter, profile="ci", seed=0, database=None,
                            report_dir="reports/test", **kw)


def test_latent_gradient_is_dk_plus_dv_for_naive():
    torch.manual_seed(0)
    q, lat = torch.randn(1, 3, 4, 192), torch.randn(1, 1, 6, 192)
    d_out = torch.randn(1, 3, 4, 128)
    naive = get("naive")
    o1, g1 = latent_call(naive, q, lat, 128, av.Spec(), d_out, views=True)
    o2, g2 = latent_call(naive, q, lat, 128, av.Spec(), d_out, views=False)
    assert torch.allclose(o1, o2) and torch.allclose(g1, g2, atol=1e-5)
    assert g1[..., 128:].abs().sum() > 0 and g1[..., :128].abs().sum() > 0  # both paths really reach the latent


def test_correct_kernels_hold():
    ok = av.adapter("mla-ok", register=False, **MLA)(lambda q, k, v, s: naive_attention(q, k, v, s, return_keep=False).out)
    for a in (get("naive"), ok):
        run = _run(a, max_examples=8)
        assert run.statuses.get("passed", 0) >= 5


def test_member_caught_by_the_ci_profile_within_60s():
    m = get_member("mla-latent-dk-dropped")
    res = run_member(m, profile="ci", seed=0, diagnose=False)
    assert res.status == "caught" and res.caught_by == "mla_latent_views", (res.status, res.caught_by, res.reason)
    assert res.first_seconds < 60


def test_skips_naming_the_missing_claim():
    a = av.adapter("mine-d64", register=False, head_dims=(64,), dv_ne_d=True, backward=True)(lambda q, k, v, s: q)
    with pytest.raises(PropertySkipped, match="mine-d64 claims neither head dims 576/512 nor 192/128"):
        _run(a)
    b = av.adapter("mine-nodv", register=False, head_dims=(192, 128), backward=True)(lambda q, k, v, s: q)
    with pytest.raises(PropertySkipped, match="mine-nodv does not claim dv_ne_d"):
        _run(b)


def test_refuses_is_asked_about_the_views_call():
    """An adapter whose `refuses` turns down a V that is a strided view (its kernel needs V contiguous) is never
    called with one: mla_latent_views skips those calls, naming the adapter's reason, instead of failing on them."""
    seen = []

    def refuses(case):
        return None if case.v.is_contiguous() else "V must be contiguous (my kernel's docs)"

    def fn(q, k, v, s):
        seen.append(v.is_contiguous())
        if not v.is_contiguous():
            raise RuntimeError("kernel: V not contiguous")  # what the real kernel would do
        return naive_attention(q, k, v, s, return_keep=False).out

    a = av.adapter("mla-contig-v", register=False, refuses=refuses, **MLA)(fn)
    run = _run(a, max_examples=6)  # a view of one key row (Lk = 1) is contiguous: that example is judged
    assert run.statuses.get("skipped", 0) >= 3 and set(run.statuses) <= {"skipped", "passed"}, run.statuses
    assert "V must be contiguous" in (run.last_skip or "")
    assert seen and all(seen), "the adapter was called with a V view it refuses"
