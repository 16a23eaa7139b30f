"""Hypothesis strategies for attention cases, drawn only from what an adapter claims.

    from attnverify.strategies import attention_cases
    from attnverify.adapters.registry import get

    @given(attention_cases(adapter=get("naive"), profile="ci"))
    def test_mine(recipe):
        av.assert_attention_close(av.check(mine, av.build_case(recipe)))
"""
from ._args import InvalidArgument
from ._cases import (LAYOUTS, VALUE_MODES, Unclaimable, attention_cases, cases, fully_masked_row_count, forget_refusal,
                     last_refusal)
from ._corpus import corpus, templates
from ._paged import cache_cases, cache_corpus, page_size_choices
from ._profiles import PROFILE_NAMES, PROFILES, ProfileLimits, profile_limits
from ._shapes import block_sizes, head_dim_candidates, interesting_lengths, seqlens, tile_partitions

__all__ = [
    "attention_cases", "cases", "corpus", "templates", "seqlens", "interesting_lengths", "head_dim_candidates",
    "tile_partitions", "block_sizes", "fully_masked_row_count", "profile_limits", "PROFILES", "PROFILE_NAMES",
    "ProfileLimits", "InvalidArgument", "LAYOUTS", "VALUE_MODES", "forget_refusal", "last_refusal",
    "cache_cases", "cache_corpus", "page_size_choices", "Unclaimable",
]
