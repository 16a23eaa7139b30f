"""The contract between properties, the driver that runs them, runners and the journal.

A Property draws JSON-able data with Hypothesis and judges one drawn example at a time:

    prop.why_skipped(adapter)                 -> None, or "mine does not claim window"
    prop.strategy(adapter, profile, device)   -> SearchStrategy of JSON-able values (CaseRecipe dicts, ...)
    prop.examples(adapter, profile, device)   -> the @example corpus (same type), run first
    prop.run_example(adapter, drawn)          -> ExampleResult (never raises for a wrong answer)

Because a drawn example is plain data, a runner may judge it in another process (crash isolation:
the parent that drives Hypothesis never touches the GPU), and the journal can replay it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional


@dataclass
class ExampleResult:
    passed: bool
    message: str = ""  # for a failure: what went wrong, every failing output
    severity: float = 0.0  # worst error / tolerance (>1 fails); fed to hypothesis.target
    records: List[dict] = field(default_factory=list)  # CheckResult.to_dict() of every check made
    case: Optional[dict] = None  # Case.to_dict() of the (main) case, for the journal and repro
    status: str = ""  # passed | failed | error | crashed | timeout | skipped ('' -> from passed)
    seconds: float = 0.0
    # where the example's seconds went, phase -> seconds (attnverify.timesplit: draw, transfer, case,
    # adapter, compile, reference, baseline, compare, ...), filled by the runner and the driver
    split: dict = field(default_factory=dict)
    retried: int = 0  # how often it was judged again after running out of device memory (attnverify.device_memory)

    def __post_init__(self):
        if not self.status:
            self.status = "passed" if self.passed else "failed"

    def to_dict(self) -> dict:
        return {
            "passed": self.passed, "message": self.message, "severity": self.severity,
            "records": self.records, "case": self.case, "status": self.status, "seconds": self.seconds,
            "split": self.split, **({"retried": self.retried} if self.retried else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "ExampleResult":
        return cls(**{k: v for k, v in d.items() if k in _FIELDS})


_FIELDS = ("passed", "message", "severity", "records", "case", "status", "seconds", "split", "retried")


class Property:
    """Base class; subclasses set `name` and `doc` and implement the four methods."""

    name: str = ""
    doc: str = ""
    needs: tuple = ()  # claim names this property requires, e.g. ("backward",)
    # adapter calls per example relative to one checked call: the profile's example count is divided
    # by it (at least 5 generated examples remain; the corpus always runs), so a property that calls
    # the adapter a dozen times per example does not cost a dozen properties' time
    cost: float = 1.0

    # True for the properties that draw fp8 cases (properties/fp8.py); the others draw none (attention_cases)
    draws_fp8: bool = False
    # True for the properties that draw K and V as views of one latent (properties/mla.py); the others draw them apart
    draws_latent_kv: bool = False

    def why_skipped(self, adapter) -> Optional[str]:
        """The reason this property does not run for `adapter` (None: it runs): its skip_reason, or an adapter that
        claims only fp8 dtypes where this property draws no fp8 case. Every caller asks this, not skip_reason."""
        dts = adapter.claims.dtypes
        if not self.draws_fp8 and dts and all(str(d).startswith("float8") for d in dts):
            return (f"{adapter.name} claims only fp8 dtypes ({', '.join(dts)}); {self.name} draws no fp8 case (the fp8 "
                    f"properties fp8_matches_reference and descale_linearity test them)")
        if adapter.claims.latent_kv and not self.draws_latent_kv:
            return (f"{adapter.name} claims latent_kv (V read as the first Dv columns of K): {self.name} draws K and V "
                    f"apart; mla_latent_views tests such a kernel")
        return self.skip_reason(adapter)

    def skip_reason(self, adapter) -> Optional[str]:
        for need in self.needs:
            if not adapter.claims.feature(need):
                return f"{adapter.name} does not claim {need}"
        return None

    def strategy(self, adapter, profile: str, device: str):  # pragma: no cover - abstract
        raise NotImplementedError

    def examples(self, adapter, profile: str, device: str) -> List[Any]:
        return []

    def run_example(self, adapter, drawn) -> ExampleResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def derived_recipes(self, recipe, params: dict) -> List[Any]:
        """[(label, CaseRecipe)]: the adapter calls of other shapes an example makes beside its case (lse_merge's
        two key subsets). Attribution judges them with forward_matches_reference when no feature of the case
        explains a failure (attnverify.attribution_calls)."""
        return []

    @property
    def test_name(self) -> str:
        return f"test_{self.name}"


_DEVICE_FAULTS = ("CUDA error", "misaligned address", "illegal memory access", "illegal instruction",
                  "device-side assert", "unspecified launch failure", "HIP error", "Triton Error [CUDA]",
                  "CUDNN_STATUS_EXECUTION_FAILED", "CUBLAS_STATUS_EXECUTION_FAILED")


def device_fault(text: str) -> bool:
    """Whether an error text is the device's (a fault that loses the process's CUDA context), not an
    adapter's own argument check. A library that could not allocate its workspace (cuBLAS's
    CUBLAS_STATUS_ALLOC_FAILED, worded "CUDA error: ..." by torch) is out of memory, not a fault."""
    text = text or ""
    return any(f in text for f in _DEVICE_FAULTS) and "_ALLOC_FAILED" not in text
