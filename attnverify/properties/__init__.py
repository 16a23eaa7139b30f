"""The properties the plugin runs, one Hypothesis test each (test id `test_<name>[adapter]`).

    from attnverify.properties import PROPERTIES, get_property
    from attnverify.properties.driver import run_property
    run_property(get_property("forward_matches_reference"), adapter, profile="ci")
"""
from ._props import (
    PROPERTIES, CaseProperty, MetamorphicProperty,
)
from ._contract import CONTRACT_PROPERTIES, install as _install_contract
from .base import ExampleResult, Property
from .profiles import DEFAULT_PROFILE, hypothesis_settings, register_profiles
from .fp8 import FP8_PROPERTIES  # issue 23: fp8 inputs with descales
from .mla import MLA_PROPERTIES  # issue 23: MLA latent K/V views
from .serving import SERVING_PROPERTIES  # issue 22: KV caches, split-KV
from .sinks import SINK_PROPERTIES  # issue 23: sinks, chunked local attention
from .splitkv import SPLIT_PROPERTIES

# contract and robustness properties (issue 8): `inputs_unmodified` becomes the forward+backward version,
# the others are appended; in place, so `_props.PROPERTIES` is the same list; then the serving ones
_install_contract(PROPERTIES)
PROPERTIES.extend(p for p in SERVING_PROPERTIES + SPLIT_PROPERTIES + SINK_PROPERTIES + MLA_PROPERTIES + FP8_PROPERTIES
                  if p.name not in {q.name for q in PROPERTIES})


def get_property(name: str) -> Property:
    for p in PROPERTIES:
        if p.name == name or p.test_name == name:
            return p
    raise KeyError(f"unknown property {name!r}; known: {', '.join(p.name for p in PROPERTIES)}")


def run_property(*args, **kwargs):
    from .driver import run_property as _run

    return _run(*args, **kwargs)


__all__ = ["PROPERTIES", "get_property", "run_property", "Property", "ExampleResult", "CaseProperty",
           "MetamorphicProperty", "hypothesis_settings", "register_profiles", "DEFAULT_PROFILE", "CONTRACT_PROPERTIES"]
