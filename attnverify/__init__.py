"""attnverify: correctness and fuzz testing for any attention implementation.

    import attnverify as av

    @av.adapter("mine", dtypes=("float16",), devices=("cuda",), backward=True)
    def mine(q, k, v, spec: av.Spec):
        return my_kernel(q, k, v, causal=spec.causal != "none", scale=spec.scale)

    result = av.check(mine, case)          # a CheckResult; never raises for a wrong answer
    av.assert_attention_close(result)      # raises with every failing output

Nothing here touches a GPU, picks a backend or prints at import.
"""
from .adapters.base import Adapter, Claims, adapter
from .adapters.registry import UnknownAdapterError, resolve
from .case import Case, CaseRecipe, build_case, load_case
# `check` and `compare` are the modules, callable as their functions (attnverify/callable_module.py):
# av.check(adapter, case) runs a check, and `attnverify.check` stays a module (import, mock.patch)
from . import check, compare
from .check import CheckResult, UsageError, assert_attention_close
from .compare import Comparison
from .reference import online_softmax, reference_backward, reference_forward
from .spec import Output, Spec

__version__ = "0.1.0"

__all__ = [
    "adapter", "Adapter", "Claims", "Spec", "Output", "Case", "CaseRecipe", "build_case", "load_case",
    "check", "CheckResult", "assert_attention_close", "compare", "Comparison", "UsageError",
    "UnknownAdapterError", "resolve", "reference_forward", "reference_backward", "online_softmax",
]
