"""Hypothesis settings of the profiles `ci`, `dev` (default) and `thorough`, registered explicitly.

Every profile sets deadline=None (first calls compile), a local example database under
.hypothesis/ (so a failure replays first on the next run, also when CI=true: Hypothesis's own
"ci" profile would disable it, and also in seeded runs: a seed fixes generation, it never sets
derandomize, which would turn the database off) and suppresses the health checks that big tensors trip.
The sizes drawn under each profile are in attnverify.strategies (PROFILES).
"""
from __future__ import annotations

import os
from typing import Optional

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from ..strategies import PROFILE_NAMES, PROFILES

DEFAULT_PROFILE = "dev"
# distinct bugs one property run looks for (attnverify.attribution): after the first shrunk failure the
# search goes on outside its needs; ci stops at the first (--attn-max-bugs overrides)
MAX_BUGS = {"ci": 1, "dev": 3, "thorough": 3}
DATABASE_DIR = os.path.join(".hypothesis", "attnverify")


def example_database(path: Optional[str] = None):
    return DirectoryBasedExampleDatabase(path or DATABASE_DIR)


def _base(name: str) -> settings:
    lim = PROFILES[name]
    return settings(
        parent=settings.get_profile("default"),  # not Hypothesis's auto-loaded "ci" profile
        max_examples=lim.max_examples,
        deadline=None,
        derandomize=False,
        database=example_database(),
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
        report_multiple_bugs=False,
        print_blob=False,
        stateful_step_count=10,
    )


def register_profiles() -> None:
    for name in PROFILE_NAMES:
        settings.register_profile(f"attnverify-{name}", _base(name))


def hypothesis_settings(profile: str = DEFAULT_PROFILE, *, max_examples: Optional[int] = None,
                        seed: Optional[int] = None, database=...) -> settings:
    """The settings one property run uses: the profile's, with overrides."""
    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r} must be one of {PROFILE_NAMES}")
    try:
        settings.get_profile(f"attnverify-{profile}")
    except Exception:  # noqa: BLE001 - not registered yet (registering again inside a running test warns)
        register_profiles()
    kw = {}
    if max_examples is not None:
        if max_examples < 1:
            raise ValueError(f"max_examples={max_examples} must be >= 1")
        kw["max_examples"] = int(max_examples)
    if seed is not None and not isinstance(seed, int):
        raise ValueError(f"seed={seed!r} must be an integer")
    # a seed fixes generation (run_property applies it with hypothesis.seed); it never sets derandomize,
    # which would switch the example database off (Hypothesis: derandomize=True implies database=None)
    if database is not ...:
        kw["database"] = database
    return settings(parent=settings.get_profile(f"attnverify-{profile}"), **kw)


register_profiles()
