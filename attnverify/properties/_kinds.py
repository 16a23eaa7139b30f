"""The two kinds of properties: CaseProperty (one case, judged by `check` against the reference) and
MetamorphicProperty (the adapter against itself, the bound widened by what `naive` does under the same change)."""
from __future__ import annotations

import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch
from hypothesis import strategies as st

from ..case import Case, CaseRecipe, build_case
from ..check import unclaimed, unpack_output
from ..compare import error_stats
from ..strategies import attention_cases, corpus
from ..magnitudes import magnitudes, score_bound
from ..timesplit import phase
from ..verdicts import compare_pairs, comparison_verdict
from ._within import Refused, ensure_claimed
from .base import ExampleResult, Property


def _result_from_check(res, case) -> ExampleResult:
    rec = res.to_dict()
    # the record already holds the case's dict when it is this case (made once: its id hashes the recipe's JSON)
    cd = dict(rec["case"]) if res.case is case else case.to_dict()
    return ExampleResult(
        passed=res.passed, message="" if res.passed else res.message(), severity=rec["severity"],
        records=[rec], case=cd, status=res.status if res.status != "error" else "error",
        seconds=res.seconds,
    )


class CaseProperty(Property):
    """A property over drawn CaseRecipes. Subclasses set `case_kwargs`, maybe `params` and `judge`."""

    case_kwargs: Dict[str, Any] = {}
    backward_cases = False

    def kwargs(self, adapter) -> dict:
        return dict(self.case_kwargs)

    def params(self, adapter):
        """Extra JSON-able parameters drawn beside the recipe (a strategy of dicts)."""
        return st.just({})

    def adapt(self, adapter, r: CaseRecipe) -> Optional[CaseRecipe]:
        """Bend a corpus case to this property (None drops it)."""
        return r

    def keep(self, r: CaseRecipe) -> bool:
        return True

    def strategy(self, adapter, profile: str, device: str):
        cases = attention_cases(adapter=adapter, profile=profile, device=device, backward=self.backward_cases,
                                **self.kwargs(adapter))
        if type(self).keep is not CaseProperty.keep:
            cases = cases.filter(self.keep)
        return st.tuples(cases, self.params(adapter)).map(lambda t: {"recipe": t[0].to_dict(), **t[1]})

    def examples(self, adapter, profile: str, device: str) -> List[Any]:
        if self.skip_reason(adapter):
            return []
        out = []
        for r in corpus(adapter, profile=profile, device=device, adapt=lambda r: self.adapt(adapter, r)):
            if self.keep(r):
                out.append({"recipe": r.to_dict(), **self.default_params()})
        return out

    def default_params(self) -> dict:
        return {}

    def run_example(self, adapter, drawn) -> ExampleResult:
        t0 = time.perf_counter()
        case = None
        try:
            with phase("case"):
                case = build_case(CaseRecipe.from_dict(drawn["recipe"]), label=self.name)
            why = unclaimed(adapter, case)
            if why:  # the draw filtered a CPU probe; an adapter's `refuses` may judge the real case otherwise
                res = ExampleResult(True, f"not claimed on the real case: {why}", status="skipped",
                                    case=case.to_dict())
                res.seconds = time.perf_counter() - t0
                return res
            res = self.judge(adapter, case, {k: v for k, v in drawn.items() if k != "recipe"})
        except Refused as e:  # a call the property derived from the case is one the adapter does not claim
            res = ExampleResult(True, f"not claimed (a call {self.name} derives from the case): {e}",
                                status="skipped", case=case.to_dict())
        except Exception as e:
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
            res = ExampleResult(False, message=f"{self.name}: the property raised {type(e).__name__}: {e}\n{tb}",
                                severity=1e30, status="error", case=None if case is None else case.to_dict())
        res.seconds = time.perf_counter() - t0
        if res.case is None and case is not None:
            res.case = case.to_dict()
        return res

    def judge(self, adapter, case: Case, params: dict) -> ExampleResult:  # pragma: no cover - abstract
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------------
# against the float64 reference


# ---------------------------------------------------------------------------------------------------
# metamorphic: the adapter against itself; the bound widened by what `naive` does under the same change

def _call(adapter, q, k, v, spec, *, backward=False, gen_seed=0):
    """Run an adapter; return {"out", "lse"?, "dq", "dk", "dv"?} as detached tensors. Raises Refused when
    the adapter does not claim the call (a metamorphic property's derived inputs)."""
    ensure_claimed(adapter, q, k, v, spec)
    if backward:
        q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    with torch.enable_grad() if backward else torch.no_grad():
        out, lse, _ = unpack_output(adapter(q, k, v, spec))
    res = {"out": out.detach()}
    if isinstance(lse, torch.Tensor):
        res["lse"] = lse.detach().float()
    if backward:
        # drawn where the output lives: a CPU draw of a big case's dO cost seconds per call on the GPU machine
        g = torch.Generator(device=out.device).manual_seed(gen_seed)
        d_out = torch.randn(out.shape, generator=g, dtype=torch.float32, device=out.device).to(out.dtype)
        with phase("adapter"):  # the adapter's backward
            dq, dk, dv = torch.autograd.grad([out], [q, k, v], [d_out], allow_unused=True)
        res.update(dq=dq, dk=dk, dv=dv)
    return res


class MetamorphicProperty(CaseProperty):
    """Subclasses implement `pairs(adapter, case, params) -> {name: (got, expected)}`."""

    case_kwargs = dict(dropout=False, poison=False)

    def pairs(self, adapter, case, params) -> Dict[str, Tuple[Any, Any]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def score_max(self, case, params, s_case: float) -> float:
        """A bound on |score| over the calls `pairs` makes (the case's own by default)."""
        return s_case

    def judge(self, adapter, case, params):
        from ..adapters.naive import naive

        mine = self.pairs(adapter, case, params)
        base = {}
        if case.dtype in naive.claims.dtypes and unclaimed(naive, case) is None:
            try:
                with phase("baseline"):
                    base = {n: error_stats(g, e) for n, (g, e) in self.pairs(naive, case, params).items()}
            except Exception:
                base = {}
        # both sides carry their own rounding: the same score-size and scale floors as `check`
        comps = compare_pairs(mine, case.dtype, score_max=self.score_max(case, params, score_bound(case)),
                              scale_floors=magnitudes(case), baseline=base)
        passed, sev, msg = comparison_verdict(comps, f"[{adapter.name}] {self.name} FAILED: {case.describe()}",
                                              self.doc, params)
        return ExampleResult(passed, msg, severity=sev, records=[c.to_dict() for c in comps], case=case.to_dict())
