"""Properties of learnable attention sinks (Spec.sinks) and chunked local attention (Spec.attention_chunk).

    sinks_match_reference     out, LSE, dQ/dK/dV and the sink's gradient against the float64 reference
    sink_as_extra_key         a sink equals one more key with that score and a zero value row
    sink_limits               sinks of -inf equal no sink; a row with no visible key gives 0 and LSE = sink (under
                              sink_in_lse=False the LSE of a keyless row, the adapter's keyless convention)
    sinks_paged               a paged-KV call with sinks against the reference over the gathered keys
    chunked_matches_reference chunked local attention (with causal, window, varlen where claimed)

Where the reference's LSE of a sink case meets an adapter's, it is taken in the adapter's declared convention
(lse_conventions: sink_in_lse, keyless_lse); the output keeps the sink in its denominator either way.

Sinks are drawn beside the recipe as plain data ({"sinks": {"kind", "level", "seed"}}), so a drawn example
replays: normal logits, large ones dominating every row, -inf, and a mix per head.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from hypothesis import strategies as st

from ..case import Case
from ..check import check, unclaimed, unpack_output
from ..compare import compare, error_stats
from ..reference import reference_forward
from ..sink_logits import SINK_KINDS, for_adapter, make_sinks
from ..magnitudes import magnitudes
from ..tolerances import floors_of, tolerance_for
from ..lse_conventions import expected_grads, expected_lse, sink_excluded
from ._props import CaseProperty, _result_from_check
from .base import ExampleResult
from ._within import ensure_claimed
from .serving import CacheProperty, judge_pairs, run

def sink_params():
    """A strategy of the JSON-able sink description drawn beside a recipe."""
    return st.fixed_dictionaries({
        "kind": st.sampled_from(SINK_KINDS),
        "level": st.sampled_from([0.5, 2.0, 8.0, 30.0]),
        "seed": st.integers(0, 2**16),
    }).map(lambda d: {"sinks": d})


def with_spec(case: Case, **changes) -> Case:
    return Case(case.q, case.k, case.v, case.spec.replace(**changes), seed=case.seed, recipe=case.recipe,
                label=case.label)


def with_chunk(case: Case, chunk: int) -> Case:
    """The case with attention_chunk = chunk, in its spec and in its recipe (a saved case replays with it)."""
    out = with_spec(case, attention_chunk=chunk)
    if case.recipe is not None and case.recipe.cache_lens is None:
        out.recipe = dataclasses.replace(case.recipe, attention_chunk=chunk)
    return out


def sinks_joined(adapter, case: Case, params: dict) -> Case:
    """with_sinks, then the adapter's `refuses` asked again: the sinks join a case drawn without them (an adapter may
    refuse sinks with soft-capping, say); a refused one raises Refused and the example is skipped with its reason."""
    # as the adapter takes them (sink_dtype="input": representable in the input dtype); kept in the drawn parameters,
    # so the journal, the repro and the attribution's neighbour calls rebuild the same logits
    params["sinks"] = for_adapter(adapter, case.dtype, params["sinks"])
    out = with_sinks(case, params)
    ensure_claimed(adapter, out.q, out.k, out.v, out.spec)
    return out


def with_sinks(case: Case, params: dict) -> Case:
    """The case with the drawn sinks, in its spec and in its recipe (so the saved case replays with them)."""
    out = with_spec(case, sinks=make_sinks(case.q.shape[1], params["sinks"], case.q.device))
    if case.recipe is not None and case.recipe.cache_lens is None:
        out.recipe = dataclasses.replace(case.recipe, sinks=dict(params["sinks"]))
    return out


CHUNKS = (1, 2, 3, 4, 7, 8, 16, 64)


class SinkProperty(CaseProperty):
    """Draws sinks beside the recipe; the LSE is always asked for where claimed (LSE = sink is half the contract)."""

    needs = ("sinks",)

    def kwargs(self, adapter):
        return dict(self.case_kwargs, return_lse=bool(adapter.claims.lse))

    def adapt(self, adapter, r):
        return dataclasses.replace(r, return_lse=bool(adapter.claims.lse))

    def params(self, adapter):
        return sink_params()

    def default_params(self):
        return {"sinks": {"kind": "mixed", "level": 2.0, "seed": 0}}


def sink_gradient(adapter, case: Case, with_terms: bool = False) -> Optional[dict]:
    """{"dsinks": (got, expected float64)} for one backward through the sinks, or {"dsinks": (None, exp)}; with
    `with_terms`, also "terms": the size of what dsinks sums (sink_gradient_terms)."""
    s = case.spec
    sinks = s.sinks.detach().clone().requires_grad_(True)
    gen = torch.Generator().manual_seed(int(case.seed) + 23)
    q, k, v = (t.detach() for t in (case.q, case.k, case.v))
    out, lse, _ = unpack_output(adapter(q, k, v, s.replace(sinks=sinks)))
    d_out = torch.randn(out.shape, generator=gen, dtype=torch.float32).to(out.device)
    ref = reference_forward(q, k, v, s)
    ref_lse = expected_lse(adapter.claims, q, k, v, s, ref.lse)  # the LSE the adapter declares (sink_in_lse)
    d_lse = None
    loss = (out.float() * d_out).sum()
    if isinstance(lse, torch.Tensor) and s.return_lse:
        d_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float32).to(out.device)
        d_lse = torch.where(torch.isfinite(ref_lse.to(d_lse.device)), d_lse, torch.zeros_like(d_lse))
        loss = loss + (torch.where(torch.isfinite(lse.float()), lse.float(), torch.zeros_like(lse.float())) * d_lse).sum()
    got = torch.autograd.grad(loss, sinks, allow_unused=True)[0] if loss.requires_grad else None
    # under sink_in_lse=False no gradient reaches the sinks through the LSE, only through the output
    exp = expected_grads(adapter.claims, q, k, v, s, d_out.double(), None if d_lse is None else d_lse.double()).dsinks
    res = {"dsinks": (None if got is None else got.detach(), exp)}
    if with_terms:
        res["terms"] = sink_gradient_terms(ref, s.sinks, d_out, None if sink_excluded(adapter.claims, s) else d_lse)
    return res


def sink_gradient_terms(ref, sinks, d_out, d_lse) -> float:
    """The size of what a sink's gradient sums, per head, largest over heads: sum_i P_sink,i (|dLSE_i| + sum_d |dO_id
    out_id|) (float64, from the reference). dsinks = sum_i P_sink,i (dLSE_i - dO_i . out_i) cancels: with one key and a
    sink of 0.13 it is 0.0078 out of terms near 1, and a correct float32 kernel errs by 2e-6 of it (H200, 2026-12-05);
    the bound is taken at the scale of the terms, as dQ's is (check's magnitudes)."""
    lse = ref.lse.double()
    p_sink = torch.exp(sinks.detach().double().to(lse.device)[None, :, None] - lse)
    p_sink = torch.where(torch.isfinite(lse), p_sink, torch.zeros_like(p_sink))  # a row without keys or sink: none
    dot = (d_out.double().to(lse.device).abs() * ref.out.double().abs()).sum(-1)
    t = dot if d_lse is None else dot + d_lse.double().to(lse.device).abs()
    per_head = torch.nan_to_num(p_sink * t, nan=0.0, posinf=0.0).sum(dim=(0, 2))
    return float(per_head.max()) if per_head.numel() else 0.0


class SinksMatchReference(SinkProperty):
    name = "sinks_match_reference"
    doc = ("With per-head sinks (the gpt-oss denominator, docs/adapters.md), the output, LSE and dQ/dK/dV match the "
           "float64 reference, and with backward the sink's gradient matches the reference's dsinks; chunked local "
           "attention is drawn with the sinks where claimed.")
    case_kwargs = dict(dropout=False, poison=False)

    def params(self, adapter):
        if not adapter.claims.attention_chunk:
            return sink_params()
        chunks = st.one_of(st.none(), st.sampled_from(CHUNKS))
        return st.tuples(sink_params(), chunks).map(lambda t: {**t[0], "attention_chunk": t[1]})

    def judge(self, adapter, case, params):
        if params.get("attention_chunk"):
            case = with_chunk(case, int(params["attention_chunk"]))
        case = sinks_joined(adapter, case, params)
        res = _result_from_check(check(adapter, case, backward=adapter.claims.backward), case)
        if not res.passed or not adapter.claims.backward:
            return res
        return judge_dsinks(self, adapter, case, params)


def judge_dsinks(prop, adapter, case, params) -> ExampleResult:
    """The sink's gradient against the reference; the bound is widened by what naive gives on the same call."""
    from ..adapters.naive import naive

    g = sink_gradient(adapter, case, with_terms=True)
    got, exp = g["dsinks"]
    base = None
    # the baseline in the adapter's convention: under sink_in_lse=False no dLSE reaches the sinks, so naive's dsinks
    # is taken without its LSE term too (else a dsinks of ~1e-53, a row shifted far below its sink, is judged against
    # naive's O(1) one, which float32 represents)
    bcase = with_spec(case, return_lse=False) if sink_excluded(adapter.claims, case.spec) else case
    if case.dtype in naive.claims.dtypes and unclaimed(naive, bcase) is None:
        base = error_stats(*sink_gradient(naive, bcase)["dsinks"])
    scale = max(float(exp.abs().max()) if exp.numel() else 0.0, g["terms"])
    tol = tolerance_for("dq", case.dtype, baseline_rel_l2=base[0] if base else None,
                        baseline_max_abs=base[1] if base else None,
                        **{**floors_of(magnitudes(case), "dsinks"), "scale_floor": scale})  # ftz: a sink far below
    if got is None:
        msg = f"[{adapter.name}] {prop.name} FAILED: {case.describe()}\ndsinks: no gradient reached the sinks, " \
              f"although {adapter.name} claims backward and sinks (a sink logit has gradient sum_i P_sink,i (dLSE_i - D_i))"
        return ExampleResult(False, msg, severity=1e30, case=case.to_dict())
    c = compare("dsinks", got.detach().double().cpu(), exp.cpu(), tol)
    if c.passed:
        return ExampleResult(True, records=[c.to_dict()], case=case.to_dict())
    return ExampleResult(False, "\n".join([f"[{adapter.name}] {prop.name} FAILED: {case.describe()}", prop.doc,
                                           c.message(), f"parameters: {params}"]),
                         severity=min(c.rel_l2 / c.tol_norm if c.tol_norm > 0 else 1e30, 1e30),
                         records=[c.to_dict()], case=case.to_dict())


def extra_key_case(case: Case) -> Case:
    """The same call without sinks: one more key (score 0 from a zero key, plus the sink through a float mask)
    over a zero value row; the positional visibility of the original call moves into the mask."""
    from .. import visibility

    s = case.spec
    b, hq, lq, _ = case.q.shape
    lk = case.k.shape[2]
    zk = case.k.new_zeros(*case.k.shape[:2], 1, case.k.shape[3])
    zv = case.v.new_zeros(*case.v.shape[:2], 1, case.v.shape[3])
    vis = visibility.positional_visibility(lq, lk, s.causal, s.window, case.q.device, chunk=s.attention_chunk)
    mask = torch.zeros(1, hq, lq, lk + 1, dtype=torch.float32, device=case.q.device)
    if vis is not None:
        mask[..., :lk] = torch.where(vis, 0.0, -math.inf)
    mask[..., lk] = s.sinks.to(mask.device).float()[:, None]
    spec = s.replace(sinks=None, causal="none", window=None, attention_chunk=None, attn_mask=mask,
                     scale=s.resolved_scale(case.q.shape[-1]))
    return Case(case.q, torch.cat([case.k, zk], dim=2), torch.cat([case.v, zv], dim=2), spec, seed=case.seed)


class SinkAsExtraKey(SinkProperty):
    name = "sink_as_extra_key"
    doc = ("A sink equals one more key whose score is the sink (a zero key plus the sink in a float mask) and whose "
           "value row is zero; compared with the adapter's own extra-key call where it claims one, else the reference's.")
    case_kwargs = dict(dropout=False, poison=False, varlen=False, alibi=False, attn_mask=False)

    def keep(self, r):  # the extra key moves causal/window into a float mask: no varlen, masks, ALiBi, dropout
        return r.seqlens_q is None and r.mask == "none" and r.key_block is None and not r.masked_rows \
            and not r.alibi and not r.dropout_p and not r.poison

    def judge(self, adapter, case, params):
        case = sinks_joined(adapter, case, params)

        sides = {}  # the adapter's own pairs: both values rounded

        def pairs(a, c):
            got = run(a, c.q, c.k, c.v, c.spec)
            ext = extra_key_case(c)
            own = unclaimed(a, ext) is None
            if own:
                exp = run(a, ext.q, ext.k, ext.v, ext.spec)
            else:
                r = reference_forward(ext.q, ext.k, ext.v, ext.spec)
                exp = {"out": r.out, "lse": r.lse}
            if own and a is adapter:
                sides.update({n: 2 for n in exp})
            if "lse" in exp and (not own or sink_excluded(a.claims, c.spec)):
                # the reference's LSE in the adapter's convention; under sink_in_lse=False the returned LSE leaves the
                # sink out while the extra key's has it as a key: only the output is the identity, the LSE is held to
                # the reference's over the visible keys (lse_conventions.expected_lse computes it then)
                exp["lse"] = expected_lse(a.claims, c.q, c.k, c.v, c.spec, exp["lse"])
                sides.pop("lse", None)
            return {n: (got[n], exp[n].double().cpu()) for n in got if n in exp}

        return judge_pairs(self, adapter, case, params, pairs, sides=sides)


class SinkLimits(SinkProperty):
    name = "sink_limits"
    doc = ("Sinks of -inf give what no sink gives; a row with no visible key returns 0 and LSE = its head's sink "
           "(under sink_in_lse=False the LSE a keyless row has in the declared convention: -inf, +inf by keyless_lse, "
           "NaN by fully_masked='nan'; not judged under 'unsupported').")
    case_kwargs = dict(dropout=False, poison=False)

    def judge(self, adapter, case, params):
        case = sinks_joined(adapter, case, params)
        problems = []
        sides = {}

        def pairs(a, c):
            off = with_spec(c, sinks=torch.full_like(c.spec.sinks, -math.inf))
            got_off = run(a, off.q, off.k, off.v, off.spec)
            plain = with_spec(c, sinks=None)
            own = unclaimed(a, plain) is None
            exp_off = run(a, plain.q, plain.k, plain.v, plain.spec) if own else \
                {"out": reference_forward(plain.q, plain.k, plain.v, plain.spec).out}
            if own and a is adapter:
                sides["out[sinks=-inf]"] = 2  # the adapter's own call without sinks: both values rounded
            out = {"out[sinks=-inf]": (got_off["out"], exp_off["out"].double().cpu())}
            ref_plain = reference_forward(plain.q, plain.k, plain.v, plain.spec)
            empty = torch.isneginf(ref_plain.lse).cpu()  # rows without a visible key (B, Hq, Lq); judged on the CPU
            # a head whose sink is -inf has no sink: its keyless rows are plain fully-masked rows, which follow the
            # adapter's fully_masked convention (NaN allowed), judged by fully_masked_rows, not here
            empty &= torch.isfinite(c.spec.sinks.detach().cpu())[None, :, None]
            if c.spec.is_varlen:  # rows past the last segment belong to no sequence: not judged
                last = int(torch.as_tensor(c.spec.cu_seqlens_q)[-1])
                empty[:, :, last:] = False
            if bool(empty.any()):
                got = run(a, c.q, c.k, c.v, c.spec)
                got_out = got["out"].cpu()
                out["out[no visible key]"] = (got_out[empty], torch.zeros_like(got_out[empty], dtype=torch.float64))
                if "lse" in got and not sink_excluded(a.claims, c.spec):
                    sink = c.spec.sinks.double().cpu()[None, :, None].expand_as(empty)
                    out["lse[no visible key]"] = (got["lse"].cpu()[empty], sink[empty])
                elif "lse" in got and a.claims.fully_masked != "unsupported":
                    # the LSE leaves the sink out (sink_in_lse=False): LSE = sink does not hold; what does is the
                    # keyless row's LSE of the declared convention, the output 0 above unchanged
                    exp = expected_lse(a.claims, c.q, c.k, c.v, c.spec, None).cpu()
                    out["lse[no visible key, sink left out]"] = (got["lse"].cpu()[empty], exp[empty])
            return out

        return judge_pairs(self, adapter, case, params, pairs, problems, sides=sides)


class SinksPaged(CacheProperty):
    name = "sinks_paged"
    doc = "A paged-KV call with sinks matches the float64 reference over each batch's gathered keys."
    needs = ("sinks", "paged")
    cache_kwargs = dict(paged=True, append=False)

    def params(self, adapter):
        return sink_params()

    def default_params(self):
        return {"sinks": {"kind": "mixed", "level": 2.0, "seed": 0}}

    def judge(self, adapter, case, params):
        case = sinks_joined(adapter, case, params)
        ref = reference_forward(case.q, case.k, case.v, case.spec)

        def pairs(a, c):
            got = run(a, c.q, c.k, c.v, c.spec)
            res = {"out": (got["out"], ref.out)}
            if "lse" in got:
                res["lse"] = (got["lse"], expected_lse(a.claims, c.q, c.k, c.v, c.spec, ref.lse))
            return res

        return judge_pairs(self, adapter, case, params, pairs)


class ChunkedMatchesReference(CaseProperty):
    name = "chunked_matches_reference"
    doc = ("With attention_chunk = C a query at position p (bottom-right aligned) sees only keys j with j // C == p // C "
           "(causal and window inside, per varlen segment); out, LSE and gradients match the float64 reference.")
    needs = ("attention_chunk",)
    case_kwargs = dict(dropout=False, poison=False)

    def params(self, adapter):
        return st.fixed_dictionaries({"attention_chunk": st.sampled_from(CHUNKS)})

    def default_params(self):
        return {"attention_chunk": 4}

    def judge(self, adapter, case, params):
        case = with_chunk(case, int(params["attention_chunk"]))
        # the chunk is added to a drawn case: an adapter may refuse that combination (transformers' chunked mask
        # comes with causal): the example is skipped, saying why, instead of sending an unclaimed call
        ensure_claimed(adapter, case.q, case.k, case.v, case.spec)
        return _result_from_check(check(adapter, case, backward=adapter.claims.backward), case)


SINK_PROPERTIES = [SinksMatchReference(), SinkAsExtraKey(), SinkLimits(), SinksPaged(), ChunkedMatchesReference()]

__all__ = ["SINK_PROPERTIES", "make_sinks", "sink_params", "extra_key_case", "sink_gradient"]
