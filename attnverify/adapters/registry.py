"""Finding adapters by name: built-ins, registered ones, entry points, import paths (SPEC.md order)."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Dict, List

from .base import Adapter

# name -> "module:attr"; imported only when asked for, so a missing library costs nothing.
BUILTINS: Dict[str, str] = {
    "naive": "attnverify.adapters.naive:naive",
    "sdpa": "attnverify.adapters.sdpa:sdpa",
    "sdpa-math": "attnverify.adapters.sdpa:sdpa_math",
    "sdpa-flash": "attnverify.adapters.sdpa:sdpa_flash",
    "sdpa-efficient": "attnverify.adapters.sdpa:sdpa_efficient",
    "sdpa-cudnn": "attnverify.adapters.sdpa:sdpa_cudnn",
    "triton": "attnverify.adapters.triton_adapter:triton",
    "flex": "attnverify.adapters.flex:flex",
    "flex-paged": "attnverify.adapters.flex_paged:flex_paged",
    "flash-attn": "attnverify.adapters.flash_attn:flash_attn",
    "flash-attn-kvcache": "attnverify.adapters.flash_attn_kvcache:flash_attn2_kvcache",
    "flash-attn3-kvcache": "attnverify.adapters.flash_attn3_kvcache:flash_attn3_kvcache",
    "flash-attn3": "attnverify.adapters.flash_attn:flash_attn3",
    "flash-attn4": "attnverify.adapters.flash_attn4:flash_attn4",
    "xformers": "attnverify.adapters.xformers_adapter:xformers",
    "flashinfer": "attnverify.adapters.flashinfer_adapter:flashinfer",
    "jax": "attnverify.adapters.jax_adapter:jax",
    "te": "attnverify.adapters.te_adapter:te",
    "onnx-attention": "attnverify.adapters.onnxruntime_adapter:onnx_attention",
    "ort-mha": "attnverify.adapters.onnxruntime_adapter:ort_mha",
    "ort-gqa": "attnverify.adapters.onnxruntime_adapter:ort_gqa",
    "tinygrad": "attnverify.adapters.tinygrad_adapter:tinygrad",
    "keras-torch": "attnverify.adapters.keras_adapter:keras_torch",
    "keras-jax": "attnverify.adapters.keras_adapter:keras_jax",
    "hf-sdpa": "attnverify.adapters.transformers_adapter:hf_sdpa",
    "hf-eager": "attnverify.adapters.transformers_adapter:hf_eager",
}
ENTRY_POINT_GROUP = "attnverify.adapters"

_registered: Dict[str, Adapter] = {}


class UnknownAdapterError(ValueError):
    """A usage error: the name is neither built in, registered, an entry point nor an import path."""


def register_adapter(a: Adapter) -> Adapter:
    _registered[a.name] = a
    return a


def import_file(path: str):
    """Import a .py file by path with its folder on sys.path (as pytest does for a conftest.py), so
    it can import the modules that sit next to it (a repo's own kernel)."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    mod_key = "attnverify_user_" + os.path.splitext(os.path.basename(path))[0]
    if mod_key in sys.modules and getattr(sys.modules[mod_key], "__file__", None) == path:
        return sys.modules[mod_key]
    spec = importlib.util.spec_from_file_location(mod_key, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_key] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[mod_key]
        raise
    return mod


def load_target(target: str) -> Adapter:
    """The adapter at "module:attr" or "path/to/file.py:attr" (a usage error names what is wrong)."""
    mod_name, _, attr = target.partition(":")
    if mod_name.endswith(".py") or os.sep in mod_name or "/" in mod_name:
        path = os.path.abspath(mod_name)
        if not os.path.exists(path):
            raise UnknownAdapterError(f"--adapter {target!r}: file {path} does not exist")
        mod = import_file(path)
    else:
        mod = importlib.import_module(mod_name)
    if not attr:
        raise UnknownAdapterError(f"--adapter {target!r}: name the object too, as module:attr")
    try:
        obj = getattr(mod, attr)
    except AttributeError:
        raise UnknownAdapterError(f"--adapter {target!r}: {mod_name} has no attribute {attr!r}") from None
    if not isinstance(obj, Adapter):
        raise UnknownAdapterError(
            f"--adapter {target!r}: {attr} is a {type(obj).__name__}, not an adapter; decorate it with @attnverify.adapter(...)"
        )
    return obj


def _entry_points() -> Dict[str, object]:
    from importlib.metadata import entry_points

    try:
        eps = entry_points(group=ENTRY_POINT_GROUP)
    except TypeError:  # Python < 3.10 API shape
        eps = entry_points().get(ENTRY_POINT_GROUP, [])
    return {ep.name: ep for ep in eps}


def known_names() -> List[str]:
    names = list(BUILTINS)
    names += [n for n in _registered if n not in names]
    names += [n for n in _entry_points() if n not in names]
    return names


def get(name: str) -> Adapter:
    """Resolve one name, in SPEC.md's order."""
    if name in BUILTINS:
        a = load_target(BUILTINS[name])
        _registered.setdefault(a.name, a)
        return a
    if name in _registered:
        return _registered[name]
    eps = _entry_points()
    if name in eps:
        obj = eps[name].load()
        if not isinstance(obj, Adapter):
            raise UnknownAdapterError(f"entry point {name!r} in group {ENTRY_POINT_GROUP} is not an adapter")
        return obj
    if ":" in name:
        return load_target(name)
    raise UnknownAdapterError(
        f"unknown adapter {name!r}. Known: {', '.join(known_names())}. "
        "Or give an import path: package.module:attr or path/to/file.py:attr"
    )


def all_adapters() -> List[Adapter]:
    out = []
    for n in known_names():
        try:
            out.append(get(n))
        except UnknownAdapterError:
            raise
        except Exception as e:  # a broken third-party entry point is shown, not fatal
            out.append(Adapter(name=n, fn=lambda *a: None, availability=lambda e=e: f"failed to load: {e}"))
    return out


def resolve(names, *, available_only_for_all: bool = True) -> List[Adapter]:
    """Resolve `--adapter` values: repeated, comma lists, and `all` (every available adapter)."""
    if isinstance(names, str):
        names = [names]
    flat: List[str] = []
    for n in names or []:
        flat += [x.strip() for x in str(n).split(",") if x.strip()]
    out: List[Adapter] = []
    seen = set()
    for n in flat:
        batch = [a for a in all_adapters() if a.unavailable_reason() is None] if n == "all" else [get(n)]
        for a in batch:
            if a.name not in seen:
                seen.add(a.name)
                out.append(a)
    return out
