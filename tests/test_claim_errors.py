"""Claim mistakes a stranger makes writing an adapter for a serving kernel are errors that name the argument and the
fix (docs/adapters.md, "Every keyword of @av.adapter"): one value where a tuple is wanted used to end in "'int' object
is not iterable" (head_dims=64, tiles=64) or "unknown dtype 'f'" (dtypes='float16'), and an on/off claim given a
value (lse='natural', gqa=1) was taken silently."""
from __future__ import annotations

import pytest

import attnverify as av

MISTAKES = [
    (dict(head_dims=64), "head_dims=...", "give a tuple, e.g. head_dims=(64, 128)"),
    (dict(tiles=64), "tiles=...", "give a tuple, e.g. tiles=(128, 64)"),
    (dict(dtypes="float16"), "dtypes=...", "give a tuple, e.g. dtypes=("),
    (dict(devices="cuda"), "devices=...", "give a tuple, e.g. devices=('cuda',)"),
    (dict(lse="natural"), "lse=...", "give True or False, not 'natural'"),
    (dict(gqa=1), "gqa=...", "give True or False, not 1"),
    (dict(paged=True, page_sizes=16), "page_sizes=...", "e.g. (16, 256)"),
    (dict(page_sizes=(16,)), "page_sizes=...", "add paged=True"),
    (dict(dtypes=("bfloat16",), descales=True), "descales=...", "add 'float8_e4m3fn'"),
    (dict(dtypes=("fp8",)), "dtypes=...", "float8_e4m3fn"),
    (dict(causal=("bottom-right",)), "causal=...", "bottom_right"),
]


@pytest.mark.parametrize("kw,arg,fix", MISTAKES, ids=[next(iter(k)) + "-" + str(i) for i, (k, _, _) in enumerate(MISTAKES)])
def test_a_claim_mistake_names_the_argument_and_the_fix(kw, arg, fix):
    with pytest.raises(ValueError) as e:
        av.adapter("stranger", register=False, **kw)(lambda q, k, v, spec: q).claims
    assert f"attnverify.adapter('stranger', {arg})" in str(e.value) and fix in str(e.value), str(e.value)


def test_a_claim_that_does_not_exist_lists_the_known_ones():
    with pytest.raises(TypeError) as e:  # a decode-only kernel has no claim: refuses= (docs/adapters.md, recipe 6)
        av.adapter("stranger", register=False, decode_only=True)(lambda q, k, v, spec: q)
    assert "unknown keyword(s) ['decode_only']" in str(e.value) and "'paged'" in str(e.value)


def test_the_right_spellings_still_work():
    a = av.adapter("stranger", register=False, dtypes=["float16"], head_dims=lambda d: d <= 128, tiles=[64, 32],
                   lse=True, gqa=False, paged=True, page_sizes=(8, 16, 32))(lambda q, k, v, spec: q)
    assert a.claims.dtypes == ("float16",) and a.claims.tiles == (64, 32) and a.claims.lse is True
