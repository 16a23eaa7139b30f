"""Properties of the calls themselves: determinism, inputs unmodified, dropout."""
from __future__ import annotations

import math

import torch

from ..case import Case
from ..check import bitwise_equal, check, unpack_output
from ..tolerances import unit_roundoff
from ..verdicts import bitwise_difference
from ._within import none_first
from .base import ExampleResult
from ._kinds import CaseProperty, _call


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
