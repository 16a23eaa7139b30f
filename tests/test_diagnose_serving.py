"""The diagnosis on serving-era cases (issues 22/23): sinks and fp8 descales are the reference's in its engine, a
descale ignored or a sink misplaced is named, and a case the engine does not model (chunked attention) names no
alternative instead of a coincidental one (a stranger's fp8 kernel with k_descale dropped was diagnosed "softmax
scale applied twice" because the engine knew no descales)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from attnverify.case import CaseRecipe, build_case
from attnverify.diagnose import Variant, alternative_forward, diagnose
from attnverify.fp8 import descaled
from attnverify.reference import reference_forward

SINKS = {"kind": "mixed", "level": 2.0, "seed": 0}
RECIPES = [
    dict(sinks=SINKS, heads_q=4, heads_kv=2, causal="bottom_right", len_q=9, len_k=21),
    dict(sinks={"kind": "dominant", "level": 4.0, "seed": 1}, causal="bottom_right", len_q=20, len_k=8),  # keyless rows
    dict(sinks={"kind": "neg_inf", "level": 0.0, "seed": 2}, causal="bottom_right", len_q=20, len_k=8),
    dict(dtype="float8_e4m3fn", descales="amax", heads_q=4, heads_kv=2, len_q=9, len_k=33),
    dict(dtype="float8_e4m3fn", descales="random", sinks=SINKS, batch=2, causal="bottom_right", len_q=7, len_k=19),
]


@pytest.mark.parametrize("r", RECIPES, ids=[str(i) for i in range(len(RECIPES))])
def test_engine_default_equals_reference_with_sinks_and_descales(r):
    c = build_case(CaseRecipe(**r))
    ref = reference_forward(c.q, c.k, c.v, c.spec)
    out, lse = alternative_forward(c.q, c.k, c.v, c.spec)
    torch.testing.assert_close(out, ref.out, rtol=1e-12, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(lse, ref.lse, rtol=1e-12, atol=1e-12, equal_nan=True)


def _fp8_case(**kw):
    return build_case(CaseRecipe(dtype="float8_e4m3fn", descales="random", batch=2, heads_q=4, heads_kv=2, len_q=9,
                                 len_k=33, return_lse=True, seed=4, **kw))


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_an_ignored_descale_is_named(name):
    c = _fp8_case()
    wrong = reference_forward(*descaled(c.q, c.k, c.v, c.spec.replace(**{f"{name}_descale": None}))[:3],
                              c.spec.replace(q_descale=None, k_descale=None, v_descale=None))
    d = diagnose(c, {"out": wrong.out.float(), "lse": wrong.lse.float()})
    assert d.summary == f"{name}_descale ignored (taken as 1)", d.text()
    right = reference_forward(c.q, c.k, c.v, c.spec)
    assert not diagnose(c, {"out": right.out.float(), "lse": right.lse.float()}).explained  # and never a right one


def test_sink_ignored_and_sink_in_numerator_are_named():
    c = build_case(CaseRecipe(sinks=SINKS, heads_q=4, heads_kv=2, len_q=9, len_k=21, return_lse=True, seed=3))
    no_sink = reference_forward(c.q, c.k, c.v, c.spec.replace(sinks=None))
    d = diagnose(c, {"out": no_sink.out.float(), "lse": no_sink.lse.float()})
    assert d.best is not None and d.best.key == "sink_ignored", d.text()
    ref = reference_forward(c.q, c.k, c.v, c.spec)
    p_sink = torch.exp(torch.as_tensor(c.spec.sinks, dtype=torch.float64)[None, :, None] - ref.lse)  # (B, Hq, Lq)
    numerator = ref.out + p_sink[..., None]  # the sink's weight on every output element
    d = diagnose(c, {"out": numerator.float()}, failing=["out"])
    assert d.best is not None and d.best.key == "sink_in_numerator", d.text()


def test_chunk_ignored_is_named_and_the_guard_is_no_blanket():
    """Chunked local attention is in the engine (it was not: every chunk bug read 'no simple explanation'): an output
    that is the reference without the chunks is named as such."""
    c = build_case(CaseRecipe(attention_chunk=4, causal="bottom_right", len_q=16, len_k=16, seed=2))
    unchunked = reference_forward(c.q, c.k, c.v, c.spec.replace(attention_chunk=None)).out
    d = diagnose(c, {"out": unchunked.float()}, failing=["out"])
    assert d.best is not None and d.best.key == "chunk_ignored", d.text()
    assert not any("does not reproduce the reference" in n for n in d.notes), d.notes
    plain = build_case(CaseRecipe(causal="bottom_right", len_q=16, len_k=40, seed=2))  # and the guard is no blanket
    skip_last = alternative_forward(plain.q, plain.k, plain.v, plain.spec, Variant(skip_last_tile=16))[0]
    assert diagnose(plain, {"out": skip_last.float()}, failing=["out"]).best.key == "last_tile_skipped_16"


def test_a_fit_is_judged_at_the_dtype_floor_where_the_reference_is_near_zero():
    """A dominant sink makes the reference ~0, and the check's norm bound for `out` far below bfloat16's rounding; the
    sink-in-numerator output (~1 everywhere, rounded to bfloat16) must still be named, not 'no simple explanation'."""
    c = build_case(CaseRecipe(sinks={"kind": "dominant", "level": 2.0, "seed": 0}, dtype="bfloat16", len_q=17,
                              len_k=33, causal="bottom_right", return_lse=True, seed=1))
    alt = alternative_forward(c.q, c.k, c.v, c.spec, Variant(sink="numerator"))[0]
    observed = alt.to(torch.bfloat16)  # what a bfloat16 kernel with this bug returns
    d = diagnose(c, {"out": observed}, failing=["out"], tol_norm={"out": 3.6e-6})
    assert d.best is not None and d.best.key == "sink_in_numerator", d.text()


def test_a_case_description_names_its_sinks_and_chunk():
    """The summary's "smallest case" of a sink bug named no sink (the sinks are the property's parameter), so it read
    as a plain case that fails; the description now carries them (and the chunk), plain and paged."""
    plain = build_case(CaseRecipe(sinks={"kind": "neg_inf", "level": 0.0, "seed": 0}, heads_q=2, attention_chunk=4,
                                  causal="bottom_right"))
    assert plain.describe().endswith("sinks=[-inf,-inf] attention_chunk=4"), plain.describe()
    paged = build_case(CaseRecipe(batch=2, cache_lens=(5, 9), len_k=9, paged=True, page_size=4, num_pages=8, len_q=1,
                                  block_table=((3, 1, 0), (2, 5, 7)), heads_q=2))
    paged = dataclasses.replace(paged, spec=paged.spec.replace(sinks=torch.tensor([0.5, -1.25])))  # as sinks_paged does
    assert "sinks=[0.5,-1.25]" in paged.describe() and "paged" in paged.describe(), paged.describe()


def test_online_model_keeps_a_nan_row_nan_and_a_swallowed_nan_is_not_an_online_bug():
    """A stranger's kernel that tested `l > 0` turned a NaN row into zeros; the diagnosis called that 'online softmax
    without rescale', because attnverify's own online model had the same `l > 0` and swallowed the NaN too."""
    from attnverify.reference import online_softmax

    c = build_case(CaseRecipe(len_q=1, len_k=63, head_dim=64, dtype="bfloat16", causal="bottom_right",
                              poison=(("q", 0, 0, 0, 0, "nan"),)))
    ref = reference_forward(c.q, c.k, c.v, c.spec)
    s = (c.q.double() @ c.k.double().transpose(-1, -2)) * c.spec.resolved_scale(64)
    online = online_softmax(s, c.v.double(), [0, 16, 32, 48, 63]).output()
    torch.testing.assert_close(online, ref.out, equal_nan=True)
    assert bool(torch.isnan(online[0, 0, 0]).all())
    swallowed = torch.nan_to_num(ref.out, nan=0.0).to(torch.bfloat16)
    d = diagnose(c, {"out": swallowed}, failing=["out"])
    assert not any(e.fits and e.key.startswith("missing_rescale") for e in d.explanations), d.text()
