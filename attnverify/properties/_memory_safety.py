"""Memory-safety properties: outputs fully written, no out-of-bounds reads or writes (and no varlen
leaks), inputs unmodified through forward and backward."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch
from hypothesis import strategies as st

from ..check import bitwise_equal, check, unclaimed, unpack_output
from ..magnitudes import magnitudes, score_bound
from ..compare import compare, error_stats
from ..reference import reference_forward
from ..tolerances import floors_of, tolerance_for
from ..verdicts import severity
from . import _props
from ._props import CaseProperty
from .base import ExampleResult, device_fault
from ._guards import (
    Guards, Poisoner, _accepts_out, _digest, _from_check, _guarded, _in_guards, _on_backward, _output_nbytes, _proxy,
    _refused, _rewrap, _sentinel_fill, _sync_faults, _unwritten_rows, _with_problems, structure_problems,
)

# ======================================================================================= properties


class OutputsFullyWritten(CaseProperty):
    name = "outputs_fully_written"
    doc = ("Every output element is written: the allocator is poisoned (NaN) right before the call and "
           "before backward, and NaN-filled guarded `out=` buffers are passed where the adapter takes one; "
           "shape, dtype, device and layout of out, LSE, dropout mask and gradients are as specified, "
           "with no self-overlap and no aliasing of the inputs.")
    case_kwargs = dict(dropout=False, poison=False)

    def judge(self, adapter, case, params):
        claims = adapter.claims
        bwd = claims.backward
        poison = Poisoner(case.q.device, _output_nbytes(case))
        seen: Dict[str, Any] = {}
        out_probs: List[str] = []
        takes_out = _accepts_out(adapter)

        def fn(q, k, v, spec):
            seen["inputs"] = (q, k, v)
            poison()
            if takes_out:
                b, hq, lq, _ = q.shape
                g = Guards("flat", pad_rows=4)
                buf = g.wrap("the out= buffer", torch.full((b, hq, lq, v.shape[-1]), math.nan, dtype=q.dtype,
                                                           device=q.device))
                result = adapter.fn(q, k, v, spec, out=buf)
                o = unpack_output(result)[0]
                out_probs.extend(g.verify())
                if isinstance(o, torch.Tensor) and o.data_ptr() != buf.data_ptr():
                    if not bitwise_equal(o.detach(), buf.detach()):
                        out_probs.append("the returned output differs from the out= buffer it was given "
                                         "(the buffer was not, or not fully, written)")
            else:
                result = adapter.fn(q, k, v, spec)
            seen["result"] = result
            return _rewrap(result, _on_backward(unpack_output(result)[0], poison))

        res = check(_proxy(adapter, fn), case, backward=bwd)
        out = _from_check(res, case)
        problems = list(out_probs)
        if "result" in seen:
            q, k, v = seen["inputs"]
            problems += structure_problems(adapter, case, seen["result"], q, k, v)
            for n, t in (("dq", q), ("dk", k), ("dv", v)):
                g = res.outputs.get(n)
                if isinstance(g, torch.Tensor):
                    if tuple(g.shape) != tuple(t.shape) or g.dtype != t.dtype or g.device != t.device:
                        problems.append(f"{n}: {tuple(g.shape)} {g.dtype} on {g.device}; expected "
                                        f"{tuple(t.shape)} {t.dtype} on {t.device}")
            if not res.passed and "out" in res.reference:
                n_rows = _unwritten_rows(res.outputs.get("out"), res.reference["out"], res.reference.get("lse"),
                                         claims.fully_masked)
                if n_rows:
                    problems.append(f"{n_rows} output row(s) hold NaN where the reference is finite: "
                                    f"unwritten memory (the allocator was poisoned with NaN before the call)")
        return _with_problems(out, problems, f"[{adapter.name}] outputs not fully or properly written: "
                                             f"{case.describe()}")


class NoOutOfBounds(CaseProperty):
    name = "no_out_of_bounds"
    doc = ("No out-of-bounds reads or writes: q, k, v (and dO in backward) are views into larger buffers "
           "whose surroundings hold NaN and huge values, a tile past the end and padding past the head dim; "
           "the result must still match the reference and the surroundings must be unchanged; in a varlen "
           "pack, NaN/huge keys and values of one segment must not reach any other segment's rows. Views one "
           "element into a buffer (not 16-byte aligned) must be used or refused with an error, never fault.")
    case_kwargs = dict(dropout=False, poison=False, layouts=("contiguous",))

    def params(self, adapter):
        return st.fixed_dictionaries({"mode": st.sampled_from(("padded", "flat", "unaligned")),
                                      "pick": st.integers(0, 2**16)})

    def default_params(self):
        return {"mode": "padded", "pick": 1}

    def _pad_rows(self, adapter) -> int:
        t = adapter.claims.tiles
        return max(16, max(t)) if t else 128

    def judge(self, adapter, case, params):
        claims = adapter.claims
        mode = params.get("mode", "padded")
        # what the adapter declares (refuses=) about such views: padded ones fall back to flat, and an
        # adapter may declare that it takes no unaligned pointer
        why = unclaimed(adapter, _in_guards(case, mode)) if mode in ("padded", "unaligned") else None
        if why is not None and mode == "padded":
            mode = "flat"
        elif why is not None:
            return _refused(adapter, case, f"declares it refuses unaligned inputs: {why}")
        guards = Guards(mode, pad_rows=self._pad_rows(adapter))

        def dout_guard(g):
            return guards.wrap("dO (the upstream gradient)", g)

        def fn(q, k, v, spec):
            qg, kg, vg = _guarded(q, guards, "q"), _guarded(k, guards, "k"), _guarded(v, guards, "v")
            result = adapter.fn(qg, kg, vg, spec)
            return _rewrap(result, _on_backward(unpack_output(result)[0], dout_guard))

        res = check(_proxy(adapter, fn), case, backward=claims.backward)
        faulted = False
        if mode == "unaligned":
            # refusing a pointer it cannot use (in forward or in backward) is the adapter's right; faulting
            # on it is not. An asynchronous fault may surface only at the next synchronisation.
            raised = [res.error or ""] if res.status == "error" else []
            raised += [p for c in res.comparisons for p in c.problems if "backward raised" in p]
            faulted = any(device_fault(t) for t in raised) or _sync_faults(case.q.device)
            refused = bool(raised) and all(c.passed or any("backward raised" in p for p in c.problems)
                                           for c in res.comparisons)
            if refused and not faulted:
                return _refused(adapter, case, "refused unaligned inputs: " + raised[0][-300:])
        out = _from_check(res, case)
        problems = guards.verify()
        if faulted:
            problems.append("the device faulted on inputs whose data pointer is not 16-byte aligned (one element "
                            "into a buffer): such tensors are valid; use them or refuse them with an error")
        header = f"[{adapter.name}] out-of-bounds access ({mode} guards): {case.describe()}"
        if not res.passed and res.status != "error" and not faulted:
            problems.append("the result differs from the reference while the inputs sat between sentinels "
                            "(NaN, +-huge): a read outside the given tensors is the likely cause, unless "
                            "forward_matches_reference fails on this case too")
        out = _with_problems(out, problems, header)
        if case.spec.is_varlen and out.passed:
            vres = self._varlen_leak(adapter, case, int(params.get("pick", 0)))
            if vres is not None and not vres.passed:
                return vres
        return out

    def _varlen_leak(self, adapter, case, pick) -> Optional[ExampleResult]:
        """Sentinels (NaN, +-huge) in segment j's keys, then in its values, must not reach the rows of any
        other segment (a varlen kernel must not read across a segment's end)."""
        from ..adapters.naive import naive_attention

        s = case.spec
        cq = [int(x) for x in torch.as_tensor(s.cu_seqlens_q).tolist()]
        ck = [int(x) for x in torch.as_tensor(s.cu_seqlens_k).tolist()]
        segs = [i for i in range(len(cq) - 1) if ck[i + 1] > ck[i]]
        if len(cq) < 3 or not segs:
            return None
        j = segs[pick % len(segs)]
        if not [i for i in range(len(cq) - 1) if i != j and cq[i + 1] > cq[i]]:
            return None
        ref = reference_forward(case.q, case.k, case.v, s)
        ign = torch.zeros(ref.out.shape[:3] + (1,), dtype=torch.bool)
        ign[:, :, cq[j]:cq[j + 1]] = True
        if adapter.claims.fully_masked != "zeros":
            ign |= torch.isneginf(ref.lse).unsqueeze(-1).cpu()
        with torch.no_grad():
            base = naive_attention(case.q, case.k, case.v, s).out
        brel, babs = error_stats(base.double().cpu().masked_fill(ign, 0.0), ref.out.cpu().masked_fill(ign, 0.0))
        mags = magnitudes(case)
        tol = tolerance_for("out", case.dtype, baseline_rel_l2=brel, baseline_max_abs=babs,
                            score_max=score_bound(case, ref.lse), **floors_of(mags, "out"))
        # judged against the adapter's own answer without sentinels: a leak is a change, and how
        # accurate that answer is belongs to forward_matches_reference (an accuracy edge had failed here)
        with torch.no_grad():
            clean, _, _ = unpack_output(adapter(case.q, case.k, case.v, s))
        if isinstance(clean, torch.Tensor) and tuple(clean.shape) == tuple(ref.out.shape):
            expected = clean.detach().double()
        else:
            expected = ref.out
        leaks, recs, sev = [], [], 0.0
        for which in ("k", "v"):
            k2, v2 = case.k.clone(), case.v.clone()
            seg = (k2 if which == "k" else v2)[:, :, ck[j]:ck[j + 1]]
            tmp = torch.empty(seg.numel(), dtype=seg.dtype, device=seg.device)
            _sentinel_fill(tmp)
            seg.copy_(tmp.view(seg.shape))
            with torch.no_grad():
                got, _, _ = unpack_output(adapter(case.q, k2, v2, s))
            c = compare("out", got, expected, tol, ignore=ign.to(expected.device))
            c.name = f"out (sentinels in {which} of segment {j})"
            recs.append(c.to_dict())
            if not c.passed:
                how = ("keys: a score outside the segment was not masked" if which == "k" else
                       "values: rows outside the segment were read and multiplied by zero probabilities "
                       "(0 x NaN = NaN) instead of not being read")
                leaks.append(f"sentinels in the {how}\n{c.message()}")
                sev = max(sev, severity([c]))
        if not leaks:
            return None
        msg = "\n".join([f"[{adapter.name}] varlen segment leak: NaN/huge entries in segment {j} (keys {ck[j]}.."
                         f"{ck[j + 1] - 1}) changed rows of other segments: {case.describe()}"] + leaks)
        return ExampleResult(False, msg, severity=max(sev, 10.0),
                             records=[{"adapter": adapter.name, "status": "failed", "comparisons": recs}],
                             case=case.to_dict())


class InputsUnmodified(_props.InputsUnmodified):
    """Extends the base property: hashes after forward AND after backward, and also guards the upstream
    gradient dO and the returned out/LSE against a backward that writes into them."""

    doc = ("The adapter leaves q, k, v, the mask, ALiBi slopes and cu_seqlens untouched (values, strides, offset) "
           "through forward and through backward (hashed before, after forward, after backward); backward also "
           "leaves the upstream gradient dO and the forward's out and LSE untouched.")

    def judge(self, adapter, case, params):
        s = case.spec
        named = {"q": case.q, "k": case.k, "v": case.v, "attn_mask": s.attn_mask, "alibi_slopes": s.alibi_slopes,
                 "cu_seqlens_q": s.cu_seqlens_q, "cu_seqlens_k": s.cu_seqlens_k}
        named = {n: t for n, t in named.items() if isinstance(t, torch.Tensor)}
        before = {n: _digest(t) for n, t in named.items()}
        bwd = adapter.claims.backward
        q, k, v = case.q, case.k, case.v
        if bwd:  # leaves that share the case's storage, so an in-place write is seen
            q, k, v = (t.detach().requires_grad_(True) for t in (case.q, case.k, case.v))
        live = {**named, "q": q, "k": k, "v": v}
        bad = []
        with torch.enable_grad() if bwd else torch.no_grad():
            out, lse, _ = unpack_output(adapter(q, k, v, s))
        for n, t in live.items():
            if _digest(t) != before[n]:
                bad.append(f"{n} was modified by forward ({_what_changed(named[n], t)})")
        if bwd and isinstance(out, torch.Tensor) and out.requires_grad:
            g = torch.Generator().manual_seed(int(case.seed) + 11)
            d_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype)
            roots, grads = [out], [d_out]
            if isinstance(lse, torch.Tensor) and lse.requires_grad:
                d_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.device, lse.dtype)
                roots.append(lse)
                grads.append(d_lse)
            watch = {"dO (upstream gradient)": d_out, "out (forward's result)": out}
            if isinstance(lse, torch.Tensor):
                watch["lse (forward's result)"] = lse
            if len(grads) > 1:
                watch["dLSE (upstream gradient)"] = grads[1]
            mid = {n: _digest(t) for n, t in {**live, **watch}.items()}
            torch.autograd.grad(roots, [q, k, v], grads, allow_unused=True)
            for n, t in {**live, **watch}.items():
                if _digest(t) != mid[n]:
                    bad.append(f"{n} was modified by backward")
        msg = "" if not bad else "\n".join([f"[{adapter.name}] modified its inputs: {case.describe()}"] + bad)
        return ExampleResult(not bad, msg, severity=10.0 if bad else 0.0, case=case.to_dict())


def _what_changed(a: torch.Tensor, b: torch.Tensor) -> str:
    a, b = a.detach(), b.detach()
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} -> {tuple(b.shape)}"
    if a.stride() != b.stride() or a.storage_offset() != b.storage_offset():
        return "strides/offset changed"
    return "values changed"
