"""Serving-time properties of KV-cache calls (attnverify/paged.py): paged_equals_contiguous, kv_cache_append,
kv_cache_leftpad.

Both draw cache recipes (strategies/_paged.py) and judge them with `judge_pairs`: comparisons whose bound
comes from the gathered keys (never from the garbage in unused slots) and, where `naive` claims the case,
widened by what the same comparison gives for `naive`.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
from hypothesis import strategies as st

from ..case import Case, CaseRecipe
from ..check import bitwise_equal, unclaimed, unpack_output
from ..magnitudes import magnitudes, score_bound
from ..paged import partial_pages_note
from ..compare import error_stats
from ..reference import reference_forward
from ..reference.paged import cache_after, cache_keys, plain_spec
from ..strategies import cache_cases, cache_corpus, page_size_choices
from ._within import ensure_claimed
from ._props import CaseProperty
from ..lse_conventions import expected_lse
from ..verdicts import compare_pairs, severity
from .base import ExampleResult

Pairs = Dict[str, Tuple[torch.Tensor, torch.Tensor]]


def run(adapter, q, k, v, spec) -> dict:
    """One call without gradients: {"out", "lse"?} detached. Raises Refused (the example is skipped, saying why)
    when the adapter does not claim the call: a property's derived calls (lse_merge's key subsets, say) stay
    within its claims and its `refuses`."""
    ensure_claimed(adapter, q, k, v, spec)
    with torch.no_grad():
        out, lse, _ = unpack_output(adapter(q, k, v, spec))
    res = {"out": out.detach()}
    if isinstance(lse, torch.Tensor):
        res["lse"] = lse.detach().float()
    return res


def fresh(case: Case) -> Case:
    """The case with copies of its caches (a call may append into them)."""
    return Case(case.q, case.k.clone(), case.v.clone(), case.spec, seed=case.seed, recipe=case.recipe, label=case.label)


def gathered_cases(case: Case) -> List[Case]:
    """Per batch, the plain call over its keys (caches as before the call, k_new appended)."""
    s = case.spec
    if s.cache_seqlens is None:
        return [case]
    return [Case(case.q[b:b + 1], kb, vb, plain_spec(s, b), seed=case.seed)
            for b, (kb, vb) in enumerate(cache_keys(case.k, case.v, s))]


def bounds(case: Case) -> Tuple[float, dict]:
    """(score bound S, magnitude floors) over the keys the call really attends to (magnitudes gathers a cache case's
    keys itself)."""
    return max([score_bound(c) for c in gathered_cases(case)] or [0.0]), magnitudes(case)


def judge_pairs(prop, adapter, case: Case, params: dict, pairs_of: Callable[[object, Case], Pairs],
                problems: Optional[List[str]] = None, bitwise: bool = False,
                sides: Union[int, Dict[str, int]] = 1) -> ExampleResult:
    """Compare every (got, expected) pair of `pairs_of(adapter, case)`; bitwise=True demands identity. sides=2:
    the expected values are the adapter's own outputs too (another call, or a merge of calls), not the float64
    reference: both carry its rounding, and their errors add up (tolerance_for's sides); a dict gives it per pair
    name, filled by pairs_of for the adapter's own pairs (it is read after pairs_of(adapter) ran)."""
    from ..adapters.naive import naive

    problems = problems if problems is not None else []  # the same list: pairs_of may add to it
    mine = pairs_of(adapter, fresh(case))
    base = {}
    if not bitwise and case.dtype in naive.claims.dtypes and unclaimed(naive, case) is None:
        try:
            base = {n: error_stats(g, e) for n, (g, e) in pairs_of(naive, fresh(case)).items()}
        except Exception:
            base = {}
    s_max, mags = bounds(case)
    if bitwise:
        for n, (got, exp) in mine.items():
            if got is None or exp is None or not bitwise_equal(got, exp):
                diff = "missing" if got is None or exp is None else \
                    f"{int((torch.nan_to_num(got.double() - exp.double(), nan=1.0) != 0).sum())} element(s) differ"
                problems.append(f"{n}: not bitwise identical ({diff}), although {adapter.name} claims deterministic=True")
        comps = []
    else:  # a pair the adapter left empty (got None) fails in compare, like every other property's pairs
        comps = compare_pairs(mine, case.dtype, score_max=s_max, scale_floors=mags, baseline=base, sides=sides)
    sev = severity(comps)
    failing = [c for c in comps if not c.passed]
    passed = not failing and not problems
    note = partial_pages_note(case)
    msg = "" if passed else "\n".join([f"[{adapter.name}] {prop.name} FAILED: {case.describe()}", prop.doc]
                                      + problems + [c.message() for c in failing] + ([note] if note else [])
                                      + ([f"parameters: {params}"] if params else []))
    if problems:
        sev = max(sev, 10.0)
    return ExampleResult(passed, msg, severity=min(sev, 1e30), records=[c.to_dict() for c in comps],
                         case=case.to_dict())


class CacheProperty(CaseProperty):
    """A property over cache recipes; subclasses set `cache_kwargs` (see strategies._paged.cache_cases)."""

    cache_kwargs: dict = {}

    def skip_reason(self, adapter):
        why = super().skip_reason(adapter)
        c = adapter.claims
        if why is None and c.paged and not c.kv_cache and not page_size_choices(c):
            return f"{adapter.name} claims no page size attnverify draws (1 to 1024)"
        return why

    def cache_kw(self, adapter) -> dict:
        return dict(self.cache_kwargs)

    def strategy(self, adapter, profile, device):
        cases = cache_cases(adapter=adapter, profile=profile, device=device, **self.cache_kw(adapter))
        return st.tuples(cases, self.params(adapter)).map(lambda t: {"recipe": t[0].to_dict(), **t[1]})

    def examples(self, adapter, profile, device):
        if self.skip_reason(adapter):
            return []
        kw = self.cache_kw(adapter)
        splits = kw.get("num_splits")
        corpus = cache_corpus(adapter, profile=profile, device=device, paged=kw.get("paged"),
                              append=bool(kw.get("append")), num_splits=splits if isinstance(splits, int) else None,
                              leftpad=kw.get("leftpad") is True)
        return [{"recipe": r.to_dict(), **self.default_params()} for r in corpus if self.keep(r)]


def nonfinite_rows(out: torch.Tensor) -> int:
    return int((~torch.isfinite(out.double())).any(-1).sum())


class PagedEqualsContiguous(CacheProperty):
    name = "paged_equals_contiguous"
    doc = ("A paged-cache call gives what the same call gives on the keys gathered from its pages (scrambled "
           "tables, shared and partial pages); the garbage in unused pages and past cache_seqlens never reaches it.")
    needs = ("paged",)
    cache_kwargs = dict(paged=True, append=False)

    def judge(self, adapter, case, params):
        problems = []

        def pairs(a, c):
            got = run(a, c.q, c.k, c.v, c.spec)
            subs = gathered_cases(c)
            if all(unclaimed(a, s) is None for s in subs):
                parts = [run(a, s.q, s.k, s.v, s.spec) for s in subs]
            else:  # the contiguous call is not claimed: the float64 reference stands for it
                refs = ((s, reference_forward(s.q, s.k, s.v, s.spec)) for s in subs)
                parts = [{"out": r.out, "lse": expected_lse(a.claims, s.q, s.k, s.v, s.spec, r.lse)} for s, r in refs]
            exp = {n: torch.cat([p[n].double().cpu() for p in parts]) for n in parts[0] if all(n in p for p in parts)}
            if a is adapter:
                bad, want = nonfinite_rows(got["out"]), nonfinite_rows(exp["out"])
                if bad > want:
                    problems.append(f"garbage reached the output: {bad} row(s) non-finite against {want} in the "
                                    f"contiguous call (unused pages / slots past cache_seqlens hold {case.recipe.garbage})")
            return {n: (got[n], exp[n]) for n in got if n in exp}

        # the contiguous calls are the adapter's own where it claims them (else the float64 reference's)
        mine = all(unclaimed(adapter, s) is None for s in gathered_cases(case))
        return judge_pairs(self, adapter, case, params, pairs, problems, sides=2 if mine else 1)


class KvCacheAppend(CacheProperty):
    name = "kv_cache_append"
    doc = ("k_new/v_new are written at cache_seqlens[b] of each batch's cache (paged or contiguous, cache_batch_idx) "
           "and nothing else in the caches changes; the output attends to prefix + new keys, bottom-right causal.")
    needs = ("append",)
    cache_kwargs = dict(append=True)

    def judge(self, adapter, case, params):
        problems = []
        ref = reference_forward(case.q, case.k, case.v, case.spec)
        k_exp, v_exp = cache_after(case.k, case.v, case.spec)

        def pairs(a, c):
            got = run(a, c.q, c.k, c.v, c.spec)  # c's caches are fresh copies: the call writes into them
            if a is adapter:
                problems.extend(cache_problems(c, k_exp, v_exp))
            out = {"out": (got["out"], ref.out)}
            if "lse" in got:
                out["lse"] = (got["lse"], expected_lse(a.claims, case.q, case.k, case.v, case.spec, ref.lse))
            return out

        return judge_pairs(self, adapter, case, params, pairs, problems)


class KvCacheLeftpad(KvCacheAppend):
    name = "kv_cache_leftpad"
    doc = ("With cache_leftpad, batch b attends to slots cache_leftpad[b] .. cache_seqlens[b] - 1 (+ the appended "
           "keys, written at cache_seqlens[b]) and never to the padding below; the caches change only where appended.")
    needs = ("cache_leftpad",)
    cache_kwargs = dict(leftpad=True)

    def cache_kw(self, adapter) -> dict:  # an append where claimed, half the time (kv_cache_append's draw)
        return dict(self.cache_kwargs, append=None if adapter.claims.append else False)

    def examples(self, adapter, profile, device):  # the corpus with and (where claimed) without an append
        if self.skip_reason(adapter):
            return []
        out = []
        for app in ((True, False) if adapter.claims.append else (False,)):
            corpus = cache_corpus(adapter, profile=profile, device=device, append=app, leftpad=True)
            out += [{"recipe": r.to_dict(), **self.default_params()} for r in corpus if self.keep(r)]
        return out


def cache_problems(case: Case, k_exp: torch.Tensor, v_exp: torch.Tensor) -> List[str]:
    """What an append did wrong to the caches: new rows missing or misplaced, other slots touched (without an
    append: any slot touched)."""
    from ..reference.paged import slots

    s = case.spec
    n, size = k_exp.shape[0], k_exp.shape[1]
    target = torch.zeros(n, size, dtype=torch.bool)
    lnew = 0 if s.k_new is None else int(s.k_new.shape[2])
    for b, c in enumerate(torch.as_tensor(s.cache_seqlens).tolist()):
        for page, off in slots(s, b, lnew, n, size, start=int(c)):
            target[page, off] = True
    out = []
    for name, got, exp in (("k", case.k, k_exp), ("v", case.v, v_exp)):
        got, exp = got.detach().cpu(), exp.detach().cpu()
        same = (got == exp) | (torch.isnan(got) & torch.isnan(exp))
        slot_ok = same.flatten(2).all(-1)  # (N, S)
        missing = int((target & ~slot_ok).sum())
        touched = int((~target & ~slot_ok).sum())
        if missing:
            p, o = (target & ~slot_ok).nonzero()[0].tolist()
            out.append(f"{name} cache: {missing} of {int(target.sum())} appended slot(s) do not hold k_new/v_new "
                       f"(e.g. page/row {p} slot {o}): written at the wrong slot or not at all")
        if touched:
            p, o = (~target & ~slot_ok).nonzero()[0].tolist()
            out.append(f"{name} cache: {touched} slot(s) outside the appended ones changed (e.g. page/row {p} slot {o})")
    return out


SERVING_PROPERTIES = [PagedEqualsContiguous(), KvCacheAppend(), KvCacheLeftpad()]

__all__ = ["SERVING_PROPERTIES", "CacheProperty", "judge_pairs", "run", "fresh", "gathered_cases", "CaseRecipe"]
