"""Keras 3: `keras.ops.dot_product_attention`, one adapter per backend (`keras-torch`, `keras-jax`).

Keras picks its backend once per process, from KERAS_BACKEND, when `keras` is first imported. Importing
this module imports no keras and touches no environment variable. The backend is resolved lazily, in the
adapter call (which attnverify makes in its forked judge process, never in the process that drives
Hypothesis): if keras is not imported yet, KERAS_BACKEND is set to the adapter's backend and keras is
imported; if keras is already loaded with another backend (a judge that served the other keras adapter,
or a user's process), the call switches with Keras' documented `keras.config.set_backend(name)` ("Reload
the backend (and the Keras package)") and fetches `keras.ops` again -- no keras object is kept across
calls, which is the condition that function's docstring sets. So both adapters run in one `attnverify
run`; a user who imported keras with a third backend in the same process has it switched under them
(use `--attn-isolate subprocess`, the default, to keep the driving process clean).

Claims from the docstring of keras.ops.dot_product_attention (keras 3.15.1) and the backends' source
(keras/src/backend/{torch,jax}/nn.py):
- layout `(B, T, N, H)`; "When `K` equals `N`, multi-headed attention (MHA) is performed. Otherwise,
  grouped query attention (GQA) is performed if `N` is a multiple of `K`" -> gqa;
- "value: The value array with the same shape of `key`" -> Dv == D;
- "bias: Optional bias array to be added to logits", "mask: ... a boolean mask where `True` indicates the
  element should take part in attention", both "broadcastable to `(B, N, T, S)`"; "Only one of `bias` and
  `mask` can be provided" (a float mask goes in `bias`, a bool one in `mask`);
- `scale` "If `None`, the scale will be set to `1.0 / sqrt(H)`";
- `is_causal`: the torch backend builds `torch.tril(ones((q_len, kv_len)))` (top-left) and folds it into
  a mask; the jax backend calls jax.nn.dot_product_attention (`jnp.tril`, top-left) -> ("none", "top_left");
- masked logits become a large finite negative (`_get_large_negative`), so a fully-masked row is a mean
  of V -> fully_masked="unsupported";
- `attn_logits_soft_cap` "is only supported in JAX TPU backend" -> no softcap;
- keras-torch stays in torch (gradients flow through it: backward claimed); keras-jax crosses through
  numpy (forward only), in bfloat16 and float32 (float16 does not compile under XLA:CPU's jit, F4).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Optional

import torch

from ..spec import Spec
from ._findings import CPU_FLASH_SWALLOWED, DIFFERENT_KV
from .base import adapter

# keras' torch backend calls torch's F.scaled_dot_product_attention, which on the CPU picks the flash kernel: its two
# CPU findings (docs/tolerances.md, declared on sdpa-flash too) come through keras unchanged (ci profile, torch 2.13)
_TORCH_FINDINGS = {
    "nonfinite_inputs_propagate": {"why": "keras-torch runs torch SDPA's CPU flash kernel (torch 2.13), which returns "
                                          "numbers for a query row holding NaN, and in fp16/bf16 for rows whose score "
                                          "against a key holding +inf is +inf (as sdpa-flash; docs/tolerances.md)",
                                   "match": CPU_FLASH_SWALLOWED},
    "contract": {"why": "keras does not check 'value ... the same shape of key' and torch SDPA's CPU flash kernel "
                        "(torch 2.13) accepts k and v of different lengths (as sdpa-flash; docs/tolerances.md)",
                 "match": DIFFERENT_KV},
}

_BACKEND_LIB = {"torch": "torch", "jax": "jax"}

# keras 3.15.1, jax backend (ci profile): k of length 1 and v of length 2 are computed (the key broadcast against the
# values), though the docstring says "value: The value array with the same shape of `key`" (docs/compatibility.md F29)
_JAX_FINDINGS = {
    "contract": {"why": "keras-jax (keras 3.15.1, jax 0.10.2) computes k and v of different lengths (k with Lk = 1 is "
                        "broadcast against v) instead of raising; the docstring requires value of the key's shape "
                        "(docs/compatibility.md F29)", "match": DIFFERENT_KV},
}


def _availability(backend: str):
    def check() -> Optional[str]:
        if importlib.util.find_spec("keras") is None:
            return "keras is not installed (pip install keras)"
        lib = _BACKEND_LIB[backend]
        if importlib.util.find_spec(lib) is None:
            return f"keras' {backend} backend needs {lib}, which is not installed"
        return None

    return check


def _ops(backend: str):
    """keras.ops with `backend` loaded (see the module docstring)."""
    if "keras" not in sys.modules:
        os.environ["KERAS_BACKEND"] = backend
        if backend == "jax":
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    keras = importlib.import_module("keras")
    if keras.backend.backend() != backend:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Using `keras.config.set_backend` is dangerous": no object is kept
            keras.config.set_backend(backend)
        keras = importlib.import_module("keras")
    return keras.ops


def _refuses(case) -> Optional[str]:
    if case.spec.attn_mask is not None and case.spec.causal != "none" and case.spec.attn_mask.dtype != torch.bool:
        return "keras folds is_causal into a boolean mask; a float mask goes in `bias`, which is not combined with it"
    return None


def _call(q, k, v, spec: Spec, backend: str, claimed):
    for name, t in (("q", q), ("k", k), ("v", v)):
        dname = str(t.dtype).replace("torch.", "")
        if dname not in claimed:
            raise TypeError(f"keras-{backend} adapter: {name} is {dname}; claimed dtypes are {claimed}")
    ops = _ops(backend)
    kw = {"scale": spec.scale, "is_causal": spec.causal == "top_left"}
    m = spec.attn_mask
    if m is not None:
        m4 = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))
        kw["mask" if m.dtype == torch.bool else "bias"] = m4 if m.dtype == torch.bool else m4.to(q.dtype)
    if backend == "torch":
        out = ops.dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)
        return out.transpose(1, 2)
    # jax: through numpy (bf16 as float32 bits would change the dtype: ml_dtypes' bfloat16 comes with jax)
    import ml_dtypes
    import numpy as np

    def to_np(t):
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    args = [to_np(t.transpose(1, 2).contiguous()) for t in (q, k, v)]
    for key in ("mask", "bias"):
        if key in kw:
            kw[key] = to_np(kw[key].contiguous())
    out = np.asarray(ops.dot_product_attention(*args, **kw))
    if out.dtype == ml_dtypes.bfloat16:
        res = torch.from_numpy(out.view(np.int16).copy()).view(torch.bfloat16)
    else:
        res = torch.from_numpy(out.copy())
    return res.transpose(1, 2).to(q.device)


_TORCH_DTYPES = ("float16", "bfloat16", "float32")
_JAX_DTYPES = ("bfloat16", "float32")
_COMMON = dict(devices=("cpu",), head_dims=lambda d: 1 <= d <= 512, max_seqlen=4096, causal=("none", "top_left"),
               attn_mask=True, gqa=True, dv_ne_d=False, fully_masked="unsupported", deterministic=True)


@adapter("keras-torch", on_request_cpu="ci profile 383 s on a 2-core CPU",
         description="keras.ops.dot_product_attention, torch backend",
         availability=_availability("torch"), refuses=_refuses, dtypes=_TORCH_DTYPES, backward=True,
         known_failures=_TORCH_FINDINGS, **_COMMON)
def keras_torch(q, k, v, spec: Spec):
    """keras.ops.dot_product_attention with KERAS_BACKEND=torch."""
    return _call(q, k, v, spec, "torch", _TORCH_DTYPES)


@adapter("keras-jax", on_request_cpu="ci profile 2,032 s on a 2-core CPU (about 3 s an example)",
         description="keras.ops.dot_product_attention, jax backend (through numpy)",
         availability=_availability("jax"), refuses=_refuses, dtypes=_JAX_DTYPES, known_failures=_JAX_FINDINGS,
         **_COMMON)
def keras_jax(q, k, v, spec: Spec):
    """keras.ops.dot_product_attention with KERAS_BACKEND=jax."""
    return _call(q, k, v, spec, "jax", _JAX_DTYPES)
