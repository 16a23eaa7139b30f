"""PyTorch `scaled_dot_product_attention`: PyTorch's own dispatch and each backend forced.

A forced backend runs under `sdpa_kernel([that backend])`, so it can never fall back silently:
if the backend cannot take a case, the call raises instead of computing it another way.

How the claims were established: `benchmarks/probe_sdpa.py` runs every backend x dtype x feature
(plain, non-default scale, GQA, causal top-left with Lq == Lk and Lq != Lk, bottom-right through
`causal_lower_right`, bool and float masks, a fully-masked row, backward, head dims 40..512) and
compares with float64. CPU: this repo's machine, torch 2.13.0 — MATH and FLASH accept everything
listed, fully-masked rows give 0; EFFICIENT and CUDNN do not exist on the CPU. CUDA: an H200 with
torch 2.11.0+cu130 (see `_CUDA_CLAIMS`, and docs/tolerances.md for the figures).
Window, softcap, ALiBi, varlen and LSE are not SDPA features and are not claimed: building them
as masks in the adapter would test the adapter, not the backend.
"""
from __future__ import annotations

import torch

from ..spec import Spec
from ._findings import CPU_FLASH_SWALLOWED, DIFFERENT_KV
from ._sdpa_cuda_findings import CUDA_FINDINGS
from .base import Adapter, Claims, _validate_claims
from .deferred import DeferredAdapter
from .registry import register_adapter
from ..devices import cuda_present

_ALL_CAUSAL = ("none", "top_left", "bottom_right")

# Per backend on the CPU (torch >= 2.5: fully-masked rows give 0; earlier NaN).
_CPU_CLAIMS = {
    "default": dict(dtypes=("float16", "bfloat16", "float32", "float64")),
    "math": dict(dtypes=("float16", "bfloat16", "float32", "float64")),
    # flash on the CPU refuses Dv != D ("requires q,k,v to have the same last dimension") and
    # has no dropout (the call runs without it)
    "flash": dict(dtypes=("float16", "bfloat16", "float32", "float64"), dv_ne_d=False, dropout=False),
}

# Per backend on CUDA, from probe_sdpa.py and calibrate_tolerances.py on the H200 (torch 2.11):
# flash and cudnn refuse fp32/fp64, Dv != D and causal with Lq != Lk, flash masks too; efficient refuses
# GQA (enable_gqa) and fp64; cudnn refuses Lk == 1. cuDNN gives neither 0 nor NaN on fully-masked rows and
# PyTorch's own dispatch (cuDNN for fp16/bf16) returns finite garbage there: both claim PyTorch's documented
# zeros and declare it (F26).
_CUDA_CLAIMS = {
    # float64: the dispatch runs it on the math backend; the H200 thorough run's `contract` property saw it
    # computed (rel L2 3e-14 from the reference), so it is claimed rather than expected to raise
    # fully_masked: PyTorch's stance since 2.5 (pytorch/pytorch#133882, "Changes the stance of SDPA on what to do
    # for fully masked out rows"): zeros; the dispatch's cuDNN path misbehaves there (declared below)
    "default": dict(dtypes=("float16", "bfloat16", "float32", "float64")),
    "math": dict(dtypes=("float16", "bfloat16", "float32", "float64")),
    # flash: half types only, no attn_mask, causal only top-left with Lq == Lk (refuses otherwise)
    "flash": dict(dtypes=("float16", "bfloat16"), attn_mask=False, causal=("none", "top_left"),
                  head_dims=lambda d: d % 8 == 0 and d <= 256, dv_ne_d=False, memory="linear"),
    "efficient": dict(dtypes=("float16", "bfloat16", "float32"), gqa=False,
                      head_dims=lambda d: d % 8 == 0 and d <= 256, memory="linear"),
    # attn_mask: SDPA documents attn_mask for every backend and the probe (benchmarks/results/probe_sdpa_h200.json)
    # has cuDNN computing bool and float masks (rel err 2.5e-4 fp16, 2e-3 bf16); its fully-masked rows are
    # neither 0 nor NaN: declared below (F26)
    "cudnn": dict(dtypes=("float16", "bfloat16"), attn_mask=True, causal=("none", "top_left"), gqa=False,
                  head_dims=lambda d: d % 8 == 0 and d <= 128, dv_ne_d=False, memory="linear"),
}

_BACKEND_ENUM = {
    "math": "MATH",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
}


def _torch_version():
    parts = torch.__version__.split("+")[0].split(".")
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts[:2])


def _claims(backend: str) -> Claims:
    """The claims of one backend for the torch installed and the device present (computed on first use)."""
    return _validate_claims(f"sdpa-{backend}", _claim_keywords(backend))


def _claim_keywords(backend: str) -> dict:
    cuda = cuda_present()
    tv = _torch_version()
    base = dict(
        devices=("cuda",) if cuda else ("cpu",),
        head_dims=lambda d: 1 <= d <= 512,
        max_seqlen=16384 if cuda else 4096,
        causal=_ALL_CAUSAL,
        attn_mask=True,
        # enable_gqa exists from torch 2.5 ("enable_gqa (bool) -- If set to True, Grouped Query Attention (GQA) is
        # enabled"); before it there is no GQA to claim
        gqa=tv >= (2, 5),
        dropout=True,
        backward=True,
        dv_ne_d=True,
        # torch 2.5 changed the stance on fully masked rows to zeros (pytorch/pytorch#133882); before it, NaN
        fully_masked="zeros" if tv >= (2, 5) else "nan",
        deterministic=not cuda,
    )
    table = _CUDA_CLAIMS if cuda else _CPU_CLAIMS
    base.update(table.get(backend, {}))
    if not cuda and backend == "flash" and tv < (2, 6):
        # torch 2.5.1 (CPU): the flash kernel refuses enable_gqa ("No available kernel", 2.5.1 run of issue 24);
        # 2.13 accepts it
        base["gqa"] = False
    return base


def _availability(backend: str):
    def check():
        if backend == "default":
            return None
        if not hasattr(torch.nn, "attention") or not hasattr(torch.nn.attention, "sdpa_kernel"):
            return f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel (needs 2.3+)"
        if cuda_present():
            return None
        if backend in ("efficient", "cudnn"):
            return f"SDPA's {backend} backend exists only on CUDA and no GPU is present"
        return None

    return check


def _refuses(backend: str):
    def check(case) -> str | None:
        lq, lk = case.q.shape[2], case.k.shape[2]
        on_cuda = case.device == "cuda"  # a probe built on the CPU may stand for a CUDA case
        if backend in ("flash", "efficient", "cudnn") and any(t.stride(-1) != 1 for t in (case.q, case.k, case.v)):
            return f"sdpa-{backend} needs a contiguous last dimension (No available kernel otherwise)"
        if on_cuda and backend in ("flash", "cudnn") and case.spec.causal != "none" and lq != lk:
            return f"sdpa-{backend} on CUDA refuses causal with Lq != Lk"
        if on_cuda and backend in ("flash", "default") and any(t.data_ptr() % 16 for t in (case.q, case.k, case.v)):
            # measured on the H200 (torch 2.11): views 1 or 67 fp16 elements into a buffer end the flash kernel
            # in "CUDA error: misaligned address" (benchmarks/repro_misaligned_sdpa.py), and PyTorch's own
            # dispatch faulted the same way on a bf16 masked case; the fault loses the process's CUDA context
            # (docs/compatibility.md F9). A declared refusal keeps every other property about aligned inputs.
            return f"sdpa{'' if backend == 'default' else '-' + backend} on CUDA faults on q/k/v that are not 16-byte aligned (F9)"
        m = case.spec.attn_mask
        if on_cuda and backend == "efficient" and m is not None and lk > 1 and (m.shape[-1] != lk or m.stride(-1) != 1):
            # measured on the H200 (torch 2.11): a mask broadcast along the keys, e.g. (B, 1, Lq, 1), raises
            # "(*bias): last dimension must be contiguous" in the forced efficient backend
            return "sdpa-efficient on CUDA raises for a mask broadcast along the keys (last dimension not contiguous)"
        if on_cuda and backend == "cudnn" and lk == 1:
            return "sdpa-cudnn on CUDA refuses Lk == 1 (No available kernel)"
        if on_cuda and backend == "cudnn" and lq == 1 and case.spec.dropout_p > 0:
            # measured on the H200 (torch 2.11, thorough run 2026-12-03): 42 of 42 dropout cases with Lq == 1
            # raised "No available kernel" (B, H, Lk, D, dtype and layout varied); 27 of 27 with Lq > 1 ran
            return "sdpa-cudnn on CUDA has no dropout kernel for Lq == 1 (No available kernel)"
        if on_cuda and case.spec.causal == "bottom_right" and lq > lk and backend in ("efficient", "default"):
            # torch documents lower-right causal with Lq > Lk as unsupported ("will produce NaNs");
            # measured on the H200 (torch 2.11): efficient returns finite garbage on the rows that
            # see no key and wrong dQ/dK elsewhere -- see docs/tolerances.md, "findings"
            return f"sdpa-{backend} on CUDA: torch does not support causal_lower_right with Lq > Lk"
        return None

    return check


def _call(q, k, v, spec: Spec, backend: str):
    import torch.nn.functional as F

    kw = {}
    if spec.scale is not None:
        kw["scale"] = float(spec.scale)
    mask = spec.attn_mask
    if spec.causal != "none":
        lq, lk = q.shape[2], k.shape[2]
        if mask is None and spec.causal == "top_left":
            kw["is_causal"] = True
        elif mask is None:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(lq, lk)
        else:  # combine with the given mask: only the math of masks can express both
            i = torch.arange(lq, device=q.device)[:, None]
            j = torch.arange(lk, device=q.device)[None, :]
            tri = j <= i if spec.causal == "top_left" else j <= i + (lk - lq)
            mask = (mask & tri) if mask.dtype == torch.bool else mask.masked_fill(~tri, float("-inf"))
    if k.shape[1] != q.shape[1]:
        if _torch_version() >= (2, 5):
            kw["enable_gqa"] = True
        else:
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    if spec.dropout_p > 0:
        kw["dropout_p"] = float(spec.dropout_p)
        if spec.seed is not None:
            torch.manual_seed(int(spec.seed))
    if backend == "default":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, _BACKEND_ENUM[backend])]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)


# Measured findings about PyTorch's kernels (docs/tolerances.md, "Findings about the backends"): the
# properties still run and report them as known (xfail), and as XPASS once a torch release fixes them.
_CPU_FLASH_FINDINGS = {
    "nonfinite_inputs_propagate": {"why": "CPU flash (torch 2.13) returns 0 for a query row holding NaN instead "
                                          "of NaN, and finite rows in fp16/bf16 where a key holding +inf scores +inf "
                                          "(docs/tolerances.md; benchmarks/repro_sdpa_flash_inf_key.py)",
                                   "match": CPU_FLASH_SWALLOWED},
    "contract": {"why": "CPU flash (torch 2.13) accepts k and v of different lengths and returns finite numbers "
                        "(docs/tolerances.md)", "match": DIFFERENT_KV},
}


# Measured on the H200 (torch 2.11): _sdpa_cuda_findings.CUDA_FINDINGS, each narrowed with `match`, with its
# shrunk case in docs/compatibility.md and its standalone repro under benchmarks/.


# torch 2.3.x on the CPU (measured on 2.3.1 with scripts/old_torch.sh; benchmarks/repro_sdpa_cpu_old_torch.py)
_F27 = ("SDPA's CPU flash backend (torch 2.3.1) computes wrong rows for a bool mask broadcast along the keys, "
        "(B, 1, Lq, 1): max |flash - math| 2.7 on rows that see every key; the same mask expanded is right "
        "(docs/compatibility.md F27; benchmarks/repro_sdpa_cpu_old_torch.py)")
_F28 = ("SDPA on the CPU in float16 (torch 2.3.1, flash and math alike) is less accurate than the float16 baseline "
        "with float32 softmax: median relative L2 error 7.1e-4 against 5.7e-4 on torch 2.13 (docs/compatibility.md "
        "F28; benchmarks/repro_sdpa_cpu_old_torch.py)")
_KEY_BROADCAST_MASK = r"shrunk case: [^\n]* mask=bool\(\d+, \d+, \d+, 1\)[^\n]*\n[\s\S]*MISMATCH"
_FP16_OUT_ONLY = r"^(?![\s\S]*non-finite)[\s\S]*shrunk case: [^\n]*\bfloat16\b[\s\S]*\bout(?::in_batch)?: MISMATCH"
_OUTPUT_PROPERTIES = ("forward_matches_reference", "gradients_match_reference", "fully_masked_rows", "causal_alignment",
                      "kv_permutation_invariance", "batch_head_independence", "row_shift_invariance", "value_scaling",
                      "determinism", "nonfinite_inputs_propagate", "outputs_fully_written", "no_out_of_bounds",
                      "repeat_and_interleave_stable", "gqa_equals_repeated_kv")


def _old_cpu_findings(backend: str) -> dict:
    """Findings of torch 2.3 on the CPU, for the properties that compare outputs."""
    out = {}
    for prop in _OUTPUT_PROPERTIES:
        whys, pats = [_F28], [_FP16_OUT_ONLY]
        if backend in ("flash", "default") and prop != "determinism":
            whys.insert(0, _F27)
            pats.insert(0, _KEY_BROADCAST_MASK)
        if prop == "determinism" and backend in ("flash", "default"):
            whys, pats = [_F27], [r"shrunk case: [^\n]* mask=bool\(\d+, \d+, \d+, 1\)"]
        out[prop] = {"why": "; ".join(whys), "match": "|".join(f"(?:{p})" for p in pats)}
    return out


def _known_failures(backend: str) -> dict:
    if cuda_present():
        return dict(CUDA_FINDINGS.get(backend, {}))
    # PyTorch's own dispatch picks the flash kernel on the CPU for these cases
    known = dict(_CPU_FLASH_FINDINGS) if backend in ("flash", "default") else {}
    if _torch_version() < (2, 4):
        old = _old_cpu_findings(backend)
        if "nonfinite_inputs_propagate" in known:  # both: either message is the known one
            nan = known["nonfinite_inputs_propagate"]
            old["nonfinite_inputs_propagate"] = {"why": nan["why"] + "; " + old["nonfinite_inputs_propagate"]["why"],
                                                 "match": f"(?:{nan['match']})|" + old["nonfinite_inputs_propagate"]["match"]}
        known.update(old)
    return known


class _SdpaAdapter(DeferredAdapter):
    """An SDPA adapter whose claims and known findings follow the installed torch and the device present:
    computed on first use, not at import (nothing here asks torch or NVML anything before a run needs it)."""

    def __init__(self, backend: str, **kw):
        self._backend = backend
        super().__init__(lambda: dict(_claim_keywords(backend), known_failures=_known_failures(backend)), **kw)


def _make(name: str, backend: str, description: str) -> Adapter:
    a = _SdpaAdapter(
        backend,
        name=name,
        fn=lambda q, k, v, spec: _call(q, k, v, spec, backend),
        description=description,
        availability=_availability(backend),
        refuses=_refuses(backend),
    )
    return register_adapter(a)


sdpa = _make("sdpa", "default", "torch SDPA, PyTorch's own backend choice")
sdpa_math = _make("sdpa-math", "math", "torch SDPA forced to the MATH backend")
sdpa_flash = _make("sdpa-flash", "flash", "torch SDPA forced to FLASH_ATTENTION")
sdpa_efficient = _make("sdpa-efficient", "efficient", "torch SDPA forced to EFFICIENT_ATTENTION (CUDA only)")
sdpa_cudnn = _make("sdpa-cudnn", "cudnn", "torch SDPA forced to CUDNN_ATTENTION (CUDA only)")
