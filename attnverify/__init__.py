"""attnverify: correctness and fuzz testing for any attention implementation.

    import attnverify as av

    @av.adapter("mine", dtypes=("float16",), devices=("cuda",), backward=True)
    def mine(q, k, v, spec: av.Spec):
        return my_kernel(q, k, v, causal=spec.causal != "none", scale=spec.scale)

    result = av.check(mine, case)          # a CheckResult; never raises for a wrong answer
    av.assert_attention_close(result)      # raises with every failing output

Nothing here touches a GPU, picks a backend or prints at import.
"""
import importlib

# the façade is lazy (PEP 562): `import attnverify` (and so the pytest plugin, loaded in every pytest run)
# imports neither torch nor hypothesis; `av.check`, `av.Spec`, ... import their module on first use.
# `check` and `compare` are the modules, callable as their functions (attnverify/callable_module.py):
# av.check(adapter, case) runs a check, and `attnverify.check` stays a module (import, mock.patch)
_LAZY = {
    "Adapter": ".adapters.base", "Claims": ".adapters.base", "adapter": ".adapters.base",
    "UnknownAdapterError": ".adapters.registry", "resolve": ".adapters.registry",
    "Case": ".case", "CaseRecipe": ".case", "build_case": ".case", "load_case": ".case",
    "check": None, "compare": None,
    "CheckResult": ".check", "UsageError": ".check", "assert_attention_close": ".check",
    "Comparison": ".compare",
    "online_softmax": ".reference", "reference_backward": ".reference", "reference_forward": ".reference",
    "Output": ".spec", "Spec": ".spec",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'attnverify' has no attribute {name!r}")
    where = _LAZY[name]
    if where is None:  # a callable module
        value = importlib.import_module(f".{name}", __name__)
    else:
        value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "adapter", "Adapter", "Claims", "Spec", "Output", "Case", "CaseRecipe", "build_case", "load_case",
    "check", "CheckResult", "assert_attention_close", "compare", "Comparison", "UsageError",
    "UnknownAdapterError", "resolve", "reference_forward", "reference_backward", "online_softmax",
]
