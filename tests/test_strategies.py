"""The strategies draw only what an adapter claims, validate their arguments, and shrink simply."""
import math

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

import attnverify as av
from attnverify.adapters.registry import get
from attnverify.check import unclaimed
from attnverify.reference import online_softmax, reference_forward
from attnverify.strategies import (
    InvalidArgument, attention_cases, corpus, fully_masked_row_count, interesting_lengths, seqlens, tile_partitions,
)

FAST = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@av.adapter("restricted-test", register=False, dtypes=("float16",), head_dims=(64, 96), max_seqlen=100)
def restricted(q, k, v, spec):
    return q


@av.adapter("no-fm-test", register=False, dtypes=("float32",), attn_mask=True, causal=("none", "bottom_right"),
            window=True, varlen=True, fully_masked="unsupported")
def no_fm(q, k, v, spec):
    return q


@pytest.mark.parametrize("name", ["naive", "sdpa-math", "sdpa-flash"])
def test_draws_only_claimed_cases(name):
    a = get(name)

    @FAST
    @given(attention_cases(adapter=a, profile="ci"))
    def t(r):
        assert unclaimed(a, av.build_case(r)) is None

    t()


def test_restricted_adapter_gets_only_its_claims():
    @FAST
    @given(attention_cases(adapter=restricted, profile="ci"))
    def t(r):
        c = av.build_case(r)
        assert unclaimed(restricted, c) is None
        assert r.dtype == "float16" and r.head_dim in (64, 96) and max(r.len_q, r.len_k) <= 100
        assert r.mask == "none" and r.causal == "none" and r.heads_q == r.heads_kv and r.head_dim_v is None

    t()


def test_no_fully_masked_rows_when_unsupported():
    @FAST
    @given(attention_cases(adapter=no_fm, profile="ci"))
    def t(r):
        assert fully_masked_row_count(r) == 0

    t()


def test_fully_masked_true_always_has_one():
    a = get("naive")

    @FAST
    @given(attention_cases(adapter=a, profile="ci", fully_masked=True))
    def t(r):
        c = av.build_case(r)
        assert torch.isneginf(reference_forward(c.q, c.k, c.v, c.spec).lse).any()

    t()


@pytest.mark.parametrize("kw, msg", [
    (dict(min_seqlen=9, max_seqlen=4), "min_seqlen=9 is larger than max_seqlen=4"),
    (dict(dtypes=("float99",)), "dtypes=('float99',)"),
    (dict(profile="huge"), "profile='huge'"),
    (dict(max_seqlen=10**6), "max_seqlen=1000000 is larger than"),
    (dict(batch=0), "batch=0 must be >= 1"),
])
def test_arguments_are_validated_at_once(kw, msg):
    with pytest.raises(InvalidArgument, match=msg.replace("(", r"\(").replace(")", r"\)")):
        attention_cases(adapter=get("naive"), **kw)


def test_unclaimed_feature_forced_is_an_error():
    with pytest.raises(InvalidArgument, match="window=True but sdpa-math does not claim window"):
        attention_cases(adapter=get("sdpa-math"), window=True)
    with pytest.raises(InvalidArgument, match="does not claim lse"):
        attention_cases(adapter=get("sdpa-math"), return_lse=True)


def test_arguments_may_be_strategies():
    a = get("naive")

    @FAST
    @given(attention_cases(adapter=a, profile="ci", max_seqlen=st.integers(5, 9), batch=st.just(2)))
    def t(r):
        assert r.batch == 2 and r.len_k <= 9

    t()


def test_interesting_lengths():
    ls = interesting_lengths(max_len=200)
    for x in (1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 192, 31, 97, 131):
        assert x in ls
    assert all(1 <= x <= 200 for x in ls)
    assert 130 in interesting_lengths(max_len=200, tiles=(65,))
    with pytest.raises(InvalidArgument, match="min_len=5 is larger than max_len=3"):
        seqlens(min_len=5, max_len=3)


def test_shrinks_to_simple_cases():
    a = get("naive")
    # derandomized: which features the first failing draw carries is luck, and a varlen pack whose
    # segments sum past 100 cannot always shrink back to a plain case
    r = find(attention_cases(adapter=a, profile="ci"), lambda r: r.len_k > 100,
             settings=settings(database=None, max_examples=500, derandomize=True, suppress_health_check=list(HealthCheck)))
    assert (r.batch, r.heads_q, r.dtype, r.mask, r.causal, r.layout, r.seed) == (1, 1, "float32", "none", "none", "contiguous", 0)
    assert r.len_k == 101 or r.len_k in interesting_lengths(max_len=200)
    r = find(attention_cases(adapter=a, profile="ci"), lambda r: r.heads_q != r.heads_kv,
             settings=settings(database=None, max_examples=500, derandomize=True, suppress_health_check=list(HealthCheck)))
    assert (r.heads_q, r.heads_kv, r.len_q, r.len_k) == (2, 1, 1, 1)


@settings(max_examples=40, deadline=None, database=None)
@given(st.integers(1, 70).flatmap(lambda n: st.tuples(st.just(n), tile_partitions(n))), st.integers(0, 1000))
def test_online_softmax_equals_reference_for_any_partition(n_bounds, seed):
    n, bounds = n_bounds
    assert bounds[0] == 0 and bounds[-1] == n and bounds == sorted(set(bounds))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 5, 8, generator=g, dtype=torch.float64) * 3
    k = torch.randn(1, 1, n, 8, generator=g, dtype=torch.float64) * 3
    v = torch.randn(1, 1, n, 4, generator=g, dtype=torch.float64)
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    st_ = online_softmax(s, v, bounds)
    ref = reference_forward(q, k, v)
    torch.testing.assert_close(st_.output(), ref.out)
    torch.testing.assert_close(st_.lse(), ref.lse)


def test_corpus_is_claimed_and_complete():
    labels = {r.tags[0] for r in corpus(get("naive"), profile="ci")}
    for want in ("two-tile", "masked-key-tile-causal-window", "L192-logits-minus-120-mask", "bottom-right-lq-gt-lk",
                 "lk-1-mod-32", "decode", "mask-broadcast-over-keys", "long-keys-precision"):
        assert want in labels
    for name in ("sdpa-math", "sdpa-flash"):
        a = get(name)
        for r in corpus(a, profile="ci"):
            assert unclaimed(a, av.build_case(r)) is None
    assert all(r.dtype == "float16" and r.head_dim in (64, 96) for r in corpus(restricted, profile="ci"))


def test_corpus_keeps_big_tile_templates_within_the_ci_cap():
    """flex on the CPU claims 128 x 128 tiles; built from them, half of the corpus (the varlen pack among it,
    389 keys) was over the ci profile's length cap and dropped, and with it the case that shows F16. Such
    templates are rebuilt from smaller tiles: every label the 16 x 16 build has, the 128 x 128 adapter
    keeps, within the cap, and the varlen pack still crosses one of the adapter's own key tiles."""
    import dataclasses

    from attnverify.strategies._profiles import profile_limits

    naive = get("naive")
    big = dataclasses.replace(naive, claims=dataclasses.replace(naive.claims, tiles=(128, 128)))
    small_labels = {r.tags[0] for r in corpus(dataclasses.replace(naive, claims=dataclasses.replace(
        naive.claims, tiles=(16, 16))), profile="ci")}
    got = {r.tags[0]: r for r in corpus(big, profile="ci")}
    assert set(got) == small_labels and "varlen-multi-segment" in got
    cap = max(profile_limits("ci").max_len, 256)
    assert all(max(r.len_q, r.len_k) <= cap for r in got.values())
    assert max(got["varlen-multi-segment"].seqlens_k) > 0 and got["varlen-multi-segment"].len_k > 128
    assert got["two-tile"].len_k == 256  # fits at the adapter's own tile size: not shrunk


def test_last_refusal_says_why_the_adapters_refuses_turned_a_draw_down():
    """The driver skips a property none of whose draws an adapter accepts with this reason
    (strategies.last_refusal, the public accessor of the strategies' record)."""
    from hypothesis.errors import Unsatisfiable

    from attnverify.strategies import last_refusal

    @av.adapter("refuses-all-test", register=False, dtypes=("float32",),
                refuses=lambda case: "this kernel takes no case at all (test)")
    def refuses_all(q, k, v, spec):
        return q

    assert last_refusal("refuses-all-test") is None
    with pytest.raises(Unsatisfiable):
        find(attention_cases(adapter=refuses_all, profile="ci"), lambda r: True,
             settings=settings(max_examples=20, database=None, suppress_health_check=list(HealthCheck)))
    assert last_refusal("refuses-all-test") == "this kernel takes no case at all (test)"


def test_a_float_mask_comes_in_the_input_dtype_and_a_users_sdpa_adapter_holds():
    """SDPA documents "a float mask of the same type as query, key, value"; given float64 inputs and a float32
    mask, its CPU flash kernel returns wrong numbers without a word (max error ~2 for Lq 1..16, torch 2.13).
    The case builder handed float64 cases a float32 mask (since 6a3dd86, meant for fp8 only), and sdpa-flash
    failed causal_alignment in the slow ci profile. A user's adapter that passes spec.attn_mask on, as SDPA's
    documentation allows, must hold; an fp8 case keeps its float32 mask (fp8 has no float mask)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    @av.adapter("users-sdpa-flash", register=False, dtypes=("float32", "float64"), head_dims=(16,), attn_mask=True)
    def mine(q, k, v, spec):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=spec.attn_mask, scale=spec.scale)

    for dt in ("float64", "float32"):
        for lq in (1, 5, 16):
            c = av.build_case(av.CaseRecipe(dtype=dt, mask="float_random", len_q=lq, len_k=16, head_dim=16, seed=3))
            res = av.check(mine, c)
            assert res.passed, res.message()
            assert c.spec.attn_mask.dtype == c.q.dtype, (dt, c.spec.attn_mask.dtype)
    fp8 = av.build_case(av.CaseRecipe(dtype="float8_e4m3fn", mask="float_random", len_q=4, len_k=16, head_dim=16))
    assert fp8.spec.attn_mask.dtype == torch.float32
