"""The properties: what `pytest --adapter=X` runs, one Hypothesis test each.

A drawn example is `{"recipe": CaseRecipe dict, ...parameters}`; `run_example` rebuilds the case
and judges it. Reference properties go through `check`; metamorphic ones compare the adapter
with itself, with a tolerance widened by what the same transformation does to `naive`.
"""
from __future__ import annotations

import dataclasses
import math
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch
from hypothesis import strategies as st

from ..case import Case, CaseRecipe, build_case
from ..check import bitwise_equal, check, unclaimed, unpack_output
from ..compare import compare, error_stats
from ..reference import reference_forward
from ..strategies import attention_cases, corpus, fully_masked_row_count
from ..tolerances import tolerance_for, unit_roundoff
from ..check import magnitudes, score_bound
from ..verdicts import bitwise_difference, compare_pairs, comparison_verdict, severity
from ._within import Refused, ensure_claimed, first_row_seeing_every_key, none_first
from .base import ExampleResult, Property


def _result_from_check(res, case) -> ExampleResult:
    return ExampleResult(
        passed=res.passed, message="" if res.passed else res.message(), severity=res.severity(),
        records=[res.to_dict()], case=case.to_dict(), status=res.status if res.status != "error" else "error",
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


class ForwardMatchesReference(CaseProperty):
    name = "forward_matches_reference"
    doc = "The output (and LSE when returned) matches the float64 reference on every claimed case."
    case_kwargs = dict(dropout=False, poison=False)

    def judge(self, adapter, case, params):
        return _result_from_check(check(adapter, case, backward=False), case)


class GradientsMatchReference(CaseProperty):
    name = "gradients_match_reference"
    doc = "dQ, dK and dV match the float64 reference's explicit backward."
    needs = ("backward",)
    case_kwargs = dict(dropout=False, poison=False)
    backward_cases = True

    def judge(self, adapter, case, params):
        return _result_from_check(check(adapter, case, backward=True), case)


class LseMatchesReference(CaseProperty):
    name = "lse_matches_reference"
    doc = "The returned log-sum-exp (natural log, float32) matches the reference's."
    needs = ("lse",)
    case_kwargs = dict(dropout=False, poison=False, return_lse=True)

    def adapt(self, adapter, r):
        return dataclasses.replace(r, return_lse=True)

    def judge(self, adapter, case, params):
        return _result_from_check(check(adapter, case, backward=False), case)


class FullyMaskedRows(CaseProperty):
    name = "fully_masked_rows"
    doc = "Rows with no visible key follow the declared convention (zeros or NaN) in out, LSE and gradients."
    case_kwargs = dict(dropout=False, poison=False, fully_masked=True)
    backward_cases = True

    def skip_reason(self, adapter):
        if adapter.claims.fully_masked == "unsupported":
            return f"{adapter.name} does not claim fully-masked rows (fully_masked='unsupported')"
        c = adapter.claims
        if not (c.attn_mask or "bottom_right" in c.causal or c.window or c.varlen):
            return f"{adapter.name} does not claim attn_mask, bottom_right causal, window or varlen (no way to mask a row)"
        return None

    def adapt(self, adapter, r):
        r = dataclasses.replace(r, return_lse=adapter.claims.lse)
        return r if fully_masked_row_count(r) else None

    def kwargs(self, adapter):
        kw = dict(self.case_kwargs)
        if adapter.claims.lse:
            kw["return_lse"] = None
        return kw

    def judge(self, adapter, case, params):
        res = check(adapter, case, backward=adapter.claims.backward)
        out = _result_from_check(res, case)
        if not res.passed:
            fm = int(torch.isneginf(reference_forward(case.q, case.k, case.v, case.spec).lse).sum()) \
                if case.spec.dropout_p == 0 else -1
            out.message += f"\nnote: {fm} fully-masked row(s) in this case; declared convention: {adapter.claims.fully_masked}"
        return out


class CausalAlignment(CaseProperty):
    name = "causal_alignment"
    doc = "Causal masking follows the declared alignment (top-left or bottom-right) when Lq != Lk."
    needs = ("causal",)
    case_kwargs = dict(dropout=False, poison=False, lq_ne_lk=True)

    def kwargs(self, adapter):
        return {**self.case_kwargs, "causal": tuple(c for c in adapter.claims.causal if c != "none")}

    def adapt(self, adapter, r):
        modes = [c for c in adapter.claims.causal if c != "none"]
        if r.len_q == r.len_k or r.seqlens_q is not None:
            return None
        return dataclasses.replace(r, causal=r.causal if r.causal in modes else modes[0])

    def keep(self, r):
        return r.causal != "none"

    def judge(self, adapter, case, params):
        res = check(adapter, case, backward=False)
        out = _result_from_check(res, case)
        if not res.passed and res.outputs.get("out") is not None:
            for other in ("top_left", "bottom_right", "none"):
                if other == case.spec.causal:
                    continue
                try:
                    alt = reference_forward(case.q, case.k, case.v, case.spec.replace(causal=other))
                except Exception:
                    continue
                got = res.outputs["out"].double().cpu()
                if torch.allclose(torch.nan_to_num(got), torch.nan_to_num(alt.out.cpu()), rtol=1e-2, atol=1e-2):
                    out.message += f"\ndiagnosis: the output follows causal={other}, but the case asked for causal={case.spec.causal}"
                    break
        return out


class NonfiniteInputsPropagate(CaseProperty):
    name = "nonfinite_inputs_propagate"
    doc = ("NaN/Inf in a visible input makes exactly the rows the reference makes non-finite non-finite; "
           "every other row still matches. Non-causal where claimed; under causal masking a poisoned key or "
           "value is the first one, which every row sees.")
    case_kwargs = dict(dropout=False, poison=True, attn_mask=False, window=False, varlen=False, fully_masked=False)

    def kwargs(self, adapter):
        return {**self.case_kwargs, "causal": none_first(adapter)}

    def strategy(self, adapter, profile, device):
        return super().strategy(adapter, profile, device).map(self._visible)

    @staticmethod
    def _visible(drawn):
        """Under causal masking a poisoned key/value moves to position 0: every row sees it (a key no row
        sees is a question of masking, not of propagation)."""
        r = drawn["recipe"]
        if r.get("causal", "none") == "none" or not r.get("poison"):
            return drawn
        poison = [list(p) for p in r["poison"]]
        for p in poison:
            if p[0] in ("k", "v"):
                p[3] = 0
        return {**drawn, "recipe": {**r, "poison": [tuple(p) for p in poison]}}

    def adapt(self, adapter, r):
        if r.causal not in none_first(adapter) or r.mask != "none" or r.key_block is not None \
                or r.window is not None or r.seqlens_q is not None or r.len_q == 0 or r.len_k == 0 \
                or fully_masked_row_count(r):  # as drawn cases (fully_masked=False): every row sees a key
            return None
        last_k = r.len_k - 1 if r.causal == "none" else 0
        which = ("q", 0, 0, r.len_q - 1, 0, "nan") if r.seed % 3 == 0 else (
            ("k", 0, 0, last_k, 0, "inf") if r.seed % 3 == 1 else ("v", 0, 0, 0, 0, "-inf"))
        return dataclasses.replace(r, poison=(which,))

    def judge(self, adapter, case, params):
        from ..adapters.naive import naive_attention

        q, k, v = case.q, case.k, case.v
        with torch.no_grad():
            out, lse, _ = unpack_output(adapter(q, k, v, case.spec))
            base = naive_attention(q, k, v, case.spec).out
        ref = reference_forward(q, k, v, case.spec)
        bad_rows = ~torch.isfinite(ref.out).all(-1, keepdim=True).cpu()
        # an Inf can leave a row with every score -inf: the reference calls it fully masked (out 0, LSE
        # -inf), and the adapter's declared convention for such rows applies, as in check()
        fm = torch.isneginf(ref.lse).unsqueeze(-1).cpu() & ~bad_rows
        ignore = bad_rows
        if bool(fm.any()) and adapter.claims.fully_masked == "unsupported":
            ignore = bad_rows | fm
        elif bool(fm.any()) and adapter.claims.fully_masked == "nan":
            bad_rows = ignore = bad_rows | fm  # declared: those rows come back NaN
        b = base.double().cpu().masked_fill(ignore, 0.0)
        r0 = ref.out.cpu().masked_fill(ignore, 0.0)
        brel, babs = error_stats(b, r0)
        mags = magnitudes(case)
        tol = tolerance_for("out", case.dtype, baseline_rel_l2=brel, baseline_max_abs=babs,
                            score_max=score_bound(case, ref.lse), scale_floor=mags["out"])
        c = compare("out", out, ref.out, tol, ignore=ignore)
        got_rows = ~torch.isfinite(out.detach().double().cpu()).all(-1, keepdim=True)
        missing = bad_rows & ~got_rows
        problems = []
        if int(missing.sum()):
            idx = tuple(int(i) for i in missing.nonzero()[0][:3])
            problems.append(f"{int(missing.sum())} row(s) finite where the reference is non-finite "
                            f"(e.g. (b, h, i) = {idx}: the NaN/Inf was swallowed)")
        passed = c.passed and not problems
        msg = "" if passed else "\n".join(problems + [c.message(), f"poison: {list(case.recipe.poison)}"])
        sev = severity([c]) + (1e3 if problems else 0.0)
        return ExampleResult(passed, msg, severity=min(sev, 1e30), records=[c.to_dict()], case=case.to_dict())


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
                base = {n: error_stats(g, e) for n, (g, e) in self.pairs(naive, case, params).items()}
            except Exception:
                base = {}
        # both sides carry their own rounding: the same score-size and scale floors as `check`
        comps = compare_pairs(mine, case.dtype, score_max=self.score_max(case, params, score_bound(case)),
                              scale_floors=magnitudes(case), baseline=base)
        passed, sev, msg = comparison_verdict(comps, f"[{adapter.name}] {self.name} FAILED: {case.describe()}",
                                              self.doc, params)
        return ExampleResult(passed, msg, severity=sev, records=[c.to_dict() for c in comps], case=case.to_dict())


def _slice_spec_tensor(t, dims_idx: Dict[int, slice]):
    if t is None or not isinstance(t, torch.Tensor):
        return t
    for d, s in dims_idx.items():
        if d < t.dim() and t.shape[d] > 1:
            t = t[(slice(None),) * d + (s,)]
    return t


class KvPermutationInvariance(MetamorphicProperty):
    name = "kv_permutation_invariance"
    doc = ("Permuting keys and values jointly (no position-dependent masking) leaves the output unchanged; "
           "under causal masking (an adapter that claims only causal), the rows that see every key.")
    case_kwargs = dict(dropout=False, poison=False, window=False, alibi=False, varlen=False)

    def kwargs(self, adapter):
        return {**self.case_kwargs, "causal": none_first(adapter)}

    def skip_reason(self, adapter):
        if adapter.claims.max_seqlen < 2:
            return f"{adapter.name} claims max_seqlen={adapter.claims.max_seqlen}: one key has no permutation"
        return super().skip_reason(adapter)

    def keep(self, r):  # a causal case must have a row that sees every key (top-left: Lq >= Lk)
        return first_row_seeing_every_key(r.len_q, r.len_k, r.causal) is not None

    def params(self, adapter):
        return st.fixed_dictionaries({"perm_seed": st.integers(0, 2**16)})

    def default_params(self):
        return {"perm_seed": 1}

    def adapt(self, adapter, r):
        if r.causal not in none_first(adapter) or r.window is not None or r.alibi or r.seqlens_q is not None:
            return None
        return r

    def pairs(self, adapter, case, params):
        lq, lk = case.q.shape[2], case.k.shape[2]
        g = torch.Generator().manual_seed(int(params.get("perm_seed", 0)))
        perm = torch.randperm(lk, generator=g).to(case.k.device)
        s = case.spec
        m = s.attn_mask
        if m is not None and m.shape[-1] > 1:
            m = m[..., perm]
        a = _call(adapter, case.q, case.k, case.v, s)
        b = _call(adapter, case.q, case.k[:, :, perm], case.v[:, :, perm], s.replace(attn_mask=m))
        # under causal masking only the rows that see every key are invariant (the last row at least)
        r0 = first_row_seeing_every_key(lq, lk, s.causal) or 0
        return {n: (b[n][:, :, r0:], a[n][:, :, r0:]) for n in a}


class BatchHeadIndependence(MetamorphicProperty):
    name = "batch_head_independence"
    doc = "Each (batch, kv-head group) computed alone gives what it gives inside the full call."
    case_kwargs = dict(dropout=False, poison=False, varlen=False)

    def keep(self, r):
        return r.batch > 1 or r.heads_kv > 1

    def params(self, adapter):
        return st.fixed_dictionaries({"pick": st.integers(0, 2**16)})

    def default_params(self):
        return {"pick": 1}

    def adapt(self, adapter, r):
        return r if r.seqlens_q is None else None

    def pairs(self, adapter, case, params):
        b, hq = case.q.shape[:2]
        hkv = case.k.shape[1]
        g = hq // hkv
        pick = int(params.get("pick", 0))
        bi, hi = pick % b, (pick // b) % hkv
        s = case.spec
        bs, hs = slice(bi, bi + 1), slice(hi * g, (hi + 1) * g)
        mask = _slice_spec_tensor(s.attn_mask, {0: bs, 1: hs})
        slopes = s.alibi_slopes
        if isinstance(slopes, torch.Tensor):
            slopes = slopes[hs] if slopes.dim() == 1 else slopes[bs, hs]
        full = _call(adapter, case.q, case.k, case.v, s)
        part = _call(adapter, case.q[bs, hs], case.k[bs, hi:hi + 1], case.v[bs, hi:hi + 1],
                     s.replace(attn_mask=mask, alibi_slopes=slopes))
        out = {"out": (part["out"], full["out"][bs, hs])}
        if "lse" in full and "lse" in part:
            out["lse"] = (part["lse"], full["lse"][bs, hs])
        return out


class RowShiftInvariance(MetamorphicProperty):
    name = "row_shift_invariance"
    doc = "Adding a constant to every score of a row changes no output; the LSE moves by exactly that constant."
    case_kwargs = dict(dropout=False, poison=False, softcap=False, extreme_values=False)

    def params(self, adapter):
        return st.fixed_dictionaries({"shift": st.sampled_from((3.0, -20.0, 100.0, -120.0, 1000.0, -1000.0))})

    def default_params(self):
        return {"shift": 100.0}

    def adapt(self, adapter, r):
        if r.softcap is not None:
            return None
        return dataclasses.replace(r, row_shift=0.0, late_boost=1.0, late_from=None)

    def score_max(self, case, params, s_case):
        # the shifted call's scores reach S + 1.5 |shift|, and that size enters through one term of a
        # D-long dot product: every partial sum after it is that large, so its rounding grows like
        # sqrt(D) (measured: D = 256, shift 100, fp32 went 1.04x past a bound without this factor)
        d = case.q.shape[-1]
        return (s_case + 1.5 * abs(float(params.get("shift", 100.0)))) * max(1.0, math.sqrt(d) / 4.0)

    def pairs(self, adapter, case, params):
        s = case.spec
        d = case.q.shape[-1]
        sc = s.resolved_scale(d)
        q0, k0 = case.q.clone(), case.k.clone()
        k0[..., 0] = 1.0
        q0[..., 0] = 0.0
        g = torch.Generator().manual_seed(int(case.seed) + 7)
        c = float(params.get("shift", 100.0)) * (0.5 + torch.rand(case.q.shape[:3], generator=g, dtype=torch.float64))
        # the shift rides in q[..., 0] as c / scale: with a tiny scale that would overflow fp16 (an
        # inf query is another property's business), so the shift is capped to what the dtype holds
        cap = torch.finfo(case.q.dtype).max * 0.25 * sc
        c = c.clamp(-cap, cap)
        q1 = q0.clone()
        q1[..., 0] = (c / sc).to(q1.dtype).to(q1.device)
        shift_actual = q1[..., 0].double().cpu() * sc  # what was really added, after rounding to the dtype
        a = _call(adapter, q0, k0, case.v, s)
        b = _call(adapter, q1, k0, case.v, s)
        out = {"out": (b["out"], a["out"])}
        if "lse" in a and "lse" in b:
            exp = a["lse"].double().cpu() + shift_actual
            out["lse"] = (b["lse"], exp)
        return out


class GqaEqualsRepeatedKv(MetamorphicProperty):
    name = "gqa_equals_repeated_kv"
    doc = "Grouped-query attention equals attention over K/V repeated per group (grouped mapping h // (Hq/Hkv))."
    needs = ("gqa",)
    case_kwargs = dict(dropout=False, poison=False, gqa=True)
    backward_cases = True

    def adapt(self, adapter, r):
        return r if r.heads_q != r.heads_kv else None

    def pairs(self, adapter, case, params):
        hq, hkv = case.q.shape[1], case.k.shape[1]
        g = hq // hkv
        bwd = adapter.claims.backward
        kr, vr = case.k.repeat_interleave(g, 1), case.v.repeat_interleave(g, 1)
        a = _call(adapter, case.q, case.k, case.v, case.spec, backward=bwd, gen_seed=case.seed)
        b = _call(adapter, case.q, kr, vr, case.spec, backward=bwd, gen_seed=case.seed)
        out = {"out": (a["out"], b["out"])}
        if "lse" in a and "lse" in b:
            out["lse"] = (a["lse"], b["lse"])
        if bwd:
            out["dq"] = (a["dq"], b["dq"])
            for n in ("dk", "dv"):
                rb = b[n]
                if rb is not None:
                    rb = rb.double().reshape(rb.shape[0], hkv, g, *rb.shape[2:]).sum(2)
                out[n] = (a[n], rb)
        return out


class ValueScaling(MetamorphicProperty):
    name = "value_scaling"
    doc = "Scaling V by a power of two scales the output by it (attention is linear in V)."
    case_kwargs = dict(dropout=False, poison=False)

    def params(self, adapter):
        return st.fixed_dictionaries({"alpha": st.sampled_from((2.0, 0.5, -1.0, 4.0))})

    def default_params(self):
        return {"alpha": 2.0}

    def pairs(self, adapter, case, params):
        alpha = float(params.get("alpha", 2.0))
        a = _call(adapter, case.q, case.k, case.v, case.spec)
        b = _call(adapter, case.q, case.k, case.v * alpha, case.spec)
        return {"out": (b["out"], a["out"].double() * alpha)}


# ---------------------------------------------------------------------------------------------------
# contracts


def _snapshot(case: Case):
    s = case.spec
    items = {"q": case.q, "k": case.k, "v": case.v, "attn_mask": s.attn_mask, "alibi_slopes": s.alibi_slopes,
             "cu_seqlens_q": s.cu_seqlens_q, "cu_seqlens_k": s.cu_seqlens_k}
    return {n: (t.detach().clone(), t.stride(), t.storage_offset()) for n, t in items.items() if isinstance(t, torch.Tensor)}


class Determinism(CaseProperty):
    name = "determinism"
    doc = "Two calls on the same inputs are bitwise identical (forward and backward), as claimed."
    needs = ("deterministic",)
    case_kwargs = dict(dropout=False, poison=False)
    cost = 2.0  # two calls with backward per example

    def judge(self, adapter, case, params):
        bwd = adapter.claims.backward
        runs = [_call(adapter, case.q, case.k, case.v, case.spec, backward=bwd, gen_seed=case.seed) for _ in range(3)]
        bad = []
        for n in runs[0]:
            for i, r in enumerate(runs[1:], 2):
                diff = bitwise_difference(runs[0][n], r[n])
                if diff:
                    bad.append(f"{n}: call {i} differs from call 1 {diff}")
                    break
        msg = "" if not bad else "\n".join([f"[{adapter.name}] claims deterministic=True, but: {case.describe()}"] + bad)
        return ExampleResult(not bad, msg, severity=10.0 if bad else 0.0, case=case.to_dict())


class InputsUnmodified(CaseProperty):
    name = "inputs_unmodified"
    doc = "The adapter leaves q, k, v, the mask, ALiBi slopes and cu_seqlens untouched (values, strides, offset)."
    case_kwargs = dict(dropout=False, poison=False)

    def judge(self, adapter, case, params):
        before = _snapshot(case)
        bwd = adapter.claims.backward
        q, k, v = case.q, case.k, case.v
        if bwd:
            q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        with torch.enable_grad() if bwd else torch.no_grad():
            out, _, _ = unpack_output(adapter(q, k, v, case.spec))
        if bwd:
            out.sum().backward() if out.requires_grad else None
        after = {"q": q, "k": k, "v": v, "attn_mask": case.spec.attn_mask, "alibi_slopes": case.spec.alibi_slopes,
                 "cu_seqlens_q": case.spec.cu_seqlens_q, "cu_seqlens_k": case.spec.cu_seqlens_k}
        bad = []
        for n, (t, stride, off) in before.items():
            a = after[n].detach()
            if not bitwise_equal(t, a):
                bad.append(f"{n} was modified in place ({int((t != a).sum())} element(s) changed)")
            elif a.stride() != stride or a.storage_offset() != off:
                bad.append(f"{n}'s strides/offset changed")
        msg = "" if not bad else "\n".join([f"[{adapter.name}] modified its inputs: {case.describe()}"] + bad)
        return ExampleResult(not bad, msg, severity=10.0 if bad else 0.0, case=case.to_dict())


class Dropout(CaseProperty):
    name = "dropout"
    doc = ("Dropout keeps each probability with chance 1-p and divides by 1-p: exact when the keep-mask is "
           "returned, else binomial tests of the kept count; the same seed repeats, another seed differs.")
    needs = ("dropout",)
    case_kwargs = dict(dropout=True, poison=False, attn_mask=False, window=False, alibi=False, varlen=False,
                       extreme_values=False, softcap=False, fully_masked=False)

    def kwargs(self, adapter):  # under causal masking each row counts the keys it sees
        return {**self.case_kwargs, "causal": none_first(adapter)}

    def keep(self, r):
        return r.batch * r.heads_q * r.len_q * r.len_k >= 64

    def adapt(self, adapter, r):
        return None  # the corpus is about masks and numerics; dropout draws its own

    def judge(self, adapter, case, params):
        from scipy import stats

        s = case.spec
        p = s.dropout_p
        q = torch.zeros_like(case.q)  # uniform attention: every visible key weighs 1/Lk
        v = torch.ones_like(case.v)  # then a row's output counts its kept keys
        # seeds are compared with random values: with v = 1 two different masks with equal row counts agree
        g = torch.Generator().manual_seed(int(case.seed) + 7)
        vr = torch.randn(case.v.shape, generator=g).to(case.v.device, case.v.dtype)
        with torch.no_grad():
            out1, _, keep = unpack_output(adapter(q, case.k, v, s))
            r1, _, _ = unpack_output(adapter(q, case.k, vr, s))
            r2, _, _ = unpack_output(adapter(q, case.k, vr, s))
            r3, _, _ = unpack_output(adapter(q, case.k, vr, s.replace(seed=int(s.seed or 0) + 1)))
        problems, recs = [], []
        sev = 0.0
        if keep is not None:  # exact: the reference with the returned keep-mask
            res = check(adapter, case, backward=False)
            recs.append(res.to_dict())
            if not res.passed:
                problems.append(res.message())
                sev = res.severity()
        from ..reference import visible_counts

        lk = case.k.shape[2]
        seen = visible_counts(case.q.shape[2], lk, s.replace(dropout_p=0.0), case.q.shape[0], case.q.shape[1])
        live = seen > 0
        # per row: the number of kept keys, estimated (uniform attention: every visible key weighs 1/seen)
        kept = (out1.double().cpu()[..., 0] * seen * (1 - p))[live]
        n_keys = int(seen.sum())
        if not torch.isfinite(kept).all():
            problems.append("non-finite output under dropout with finite inputs")
        else:
            # How far an estimate may be from the true count: every kept probability 1/(Lk (1-p)) may be
            # rounded to the input dtype before and after the 1/(1-p) scaling and the output once more
            # (3 u, the same direction in every row: a bias, not noise), plus fp32 accumulation over Lk terms
            # (a lower-precision accumulator fails forward_matches_reference first).
            delta = 3 * unit_roundoff(case.dtype) + (lk + 2) * unit_roundoff("float32")
            row_tol = 0.02 + float(kept.abs().max()) * delta
            resid = float((kept - kept.round()).abs().max())
            if row_tol < 0.5 and resid > row_tol:  # whole counts are resolvable in this dtype: they must be whole
                problems.append(f"kept probabilities are not scaled by 1/(1-p): row sums x Lk x (1-p) = "
                                f"{float(kept.flatten()[0]):.4f} ... are not whole numbers (off by up to {resid:.3g}; "
                                f"rounding allows {row_tol:.3g})")
            est = float(kept.sum())
            trials = n_keys
            if row_tol < 0.5:  # every row's count is known exactly: no slack
                lo = hi = min(max(int(kept.round().sum()), 0), trials)
            else:  # the most plausible total among those the rounded outputs allow
                lo = max(0, math.ceil(est * (1 - delta) - 0.5))
                hi = min(trials, math.floor(est * (1 + delta) + 0.5))
            total = min(max(round(trials * (1 - p)), lo), hi) if lo <= hi else min(max(round(est), 0), trials)
            pv = stats.binomtest(total, trials, 1 - p).pvalue
            if pv < 1e-6:
                problems.append(f"kept fraction {est / trials:.4f} over {trials} draws (within rounding: "
                                f"{lo / trials:.4f} to {hi / trials:.4f}); expected {1 - p:.4f} (binomial test "
                                f"p-value {pv:.2e} at the most plausible count)")
            sev = max(sev, 1e-6 / max(pv, 1e-300))
        if not bitwise_equal(r1, r2):
            problems.append("the same seed gave a different result")
        # two independent masks agree with probability (p^2 + (1-p)^2)^(elements): judge only where negligible
        if (p * p + (1 - p) ** 2) ** n_keys < 1e-6 and bitwise_equal(r1, r3):
            problems.append("a different seed gave the identical result")
        msg = "" if not problems else "\n".join([f"[{adapter.name}] dropout p={p}: {case.describe()}"] + problems)
        return ExampleResult(not problems, msg, severity=min(sev, 1e30) if problems else min(sev, 0.99),
                             records=recs, case=case.to_dict())


PROPERTIES: List[Property] = [
    ForwardMatchesReference(),
    GradientsMatchReference(),
    LseMatchesReference(),
    FullyMaskedRows(),
    CausalAlignment(),
    KvPermutationInvariance(),
    BatchHeadIndependence(),
    RowShiftInvariance(),
    GqaEqualsRepeatedKv(),
    ValueScaling(),
    Determinism(),
    InputsUnmodified(),
    Dropout(),
    NonfiniteInputsPropagate(),
]
