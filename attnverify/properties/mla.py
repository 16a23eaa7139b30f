"""MLA in its absorbed form (DeepSeek): K and V are views of one latent tensor, V = K[..., :Dv], one latent head
shared by every query head (GQA-like), head dims 576/512 or 192/128.

    mla_latent_views   latent K/V views give what separate copies give, and the latent's gradient is dK + dV
                       (the dV path added into the first Dv columns of the dK path)
"""
from __future__ import annotations

import time

import torch
from hypothesis import strategies as st

from ..case import DTYPES, Case
from ..check import unpack_output
from ..spec import Spec
from .base import ExampleResult, Property
from .serving import judge_pairs

MLA_DIMS = ((576, 512), (192, 128))


def claimed_dims(claims):
    return [d for d in MLA_DIMS if claims.head_dim_ok(d[0]) and claims.head_dim_ok(d[1])]


def latent_call(adapter, q, latent, dv, spec, d_out, views: bool):
    """(out, d latent) of one call with K = latent and V = latent[..., :dv], as views or as separate copies."""
    q = q.detach().clone().requires_grad_(True)
    lat = latent.detach().clone().requires_grad_(True)
    if views:
        k, v = lat, lat[..., :dv]
    else:
        k = lat.detach().clone().requires_grad_(True)
        v = lat[..., :dv].detach().clone().requires_grad_(True)
    out = unpack_output(adapter(q, k, v, spec))[0]
    grads = torch.autograd.grad((out.float() * d_out).sum(), [lat] if views else [k, v], allow_unused=True)
    if views:
        g = grads[0]
    else:
        dk, dvv = (torch.zeros_like(t) if g is None else g for t, g in zip((k, v), grads))
        g = dk.clone()
        g[..., :dv] += dvv
    return out.detach(), (torch.zeros_like(lat) if g is None else g).detach()


class MlaLatentViews(Property):
    name = "mla_latent_views"
    doc = ("With K and V views of one latent tensor (V = K[..., :Dv], one latent head for all query heads) the output "
           "equals the separate-copies call, and the latent's gradient equals dK + dV of the separate copies.")
    needs = ("dv_ne_d", "backward")
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
            "heads_q": st.integers(1, 4) if c.gqa else st.just(1),
            "len_q": st.integers(1, min(24, cap)), "len_k": st.integers(1, min(40, cap)),
            "dtype": st.sampled_from([d for d in c.dtypes if not d.startswith("float8")]),
            "causal": st.sampled_from(c.causal), "seed": st.integers(0, 2**16),
        }).map(lambda d: {**d, "dims": list(d["dims"])})

    def examples(self, adapter, profile, device):
        if self.skip_reason(adapter):
            return []
        c = adapter.claims
        dt = [d for d in c.dtypes if not d.startswith("float8")][0]
        cap = c.max_seqlen or 9
        return [{"dims": list(claimed_dims(c)[0]), "heads_q": 2 if c.gqa else 1, "len_q": min(5, cap), "len_k": min(9, cap),
                 "dtype": dt,
                 "causal": c.causal[-1], "seed": 0}]

    def run_example(self, adapter, drawn) -> ExampleResult:
        t0 = time.perf_counter()
        d, dv = drawn["dims"]
        gen = torch.Generator().manual_seed(int(drawn["seed"]))
        dtype = DTYPES[drawn["dtype"]]
        dev = "cpu" if "cpu" in adapter.claims.devices else "cuda"
        q = torch.randn(1, drawn["heads_q"], drawn["len_q"], d, generator=gen).to(dev, dtype)
        latent = torch.randn(1, 1, drawn["len_k"], d, generator=gen).to(dev, dtype)
        spec = Spec(causal=drawn["causal"])
        d_out = torch.randn(1, drawn["heads_q"], drawn["len_q"], dv, generator=gen).to(dev)
        case = Case(q, latent, latent[..., :dv], spec, seed=int(drawn["seed"]), label=self.name)

        def pairs(a, c):
            o1, g1 = latent_call(a, c.q, c.k, dv, spec, d_out, views=True)
            o2, g2 = latent_call(a, c.q, c.k, dv, spec, d_out, views=False)
            return {"out": (o1, o2.double().cpu()), "d_latent": (g1, g2.double().cpu())}

        try:
            res = judge_pairs(self, adapter, case, drawn, pairs)
        except Exception as e:
            res = ExampleResult(False, f"{self.name}: the property raised {type(e).__name__}: {e}", severity=1e30,
                                status="error", case=case.to_dict())
        res.seconds = time.perf_counter() - t0
        return res


MLA_PROPERTIES = [MlaLatentViews()]

__all__ = ["MLA_PROPERTIES", "MLA_DIMS", "latent_call"]
