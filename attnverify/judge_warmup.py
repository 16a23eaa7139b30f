"""Warm the judge in a fresh judging child before its first example (issue 25, item 3).

A judging child pays, in its first examples, every first use of the judge's own paths: lazily imported
modules and first calls on the CPU; on a GPU also CUDA's start, the caching allocator's first blocks and
CUDA's lazy module loading (CUDA_MODULE_LOADING=LAZY, torch's default: each kernel's module is loaded at its
first launch, so every elementwise, reduction and GEMM kernel the reference, the same-dtype baseline and the
comparison launch is loaded the first time an example needs it). `warm_judge(plan)` runs, for each
(device, dtype, backward) of the plan, two tiny cases (plain; causal with a boolean mask and grouped heads)
through attnverify's own naive adapter and `check`: case build, reference, magnitudes, baseline, comparison,
and the gradients when asked. The user's adapter is never called (its first use stays its own: a kernel
that crashes must crash in an example, where it is reported). Nothing it does reaches a verdict: every
random draw of the judge uses its own generator seeded from the case, so examples are judged alike with or
without it (tests/test_draw_and_warmup.py).

The runner forks the child and sends the plan as soon as the session knows its adapters, so the warm-up
runs while the driving process draws its first examples (isolation.SubprocessRunner.warm).
"""
from __future__ import annotations

import time
from typing import Iterable, List, Tuple

WARM_DTYPES = ("float32", "float16", "bfloat16", "float64")

Plan = List[Tuple[str, str, bool]]


def warm_plan(adapters: Iterable, device: str, backward: bool) -> Plan:
    """(device, dtype, backward) for each claimed non-fp8 dtype of each adapter on its run device."""
    out: Plan = []
    for a in adapters:
        claims = getattr(a, "claims", None)
        if claims is None:
            continue
        try:
            dev = a.run_device(device)
        except Exception:
            continue
        bwd = bool(backward and claims.backward)
        for dt in WARM_DTYPES:
            if dt in claims.dtypes and (dev, dt, bwd) not in out:
                out.append((dev, dt, bwd))
    return out


def _recipes(device: str, dtype: str):
    from .case import CaseRecipe

    base = dict(batch=1, heads_q=2, heads_kv=2, len_q=5, len_k=7, head_dim=16, dtype=dtype, device=device, seed=0)
    yield CaseRecipe(**base)
    yield CaseRecipe(**{**base, "heads_kv": 1, "causal": "bottom_right", "mask": "bool_random", "return_lse": True})


def warm_judge(plan: Plan) -> dict:
    """Judge the plan's tiny cases once; {'seconds', 'cases', 'errors'} (an error is counted, never raised)."""
    t0 = time.perf_counter()
    n = errors = 0
    if not plan:
        return {"seconds": 0.0, "cases": 0, "errors": 0}
    from .adapters.registry import get
    from .case import build_case
    from .check import check

    naive = get("naive")
    for device, dtype, backward in plan:
        for r in _recipes(device, dtype):
            try:
                check(naive, build_case(r), backward=backward, keep_tensors=False)
                n += 1
            except Exception:
                errors += 1
    if any(d == "cuda" for d, _, _ in plan):
        try:
            import torch

            torch.cuda.synchronize()
        except Exception:
            pass
    return {"seconds": time.perf_counter() - t0, "cases": n, "errors": errors}
