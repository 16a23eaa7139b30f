"""Where `check` judges a case: on the case's own device, or on a CPU twin of a small case (issue 25 item 3).

The judge of a small case is a few hundred tiny torch operations (the float64 reference, the magnitudes, the
same-dtype baseline, the comparisons; benchmarks/fuzz_overhead.py counts them). On a GPU each is a kernel
launch with its dispatch (10-20 us) and a dozen of them wait for the device; on a CPU each costs a few us.
A CPU twin judges such a case on the host: the adapter still runs on the device case (its inputs, outputs
and backward stay on the GPU, the calls are the same), while the reference, magnitudes, baseline and every
comparison run on a CPU copy of the same case, with the adapter's outputs (out, LSE, keep mask, gradients)
copied to the CPU once. The values are the same: cases are drawn on the CPU generator and then moved
(attnverify/case.py build_case), so the copy back is exact; the upstream gradients are the same draw of
the CPU generator, the adapter getting the device copy.

What changes on a twin is only where the judge's own float arithmetic runs: the float64 reference is exact
to far below any tolerance on either device, but the baseline (`naive` in float32 arithmetic) accumulates
in the CPU's order instead of the GPU's, so its error, from which the per-case tolerance is derived, can
differ slightly. Hence off by default on a GPU until an A/B on one (benchmarks/throughput_h200.sh with
FLASH_AB=1) has shown the same verdicts.

    ATTNVERIFY_JUDGE_ON    (read at every check)
        device     judge on the case's device (the default while JUDGE_SMALL_ON_CPU is False)
        auto       judge a small case of a non-CPU device on a CPU twin (`is_small`), the others on their device
                   (the default once JUDGE_SMALL_ON_CPU is True)
        cpu-twin   judge every case on a CPU copy, a CPU case included (a distinct copy: how the tests prove that
                   the twin path judges alike)

A case with a KV cache (attnverify/paged.py) is judged on its device under `auto` (the rule below was measured
on plain calls); `cpu-twin` copies it all the same (every tensor of its Spec).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Tuple

import torch

from .case import Case

# Judge small GPU cases on a CPU twin when ATTNVERIFY_JUDGE_ON is unset. False until validated on a GPU.
JUDGE_SMALL_ON_CPU = False
ENV = "ATTNVERIFY_JUDGE_ON"
MODES = ("device", "auto", "cpu-twin")

# "Small" (one home): the judge's float work is about scores x (D + Dv) multiply-adds per pass, and a case whose
# B*Hq*Lq*Lk*(D + Dv) is at most SMALL_WORK (forward) costs under ~2.3 ms on a 2-core EPYC for the float64 reference and the baseline
# together on one CPU thread (a floor of 1.1-1.7 ms); a backward judge does about three times the passes, so its bound
# is a third (its twins cost 3-7.3 ms there: its floor is ~3 ms; the GPU side of a backward judge is not measured yet).
# Measured by benchmarks/judge_twin_cost.py (BENCHMARKS.md, "The judge on a CPU twin").
SMALL_WORK = 2_000_000
BACKWARD_PASSES = 3


def judge_mode() -> str:
    """ATTNVERIFY_JUDGE_ON, read now (not at import): device | auto | cpu-twin."""
    v = os.environ.get(ENV, "").strip().lower()
    if not v:
        return "auto" if JUDGE_SMALL_ON_CPU else "device"
    if v not in MODES:
        raise ValueError(f"{ENV}={v!r}: use one of {', '.join(MODES)}")
    return v


def judge_work(case: Case, backward: bool) -> int:
    """The rule's measure of a case: B*Hq*Lq*Lk*(D + Dv), times BACKWARD_PASSES with gradients."""
    b, hq, lq, d = case.q.shape
    lk, dv = case.k.shape[2], case.v.shape[-1]
    return b * hq * lq * lk * (d + dv) * (BACKWARD_PASSES if backward else 1)


def is_small(case: Case, backward: bool) -> bool:
    """Whether `auto` judges this case on a CPU twin: a plain call (no KV cache) within SMALL_WORK."""
    if case.spec.cache_seqlens is not None:
        return False
    return judge_work(case, backward) <= SMALL_WORK


def wants_twin(case: Case, backward: bool) -> bool:
    """Whether `check` judges this case on a CPU twin (ATTNVERIFY_JUDGE_ON, then the rule under `auto`)."""
    mode = judge_mode()
    if mode != "auto":
        return mode == "cpu-twin"
    return case.q.device.type != "cpu" and is_small(case, backward)


def judged_case(case: Case, backward: bool) -> Case:
    """The case the judge works on: `case` itself, or its CPU twin."""
    return cpu_twin(case) if wants_twin(case, backward) else case


def cpu_twin(case: Case) -> Case:
    """A CPU copy of the case: the same values, shapes, dtypes and strides (stride-0 dimensions stay
    expanded), every tensor of its Spec copied too; always new memory, even for a CPU case."""
    spec = case.spec
    moved = {f.name: _copy(getattr(spec, f.name)) for f in dataclasses.fields(spec)
             if isinstance(getattr(spec, f.name), torch.Tensor)}
    twin_spec = dataclasses.replace(spec, **moved) if moved else spec
    q, k, v = (_copy(t) for t in (case.q, case.k, case.v))
    return Case(q, k, v, twin_spec, seed=case.seed, recipe=case.recipe, label=case.label)


def _copy(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if 0 in t.stride() and t.numel() > 1:  # copy the distinct elements, expand again: the zero strides stay
        compact = [1 if st == 0 else n for n, st in zip(t.shape, t.stride())]
        return t.as_strided(compact, t.stride()).to("cpu", copy=True).expand(t.shape)
    if t.is_contiguous():
        return t.to("cpu", copy=True)
    base = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu")  # the same strides (transposed, sliced)
    base.copy_(t)
    return base


def on_judge(twin: bool, *tensors) -> tuple:
    """The adapter's tensors where the judge works: unchanged on the plain path, else copied to the CPU
    (anything not a tensor is passed through)."""
    if not twin:
        return tensors
    return tuple(t.detach().to("cpu") if isinstance(t, torch.Tensor) else t for t in tensors)


def upstream(draw: torch.Tensor, like: torch.Tensor, twin: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """An upstream gradient drawn on the CPU (float64), in `like`'s dtype: (the adapter's copy, on `like`'s
    device; the judge's copy). On the plain path both are one tensor, made as check always made it."""
    if not twin:
        t = draw.to(like.device, like.dtype)
        return t, t
    j = draw.to(like.dtype)
    return j.to(like.device), j


def judged_on(jcase: Case, case: Case) -> str:
    """What the result records: the device the judge ran on ("cpu twin" for a twin)."""
    return "cpu twin" if jcase is not case else case.q.device.type


def twin_note(jcase: Case, case: Case) -> Optional[str]:
    if jcase is case:
        return None
    return (f"judged on a CPU twin of the {case.q.device.type} case ({ENV}={judge_mode()}): the reference, "
            f"baseline and comparisons ran on the CPU, the adapter on the case's device")
