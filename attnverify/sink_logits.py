"""Sink logits drawn from a JSON-able description ({"kind", "level", "seed"}): what a recipe (CaseRecipe.sinks) and
the sink properties (properties/sinks.py) rebuild Spec.sinks from, so a saved case replays with its sinks."""
from __future__ import annotations

import math

import torch

SINK_KINDS = ("normal", "dominant", "neg_inf", "mixed")


def make_sinks(hq: int, d: dict, device="cpu") -> torch.Tensor:
    """(Hq,) float32 sink logits from a drawn description: normal logits of std `level`, large ones dominating every
    row, -inf, or a mix per head."""
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
    return x.to(torch.float32).to(device)
