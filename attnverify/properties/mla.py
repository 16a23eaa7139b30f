"""MLA in its absorbed form (DeepSeek): K and V are views of one latent tensor, V = K[..., :Dv], one latent head
shared by every query head (GQA-like), head dims 576/512 or 192/128.

    mla_latent_views   latent K/V views give what separate copies give and what the float64 reference gives (out,
                       and the LSE where claimed), and, with `backward`, the latent's gradient is dK + dV (the dV path
                       added into the first Dv columns of the dK path); with sinks where claimed

A forward-only kernel that reads V from K's first Dv columns itself (FlashMLA's `flash_mla_with_kvcache` has no V
argument) runs it too: the views-vs-copies comparison is blind to a wrong score or V slice there (both calls carry
the same values), so the views call is also held to the reference. Lk reaches past 64 and B is 1 or 2, so a kernel
that pages the latent (FlashMLA: pages of 64) reads more than one page.
"""
from __future__ import annotations

import time

import torch
from hypothesis import strategies as st

from ..case import DTYPES, Case
from ..check import unpack_output
from ..reference import reference_forward
from ..spec import Spec
from ..lse_conventions import expected_lse
from ..sink_logits import for_adapter, make_sinks
from ._within import Refused, ensure_claimed
from .base import ExampleResult, Property
from .serving import judge_pairs
from .sinks import sink_params

MLA_DIMS = ((576, 512), (192, 128))
LONG_KEYS = (63, 64, 65, 127, 128, 129, 160)  # around a page of 64 (FlashMLA's) and two


def claimed_dims(claims):
    return [d for d in MLA_DIMS if claims.head_dim_ok(d[0]) and claims.head_dim_ok(d[1])]


def latent_call(adapter, q, latent, dv, spec, d_out, views: bool, grad: bool = True, with_lse: bool = False):
    """(out, d latent) of one call with K = latent and V = latent[..., :dv], as views or as separate copies
    (grad=False: forward only, d latent None; with_lse: (out, d latent, lse))."""
    q = q.detach().clone().requires_grad_(grad)
    lat = latent.detach().clone().requires_grad_(grad)
    if views:
        k, v = lat, lat[..., :dv]
    else:
        k = lat.detach().clone().requires_grad_(grad)
        v = lat[..., :dv].detach().clone().requires_grad_(grad)
    res = unpack_output(adapter(q, k, v, spec))
    out, lse = res[0], res[1]
    if not grad:
        return (out.detach(), None, lse) if with_lse else (out.detach(), None)
    grads = torch.autograd.grad((out.float() * d_out).sum(), [lat] if views else [k, v], allow_unused=True)
    if views:
        g = grads[0]
    else:
        dk, dvv = (torch.zeros_like(t) if g is None else g for t, g in zip((k, v), grads))
        g = dk.clone()
        g[..., :dv] += dvv
    g = (torch.zeros_like(lat) if g is None else g).detach()
    return (out.detach(), g, lse) if with_lse else (out.detach(), g)


class MlaLatentViews(Property):
    name = "mla_latent_views"
    doc = ("With K and V views of one latent tensor (V = K[..., :Dv], one latent head for all query heads) the output "
           "equals the separate-copies call and the float64 reference (the LSE too where claimed), and with backward "
           "the latent's gradient equals dK + dV of the separate copies.")
    needs = ("dv_ne_d",)
    draws_latent_kv = True
    cost = 2.0

    def skip_reason(self, adapter):
        why = super().skip_reason(adapter)
        if why is None and not claimed_dims(adapter.claims):
            return f"{adapter.name} claims neither head dims 576/512 nor 192/128 (MLA)"
        return why

    def strategy(self, adapter, profile, device):
        c = adapter.claims
        cap = c.max_seqlen or 40  # the claim-set fuzz found Lk = 35 drawn for max_seqlen = 34
        return st.fixed_dictionaries({
            "dims": st.sampled_from(claimed_dims(c)),
            "heads_q": st.integers(1, 4) if c.gqa else st.just(1), "batch": st.integers(1, 2),
            "len_q": st.integers(1, min(24, cap)),
            "len_k": st.one_of(st.integers(1, min(40, cap)), st.sampled_from([n for n in LONG_KEYS if n <= cap] or [1])),
            "dtype": st.sampled_from([d for d in c.dtypes if not d.startswith("float8")]),
            "causal": st.sampled_from(c.causal), "seed": st.integers(0, 2**16),
            # sinks where claimed (FlashMLA's attn_sink): with latent_kv no other property draws them
            "sinks": st.one_of(st.none(), sink_params().map(lambda x: x["sinks"])) if c.sinks else st.none(),
        }).map(lambda d: {**d, "dims": list(d["dims"]), "sinks": for_adapter(adapter, d["dtype"], d["sinks"])})

    def examples(self, adapter, profile, device):
        if self.skip_reason(adapter):
            return []
        c = adapter.claims
        dt = [d for d in c.dtypes if not d.startswith("float8")][0]
        cap = c.max_seqlen or 9
        first = {"dims": list(claimed_dims(c)[0]), "heads_q": 2 if c.gqa else 1, "batch": 1, "len_q": min(5, cap),
                 "len_k": min(9, cap), "dtype": dt, "causal": c.causal[-1], "seed": 0}
        out = [first]
        if "bottom_right" in c.causal and c.fully_masked == "zeros" and cap >= 2:
            # rows with no visible key (bottom-right, Lq > Lk): out 0 and the LSE of the declared keyless_lse
            out.append({**first, "len_q": min(9, cap), "len_k": min(5, cap - 1), "causal": "bottom_right"})
        if c.sinks:  # the last case again with mixed sinks (a -inf one, large ones): the sink in the denominator
            out.append({**out[-1], "sinks": for_adapter(adapter, dt, {"kind": "mixed", "level": 2.0, "seed": 0})})
        return out

    def rebuild_case(self, drawn, device: str) -> Case:
        """The example's case again (q, and K and V views of one latent): what its evidence re-runs and diagnoses
        (no CaseRecipe describes V as a view of K, so the case carries {"rebuild": ...} instead)."""
        d, dv = drawn["dims"]
        gen = torch.Generator().manual_seed(int(drawn["seed"]))
        dtype = DTYPES[drawn["dtype"]]
        b, hq, lq = drawn.get("batch", 1), drawn["heads_q"], drawn.get("rows", drawn["len_q"])
        q = torch.randn(b, hq, lq, d, generator=gen).to(device, dtype)
        latent = torch.randn(b, 1, drawn["len_k"], d, generator=gen).to(device, dtype)
        sinks = make_sinks(hq, drawn["sinks"], device) if drawn.get("sinks") else None
        spec = Spec(causal=drawn["causal"], return_lse=bool(drawn.get("lse", False)), sinks=sinks)
        return Case(q, latent, latent[..., :dv], spec, seed=int(drawn["seed"]), label=self.name)

    def run_example(self, adapter, drawn) -> ExampleResult:
        t0 = time.perf_counter()
        dv = drawn["dims"][1]
        dev = "cpu" if "cpu" in adapter.claims.devices else "cuda"
        lq = drawn["len_q"]
        if drawn["causal"] != "none" and adapter.claims.fully_masked != "zeros":
            lq = min(lq, drawn["len_k"])  # no row without a visible key: the reference's 0 / -inf is not claimed
        full = {**drawn, "rows": lq, "lse": adapter.claims.lse}
        case = self.rebuild_case(full, dev)
        spec = case.spec
        gen = torch.Generator().manual_seed(int(drawn["seed"]) + 1)
        d_out = torch.randn(*case.q.shape[:3], dv, generator=gen).to(dev)

        def pairs(a, c):
            grad = a.claims.backward and adapter.claims.backward
            o1, g1, lse1 = latent_call(a, c.q, c.k, dv, spec, d_out, views=True, grad=grad, with_lse=True)
            o2, g2 = latent_call(a, c.q, c.k, dv, spec, d_out, views=False, grad=grad)
            ref = reference_forward(c.q, c.k, c.k[..., :dv], spec)
            out = {"out": (o1, ref.out), "out_views_vs_copies": (o1, o2.double().cpu())}
            if spec.return_lse:
                out["lse"] = (lse1, expected_lse(a.claims, c.q, c.k, c.k[..., :dv], spec, ref.lse))
            if grad:
                out["d_latent"] = (g1, g2.double().cpu())
            return out

        try:
            # both calls within the adapter's claims and its `refuses` (the views' strides are the latent's)
            ensure_claimed(adapter, case.q, case.k, case.v, spec)
            ensure_claimed(adapter, case.q, case.k.clone(), case.v.contiguous(), spec)
            # views against copies: two calls of the adapter (both rounded); the rest against the reference
            res = judge_pairs(self, adapter, case, drawn, pairs, sides={"out_views_vs_copies": 2, "d_latent": 2})
        except Refused as e:
            res = ExampleResult(True, f"not claimed (a call {self.name} makes): {e}", status="skipped",
                                case=case.to_dict())
        except Exception as e:
            res = ExampleResult(False, f"{self.name}: the property raised {type(e).__name__}: {e}", severity=1e30,
                                status="error", case=case.to_dict())
        res.case = {**(res.case or case.to_dict()), "rebuild": {"property": self.name, "drawn": full, "device": dev}}
        res.seconds = time.perf_counter() - t0
        return res


MLA_PROPERTIES = [MlaLatentViews()]

__all__ = ["MLA_PROPERTIES", "MLA_DIMS", "latent_call"]
