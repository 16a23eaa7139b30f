"""Stability: the 1st and the 11th call agree, also with other shapes in between, and a request alone
equals the same request inside a larger batch or pack."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch
from hypothesis import strategies as st

from ..case import Case, CaseRecipe, build_case
from ..check import unclaimed, unpack_output
from ..magnitudes import magnitudes, score_bound
from ..compare import error_stats
from ..verdicts import bitwise_difference, compare_pairs, comparison_verdict
from ._props import MetamorphicProperty, _call
from .base import ExampleResult
from ._guards import _interpreted_triton, _with_problems

class RepeatAndInterleaveStable(MetamorphicProperty):
    name = "repeat_and_interleave_stable"
    doc = ("The same answer on the 1st and the 11th call, and again after calls of other shapes, head dims, "
           "dtypes and causal modes ran in between (stale caches, autotuning state); bitwise when the adapter "
           "claims deterministic. One request alone equals the same request inside a larger batch (or varlen pack).")
    case_kwargs = dict(dropout=False, poison=False)
    cost = 6.0  # 11 calls, the interleaved shapes and a batched call per example

    def params(self, adapter):
        return st.fixed_dictionaries({"extra": st.integers(1, 2), "pos": st.integers(0, 2)})

    def default_params(self):
        return {"extra": 1, "pos": 1}

    def judge(self, adapter, case, params):
        # The adapter against itself on identical inputs: no same-dtype baseline to widen the bound by
        # (naive under the same "transformation" is exact), so the dtype's unit-roundoff floors apply.
        bitwise: List[str] = []
        mine = self.pairs(adapter, case, params, bitwise=bitwise)
        mags = magnitudes(case)  # large scores make every float32 re-association visible: as check() does
        score_max = score_bound(case)
        base = self._batch_baseline(case, params)
        comps = compare_pairs(mine, case.dtype, score_max=score_max, scale_floors=mags, baseline=base, missing="skip")
        passed, sev, msg = comparison_verdict(comps, f"[{adapter.name}] {self.name} FAILED: {case.describe()}",
                                              self.doc, params)
        res = ExampleResult(passed, msg, severity=sev, records=[{"adapter": adapter.name,
                            "status": "passed" if passed else "failed", "comparisons": [c.to_dict() for c in comps]}],
                            case=case.to_dict())
        probs = bitwise if adapter.claims.deterministic else []
        return _with_problems(res, probs, f"[{adapter.name}] claims deterministic=True, but repeated calls on the "
                                          f"same inputs differ in bits: {case.describe()}")

    def derived_recipes(self, r, params):
        """The call that holds the case inside a larger batch (attribution_calls); a varlen pack's is not
        a recipe of this kind."""
        if r.seqlens_q is not None:
            return []
        return [("in_batch", dataclasses.replace(r, batch=r.batch + max(1, int(params.get("extra", 1)))))]

    @staticmethod
    def _batch_baseline(case, params) -> dict:
        """What batching does to `naive` (the same-dtype eager baseline): widens the in-batch bound."""
        from ..adapters.naive import naive

        if case.dtype not in naive.claims.dtypes or unclaimed(naive, case) is not None:
            return {}
        try:
            emb = _embed_in_batch(naive, case, int(params.get("extra", 1)), int(params.get("pos", 1)))
            if emb is None:
                return {}
            with torch.no_grad():
                alone = unpack_output(naive(case.q, case.k, case.v, case.spec.replace(return_lse=True)))
                big = unpack_output(naive(*emb[:3], emb[3].replace(return_lse=True)))
            sl = emb[4]
            return {"out:in_batch": error_stats(big[0][sl], alone[0].double()),
                    "lse:in_batch": error_stats(big[1][sl], alone[1].double())}
        except Exception:
            return {}

    @staticmethod
    def _bitwise(out: List[str], label, a: dict, b: dict):
        for n in a:
            d = bitwise_difference(a.get(n), b.get(n))
            if d:
                out.append(f"{n}: {label} differs from the 1st call {d}")

    def pairs(self, adapter, case, params, bitwise: Optional[List[str]] = None):
        bitwise = [] if bitwise is None else bitwise
        bwd = adapter.claims.backward
        # under the Triton interpreter a call costs seconds: calls 2..10, two other lengths and the call after
        # them run forward only (the example must fit the isolated child's per-example timeout, 60 s)
        light = _interpreted_triton(adapter)
        first = _call(adapter, case.q, case.k, case.v, case.spec, backward=bwd, gen_seed=case.seed)
        for _ in range(9):  # calls 2..10: forward (and backward) with nothing kept
            _call(adapter, case.q, case.k, case.v, case.spec, backward=bwd and not light and case.q.numel() < 20_000,
                  gen_seed=case.seed)
        eleventh = _call(adapter, case.q, case.k, case.v, case.spec, backward=bwd, gen_seed=case.seed)
        ran = 0
        others = _other_cases(adapter, case)
        for i, other in enumerate(others[-3:-1] if light else others):
            _call(adapter, other.q, other.k, other.v, other.spec, backward=bwd and i == 0 and not light,
                  gen_seed=other.seed)
            ran += 1
        after = _call(adapter, case.q, case.k, case.v, case.spec, backward=bwd and not light, gen_seed=case.seed)
        pairs: Dict[str, Tuple[Any, Any]] = {}
        for n in first:
            pairs[f"{n}:11th_call"] = (eleventh.get(n), first[n])
            if ran and n in after:
                pairs[f"{n}:after_other_shapes"] = (after[n], first[n])
        self._bitwise(bitwise, "the 11th call", first, eleventh)
        if ran:
            self._bitwise(bitwise, f"the call after {ran} calls of other shapes", first, after)
        emb = _embed_in_batch(adapter, case, int(params.get("extra", 1)), int(params.get("pos", 1)))
        if emb is not None:
            big_q, big_k, big_v, big_spec, sl = emb
            with torch.no_grad():
                o, lse, _ = unpack_output(adapter(big_q, big_k, big_v, big_spec))
            pairs["out:in_batch"] = (o[sl], first["out"])
            if "lse" in first and isinstance(lse, torch.Tensor):
                pairs["lse:in_batch"] = (lse[sl].float(), first["lse"])
        return pairs


def _other_cases(adapter, case: Case) -> List[Case]:
    """A few claimed cases of other shapes (lengths, decode, head dim, dtype, causal) to run in between."""
    c = adapter.claims
    r0 = case.recipe
    b, hq, lq, d = case.q.shape
    hkv, lk = case.k.shape[1], case.k.shape[2]
    dev = case.device
    base = dict(batch=min(b, 2), heads_q=hq, heads_kv=hkv, head_dim=d, dtype=case.dtype, device=dev,
                seed=(case.seed + 1) % 2**31, causal="none")
    cap = min(c.max_seqlen, 2 * max(lq, lk) + 40)
    # same lengths with other head dim / dtype / no features first, other lengths last: a call of the
    # case's own shape must not be the last one before the case runs again (a one-slot cache would be fresh)
    variants = []
    for d2 in (64, 128, 32, 16, 96):
        if d2 != d and c.head_dim_ok(d2):
            variants.append(dict(len_q=lq, len_k=lk, head_dim=d2))
            break
    for dt in ("bfloat16", "float16", "float32"):
        if dt != case.dtype and dt in c.dtypes:
            variants.append(dict(len_q=lq, len_k=lk, dtype=dt))
            break
    if r0 is not None and (r0.window is not None or r0.softcap is not None or r0.alibi or r0.scale is not None):
        variants.append(dict(len_q=lq, len_k=lk))  # the same shape without this case's features
    variants += [
        dict(len_q=min(cap, lk + 17), len_k=min(cap, lq + 5)),
        dict(len_q=1, len_k=min(cap, 2 * lk + 1)),
        dict(len_q=min(cap, lq + 64), len_k=min(cap, lk + 64), causal=next((m for m in c.causal if m != "none"), "none")),
    ]
    out = []
    for kw in variants:
        r = CaseRecipe(**{**base, **kw})
        try:
            oc = build_case(r, label="other shape")
        except ValueError:
            continue
        if unclaimed(adapter, oc) is None:
            out.append(oc)
    return out


def _embed_in_batch(adapter, case: Case, extra: int, pos: int):
    """(q, k, v, spec, slice) of a bigger call that holds this case at `slice` of dim 0 (dense) or dim 2
    (a varlen pack with segments added before and after); None when it cannot be built or is unclaimed."""
    s = case.spec
    g = torch.Generator().manual_seed(int(case.seed) + 5)
    dev, dt = case.q.device, case.q.dtype
    b, hq, lq, d = case.q.shape
    hkv, lk, dv = case.k.shape[1], case.k.shape[2], case.v.shape[-1]
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dev, dt)  # noqa: E731
    extra = max(1, extra)
    pos = pos % (extra + 1)
    if s.is_varlen:
        cq = [int(x) for x in torch.as_tensor(s.cu_seqlens_q).tolist()]
        ck = [int(x) for x in torch.as_tensor(s.cu_seqlens_k).tolist()]
        segs_q = [cq[i + 1] - cq[i] for i in range(len(cq) - 1)]
        segs_k = [ck[i + 1] - ck[i] for i in range(len(ck) - 1)]
        add_q = [max(1, (lq // 2) + 3 + i) for i in range(extra)]
        add_k = [max(1, (lk // 2) + 5 + i) for i in range(extra)]
        before_q, before_k = sum(add_q[:pos]), sum(add_k[:pos])
        new_q = add_q[:pos] + segs_q + add_q[pos:]
        new_k = add_k[:pos] + segs_k + add_k[pos:]
        if max(sum(new_q), sum(new_k)) > adapter.claims.max_seqlen:
            return None
        qq = torch.cat([rnd(1, hq, before_q, d), case.q, rnd(1, hq, sum(add_q[pos:]), d)], 2)
        kk = torch.cat([rnd(1, hkv, before_k, d), case.k, rnd(1, hkv, sum(add_k[pos:]), d)], 2)
        vv = torch.cat([rnd(1, hkv, before_k, dv), case.v, rnd(1, hkv, sum(add_k[pos:]), dv)], 2)
        cuq = torch.tensor([0] + list(_cum(new_q)), dtype=torch.int32, device=s.cu_seqlens_q.device)
        cuk = torch.tensor([0] + list(_cum(new_k)), dtype=torch.int32, device=s.cu_seqlens_k.device)
        spec = s.replace(cu_seqlens_q=cuq, cu_seqlens_k=cuk, max_seqlen_q=max(new_q), max_seqlen_k=max(new_k))
        sl = (slice(None), slice(None), slice(before_q, before_q + lq))
    else:
        def grow(t, force=False):  # a per-batch tensor (mask, slopes): copies of its first entry for the extras
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != b or (t.shape[0] == 1 and not force):
                return t  # broadcast over the batch: it applies to the extras as well
            first = t[:1]
            return torch.cat([first.expand(pos, *t.shape[1:]), t, first.expand(extra - pos, *t.shape[1:])], 0)

        qs = [rnd(1, hq, lq, d) for _ in range(extra)]
        ks = [rnd(1, hkv, lk, d) for _ in range(extra)]
        vs = [rnd(1, hkv, lk, dv) for _ in range(extra)]
        qq = torch.cat(qs[:pos] + [case.q] + qs[pos:], 0)
        kk = torch.cat(ks[:pos] + [case.k] + ks[pos:], 0)
        vv = torch.cat(vs[:pos] + [case.v] + vs[pos:], 0)
        mask = s.attn_mask
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            mask = grow(mask)
        slopes = s.alibi_slopes
        if isinstance(slopes, torch.Tensor) and slopes.dim() == 2:  # (B, Hq): one row per request
            slopes = grow(slopes.expand(b, hq), force=True)
        spec = s.replace(attn_mask=mask, alibi_slopes=slopes)
        sl = slice(pos, pos + b)
    big = Case(qq, kk, vv, spec, seed=case.seed)
    if unclaimed(adapter, big) is not None:
        return None
    return qq, kk, vv, spec, sl


def _cum(xs):
    t = 0
    for x in xs:
        t += x
        yield t
