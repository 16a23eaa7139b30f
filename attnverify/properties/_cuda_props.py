"""CUDA-only properties: inputs produced on a non-default stream, CUDA graph capture and replay."""
from __future__ import annotations

import dataclasses
import math

import torch

from ..case import Case, build_case
from ..check import check, unpack_output
from ..spec import Output
from ._props import CaseProperty
from ._guards import _cuda_reason, _from_check, _on_backward, _proxy, _rewrap, _skipped

# ------------------------------------------------------------------------------------ CUDA-only


class NonDefaultStream(CaseProperty):
    name = "non_default_stream"
    doc = ("Correct on a non-default (non-blocking) stream: the inputs and the upstream gradient are produced on a "
           "side stream behind a ~50 ms GPU sleep, so a kernel that launches on the default stream instead of the "
           "current one reads them before they exist.")
    case_kwargs = dict(dropout=False, poison=False)
    SLEEP_CYCLES = 100_000_000  # ~50-70 ms at H200 clocks

    def skip_reason(self, adapter):
        return _cuda_reason(adapter) or super().skip_reason(adapter)

    def judge(self, adapter, case, params):
        if case.q.device.type != "cuda":
            return _skipped(f"{self.name}: case is on {case.device}; run with --attn-device cuda", case)
        side = torch.cuda.Stream(device=case.q.device)  # from PyTorch's pool: cudaStreamNonBlocking
        sleep = self.SLEEP_CYCLES

        def late(t):
            """On the current (side) stream: a NaN buffer, a sleep, then the values."""
            x = torch.full_like(t, math.nan) if t.is_floating_point() else torch.empty_like(t)
            torch.cuda._sleep(sleep)
            x.copy_(t)
            return x

        def dout_late(g):  # runs in backward, before the adapter's backward
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                x = late(g)
            cur.wait_stream(side)
            x.record_stream(cur)
            return x

        def fn(q, k, v, spec):
            caller = torch.cuda.current_stream()
            side.wait_stream(caller)
            with torch.cuda.stream(side):
                ql, kl, vl = late(q), late(k), late(v)
                result = adapter.fn(ql, kl, vl, spec)
                out = _on_backward(unpack_output(result)[0], dout_late)
                result = _rewrap(result, out)
            caller.wait_stream(side)
            for t in (unpack_output(result)[0], unpack_output(result)[1]):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(caller)
            return result

        res = check(_proxy(adapter, fn), case, backward=adapter.claims.backward)
        torch.cuda.synchronize()
        out = _from_check(res, case)
        if not res.passed:
            out.message += ("\nnote: the inputs were written on a non-blocking side stream after a GPU sleep; "
                            "a kernel launched on the default stream (or a hard-coded stream) reads them too early")
        return out


class CudaGraphReplay(CaseProperty):
    name = "cuda_graph_replay"
    doc = ("Captured once in a CUDA graph, the call replays correctly with new contents copied into the same input "
           "storage (nothing is baked in at capture: values, scalars read from data, host-side caches). "
           "Forward only; an adapter that cannot be captured is reported as skipped with the capture error.")
    case_kwargs = dict(dropout=False, poison=False)

    def skip_reason(self, adapter):
        return _cuda_reason(adapter) or super().skip_reason(adapter)

    def judge(self, adapter, case, params):
        if case.q.device.type != "cuda":
            return _skipped(f"{self.name}: case is on {case.device}; run with --attn-device cuda", case)
        sq, sk, sv = (t.detach().clone() for t in (case.q, case.k, case.v))
        spec = case.spec
        caller = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(caller)
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(3):  # warm-up off the capture (compilation, autotuning, workspace allocation)
                adapter(sq, sk, sv, spec)
        caller.wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.no_grad(), torch.cuda.graph(graph):
                static = adapter(sq, sk, sv, spec)
        except Exception as e:
            torch.cuda.synchronize()
            return _skipped(f"{adapter.name} cannot be captured in a CUDA graph: {type(e).__name__}: "
                            f"{str(e).splitlines()[0][:300] if str(e) else ''}", case)
        s_out, s_lse, _ = unpack_output(static)
        results = []
        for bump in (1, 2):  # two replays with different contents
            r2 = dataclasses.replace(case.recipe, seed=(case.recipe.seed + 1000 * bump) % 2**31) if case.recipe else None
            fresh = build_case(r2) if r2 is not None else None
            nq, nk, nv = (fresh.q, fresh.k, fresh.v) if fresh is not None else (
                case.q * (1 + bump), case.k.flip(2), case.v * -1)
            new_case = Case(nq, nk, nv, spec, seed=case.seed + bump, recipe=None, label=self.name)

            def fn(q, k, v, _spec, nq=nq, nk=nk, nv=nv):
                with torch.no_grad():
                    sq.copy_(q)
                    sk.copy_(k)
                    sv.copy_(v)
                    graph.replay()
                    torch.cuda.synchronize()
                    o = s_out.clone()
                    lse = s_lse.clone() if isinstance(s_lse, torch.Tensor) else None
                return Output(o, lse=lse)

            res = check(_proxy(adapter, fn), new_case, backward=False)
            results.append(res)
        failed = [r for r in results if not r.passed]
        out = _from_check(failed[0] if failed else results[-1], case)
        if failed:
            out.message = (f"[{adapter.name}] CUDA graph replay with new input contents (same storage) is wrong on "
                           f"{len(failed)} of 2 replays: {case.describe()}\n" + out.message)
        return out
