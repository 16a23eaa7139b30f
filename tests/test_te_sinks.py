"""The `te` adapter's sinks (issue 23): softmax_type='learnable' with the module's alpha replaced by spec.sinks.

Transformer Engine needs a CUDA GPU and is not installed here. A plain-torch DotProductAttention written from TE's
docstring ("Softmax(S)_{:,h,:,i} = exp(S_{:,h,:,i}) / (exp(alpha_h) + sum_j exp(S_{:,h,:,j}))", alpha a learnable
parameter `softmax_offset` of shape [h]) and the unfused backend's reading of it (the offset appended as one more
column of the scaled scores, dropped before the product with V) stands in for it in sys.modules; the sink
properties, with backward (the sink's gradient), run through the adapter's own code. A glue that leaves the
module's parameter in place (the sinks never reach TE) fails.
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

from attnverify.adapters import te_adapter
from attnverify.adapters.base import Adapter
from attnverify.adapters.registry import get
from attnverify.case import CaseRecipe, build_case
from attnverify.properties import get_property
from attnverify.properties.driver import run_property

TE = get("te")


class DotProductAttention(torch.nn.Module):
    """bshd only; attn_mask_type no_mask / causal (top-left) / causal_bottom_right; softmax_type vanilla / learnable."""

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0, qkv_format="bshd",
                 attn_mask_type="causal", softmax_scale=None, softmax_type="vanilla", **kw):
        super().__init__()
        assert qkv_format == "bshd" and attention_dropout == 0.0 and softmax_type in ("vanilla", "learnable")
        self.h, self.g = num_attention_heads, num_gqa_groups or num_attention_heads
        d = kv_channels if isinstance(kv_channels, int) else kv_channels[0]
        self.scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(d)
        self.softmax_type = softmax_type
        if softmax_type == "learnable":
            self.register_parameter("softmax_offset", torch.nn.Parameter(torch.zeros(num_attention_heads)))

    def forward(self, q, k, v, attn_mask_type="no_mask", qkv_format="bshd", window_size=None, **kw):
        assert not kw, f"not in this stand-in: {sorted(kw)}"
        b, sq, h, _ = q.shape
        sk = k.shape[1]
        rep = self.h // self.g
        qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
        kf, vf = kf.repeat_interleave(rep, 1), vf.repeat_interleave(rep, 1)
        s = (qf @ kf.transpose(-1, -2)) * self.scale
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        keep = torch.ones(sq, sk, dtype=torch.bool)
        if attn_mask_type == "causal":
            keep &= j <= i
        elif attn_mask_type == "causal_bottom_right":
            keep &= j <= i + sk - sq
        else:
            assert attn_mask_type == "no_mask"
        if window_size is not None:
            left, right = window_size
            if left >= 0:
                keep &= j >= i + sk - sq - left
            if right >= 0:
                keep &= j <= i + sk - sq + right
        s = s.masked_fill(~keep, -math.inf)
        if self.softmax_type == "learnable":  # one more column: the offset, never masked
            s = torch.cat([s, self.softmax_offset.float().view(1, h, 1, 1).expand(b, h, sq, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)
        if self.softmax_type == "learnable":
            p = p[..., :-1]
        out = (p @ vf).transpose(1, 2).to(q.dtype)  # (B, Sq, H, Dv)
        return out.reshape(b, sq, h * v.shape[-1])


@pytest.fixture
def fake_te(monkeypatch):
    pkg = types.ModuleType("transformer_engine")
    pkg.__version__ = "2.20.0+cpu-standin"
    mod = types.ModuleType("transformer_engine.pytorch")
    mod.DotProductAttention = DotProductAttention
    pkg.pytorch = mod
    monkeypatch.setitem(sys.modules, "transformer_engine", pkg)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", mod)
    monkeypatch.setattr(te_adapter, "_MODULES", {})
    return Adapter(name="te-cpu", fn=TE.fn, refuses=TE.refuses,
                   claims=dataclasses.replace(TE.claims, devices=("cpu",), dtypes=("float32",), varlen=False,
                                              alibi=False, attn_mask=False, dropout=False, head_dims=(16, 32)))


def _run(adapter, prop, n=6):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_property(get_property(prop), adapter, profile="ci", seed=0, database=None,
                            report_dir="reports/test", max_examples=n)


@pytest.mark.parametrize("prop", ["sinks_match_reference", "sink_as_extra_key", "sink_limits"])
def test_sinks_through_learnable_softmax(fake_te, prop):
    assert fake_te.claims.backward  # sinks_match_reference judges the sink's gradient too
    run = _run(fake_te, prop)
    assert run.statuses.get("passed", 0) >= 3, run.statuses


def test_sinks_left_on_the_module_are_caught(fake_te, monkeypatch):
    """The glue calling the module without replacing its alpha (all zeros: 'off-by-one', not the drawn sinks)."""
    monkeypatch.setattr(te_adapter, "_call", lambda mod, alpha, args, kwargs: mod(*args, **kwargs))
    with pytest.raises(AssertionError, match="MISMATCH"):
        _run(fake_te, "sinks_match_reference", n=10)


def test_old_transformer_engine_is_refused_sinks_saying_why(monkeypatch):
    case = build_case(CaseRecipe(heads_q=2, heads_kv=2, len_q=3, len_k=4, head_dim=16, sinks={"kind": "normal",
                                                                                                 "level": 1.0, "seed": 0}))
    monkeypatch.setattr(te_adapter, "_te_version", lambda: (2, 8))
    assert "sinks need TE >= 2.9" in TE.refuses(case)
    monkeypatch.setattr(te_adapter, "_te_version", lambda: (2, 9))
    assert TE.refuses(case) is None
    monkeypatch.setattr(te_adapter, "_te_version", lambda: None)  # not installed: the adapter is unavailable anyway
    assert TE.refuses(case) is None


@pytest.mark.gpu
@pytest.mark.parametrize("prop", ["sinks_match_reference", "sink_as_extra_key", "sink_limits"])
def test_real_transformer_engine_sinks(prop, tmp_path):
    judged_on_the_real_library(TE, prop, tmp_path, min_passed=3)
