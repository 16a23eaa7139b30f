"""Metamorphic properties: kv permutation, batch/head independence, row shift, GQA = repeated kv, value scaling."""
from __future__ import annotations

import dataclasses
import math
from typing import Dict

import torch
from hypothesis import strategies as st

from ._within import first_row_seeing_every_key, none_first
from ._kinds import MetamorphicProperty, _call


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
