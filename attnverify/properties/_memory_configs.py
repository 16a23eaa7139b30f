"""memory_scaling's measured configurations, kept to what the adapter claims (issue 18).

The property times calls at N, 2N and 4N keys; every one of them must be a case the adapter claims
(length, head dim, its `refuses`), or the configuration is left out; none left: the property is skipped
with the reason.
"""
from __future__ import annotations

from typing import List, Optional

import torch


def _why(cfg: dict, adapter) -> Optional[str]:
    from ..case import Case
    from ..check import unclaimed
    from ..spec import Spec

    c = adapter.claims
    if not c.head_dim_ok(cfg["head_dim"]):
        return f"{adapter.name} claims none of the head dims memory_scaling can use (16 to 256)"
    dt = getattr(torch, cfg["dtype"])
    for mult in (1, 2, 4):
        n = cfg["n"] * mult
        if n > c.max_seqlen:
            from ._memory_scaling import N_MIN

            return (f"{adapter.name} claims max_seqlen={c.max_seqlen}: memory_scaling needs N, 2N and 4N keys "
                    f"with N >= {N_MIN} (4N = {4 * cfg['n']})")
        # a probe on the CPU with the shape of the call (the parent never starts CUDA); the device it stands for
        shape = (cfg["batch"], cfg["heads"], n, cfg["head_dim"])
        t = torch.zeros(1, dtype=dt).expand(*shape)
        why = unclaimed(adapter, Case(t, t, t, Spec(causal=cfg["causal"]), stands_for=cfg["device"]))
        if why:
            return why
    return None


def claimed_configs(configs: List[dict], adapter) -> List[dict]:
    return [cfg for cfg in configs if _why(cfg, adapter) is None]


def why_no_config(adapter, device: str) -> str:
    from ._memory_scaling import MemoryScaling

    reasons = [_why(cfg, adapter) for cfg in MemoryScaling()._all_configs(adapter, device)]
    return next((r for r in reasons if r), f"{adapter.name}: no configuration for memory_scaling")
