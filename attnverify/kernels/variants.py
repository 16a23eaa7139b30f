"""Host side of the kernels' speed candidates (issue 25): which switch applies to which call.

Each candidate is a field of `launch.Config` (off by default) and a compile-time switch of the kernels
(`flash_fwd_variants` documents what each does). `ATTNVERIFY_TRITON_VARIANT` (a comma list of
`VARIANTS`, read when a default configuration is made, never at import) turns candidates on for every
call that uses the default configuration: the test suite runs that way to prove a candidate correct,
and `benchmarks/perf_candidates.py` times them against the default on a GPU.

A switch that does not apply to a call is dropped for it, so every call stays exact: FMA needs a
positive scale and no softcap or ALiBi; TMA needs dense (not varlen) K and V whose strides TMA takes
(and sm90+ on a GPU); LPT matters only for causal launches. `nospec` (fewer compiles, not speed) runs the
kernels' twins that are not specialised on lengths and head counts (flash_fwd.NOSPEC); `spec` switches it off where
launch.NOSPEC_ON_GPU makes it a GPU's default (off until the perf gate has timed it).
"""
from __future__ import annotations

import os
from dataclasses import replace

ENV = "ATTNVERIFY_TRITON_VARIANT"
# name -> Config field
VARIANTS = {"fma": "fwd_fma", "lazy": "fwd_lazy", "tma": "fwd_tma", "ws": "fwd_ws", "lpt": "lpt", "nospec": "nospec"}


def parse(text: str) -> dict:
    """'fma,lazy' -> {'fwd_fma': True, 'fwd_lazy': True}; '' or 'none' -> {}; 'spec' -> {'nospec': False} (the
    specialised kernels, which a GPU's default configuration no longer uses: the perf gate's A/B)."""
    out = {}
    for name in (x.strip().lower() for x in text.split(",")):
        if not name or name == "none":
            continue
        if name == "spec":
            out["nospec"] = False
            continue
        if name not in VARIANTS:
            raise ValueError(f"{ENV}: unknown variant {name!r}; use a comma list of {', '.join(VARIANTS)} "
                             f"(or 'none'; 'spec' for the specialised kernels)")
        out[VARIANTS[name]] = True
    return out


def from_env(cfg):
    """`cfg` with the candidates named in ATTNVERIFY_TRITON_VARIANT switched on (unchanged if unset)."""
    text = os.environ.get(ENV, "")
    fields = parse(text) if text else {}
    return replace(cfg, **fields) if fields else cfg


def names(cfg) -> str:
    """The candidates a Config has on, as the comma list ATTNVERIFY_TRITON_VARIANT takes ('none' if none)."""
    on = [n for n, f in VARIANTS.items() if getattr(cfg, f)]
    return ",".join(on) or "none"


def strides(t) -> tuple:
    """t's strides with those of size-1 dims (not the last) as 0: index 0 is addressed alike, and the
    kernels see one value class (divisible by 16) instead of whatever the layout gave (Config.nospec)."""
    last = t.dim() - 1
    return tuple(0 if n == 1 and i < last else s for i, (s, n) in enumerate(zip(t.stride(), t.shape)))


def _tma_ok(t, interpreting: bool) -> bool:
    if t.dim() != 4 or t.stride(-1) != 1 or t.data_ptr() % 16 or t.numel() == 0:  # TMA: every dim >= 1
        return False
    es = t.element_size()
    if any((s * es) % 16 or (s == 0 and n > 1) for s, n in zip(t.stride()[:-1], t.shape[:-1])):
        return False
    if t.device.type == "cuda" and not interpreting:
        import torch

        return torch.cuda.get_device_capability(t.device)[0] >= 9
    return True


def tma_descriptors(k, v, block_n: int, block_d: int, block_dv: int, interpreting: bool):
    """Host tensor descriptors over K and V (B, Hkv, Lk, D) with (1, 1, BLOCK_N, BLOCK_D) boxes, or None
    where TMA cannot take these tensors (or this Triton has no host descriptors)."""
    if not (_tma_ok(k, interpreting) and _tma_ok(v, interpreting)):
        return None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return (TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, block_n, block_d]),
            TensorDescriptor(v, list(v.shape), list(v.stride()), [1, 1, block_n, block_dv]))


def fwd_switches(cfg, p, k, v, block_n: int, dims: dict, interpreting: bool) -> dict:
    """The forward kernel's candidate arguments for this call (all off unless `cfg` asks and they apply)."""
    flags = p.flags
    fma = cfg.fwd_fma and p.qk_scale > 0 and not flags["HAS_SOFTCAP"] and not flags["HAS_ALIBI"]
    descs = None
    if cfg.fwd_tma and not flags["IS_VARLEN"]:
        descs = tma_descriptors(k, v, block_n, dims["BLOCK_D"], dims["BLOCK_DV"], interpreting)
    return dict(DESC_K=descs[0] if descs else None, DESC_V=descs[1] if descs else None,
                FMA=bool(fma), LAZY=bool(cfg.fwd_lazy), TMA=descs is not None, WS=bool(cfg.fwd_ws),
                LPT=bool(cfg.lpt and flags["IS_CAUSAL"]))
