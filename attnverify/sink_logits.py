"""Sink logits drawn from a JSON-able description ({"kind", "level", "seed"}, and "dtype" where the adapter takes its
sinks in the input dtype): what a recipe (CaseRecipe.sinks) and the sink properties (properties/sinks.py) rebuild
Spec.sinks from, so a saved case replays with its sinks."""
from __future__ import annotations

import math
from typing import Optional

import torch

SINK_KINDS = ("normal", "dominant", "neg_inf", "mixed")


def for_adapter(adapter, dtype: str, d: Optional[dict]) -> Optional[dict]:
    """The description `d` as `adapter` is given its sinks for a call in `dtype`: with "dtype" where it claims
    sink_dtype="input" (onnxruntime's `head_sink` has the query's type), so that the drawn logits are representable
    there and the reference and the adapter see the same ones."""
    # half dtypes only: float32/float64 hold the logits as drawn, and fp8 has no infinity for a -inf sink (no fp8 API
    # takes its sinks in fp8 either)
    if d is None or getattr(adapter.claims, "sink_dtype", "float32") != "input" or dtype not in ("float16", "bfloat16"):
        return d
    return {**d, "dtype": dtype}


def make_sinks(hq: int, d: dict, device="cpu") -> torch.Tensor:
    """(Hq,) float32 sink logits from a drawn description: normal logits of std `level`, large ones dominating every
    row, -inf, or a mix per head; rounded through d["dtype"] when given (for_adapter)."""
    if not isinstance(d, dict):
        raise ValueError(f"sinks={d!r}: give a dict {{'kind': one of {SINK_KINDS}, 'level': float, 'seed': int}}")
    gen = torch.Generator().manual_seed(int(d.get("seed", 0)))
    kind, level = d.get("kind", "normal"), float(d.get("level", 1.0))
    if kind not in SINK_KINDS:
        raise ValueError(f"sinks kind={kind!r}: use one of {SINK_KINDS}")
    x = torch.randn(hq, generator=gen) * level
    if kind == "dominant":  # far above any score of a drawn row: the sink takes nearly all the weight
        x = level + 10.0 + x.abs()
    elif kind == "neg_inf":
        x = torch.full((hq,), -math.inf)
    elif kind == "mixed":
        pick = torch.randint(0, 3, (hq,), generator=gen)
        x = torch.where(pick == 0, torch.full_like(x, -math.inf), torch.where(pick == 1, level + 10.0 + x.abs(), x))
    x = x.to(torch.float32)
    if d.get("dtype") is not None:
        dt = getattr(torch, str(d["dtype"]), None)
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise ValueError(f"sinks dtype={d['dtype']!r}: give a floating dtype name, e.g. 'float16'")
        x = x.to(dt).to(torch.float32)  # representable in the adapter's sink dtype (saturating fp8: inf stays inf)
    return x.to(device)
