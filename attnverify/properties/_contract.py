"""Contract and robustness properties: what a comparison of one call against the reference does not see.

Kernels have passed single-call checks by returning reused memory, zeroing or scribbling on their
inputs, reading past the end of a tensor, or being right only on the first call. These properties
aim at exactly that, each aware of what the adapter claims:

    outputs_fully_written           poisoned allocator (and NaN-filled `out=` buffers) before the call and
                                    before backward; shape, dtype, device, layout, no overlap, no aliasing
    no_out_of_bounds                inputs (and dO) as views into larger buffers whose surroundings hold NaN
                                    and huge values; the surroundings must not reach the result nor change;
                                    NaN in another varlen segment's keys must not reach a segment's rows
    inputs_unmodified               (extends the property of that name) hashes before forward, after
                                    forward and after backward; backward also leaves dO, out and LSE alone
    repeat_and_interleave_stable    the 1st and the 11th call agree, and after other shapes ran in between;
                                    a request alone equals the same request inside a larger batch / pack
    contract                        inputs outside any claim (k/v lengths differ, Hq % Hkv != 0, q/k head
                                    dims differ, an unclaimed dtype) must raise, not return numbers
    non_default_stream              (CUDA) inputs produced on a non-blocking side stream behind a sleep
    cuda_graph_replay               (CUDA) capture once, replay with new contents in the same storage
    memory_scaling                  peak extra memory at N, 2N, 4N has no N x N part (memory="linear");
                                    measured with torch.cuda.max_memory_allocated, or on a CPU with the
                                    profiler's allocation events

Nothing here touches a GPU at import or while drawing examples; the GPU work happens in run_example.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from ..case import DTYPES
from ..check import unpack_output
from ..magnitudes import magnitudes, score_bound
from ..compare import compare, error_stats
from ..reference import reference_forward
from ..tolerances import floors_of, tolerance_for
from ._props import CaseProperty
from .base import ExampleResult, Property
from ._cuda_props import CudaGraphReplay, NonDefaultStream
from ._guards import Guards, Poisoner, structure_problems
from ._memory_safety import InputsUnmodified, NoOutOfBounds, OutputsFullyWritten
from ._memory_scaling import MemoryScaling, judge_memory_scaling
from ._stability import RepeatAndInterleaveStable
class Contract(CaseProperty):
    name = "contract"
    doc = ("Inputs outside what any adapter can claim -- k and v of different lengths, Hq not a multiple of Hkv, "
           "q and k of different head dims -- must raise an error instead of returning numbers. An unclaimed dtype "
           "must raise, or else come back right (the output in that dtype, matching the reference): an adapter that "
           "silently computes wrong numbers for it is reported.")
    case_kwargs = dict(dropout=False, poison=False, varlen=False, attn_mask=False, alibi=False, return_lse=False,
                       layouts=("contiguous",))
    # True: an unclaimed dtype must raise, even where the adapter computes it correctly (the strict reading).
    # False (default): correct numbers are accepted -- the default claims are the least (float32 only), so a
    # plain PyTorch adapter that is right for float64 too would otherwise fail for being modest.
    STRICT_DTYPES = False

    def judge(self, adapter, case, params):
        g = torch.Generator().manual_seed(int(case.seed) + 3)
        dev, dt = case.q.device, case.q.dtype
        b, hq, lq, d = case.q.shape
        hkv, lk, dv = case.k.shape[1], case.k.shape[2], case.v.shape[-1]
        rnd = lambda *shape, dtype=dt: torch.randn(*shape, generator=g, dtype=torch.float64).to(dev, dtype)  # noqa: E731
        s = case.spec
        trials = []
        v_bad = case.v[:, :, :lk - 1] if lk >= 2 else torch.cat([case.v, case.v], 2)
        trials.append(("k and v of different lengths", (case.q, case.k, v_bad), f"k has Lk={lk}, v has {v_bad.shape[2]}"))
        trials.append(("Hq not a multiple of Hkv", (rnd(b, 3, lq, d), rnd(b, 2, lk, d), rnd(b, 2, lk, dv)), "Hq=3, Hkv=2"))
        trials.append(("q and k of different head dims", (case.q, rnd(b, hkv, lk, d + 8), case.v),
                       f"q has D={d}, k has D={d + 8}"))
        silent, notes = [], []
        for what, (q, k, v), detail in trials:
            try:
                with torch.no_grad():
                    result = adapter(q, k, v, s)
            except Exception:
                continue  # raised: as it must
            silent.append(f"{what} ({detail}): {_returned(result)} instead of raising")
        un = [x for x in ("float64", "float32", "float16", "bfloat16") if x not in adapter.claims.dtypes]
        if un:
            why = self._unclaimed_dtype(adapter, case, un[0])
            if why and (self.STRICT_DTYPES or not why.startswith("ok")):
                silent.append(why)
            elif why:
                notes.append(why)
        if not silent:
            return ExampleResult(True, message="\n".join(notes), case=case.to_dict())
        msg = "\n".join([f"[{adapter.name}] silently computed on inputs outside its contract (base case "
                         f"{case.describe()}):"] + silent)
        return ExampleResult(False, msg, severity=10.0, case=case.to_dict())

    def _unclaimed_dtype(self, adapter, case, dname) -> Optional[str]:
        """None when the call raised; 'ok: ...' when it returned right numbers; else what was wrong."""
        from ..adapters.naive import naive_attention

        udt = DTYPES[dname]
        q, k, v = (t.to(udt) for t in (case.q, case.k, case.v))
        try:
            with torch.no_grad():
                result = adapter(q, k, v, case.spec)
        except Exception:
            return None
        head = f"unclaimed dtype {dname} (claims {', '.join(adapter.claims.dtypes)}): {_returned(result)}"
        out = unpack_output(result)[0]
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (*q.shape[:3], v.shape[-1]):
            return head + " of the wrong shape instead of raising"
        if out.dtype != udt:
            return head + f" in dtype {str(out.dtype).replace('torch.', '')} instead of raising"
        ref = reference_forward(q, k, v, case.spec)
        with torch.no_grad():
            base = naive_attention(q, k, v, case.spec).out
        brel, babs = error_stats(base, ref.out)
        probe = dataclasses.replace(case, q=q, k=k, v=v)
        # large scores round like check() allows for (row_shift cases, additive biases)
        tol = tolerance_for("out", dname, baseline_rel_l2=brel, baseline_max_abs=babs,
                            **floors_of(magnitudes(probe), "out"), score_max=score_bound(probe, ref.lse))
        c = compare("out", out, ref.out, tol)
        if not c.passed:
            return head + f" that are WRONG (rel L2 {c.rel_l2:.2g} vs {c.tol_norm:.2g} allowed) instead of raising"
        return "ok: " + head + f" that match the reference (rel L2 {c.rel_l2:.2g}): raise, or claim {dname}"


def _returned(result) -> str:
    out = unpack_output(result)[0]
    if not isinstance(out, torch.Tensor):
        return f"returned a {type(out).__name__}"
    fin = ""
    if out.is_floating_point():
        fin = ", all finite" if bool(torch.isfinite(out).all()) else ", with non-finite values"
    return f"returned {tuple(out.shape)} {str(out.dtype).replace('torch.', '')}{fin}"


# ------------------------------------------------------------------------------------ registration

CONTRACT_PROPERTIES: List[Property] = [
    OutputsFullyWritten(),
    NoOutOfBounds(),
    RepeatAndInterleaveStable(),
    Contract(),
    NonDefaultStream(),
    CudaGraphReplay(),
    MemoryScaling(),
]


def install(properties: List[Property]) -> List[Property]:
    """Replace `inputs_unmodified` by the forward+backward version and append the contract properties,
    in place (so `attnverify.properties._props.PROPERTIES` and the package's PROPERTIES agree)."""
    for i, p in enumerate(properties):
        if p.name == "inputs_unmodified" and not isinstance(p, InputsUnmodified):
            properties[i] = InputsUnmodified()
    have = {p.name for p in properties}
    properties.extend(p for p in CONTRACT_PROPERTIES if p.name not in have)
    return properties


__all__ = [
    "CONTRACT_PROPERTIES", "install", "Contract", "OutputsFullyWritten", "NoOutOfBounds", "InputsUnmodified",
    "RepeatAndInterleaveStable", "NonDefaultStream", "CudaGraphReplay", "MemoryScaling", "judge_memory_scaling",
    "Guards", "Poisoner", "structure_problems",
]
