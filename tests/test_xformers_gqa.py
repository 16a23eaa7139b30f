"""The `xformers` adapter's GQA follows xformers' docstring: "MQA/GQA is an experimental feature supported only for
the forward pass ... provide 5-dim tensors in the [B, M, G, H, K] format" (memory_efficient_attention, xformers
0.0.33-0.0.35). xformers needs a CUDA GPU and is not installed here, so a plain-torch memory_efficient_attention
written from that docstring stands in for it: BMHK with autograd, and the 5-D BMGHK form forward only (it raises
when an input requires grad, and K/V must be broadcast by the caller). Through it, the adapter's own code passes
`gqa_equals_repeated_kv` and `gradients_match_reference` with GQA: the 5-D form is asked only without gradients,
the MHA form (with K/V repeated) with them. A glue that sends the 5-D form with gradients fails.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import types
import warnings

import pytest
import torch

from _judged import judged_on_the_real_library

from attnverify.adapters import xformers_adapter
from attnverify.adapters.base import Adapter
from attnverify.adapters.registry import get
from attnverify.properties import get_property
from attnverify.properties.driver import run_property

XF = get("xformers")
CALLS: list = []


def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None, output_dtype=None):
    """The docstring's "Equivalent pytorch code", for [B, M, H, K] and (forward only) [B, M, G, H, K] inputs."""
    assert attn_bias is None and p == 0.0
    five = query.dim() == 5
    CALLS.append(("5-D" if five else "4-D", any(t.requires_grad for t in (query, key, value))))
    if five:
        if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
            raise NotImplementedError("MQA/GQA is an experimental feature supported only for the forward pass")
        assert key.shape[:4] == (query.shape[0], key.shape[1], *query.shape[2:4]), "broadcast K/V manually"
        b, m, g, h, k = query.shape
        out = memory_efficient_attention(query.flatten(2, 3), key.flatten(2, 3), value.flatten(2, 3), scale=scale)
        return out.unflatten(2, (g, h))
    assert query.shape[2] == key.shape[2], "BMHK: as many K/V heads as query heads"
    scale = 1.0 / query.shape[-1] ** 0.5 if scale is None else scale
    q, k, v = (t.transpose(1, 2) for t in (query * scale, key, value))
    attn = (q.float() @ k.float().transpose(-2, -1)).softmax(-1)
    return (attn @ v.float()).to(query.dtype).transpose(1, 2).contiguous()


@pytest.fixture
def fake_xformers(monkeypatch):
    pkg = types.ModuleType("xformers")
    ops = types.ModuleType("xformers.ops")
    ops.memory_efficient_attention = memory_efficient_attention
    ops.fmha = types.SimpleNamespace(attn_bias=types.SimpleNamespace())
    pkg.ops = ops
    monkeypatch.setitem(sys.modules, "xformers", pkg)
    monkeypatch.setitem(sys.modules, "xformers.ops", ops)
    CALLS.clear()
    return Adapter(name="xformers-cpu", fn=XF.fn, refuses=XF.refuses,
                   claims=dataclasses.replace(XF.claims, devices=("cpu",), dtypes=("float32",), causal=("none",),
                                              window=False, attn_mask=False, varlen=False, dropout=False, lse=False,
                                              dv_ne_d=False, fully_masked="unsupported", head_dims=(16, 32)))


def _run(adapter, prop, n=6):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_property(get_property(prop), adapter, profile="ci", seed=0, database=None,
                            report_dir="reports/test", max_examples=n)


@pytest.mark.parametrize("prop", ["gqa_equals_repeated_kv", "gradients_match_reference"])
def test_gqa_forward_in_5d_and_gradients_through_the_mha_form(fake_xformers, prop):
    run = _run(fake_xformers, prop)
    assert run.statuses.get("passed", 0) >= 3, run.statuses
    assert ("5-D", True) not in CALLS  # the documented limit: never a 5-D call with gradients


@pytest.mark.parametrize("prop", ["forward_matches_reference", "batch_head_independence"])
def test_gqa_calls_without_gradients_use_the_5d_form(fake_xformers, prop):
    run = _run(fake_xformers, prop)
    assert run.statuses.get("passed", 0) >= 3, run.statuses
    assert ("5-D", True) not in CALLS
    assert ("5-D", False) in CALLS, sorted(set(CALLS))  # GQA forward through the documented BMGHK form


def test_a_5d_call_with_gradients_is_what_the_docstring_forbids(fake_xformers):
    q = torch.randn(1, 4, 2, 3, 16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="only for the forward pass"):
        memory_efficient_attention(q, q, q)
    assert math.isfinite(float(memory_efficient_attention(q.detach(), q.detach(), q.detach()).sum()))


def test_glue_sending_gqa_gradients_to_the_5d_form_fails(fake_xformers, monkeypatch):
    real = xformers_adapter.xformers.fn

    def wrong(q, k, v, spec):  # as if the adapter took the 5-D path whatever the gradients
        g = q.shape[1] // k.shape[1]
        if g > 1:
            b, hq, lq, d = q.shape
            qq = q.transpose(1, 2).unflatten(2, (k.shape[1], g))
            kk = k.transpose(1, 2).unsqueeze(3).expand(b, k.shape[2], k.shape[1], g, d)
            vv = v.transpose(1, 2).unsqueeze(3).expand(b, v.shape[2], v.shape[1], g, v.shape[3])
            return memory_efficient_attention(qq, kk, vv, scale=spec.resolved_scale(d)).flatten(2, 3).transpose(1, 2)
        return real(q, k, v, spec)

    a = Adapter(name="xformers-wrong", fn=wrong, refuses=fake_xformers.refuses, claims=fake_xformers.claims)
    with pytest.raises(AssertionError, match="only for the forward pass"):
        _run(a, "gradients_match_reference", n=10)


@pytest.mark.gpu
@pytest.mark.parametrize("prop", ["gqa_equals_repeated_kv", "gradients_match_reference"])
def test_real_xformers_gqa(prop, tmp_path):
    judged_on_the_real_library(XF, prop, tmp_path, min_passed=3)
