"""Properties judged against the float64 reference: forward, gradients, LSE, fully masked rows, causal
alignment, non-finite inputs."""
from __future__ import annotations

import dataclasses

import torch

from ..check import check, unpack_output
from ..compare import compare, error_stats
from ..reference import reference_forward
from ..strategies import fully_masked_row_count
from ..tolerances import floors_of, tolerance_for
from ..magnitudes import magnitudes, score_bound
from ..verdicts import severity
from ._within import none_first
from .base import ExampleResult
from ._kinds import CaseProperty, _result_from_check


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
    doc = ("Rows with no visible key follow the declared convention (zeros, with the LSE keyless_lse declares, or NaN) "
           "in out, LSE and gradients.")
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
            kl = adapter.claims.keyless_lse
            conv = adapter.claims.fully_masked + (f", keyless_lse={kl!r}" if kl != "-inf" else "")
            out.message += f"\nnote: {fm} fully-masked row(s) in this case; declared convention: {conv}"
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
            got = torch.nan_to_num(res.outputs["out"].double().cpu())
            asked = torch.nan_to_num(reference_forward(case.q, case.k, case.v, case.spec).out.cpu())
            for other in ("top_left", "bottom_right", "none"):
                if other == case.spec.causal:
                    continue
                try:
                    alt = torch.nan_to_num(reference_forward(case.q, case.k, case.v, case.spec.replace(causal=other)).out.cpu())
                except Exception:
                    continue
                if torch.equal(alt, asked):  # the same visibility here (Lq = 1 bottom-right is no mask): names nothing
                    continue
                if torch.allclose(got, alt, rtol=1e-2, atol=1e-2):
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
        got_rows = ~torch.isfinite(out.detach().double().cpu()).all(-1, keepdim=True)
        ignore = bad_rows
        if bool(fm.any()) and adapter.claims.fully_masked == "unsupported":
            ignore = bad_rows | fm
        elif bool(fm.any()) and adapter.claims.fully_masked == "nan":
            bad_rows = ignore = bad_rows | fm  # declared: those rows come back NaN
        elif bool(fm.any()):
            # the drawn cases mask no row, so these rows lost every key to the poison (an Inf in q or k: every score
            # -inf): the declared convention (zeros) or the NaN/Inf propagated are both right there; a finite value
            # is held to the convention (2026-12-05: the README's quick-start kernel, a plain softmax, gave NaN on
            # `Lq=Lk=1 q[0]=inf` and failed one seed's ci run)
            ignore = bad_rows | (fm & got_rows)
        b = base.double().cpu().masked_fill(ignore, 0.0)
        r0 = ref.out.cpu().masked_fill(ignore, 0.0)
        brel, babs = error_stats(b, r0)
        mags = magnitudes(case)
        tol = tolerance_for("out", case.dtype, baseline_rel_l2=brel, baseline_max_abs=babs,
                            score_max=score_bound(case, ref.lse), **floors_of(mags, "out"))
        c = compare("out", out, ref.out, tol, ignore=ignore)
        missing = bad_rows & ~got_rows
        problems = []
        if int(missing.sum()):
            idx = tuple(int(i) for i in missing.nonzero()[0][:3])
            problems.append(f"{int(missing.sum())} row(s) finite where the reference is non-finite "
                            f"(e.g. (b, h, i) = {idx}: the NaN/Inf was swallowed)")
        passed = c.passed and not problems
        # the comparison skips the rows the reference makes non-finite: say so, or 'out: ok' beside 'N row(s) finite
        # where the reference is non-finite' reads as a contradiction
        cmsg = c.message().replace("out: ok", "out, on the rows the reference keeps finite: ok", 1)
        msg = "" if passed else "\n".join(problems + [cmsg, f"poison: {list(case.recipe.poison)}"])
        sev = severity([c]) + (1e3 if problems else 0.0)
        return ExampleResult(passed, msg, severity=min(sev, 1e30), records=[c.to_dict()], case=case.to_dict())
