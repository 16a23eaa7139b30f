"""Split-KV properties: split_invariance, lse_merge, batch_invariance.

split_invariance  num_splits = 1 (or the least claimed) and k agree within tolerance; a deterministic adapter
                  repeats its split call bitwise
lse_merge         attention over keys K equals the LSE-weighted merge of attention over two disjoint key sets
                  K1 and K2 (natural log, the softmax scale included): pins the returned LSE's base and scale
batch_invariance  a request alone gives what it gives co-batched with requests of other lengths (bitwise for a
                  deterministic adapter)
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from hypothesis import strategies as st

from ..strategies import attention_cases
from .serving import CacheProperty, judge_pairs, run
from ._props import CaseProperty
from ._within import first_row_seeing_every_key, none_first


def _serving_kind(adapter) -> Optional[bool]:
    c = adapter.claims
    return None if (c.paged and c.kv_cache) else (True if c.paged else (False if c.kv_cache else None))


class SplitInvariance(CacheProperty):
    name = "split_invariance"
    doc = ("num_splits = 1 (the least claimed value) and num_splits = k give the same output and LSE within "
           "tolerance; a deterministic adapter repeats the split call bitwise.")
    needs = ("num_splits",)

    def skip_reason(self, adapter):
        why = super().skip_reason(adapter)
        if why is None and len(adapter.claims.num_splits) < 2:
            return f"{adapter.name} claims a single num_splits value {adapter.claims.num_splits}: nothing to compare"
        return why

    def cache_kw(self, adapter):
        return dict(paged=_serving_kind(adapter), append=False)

    def strategy(self, adapter, profile, device):
        c = adapter.claims
        if c.paged or c.kv_cache:
            return super().strategy(adapter, profile, device)
        cases = attention_cases(adapter=adapter, profile=profile, device=device, dropout=False, poison=False,
                                varlen=False)
        return st.tuples(cases, self.params(adapter)).map(lambda t: {"recipe": t[0].to_dict(), **t[1]})

    def examples(self, adapter, profile, device):
        c = adapter.claims
        if self.skip_reason(adapter) or not (c.paged or c.kv_cache):
            return []
        return super().examples(adapter, profile, device)

    def params(self, adapter):
        return st.fixed_dictionaries({"k": st.sampled_from(adapter.claims.num_splits[1:])})

    def default_params(self):
        return {}

    def judge(self, adapter, case, params):
        ns = adapter.claims.num_splits
        k = int(params.get("k", ns[-1]))
        one, split = case.spec.replace(num_splits=ns[0]), case.spec.replace(num_splits=k)

        def pairs(a, c):
            if k not in a.claims.num_splits or ns[0] not in a.claims.num_splits:
                raise ValueError(f"{a.name} does not claim num_splits {ns[0]} and {k}")
            x = run(a, c.q, c.k.clone(), c.v.clone(), one)
            y = run(a, c.q, c.k.clone(), c.v.clone(), split)
            return {f"{n}:splits={k}": (y[n], x[n]) for n in x if n in y}

        res = judge_pairs(self, adapter, case, params, pairs, sides=2)
        if res.passed and adapter.claims.deterministic:
            def again(a, c):
                x = run(a, c.q, c.k.clone(), c.v.clone(), split)
                y = run(a, c.q, c.k.clone(), c.v.clone(), split)
                return {f"{n}:splits={k} repeated": (y[n], x[n]) for n in x if n in y}

            res = judge_pairs(self, adapter, case, params, again, bitwise=True)
        return res


class LseMerge(CaseProperty):
    name = "lse_merge"
    doc = ("Attention over keys K equals the merge of attention over two disjoint key sets K1, K2 weighted by "
           "exp(LSE_i - logaddexp(LSE_1, LSE_2)), and the LSE is that logaddexp: natural log, scale included. "
           "Under causal masking (an adapter that claims only causal), the rows that see every key.")
    needs = ("lse",)
    case_kwargs = dict(dropout=False, poison=False, window=False, alibi=False, varlen=False,
                       attn_mask=False, return_lse=True, fully_masked=False)
    cost = 3.0

    def kwargs(self, adapter):
        return {**self.case_kwargs, "causal": none_first(adapter)}

    def skip_reason(self, adapter):
        if adapter.claims.max_seqlen < 2:
            return f"{adapter.name} claims max_seqlen={adapter.claims.max_seqlen}: one key cannot be split in two sets"
        return super().skip_reason(adapter)

    def keep(self, r):  # a causal case must have a row that sees every key, in the full call and in both halves
        return r.len_k >= 2 and first_row_seeing_every_key(r.len_q, r.len_k, r.causal) is not None

    def adapt(self, adapter, r):
        if r.causal not in none_first(adapter) or r.window is not None or r.alibi or r.seqlens_q is not None \
                or r.mask != "none" or r.key_block is not None or not self.keep(r):
            return None
        return dataclasses.replace(r, return_lse=True)

    def params(self, adapter):
        return st.fixed_dictionaries({"cut_seed": st.integers(0, 2**16)})

    def default_params(self):
        return {"cut_seed": 1}

    @staticmethod
    def _cut(lk: int, params) -> tuple:
        """(a permutation of the keys, n1): K1 is its first n1 keys, K2 the rest."""
        g = torch.Generator().manual_seed(int(params.get("cut_seed", 0)))
        perm = torch.randperm(lk, generator=g)
        return perm, 1 + int(torch.randint(0, lk - 1, (1,), generator=g))

    def derived_recipes(self, r, params):
        """The calls on K1 and K2: the case with n1 and Lk - n1 keys (attribution_calls)."""
        n1 = self._cut(r.len_k, params)[1]
        return [("K1", dataclasses.replace(r, len_k=n1)), ("K2", dataclasses.replace(r, len_k=r.len_k - n1))]

    def judge(self, adapter, case, params):
        lk = case.k.shape[2]
        perm, n1 = self._cut(lk, params)
        i1, i2 = perm[:n1].sort().values.to(case.k.device), perm[n1:].sort().values.to(case.k.device)
        spec = case.spec.replace(return_lse=True)
        # a row that sees every key of the full call sees every key of a subset call too (top-left: i >= Lk - 1
        # >= Lk' - 1; bottom-right: only the last row, which sees every key of any call)
        r0 = first_row_seeing_every_key(case.q.shape[2], lk, spec.causal) or 0

        def pairs(a, c):
            full = run(a, c.q, c.k, c.v, spec)
            p1 = run(a, c.q, c.k[:, :, i1], c.v[:, :, i1], spec)
            p2 = run(a, c.q, c.k[:, :, i2], c.v[:, :, i2], spec)
            if not all("lse" in p for p in (full, p1, p2)):
                return {"lse": (None, torch.zeros(1))}
            l1, l2 = p1["lse"].double().cpu(), p2["lse"].double().cpu()
            lse = torch.logaddexp(l1, l2)
            w1, w2 = torch.exp(l1 - lse).unsqueeze(-1), torch.exp(l2 - lse).unsqueeze(-1)
            merged = w1 * p1["out"].double().cpu() + w2 * p2["out"].double().cpu()
            return {"out": (full["out"][:, :, r0:], merged[:, :, r0:]), "lse": (full["lse"][:, :, r0:], lse[:, :, r0:])}

        extra = {"K1 size": n1, "K2 size": lk - n1, **({"rows judged from": r0} if r0 else {})}
        return judge_pairs(self, adapter, case, {**params, **extra}, pairs, sides=2)


class BatchInvariance(CacheProperty):
    name = "batch_invariance"
    doc = ("A request's output and LSE are the same alone and co-batched with requests of other lengths, at the "
           "same num_splits (bitwise for a deterministic adapter).")
    needs = ()

    def skip_reason(self, adapter):
        c = adapter.claims
        if not (c.paged or c.kv_cache):
            return f"{adapter.name} does not claim paged or kv_cache (no batch of requests of different lengths)"
        return super().skip_reason(adapter)

    def cache_kw(self, adapter):
        return dict(paged=_serving_kind(adapter), append=False, min_batch=2, distinct_lengths=True,
                    num_splits="draw" if adapter.claims.num_splits else None)

    def keep(self, r):
        return r.batch >= 2 and len(set(r.cache_lens)) > 1

    def params(self, adapter):
        return st.fixed_dictionaries({"pick": st.integers(0, 2**16)})

    def default_params(self):
        return {"pick": 1}

    def judge(self, adapter, case, params):
        s = case.spec
        b = int(params.get("pick", 0)) % case.q.shape[0]
        one = slice(b, b + 1)
        slopes = s.alibi_slopes[one] if isinstance(s.alibi_slopes, torch.Tensor) and s.alibi_slopes.dim() == 2 \
            else s.alibi_slopes
        alone = s.replace(cache_seqlens=s.cache_seqlens[one], alibi_slopes=slopes,
                          block_table=None if s.block_table is None else s.block_table[one],
                          cache_batch_idx=None if s.cache_batch_idx is None else s.cache_batch_idx[one],
                          cache_leftpad=None if s.cache_leftpad is None else s.cache_leftpad[one])
        if s.block_table is None and s.cache_batch_idx is None:  # batch b's row of a contiguous cache
            alone = alone.replace(cache_batch_idx=torch.tensor([b], dtype=torch.int32, device=case.q.device))

        def pairs(a, c):
            full = run(a, c.q, c.k.clone(), c.v.clone(), s)
            part = run(a, c.q[one], c.k.clone(), c.v.clone(), alone)
            return {f"{n}[request {b}]": (part[n], full[n][one]) for n in full if n in part}

        params = {**params, "request": b}
        if adapter.claims.deterministic:
            return judge_pairs(self, adapter, case, params, pairs, bitwise=True)
        return judge_pairs(self, adapter, case, params, pairs, sides=2)


SPLIT_PROPERTIES = [SplitInvariance(), LseMerge(), BatchInvariance()]
