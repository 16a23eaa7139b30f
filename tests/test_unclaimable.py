"""A property whose strategy cannot draw any case the claims allow skips at once, naming the claim (strategies
`Unclaimable`, raised by attention_cases only where it is certain); a property that can still draw one runs.

Before: Hypothesis found out by drawing (up to its 458 invalid test cases, 1.1 s for fully_masked_rows on a one-key
adapter with a window here) and the skip read 'no draw satisfies what the property needs within the claims (<every
claim>)', which named no claim.
"""
from __future__ import annotations

import time
import warnings

import pytest
from hypothesis import find

import attnverify as av
from attnverify.adapters.naive import naive_serving
from attnverify.properties import get_property, run_property
from attnverify.properties.driver import PropertySkipped
from attnverify.strategies import InvalidArgument, Unclaimable, attention_cases

ONE_KEY = av.adapter("one-key", register=False, max_seqlen=1, causal=("bottom_right",), fully_masked="zeros",
                     window=True)(naive_serving)


def _skip(prop, adapter):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        with pytest.raises(PropertySkipped) as e:
            run_property(get_property(prop), adapter, profile="ci", seed=1, database=None, report_dir="reports/test")
    return str(e.value), time.perf_counter() - t


@pytest.mark.parametrize("prop, why", [
    ("causal_alignment", "one-key claims max_seqlen=1: Lq != Lk needs two positions"),
    ("fully_masked_rows", "one-key claims max_seqlen=1: a row with no visible key needs Lq > Lk"),
])
def test_a_property_the_claims_exclude_skips_naming_the_claim(prop, why):
    msg, secs = _skip(prop, ONE_KEY)
    assert msg.startswith(f"one-key accepts none of the cases {prop} draws: {why}"), msg
    assert "no draw satisfies" not in msg, msg
    assert secs < 0.5, secs  # no Hypothesis run: the strategy is refused when it is built


def test_a_property_that_can_still_draw_runs():
    """One position, but a way to mask a row at any length (attn_mask) or to have no keys (varlen with min_seqlen=0):
    not excluded."""
    masked = av.adapter("one-key-mask", register=False, max_seqlen=1, causal=("bottom_right",), fully_masked="zeros",
                        attn_mask=True)(naive_serving)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = run_property(get_property("fully_masked_rows"), masked, profile="ci", seed=1, max_examples=5,
                           database=None, report_dir="reports/test")
    assert run.statuses.get("passed", 0) >= 1, run.statuses
    empty = av.adapter("one-key-varlen", register=False, max_seqlen=1, causal=("none", "bottom_right"),
                       fully_masked="zeros", varlen=True)(naive_serving)
    r = find(attention_cases(adapter=empty, profile="ci", lq_ne_lk=True, min_seqlen=0), lambda r: True)
    assert r.len_q != r.len_k and r.seqlens_q is not None, r
    with pytest.raises(Unclaimable, match="max_seqlen=1: Lq != Lk needs two positions"):  # min_seqlen=1: no empty keys
        attention_cases(adapter=empty, profile="ci", lq_ne_lk=True)


def test_unclaimable_is_an_invalid_argument_of_attention_cases():
    one_dim = av.adapter("one-dim", register=False, head_dims=(64,), dv_ne_d=True)(naive_serving)
    with pytest.raises(Unclaimable, match=r"one-dim claims one head dim \(64\) here: Dv != D needs two"):
        attention_cases(adapter=one_dim, profile="ci", dv_ne_d=True)
    assert issubclass(Unclaimable, InvalidArgument)
    two = av.adapter("two-dims", register=False, head_dims=(64, 32), dv_ne_d=True)(naive_serving)
    r = find(attention_cases(adapter=two, profile="ci", dv_ne_d=True), lambda r: True)
    assert r.head_dim_v is not None and r.head_dim_v != r.head_dim
