"""Modules that can be called like the function they are named after.

`attnverify.check` and `attnverify.compare` are both a module and the package's headline function:
`av.check(adapter, case)` calls the function while `import attnverify.check as m`, `m.unclaimed` and
`mock.patch("attnverify.check.reference_forward")` see the module. `make_callable(__name__, check)` at the
end of the module makes calling the module call its attribute `check` (looked up at each call, so
`mock.patch("attnverify.check.check")` patches `av.check(...)` too); help() shows the function's signature.
"""
from __future__ import annotations

import inspect
import sys
import types
from typing import Callable


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return getattr(self, self.__dict__["__call_target__"])(*args, **kwargs)


def make_callable(module_name: str, func: Callable) -> None:
    """Make the module `module_name` (already in sys.modules) callable as `func`."""
    mod = sys.modules[module_name]
    mod.__call_target__ = func.__name__
    try:
        mod.__signature__ = inspect.signature(func)
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        pass
    mod.__class__ = _CallableModule
