"""Where an adapter comes from, recorded with a run so that a report can name it on another machine.

    adapter_origin(adapter, requested="path/to/file.py:attr", cwd=...) -> {
        "kind":   "builtin" | "file" | "module" | "registered",
        "name":   the adapter's name,
        "target": what `--adapter` takes to load it again (builtin name, module:attr, file.py:attr),
                  or None when it was registered by code that has no name for it (a conftest hook),
        "module", "attr", "file" (absolute), "file_rel" (relative to the run's folder when inside it),
        "sha256": of that file (so a report tells whether the file on this machine is the one that ran),
        "conftest": the conftest.py that registered it, when the target is None}

Reads sys.modules only: it imports nothing and never calls the adapter.
"""
from __future__ import annotations

import hashlib
import inspect
import os
import sys
from typing import Any, Optional


def file_sha256(path: Optional[str]) -> Optional[str]:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def display_path(path: Optional[str], cwd: Optional[str] = None) -> Optional[str]:
    """`path` relative to `cwd` (default: the current folder) for messages, unless it lies outside it."""
    if not path:
        return None
    try:
        r = os.path.relpath(path, cwd or os.getcwd())
    except ValueError:
        return path
    return path if r.startswith("..") else r


def _attr_in(module, obj) -> Optional[str]:
    try:
        items = list(vars(module).items())
    except TypeError:
        return None
    return next((k for k, v in items if v is obj and not k.startswith("_")), None) or \
        next((k for k, v in items if v is obj), None)


def _holder(adapter):
    """(module, attr) of the module-level name bound to this adapter object, or (module of fn, None)."""
    fn = getattr(adapter, "fn", None)
    mod = sys.modules.get(getattr(fn, "__module__", None) or "")
    if mod is not None:
        attr = _attr_in(mod, adapter)
        if attr:
            return mod, attr
    for m in list(sys.modules.values()):
        if m is None or m is mod:
            continue
        attr = _attr_in(m, adapter)
        if attr:
            return m, attr
    return mod, None


def _looks_like_file(target: str) -> bool:
    mod = target.partition(":")[0]
    return mod.endswith(".py") or os.sep in mod or "/" in mod


def adapter_origin(adapter: Any, requested: Optional[str] = None, cwd: Optional[str] = None) -> dict:
    from .adapters.registry import BUILTINS

    name = getattr(adapter, "name", str(adapter))
    out = {"kind": "registered", "name": name, "target": None, "module": None, "attr": None, "file": None,
           "file_rel": None, "sha256": None, "conftest": None}
    for bname, target in BUILTINS.items():
        mname, _, attr = target.partition(":")
        m = sys.modules.get(mname)
        if m is not None and getattr(m, attr, None) is adapter:
            out.update(kind="builtin", target=bname, module=mname, attr=attr, file=getattr(m, "__file__", None))
            return out
    mod, attr = _holder(adapter)
    f = getattr(mod, "__file__", None) if mod is not None else None
    if not f:
        try:
            f = inspect.getsourcefile(getattr(adapter, "fn", None))
        except (TypeError, OSError):
            f = None
    f = os.path.abspath(f) if f else None
    mname = getattr(mod, "__name__", None)
    out.update(module=mname, attr=attr, file=f, file_rel=display_path(f, cwd), sha256=file_sha256(f))
    if requested and ":" in requested and _looks_like_file(requested):
        path, _, rattr = requested.partition(":")
        f = os.path.abspath(os.path.join(cwd or os.getcwd(), path))
        out.update(kind="file", file=f, file_rel=display_path(f, cwd), attr=rattr, sha256=file_sha256(f),
                   target=f"{display_path(f, cwd)}:{rattr}")
    elif requested and ":" in requested:
        out.update(kind="module", module=requested.partition(":")[0], attr=requested.partition(":")[2], target=requested)
    elif attr and mname and f and not _is_script(mname, f):
        out.update(kind="module", target=f"{mname}:{attr}")
    elif attr and f:
        out.update(kind="file", target=f"{out['file_rel']}:{attr}")
    elif f and os.path.basename(f) == "conftest.py":
        out["conftest"] = out["file_rel"]
    return out


def _is_script(module_name: str, path: str) -> bool:
    """Modules that `--adapter module:attr` could not import by name: conftests, scripts, files loaded
    by path (attnverify's import_file names them attnverify_user_*)."""
    return (module_name in ("__main__", "conftest") or module_name.startswith("attnverify_user_")
            or os.path.basename(path) == "conftest.py")
