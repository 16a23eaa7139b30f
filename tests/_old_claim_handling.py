"""Test fixture: kv_permutation_invariance and nonfinite_inputs_propagate as they were before issue 18
(verbatim from attnverify/properties/_props.py at b2db32f~1), when both forced causal=("none",) and ended
in InvalidArgument for an adapter claiming only causal. tests/test_claim_fuzz.py shows that the claim-set
fuzz finds that error on this code."""
import dataclasses

import torch
from hypothesis import strategies as st

from attnverify.check import unpack_output
from attnverify.magnitudes import magnitudes, score_bound
from attnverify.compare import compare, error_stats
from attnverify.properties import CaseProperty, ExampleResult, MetamorphicProperty
from attnverify.properties._props import _call
from attnverify.reference import reference_forward
from attnverify.tolerances import tolerance_for


class OldNonfiniteInputsPropagate(CaseProperty):
    name = "nonfinite_inputs_propagate"
    doc = ("NaN/Inf in a visible input makes exactly the rows the reference makes non-finite non-finite; "
           "every other row still matches.")
    case_kwargs = dict(dropout=False, poison=True, attn_mask=False, window=False, varlen=False, causal=("none",),
                       fully_masked=False)

    def adapt(self, adapter, r):
        if r.causal != "none" or r.mask != "none" or r.key_block is not None or r.window is not None \
                or r.seqlens_q is not None or r.len_q == 0 or r.len_k == 0:
            return None
        which = ("q", 0, 0, r.len_q - 1, 0, "nan") if r.seed % 3 == 0 else (
            ("k", 0, 0, r.len_k - 1, 0, "inf") if r.seed % 3 == 1 else ("v", 0, 0, 0, 0, "-inf"))
        return dataclasses.replace(r, poison=(which,))

    def judge(self, adapter, case, params):
        from attnverify.adapters.naive import naive_attention

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
        sev = (c.rel_l2 / c.tol_norm if c.tol_norm else 0.0) + (1e3 if problems else 0.0)
        return ExampleResult(passed, msg, severity=min(sev, 1e30), records=[c.to_dict()], case=case.to_dict())



class OldKvPermutationInvariance(MetamorphicProperty):
    name = "kv_permutation_invariance"
    doc = "Permuting keys and values jointly (no position-dependent masking) leaves the output unchanged."
    case_kwargs = dict(dropout=False, poison=False, causal=("none",), window=False, alibi=False, varlen=False)

    def params(self, adapter):
        return st.fixed_dictionaries({"perm_seed": st.integers(0, 2**16)})

    def default_params(self):
        return {"perm_seed": 1}

    def adapt(self, adapter, r):
        if r.causal != "none" or r.window is not None or r.alibi or r.seqlens_q is not None:
            return None
        return r

    def pairs(self, adapter, case, params):
        lk = case.k.shape[2]
        g = torch.Generator().manual_seed(int(params.get("perm_seed", 0)))
        perm = torch.randperm(lk, generator=g).to(case.k.device)
        s = case.spec
        m = s.attn_mask
        if m is not None and m.shape[-1] > 1:
            m = m[..., perm]
        a = _call(adapter, case.q, case.k, case.v, s)
        b = _call(adapter, case.q, case.k[:, :, perm], case.v[:, :, perm], s.replace(attn_mask=m))
        return {n: (b[n], a[n]) for n in a}

