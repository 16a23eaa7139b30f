"""Adapters whose claims depend on the machine, computed on first use and never at import.

A built-in's claims, known findings and `min_timeout` may depend on the machine: a GPU present, a
library's CUDA plugin installed, the torch installed. Asking at import would probe the machine whenever
the module is imported (by the registry, by `attnverify adapters`, by a test that only needs one helper of
the module); a `DeferredAdapter` calls its `resolve()` once, the first time `claims`, `known_failures`,
`known_patterns` or `min_timeout` is read, validates the keywords as `@attnverify.adapter` does, and keeps
the answer. `@attnverify.adapter(..., deferred_claims=fn)` makes one (docs/adapters.md).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from .base import Adapter, _validate_claims, _validate_min_timeout, validate_known_failures

DEFERRED_FIELDS = ("claims", "known_failures", "known_patterns", "known_not_strict", "min_timeout")


def _deferred_field(name: str) -> property:
    def get(self):
        return self._values()[name]

    def set_(self, value) -> None:
        if not self._ready:  # the dataclass __init__ assigning its defaults: resolve() decides
            return
        self._values()[name] = value  # an explicit assignment after construction wins

    return property(get, set_, doc=f"`{name}`, computed on first use (see DeferredAdapter)")


class DeferredAdapter(Adapter):
    """An `Adapter` whose claims, known findings and min_timeout are `resolve()`'s keywords merged over the
    ones given here (`claims`: a dict of claim keywords), computed on first use and kept."""

    claims = _deferred_field("claims")
    known_failures = _deferred_field("known_failures")
    known_patterns = _deferred_field("known_patterns")
    known_not_strict = _deferred_field("known_not_strict")
    min_timeout = _deferred_field("min_timeout")

    def __init__(self, resolve: Callable[[], Dict[str, Any]], *, claims: Optional[Dict[str, Any]] = None,
                 known_failures: Optional[Dict[str, Any]] = None, min_timeout: Optional[float] = None, **kw):
        if not callable(resolve):
            raise TypeError(f"DeferredAdapter({kw.get('name')!r}): resolve must be a function () -> dict of keywords")
        self._ready = False
        self._resolve = resolve
        self._given = (dict(claims or {}), known_failures, min_timeout)
        self._cache: Optional[Dict[str, Any]] = None
        super().__init__(**kw)
        self._ready = True

    @property
    def resolved(self) -> bool:
        """Whether `resolve()` has run (nothing is asked of the machine before the claims are)."""
        return self._cache is not None

    def _values(self) -> Dict[str, Any]:
        if self._cache is None:
            claims, known, timeout = self._given
            extra = self._resolve()
            if not isinstance(extra, dict):
                raise TypeError(f"attnverify.adapter({self.name!r}, deferred_claims=...): the function returned "
                                f"{type(extra).__name__}; return a dict of keywords (claims, known_failures, "
                                f"min_timeout)")
            extra = dict(extra)
            known = extra.pop("known_failures", known)
            timeout = extra.pop("min_timeout", timeout)
            reasons, patterns, not_strict = validate_known_failures(self.name, known)
            self._cache = dict(claims=_validate_claims(self.name, {**claims, **extra}), known_failures=reasons,
                               known_patterns=patterns, known_not_strict=not_strict,
                               min_timeout=_validate_min_timeout(self.name, timeout))
        return self._cache
