"""The properties: what `pytest --adapter=X` runs, one Hypothesis test each.

A drawn example is `{"recipe": CaseRecipe dict, ...parameters}`; `run_example` rebuilds the case
and judges it. Reference properties go through `check`; metamorphic ones compare the adapter
with itself, with a tolerance widened by what the same transformation does to `naive`.
The registry of the core properties; they are written in _reference_props.py, _metamorphic.py and _runs.py
on the two kinds of _kinds.py.
"""

from __future__ import annotations

from typing import List

from ._kinds import CaseProperty, MetamorphicProperty, _call, _result_from_check
from ._metamorphic import (
    BatchHeadIndependence, GqaEqualsRepeatedKv, KvPermutationInvariance, RowShiftInvariance, ValueScaling,
)
from ._reference_props import (
    CausalAlignment, ForwardMatchesReference, FullyMaskedRows, GradientsMatchReference, LseMatchesReference,
    NonfiniteInputsPropagate,
)
from ._runs import Determinism, Dropout, InputsUnmodified
from .base import Property


PROPERTIES: List[Property] = [
    ForwardMatchesReference(),
    GradientsMatchReference(),
    LseMatchesReference(),
    FullyMaskedRows(),
    CausalAlignment(),
    KvPermutationInvariance(),
    BatchHeadIndependence(),
    RowShiftInvariance(),
    GqaEqualsRepeatedKv(),
    ValueScaling(),
    Determinism(),
    InputsUnmodified(),
    Dropout(),
    NonfiniteInputsPropagate(),
]


__all__ = [
    "PROPERTIES", "CaseProperty", "MetamorphicProperty", "_call", "_result_from_check", "ForwardMatchesReference",
    "GradientsMatchReference", "LseMatchesReference", "FullyMaskedRows", "CausalAlignment", "NonfiniteInputsPropagate",
    "KvPermutationInvariance", "BatchHeadIndependence", "RowShiftInvariance", "GqaEqualsRepeatedKv", "ValueScaling",
    "Determinism", "InputsUnmodified", "Dropout",
]
