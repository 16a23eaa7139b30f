"""The bundled Triton FlashAttention kernel (`attnverify.kernels`) as the built-in adapter `triton`.

On a GPU the kernels are compiled for it; on a CPU they run under the Triton interpreter, which must
be switched on (TRITON_INTERPRET=1) before the kernel module is first imported. Importing this module
imports no Triton and touches no GPU.

Claims, and why each is true (tests/test_triton_kernel.py checks every one against the reference):
fp16/bf16/fp32 with fp32 accumulation (fp32 dots in IEEE mode on GPU, not tf32); head dims 1..256,
non-powers of two padded in the kernel, Dv != D; all three causal alignments; windows; softcap; ALiBi
((Hq,) or (B, Hq) slopes); GQA/MQA; varlen packs with empty segments; LSE (differentiable);
fully-masked rows give 0 / LSE -inf / zero gradients; backward without atomics (deterministic);
sinks (per-head logits in every row's denominator, forward and their gradient).
fp8 (float8_e4m3fn, float8_e5m2) with FA3's descales (q/k/v_descale, float32 (B, Hkv)), forward only, out
bfloat16: claimed on GPUs of compute capability 8.9+ and under the interpreter of Triton 3.9+, decided when the
claims are first read (adapters/triton_fp8.py); q_descale * k_descale joins the softmax scale, v_descale the
epilogue, P is cast to V's fp8 dtype after the running max is subtracted (kernels/fp8.py).
Serving (adapters/triton_serving.py, forward only): paged and contiguous KV caches of any page size
through a split-KV decode kernel with an LSE combine kernel; append is a torch scatter before the
kernel; num_splits any int >= 1 (claimed: those the tests run); deterministic and batch-invariant.
`tiles` are the fp16/bf16 forward tiles; fp32 and D > 128 use tiles that divide them, so lengths
around multiples of the claimed tiles are tile boundaries for every configuration.
"""
from __future__ import annotations

import importlib.util
import os
import sys


from ..spec import Output, Spec
from .base import adapter
from ..devices import cuda_present

_TILES = (64, 64)  # kernels.launch.default_config / INTERPRETER_CONFIG


def _interpreter_switchable() -> bool:
    """Without a GPU the kernels can only run under the interpreter, which Triton reads when it is first
    imported: it can still be switched on if nobody decided otherwise and triton is not loaded yet."""
    return not cuda_present() and "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules


def use_interpreter_if_needed() -> None:
    """Switch the interpreter on at the first call (never at import: importing this module changes no
    environment variable of the process)."""
    if _interpreter_switchable():
        os.environ["TRITON_INTERPRET"] = "1"


def _availability():
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'attnverify[triton]')"
    from ._external import dist_version, version_tuple

    tv = dist_version("triton")
    if tv and version_tuple(tv) < (3, 6):  # the supported range; torch 2.3's pinned triton 2.3.1 lacks tl.value
        return f"triton {tv} is older than the supported 3.6 (pip install 'attnverify[triton]')"
    if _interpreter_switchable():
        return None  # switched on at the first call
    if not cuda_present() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return ("no CUDA GPU here and the Triton interpreter is off (export TRITON_INTERPRET=1 before "
                "anything imports triton to run on the CPU)")
    return None


def _machine_claims() -> dict:
    """Asked on first use, not at import (NVML: no CUDA context, fork stays safe); fp8 with descales where the
    GPU has fp8 tensor cores (sm_89+) or the interpreter handles fp8 (adapters/triton_fp8.py)."""
    from ._external import dist_version
    from .triton_fp8 import fp8_claims

    cuda = cuda_present()
    return dict(devices=("cuda",) if cuda else ("cpu",), max_seqlen=16384 if cuda else 4096,
                **fp8_claims(cuda, dist_version("triton")))


def _prewarm(scratch: str):
    """`--attn-prewarm` (attnverify/prewarm.py): a context in which the kernels compile and do not run; None under the
    interpreter, which compiles nothing."""
    from ..triton_prewarm import compile_only_here

    return compile_only_here(scratch)


def _refuses(case):
    if case.spec.attn_mask is not None:
        return "triton does not implement attn_mask"
    if case.spec.dropout_p:
        return "triton does not implement dropout"
    if (case.spec.has_descales or str(case.dtype).startswith("float8")) and (
            case.spec.cache_seqlens is not None or case.spec.num_splits is not None):
        return "triton takes fp8 inputs and descales through its FlashAttention forward only, not its decode path"
    return None


@adapter(
    "triton",
    description="bundled Triton FlashAttention-2 kernel (attnverify.kernels), forward and backward",
    availability=_availability,
    refuses=_refuses,
    prepare=use_interpreter_if_needed,  # the plugin calls it at the run's start, before a property imports triton
    prewarm=_prewarm,  # --attn-prewarm: the run's kernels compiled in parallel before it starts
    dtypes=("float16", "bfloat16", "float32"),
    deferred_claims=_machine_claims,  # devices, max_seqlen
    head_dims=lambda d: 1 <= d <= 256,
    causal=("none", "top_left", "bottom_right"),
    window=True,
    softcap=True,
    alibi=True,
    attn_mask=False,
    gqa=True,
    varlen=True,
    dropout=False,
    backward=True,
    lse=True,
    dv_ne_d=True,
    fully_masked="zeros",
    deterministic=True,
    sinks=True,
    tiles=_TILES,
    memory="linear",
    kv_cache=True,
    paged=True,
    page_sizes=lambda p: p >= 1,
    append=True,
    cache_leftpad=True,
    num_splits=(1, 2, 3, 4, 8, 16),
)
def triton(q, k, v, spec: Spec):
    """The bundled Triton FlashAttention-2 kernel."""
    use_interpreter_if_needed()
    from .triton_serving import serve, wants_serving

    if wants_serving(q, k, v, spec):
        return serve(q, k, v, spec)
    from ..kernels.autograd import flash_attention

    out, lse = flash_attention(q, k, v, spec)
    return Output(out, lse=lse if spec.return_lse else None)
