"""Size limits of the profiles. Hypothesis settings for them live in attnverify.properties.profiles.

ci        small shapes that still cross tile boundaries (up to 200 keys), few examples: minutes on 2 cores.
dev       the default: up to ~600 keys, 100 examples a property.
thorough  for a GPU: long sequences (up to the adapter's max_seqlen, capped at 8192), many examples.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

PROFILE_NAMES = ("ci", "dev", "thorough")


@dataclass(frozen=True)
class ProfileLimits:
    name: str
    max_examples: int
    max_len: int  # longest sequence drawn (further capped by the adapter's max_seqlen)
    max_batch: int
    max_heads_kv: int
    max_group: int  # largest Hq / Hkv
    head_dims: Tuple[int, ...]  # candidates, simplest first; filtered by the adapter's claims
    max_segments: int  # varlen documents in one pack
    max_numel: int  # cap on B * Hq * Lq * Lk (keeps the float64 reference cheap)


PROFILES = {
    "ci": ProfileLimits("ci", 30, 200, 2, 2, 2, (16, 32, 64, 40, 8, 72, 59, 128, 160, 256), 4, 400_000),
    "dev": ProfileLimits("dev", 100, 512, 3, 4, 4, (16, 32, 64, 40, 8, 72, 59, 80, 96, 111, 128, 160, 192, 256), 6, 1_000_000),
    "thorough": ProfileLimits("thorough", 1000, 8192, 4, 8, 8,
                              (16, 32, 64, 40, 8, 72, 59, 80, 96, 111, 128, 160, 192, 256, 512), 16, 600_000_000),
}


def profile_limits(profile) -> ProfileLimits:
    if isinstance(profile, ProfileLimits):
        return profile
    if profile not in PROFILES:
        from ._args import InvalidArgument

        raise InvalidArgument(f"profile={profile!r} must be one of {PROFILE_NAMES}")
    return PROFILES[profile]
