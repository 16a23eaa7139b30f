"""Registers this repo's kernels with attnverify: `pytest --adapter=mykernel` or `attnverify run --adapter mykernel`."""
import torch

import attnverify as av

import mykernel
import mykernel_fixed

CLAIMS = dict(
    dtypes=("float32", "float16", "bfloat16"),
    devices=("cpu", "cuda"),
    head_dims=lambda d: 1 <= d <= 256,
    max_seqlen=2048,
    causal=("none", "bottom_right"),  # what the kernel promises: flash-attn's alignment
    attn_mask=True,  # boolean masks only: float masks are refused below
    backward=True,  # plain torch ops: autograd gives the gradients
    fully_masked="zeros",  # what the kernel promises for a row that sees no key
    deterministic=True,
)


def _refuses(case):
    m = case.spec.attn_mask
    if m is not None and m.dtype != torch.bool:
        return "mykernel takes boolean masks only"
    return None


def _call(kernel, q, k, v, spec):
    return kernel.attention(q, k, v, causal=spec.causal != "none", softmax_scale=spec.scale,
                            attn_mask=spec.attn_mask)


@av.adapter("mykernel", refuses=_refuses, **CLAIMS)
def mykernel_adapter(q, k, v, spec: av.Spec):
    return _call(mykernel, q, k, v, spec)


@av.adapter("mykernel-fixed", refuses=_refuses, **CLAIMS)
def mykernel_fixed_adapter(q, k, v, spec: av.Spec):
    return _call(mykernel_fixed, q, k, v, spec)
