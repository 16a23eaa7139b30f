"""Regressions found when the claim-set fuzz's wide slice began drawing fp8 / descales (issue 23) and
cache_leftpad (issue 22): each replays the claim set or the call that showed the problem."""
import pytest

from attnverify.case import CaseRecipe, build_case, build_probe
from attnverify.properties import get_property
from attnverify.zoo.claimsets import run_claim_set

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BASE = {"dtypes": ["float32"], "devices": ["cpu"], "head_dims": [16], "max_seqlen": 46, "causal": ["none"],
        "window": False, "softcap": False, "alibi": False, "attn_mask": False, "gqa": False, "varlen": False,
        "dropout": False, "backward": False, "lse": False, "dv_ne_d": False, "deterministic": False,
        "fully_masked": "zeros", "tiles": None, "memory": "quadratic", "refuses": None, "known": None}


def test_the_cache_strategies_claim_probe_draws_no_values():
    """A cache draw's claim probe (build_probe(values=False)) was the whole case: caches drawn in float64, garbage
    written slot by slot, then cast -- most of the 68 s that seed 2001's claim set (every draw refused) spent per
    cache property. The probe is zeros in the case's dtype, with its shapes, strides and spec."""
    r = CaseRecipe(batch=2, heads_q=2, heads_kv=1, len_q=3, len_k=9, head_dim=16, dtype="bfloat16", causal="none",
                   cache_lens=[6, 9], cache_leftpad=[1, 3], new_len=3, page_size=16, num_pages=3, garbage="nan")
    real, probe = build_case(r), build_probe(r, values=False)
    assert bool(real.k.isnan().any())  # the real case has garbage in its unused slots
    for a, b in ((real.q, probe.q), (real.k, probe.k), (real.v, probe.v), (real.spec.k_new, probe.spec.k_new)):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        assert not bool(b.any())
    assert probe.spec.cache_seqlens.tolist() == real.spec.cache_seqlens.tolist() == [6, 9]
    assert probe.spec.cache_leftpad.tolist() == [1, 3]


def test_a_cache_property_whose_draws_are_all_refused_skips_with_the_refusal(tmp_path):
    """Seed 2001's claim set (head dims multiples of 48, `refuses` every head dim above 32): the cache properties
    skipped with 'no draw satisfies what the property needs within the claims (dtypes=...)', not the refusal,
    which only attention_cases recorded; the cache strategy records it too."""
    desc = dict(BASE, head_dims="multiple_of_48", refuses="head_dim_above_32", kv_cache=True, append=True)
    rows = run_claim_set(desc, [get_property("kv_cache_append")], max_examples=1, report_dir=str(tmp_path))
    assert [r["outcome"] for r in rows] == ["skipped"], rows
    assert "refuses head dims above 32" in rows[0]["message"], rows


def test_memory_scaling_holds_for_the_strict_adapters_linear_memory_claim(tmp_path):
    """memory="linear" claim sets: the strict adapter's row chunks were 64 rows, so every call at N, 2N, 4N <= 64
    was one chunk holding the whole N x N scores. And at small N one score matrix at 4N is the size of a correct
    kernel's workspace steps: at N = 16 (float32) the fit read 5 KiB of quadratic part against 2 KiB allowed, at
    N = 32 (wide shard 4's claim set: bfloat16, fwd+bwd, D = 17) per-chunk 5 KiB buffers against 4 KiB. The
    property now starts at N = 64 and says so below it."""
    desc = dict(BASE, dtypes=["float16", "bfloat16", "float8_e4m3fn"], head_dims="odd_below_100", descales=True,
                causal=["none", "top_left", "bottom_right"], backward=True, lse=True, memory="linear",
                fully_masked="nan", refuses="head_dim_above_32")
    rows = run_claim_set(dict(desc, max_seqlen=256), [get_property("memory_scaling")], max_examples=4,
                         report_dir=str(tmp_path))
    assert [r["outcome"] for r in rows] == ["passed"], rows
    rows = run_claim_set(dict(desc, max_seqlen=200), [get_property("memory_scaling")], max_examples=4,
                         report_dir=str(tmp_path))
    assert [r["outcome"] for r in rows] == ["skipped"], rows
    assert "memory_scaling needs N, 2N and 4N keys with N >= 64 (4N = 256)" in rows[0]["message"], rows


def test_a_wrong_implementation_is_not_chunked_by_the_strict_adapter():
    """The slow wrong-implementation test (seed 4000) drew a memory="linear" claim set once fp8 was drawn: the
    strict adapter chunked the wrong engine's rows too, turning bottom-right causal into a correct bool mask, and
    causal_top_left passed causal_alignment. A wrong implementation now gets the call as it comes."""
    import torch

    from attnverify.adapters.naive import naive_attention
    from attnverify.zoo.claimsets import strict_adapter

    desc = dict(BASE, head_dims=[16], causal=["top_left", "bottom_right"], memory="linear", lse=True)
    c = build_case(CaseRecipe(len_q=5, len_k=40, head_dim=16, causal="bottom_right"))
    good = strict_adapter(desc)(c.q, c.k, c.v, c.spec).out
    bad = strict_adapter(desc, bug="causal_top_left")(c.q, c.k, c.v, c.spec).out
    ref = naive_attention(c.q, c.k, c.v, c.spec).out
    assert torch.allclose(good, ref, atol=1e-5)
    assert not torch.allclose(bad, ref, atol=1e-2), "the bug did not reach the call"
