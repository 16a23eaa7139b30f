"""Argument checking shared by the strategy factories: keyword-only, validated at once, and each
argument may be a value or a Hypothesis strategy (drawn inside the composite)."""
from __future__ import annotations

from typing import Any, Optional

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy


class InvalidArgument(ValueError):
    """A strategy factory was called with arguments that can never produce a case."""


def is_strategy(x: Any) -> bool:
    return isinstance(x, SearchStrategy)


def resolve(draw, x):
    """Draw `x` when it is a strategy, else return it as is."""
    return draw(x) if is_strategy(x) else x


def check_int(name: str, value, *, min_value: Optional[int] = None, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if is_strategy(value):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name}={value!r} must be an int" + (" or None" if allow_none else "") + " (or a strategy)")
    if min_value is not None and value < min_value:
        raise InvalidArgument(f"{name}={value} must be >= {min_value}")
    return value


def check_order(lo_name: str, lo, hi_name: str, hi) -> None:
    if lo is None or hi is None or is_strategy(lo) or is_strategy(hi):
        return
    if lo > hi:
        raise InvalidArgument(f"{lo_name}={lo} is larger than {hi_name}={hi}")


def check_tristate(name: str, value) -> Optional[bool]:
    """None = draw it when claimed, True = always (must be claimed), False = never."""
    if value is None or is_strategy(value):
        return value
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name}={value!r} must be True, False or None (draw when claimed), or a strategy")
    return value


def check_choice(name: str, value, allowed) -> Any:
    if value is None or is_strategy(value):
        return value
    vals = (value,) if isinstance(value, str) else tuple(value)
    for v in vals:
        if v not in allowed:
            raise InvalidArgument(f"{name}={value!r}: {v!r} is not one of {tuple(allowed)}")
    return vals


def as_strategy(x) -> SearchStrategy:
    return x if is_strategy(x) else st.just(x)
