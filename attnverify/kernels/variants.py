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

Two further compile-count switches are variants of the `nospec` twins, so each implies `nospec` (`spec` with either
is refused, as is a Config that has one without `nospec`); each is off by default until the perf gate times it:
- `aligned`: the tile strides (Q, K, V, O, dO, dQ, dK, dV: batch, head, row, head-dim) are not specialised either.
  The host checks that every tile tensor of a launch has a unit last stride and its other strides (size-1 dims as 0)
  multiples of 16 bytes and below 2**31, and then passes them divided by ALIGNED = 16 bytes in elements (8 for 16-bit
  types, 4 for float32), which the kernel multiplies back by the constexpr (`common._aligned`): Triton sees the
  16-byte multiples that its divisibility-by-16 specialisation gave before, so the vector loads stay. Otherwise
  ALIGNED = 0: the strides as they are, no alignment known (scalar loads; odd layouts only). Not for fp8 inputs
  (FA3's V is column-major on a GPU, no unit last stride): they keep the `nospec` twin.
- `rtmask`: the mask flags causal, bottom-right, window and sinks are run-time bits (RTF, common.RT_*) with their
  code compiled in: causal and window as bounds that are neutral when off (a diagonal past every key, unbounded
  sides), which blocks are masked chosen at run time, the sink a branch in the forward's epilogue. Same blocks,
  same arithmetic: bit-identical outputs under the interpreter. No branch in a key loop: softcap and ALiBi stay
  compile-time, because a per-tile branch (scf.if) in a key loop fails Triton 3.6's software pipeliner (the H200's
  Triton; 3.9 takes it) and the branch-free forms cost work on every tile (softcap's tanh, ALiBi's distances) for
  about 30 of the dev profile's keys (BENCHMARKS.md). LPT (a program order) then applies whether or not the call is
  causal, so it does not split the kernels either.
"""
from __future__ import annotations

import os
from dataclasses import replace

from . import common

ENV = "ATTNVERIFY_TRITON_VARIANT"
# name -> Config field
VARIANTS = {"fma": "fwd_fma", "lazy": "fwd_lazy", "tma": "fwd_tma", "ws": "fwd_ws", "lpt": "lpt", "nospec": "nospec",
            "aligned": "aligned", "rtmask": "rtmask"}
OF_NOSPEC = ("aligned", "rtmask")  # variants of the nospec twins: they imply nospec


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
    of_nospec = [n for n in OF_NOSPEC if out.get(n)]
    if of_nospec and out.get("nospec") is False:
        raise ValueError(f"{ENV}: {', '.join(of_nospec)} run the nospec twins, which 'spec' switches off; drop one")
    if of_nospec:
        out["nospec"] = True
    return out


def check(cfg) -> None:
    """Refuse a Config with `aligned` or `rtmask` but not `nospec` (they are variants of the nospec twins)."""
    bad = [n for n in OF_NOSPEC if getattr(cfg, n)]
    if bad and not cfg.nospec:
        raise ValueError(f"triton attention: Config {'/'.join(bad)}=True needs nospec=True (variants of the nospec "
                         f"twins; ATTNVERIFY_TRITON_VARIANT={bad[0]} sets both)")


def from_env(cfg):
    """`cfg` with the candidates named in ATTNVERIFY_TRITON_VARIANT switched on (unchanged if unset)."""
    text = os.environ.get(ENV, "")
    fields = parse(text) if text else {}
    return replace(cfg, **fields) if fields else cfg


def names(cfg) -> str:
    """The candidates a Config has on, as the comma list ATTNVERIFY_TRITON_VARIANT takes ('none' if none; nospec is
    left out where aligned or rtmask, which imply it, are on)."""
    on = [n for n, f in VARIANTS.items() if getattr(cfg, f)]
    if any(n in on for n in OF_NOSPEC):
        on.remove("nospec")
    return ",".join(on) or "none"


def strides(t) -> tuple:
    """t's strides with those of size-1 dims (not the last) as 0: index 0 is addressed alike, and the
    kernels see one value class (divisible by 16) instead of whatever the layout gave (Config.nospec)."""
    last = t.dim() - 1
    return tuple(0 if n == 1 and i < last else s for i, (s, n) in enumerate(zip(t.stride(), t.shape)))


def kernel(cfg, plain, nospec, twins, aligned_ok: bool = True, rtmask_ok: bool = True):
    """The kernel a launch runs: `plain` (specialised), its `nospec` twin, or twins[(aligned, rtmask)] (common.
    nospec_twins) where those apply (`aligned_ok`: not fp8; `rtmask_ok`: the kernel has mask flags)."""
    if not cfg.nospec:
        return plain
    a, r = bool(cfg.aligned and aligned_ok), bool(cfg.rtmask and rtmask_ok)
    return twins[(a, r)] if a or r else nospec


def align(tensors, tile_strides) -> int:
    """ALIGNED for a launch's tile tensors: 16 bytes in elements if they share one element size, each has a unit last
    stride and its other strides (as passed) are multiples of that below 2**31 (divided, they keep Triton's int
    type); else 0."""
    sizes = {t.element_size() for t in tensors}
    if len(sizes) != 1:
        return 0
    a = max(1, 16 // sizes.pop())
    ok = all(st[-1] == 1 and all(x % a == 0 and 0 <= x < 2 ** 31 for x in st[:-1]) for st in tile_strides)
    return a if ok else 0


def tile_args(cfg, tensors, aligned_ok: bool = True) -> tuple:
    """-> (the tile tensors' strides in argument order, the kernel's ALIGNED keyword ({} unless `aligned` applies))."""
    sts = [strides(t) if cfg.nospec else tuple(t.stride()) for t in tensors]
    if not (cfg.nospec and cfg.aligned and aligned_ok):
        return [x for st in sts for x in st], {}
    a = align(tensors, sts)
    if not a:
        return [x for st in sts for x in st], {"ALIGNED": 0}
    return [x for st in sts for x in (*(y // a for y in st[:-1]), st[-1])], {"ALIGNED": a}


def rtmask_args(cfg, flags: dict) -> tuple:
    """-> (the kernel's flag keywords, {'RTF': bits}): `flags` as they are and {} unless `rtmask` applies; with it
    the run-time mask flags in `flags` compiled in (True) and their values as RTF's bits (common.RT_*)."""
    if not (cfg.nospec and cfg.rtmask):
        return flags, {}
    bits = {"IS_CAUSAL": common.RT_CAUSAL, "CAUSAL_BR": common.RT_BR, "HAS_WINDOW": common.RT_WINDOW,
            "HAS_SINKS": common.RT_SINKS}
    rtf = sum(1 << bits[n].value for n in bits if flags.get(n))
    return dict(flags, **{n: True for n in bits if n in flags}), {"RTF": rtf}


def lpt(cfg, flags: dict) -> bool:
    """LPT (longest query blocks first) for a causal launch; under `rtmask` for any (a program order: it would
    otherwise split the kernels on causality again)."""
    return bool(cfg.lpt and (flags["IS_CAUSAL"] or (cfg.nospec and cfg.rtmask)))


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
                LPT=lpt(cfg, flags))
