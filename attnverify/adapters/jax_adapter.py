"""JAX: `jax.nn.dot_product_attention`, fed torch tensors through DLPack.

Importing this module imports no JAX. On a CPU machine (or with ATTNVERIFY_JAX_IMPLEMENTATION=xla)
the call uses implementation="xla"; where torch sees a GPU and a JAX CUDA plugin is installed it
uses implementation="cudnn" (cuDNN flash attention) on that GPU. XLA_PYTHON_CLIENT_PREALLOCATE is
set to false (unless you set it) before JAX is first imported, so JAX does not take 75% of the GPU
that torch shares. Tensors cross by DLPack: torch -> jax is zero-copy for contiguous BTNH views
(jax copies other strides), jax -> torch is zero-copy; BHSD <-> BTNH are transposed views.
One jitted function per static configuration (causal, window, scale, residual) is cached; XLA
compiles it once per shape (~0.1 s on the CPU).

Claims for the XLA implementation, from the docstring and the source of jax/_src/nn/functions.py
(jax 0.10.2) and measured on the CPU (tests/test_external_adapters.py, docs/compatibility.md):

- is_causal is TOP-LEFT: `_get_causal_mask` is `jnp.tril(ones((T, S)))`, so with Lq != Lk it is not
  flash-attn's bottom-right mask -> causal=("none", "top_left").
- local_window_size=(left, right) is also top-left aligned: `_get_window_mask` keeps
  i - left <= j <= i + right. SPEC's windows are bottom-right aligned, the same only when Lq == Lk,
  so windows are refused when Lq != Lk (per segment for varlen). -1 (unbounded) is passed as Lq + Lk.
- mask: boolean, True = attend; bias: additive; both 4-D broadcastable to (B, N, T, S).
- scale: logits *= scale. GQA: K heads with N % K == 0, query head n reads kv head n // (N // K).
- masked logits are replaced by a large finite negative number (-0.7 * float32 max), not -inf: a row
  with no visible key returns the mean of V, neither 0 nor NaN -> fully_masked="unsupported".
- varlen: the packed documents are unpacked into a padded batch (one document per batch row) and
  passed with query_seq_lengths / key_value_seq_lengths, JAX's documented padding support; causal
  and windows then apply inside each document (top-left within a document = SPEC's per-segment
  masks when the document's lengths are equal).
- LSE: return_residual=True gives the logsumexp of the masked logits, but cast to the key dtype
  (`.astype(key.dtype)`): claimed, and refused for fp16/bf16 inputs, where it is rounded.
- softmax in float32, logits with fp32 accumulation ("BF16_BF16_F32"); dtypes bf16 and fp32 on the
  CPU. fp16 is not claimed there: under jax.jit the logits einsum asks for precision F16_F16_F32,
  which XLA:CPU's dot_general rejects at compile time (jax's try/except fallback to the default
  precision only works eagerly) -- a JAX finding, docs/compatibility.md. fp64 would need
  jax_enable_x64, a process-wide switch: not claimed; unclaimed dtypes raise TypeError here (JAX
  without x64 would silently compute float64 in float32). Dv == D ("value: should have the same
  shape as the key array").
- bf16 with B = H = Lq = Lk = 1 does not compile under jax.jit on XLA:CPU ("Algorithm not supported
  by the ElementalIrEmitter: ALG_DOT_BF16_BF16_F32"); for that one shape the adapter calls the
  function eagerly, where JAX's own fallback works (finding recorded in docs/compatibility.md).
- forward only (no gradients are wired back to torch); deterministic on the CPU (measured).

cuDNN (GPU) claims are narrower: fp16/bf16, head dims multiples of 8 up to 128, no window, no LSE.
Its thorough run on the H200 (jax 0.11.2) found that the cuDNN path rejects masks with a broadcast
query or key dimension, which the docstring allows ("broadcastable to (B, N, T, S)"): the adapter
expands those two dimensions for cuDNN (F15 in docs/compatibility.md).
"""
from __future__ import annotations

import functools
import importlib.util
import os
from typing import Optional

import torch

from ..spec import Output, Spec
from ..devices import cuda_present
from ._external import probe, segments
from .base import adapter

_AVAIL: dict = {}


@functools.lru_cache(maxsize=None)
def _machine() -> tuple:
    """(implementation, on a GPU): asked on first use, not at import. On a GPU where torch sees one and JAX's CUDA
    plugin is installed; the implementation "cudnn" there, else "xla", unless ATTNVERIFY_JAX_IMPLEMENTATION says."""
    plugin = importlib.util.find_spec("jax") is not None and any(
        importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    on_gpu = bool(plugin and cuda_present())
    return os.environ.get("ATTNVERIFY_JAX_IMPLEMENTATION") or ("cudnn" if on_gpu else "xla"), on_gpu


def _impl() -> str:
    return _machine()[0]


def _on_gpu() -> bool:
    return _machine()[1]

_PROBE = r"""
import inspect
import jax, jax.numpy as jnp
params = inspect.signature(jax.nn.dot_product_attention).parameters
for name in ("local_window_size", "query_seq_lengths", "implementation"):
    if name not in params:
        _done(False, f"jax {jax.__version__}: jax.nn.dot_product_attention has no {name} (upgrade jax)")
platform = "%s"
devs = jax.devices(platform)
if not devs:
    _done(False, f"JAX sees no {platform} device")
x = jax.device_put(jnp.ones((1, 4, 2, 8), jnp.float32), devs[0])
out = jax.nn.dot_product_attention(x, x, x, is_causal=True)
out.block_until_ready()
_done(True, version=jax.__version__, platform=platform)
"""


def _available() -> Optional[str]:
    if "why" in _AVAIL:
        return _AVAIL["why"]
    why: Optional[str] = None
    if importlib.util.find_spec("jax") is None:
        why = "jax is not installed (pip install 'attnverify[jax]', or pip install jax jaxlib for the CPU)"
    else:
        # in a child process: importing JAX and starting its backend here would make the forked
        # judges of attnverify.isolation inherit JAX's threads (and, on a GPU, its CUDA context)
        ok, msg, _ = probe("jax", _PROBE % ("gpu" if _on_gpu() else "cpu"))
        why = None if ok else msg
    _AVAIL["why"] = why
    return why


def _jax():
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    return jax


def _refuses(case) -> Optional[str]:
    s = case.spec
    lq, lk = case.q.shape[2], case.k.shape[2]
    if s.window is not None:
        if _impl() == "cudnn":
            return "jax's cudnn implementation is not claimed with local_window_size"
        if s.is_varlen:
            if any(q1 - q0 != k1 - k0 for q0, q1, k0, k1 in segments(s)):
                return "jax's local_window_size is top-left aligned: equals SPEC's bottom-right window only when Lq == Lk"
        elif lq != lk:
            return "jax's local_window_size is top-left aligned: equals SPEC's bottom-right window only when Lq == Lk"
    if s.return_lse:
        if case.q.dtype in (torch.float16, torch.bfloat16):
            return "jax returns the logsumexp residual cast to the key dtype (rounded for fp16/bf16)"
        import inspect

        if "return_residual" not in inspect.signature(_jax().nn.dot_product_attention).parameters:
            return "this jax has no return_residual (no LSE output)"
    if s.is_varlen and s.attn_mask is not None:
        return "attn_mask with varlen is not a SPEC combination"
    return None


@functools.lru_cache(maxsize=None)
def _jitted(is_causal: bool, window, scale: float, residual: bool, implementation: str, has_mask: bool,
            has_bias: bool, has_lengths: bool):
    jax = _jax()

    def f(q, k, v, mask, bias, q_len, kv_len):
        kw = dict(scale=scale, is_causal=is_causal, implementation=implementation)
        if window is not None:
            kw["local_window_size"] = window
        if residual:
            kw["return_residual"] = True
        if has_lengths:
            kw["query_seq_lengths"] = q_len
            kw["key_value_seq_lengths"] = kv_len
        return jax.nn.dot_product_attention(q, k, v, bias=bias if has_bias else None, mask=mask if has_mask else None, **kw)

    return jax.jit(f), f


def _degenerate_bf16(q, k) -> bool:
    """bf16 with B = H = Lq = Lk = 1: XLA:CPU cannot compile jax's attention under jax.jit.

    Measured (jax 0.10.2): with every non-contracted dim 1 the dot is lowered elementally, and the
    ElementalIrEmitter rejects the BF16_BF16_F32 algorithm jax asks for ("Algorithm not supported by the
    ElementalIrEmitter: ALG_DOT_BF16_BF16_F32"). Called eagerly, jax's own fallback to the default
    precision catches the error. docs/compatibility.md has the reproduction.
    """
    return (not _on_gpu() and q.dtype == torch.bfloat16
            and q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] == 1)


def _compact(t: torch.Tensor) -> bool:
    """A permutation of a dense tensor (what JAX's DLPack import accepts without copying)."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


# XLA requires every entry parameter of an executable to be 16-byte aligned, but jax's DLPack import
# takes a misaligned GPU buffer without copying; the executable then fails with INTERNAL "Address of
# buffer N must be a multiple of 10" (hex), reported when the output is read (H200, jax 0.11.2; F20).
_XLA_ALIGN = 16


def _importable(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy JAX can use: compact strides and a 16-byte aligned start."""
    if not _compact(t):  # sliced / broadcast (stride 0) views: JAX accepts only compact strides
        return t.contiguous()
    if t.numel() and t.data_ptr() % _XLA_ALIGN:  # e.g. one batch element sliced out of a bool mask
        return t.clone(memory_format=torch.preserve_format)
    return t


def _to_jax(t: torch.Tensor):
    jax = _jax()
    dev = jax.devices("gpu" if t.is_cuda else "cpu")[0]
    t = _importable(t.detach())
    x = jax.dlpack.from_dlpack(t)
    return x if x.devices() == {dev} else jax.device_put(x, dev)


def _to_torch(x, device) -> torch.Tensor:
    return torch.from_dlpack(x).to(device)


def _window(spec: Spec, lq: int, lk: int):
    if spec.window is None:
        return None
    big = lq + lk + 1
    left, right = spec.window
    return (left if left >= 0 else big, right if right >= 0 else big)


def _mask4(m: torch.Tensor) -> torch.Tensor:
    return m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))


def _call(q, k, v, spec: Spec, mask=None, bias=None, q_len=None, kv_len=None):
    """q, k, v BHSD torch tensors -> (out BHSD torch, lse (B, H, T) torch or None)."""
    b, hq, lq, d = q.shape
    lk = k.shape[2]
    residual = bool(spec.return_lse)
    jitted, eager = _jitted(spec.causal == "top_left", _window(spec, lq, lk), float(spec.resolved_scale(d)), residual,
                            _impl(), mask is not None, bias is not None, q_len is not None)
    fn = eager if _degenerate_bf16(q, k) else jitted
    jq, jk, jv = (_to_jax(t.transpose(1, 2)) for t in (q, k, v))  # BTNH views
    jm = _to_jax(mask) if mask is not None else None
    jb = _to_jax(bias) if bias is not None else None
    jl = (_to_jax(q_len), _to_jax(kv_len)) if q_len is not None else (None, None)
    res = fn(jq, jk, jv, jm, jb, *jl)
    out, lse = (res if residual else (res, None))
    out = _to_torch(out, q.device).transpose(1, 2)
    if lse is not None:
        lse = _to_torch(lse, q.device).float().transpose(1, 2)  # BTN -> BNT
    return out, lse


def _claims() -> dict:
    """What depends on the machine (asked on first use): the cudnn implementation's narrower claims, or XLA's on
    the device JAX runs on."""
    on_gpu = _on_gpu()
    if _impl() == "cudnn":
        return dict(dtypes=("float16", "bfloat16"), devices=("cuda",), head_dims=lambda d: d % 8 == 0 and 8 <= d <= 128,
                    window=False, lse=False, deterministic=False)
    # float16 on the CPU: under jax.jit the logits einsum asks for precision F16_F16_F32, which XLA's
    # CPU dot_general rejects at compile time ("not supported by dot_general on CPU"); the function's
    # try/except fallback to default precision only catches it when called eagerly -> not claimed
    return dict(dtypes=("float16", "bfloat16", "float32") if on_gpu else ("bfloat16", "float32"),
                devices=("cuda",) if on_gpu else ("cpu",),
                head_dims=lambda d: 1 <= d <= 512, window=True, lse=True, deterministic=not on_gpu)


@adapter(
    "jax",
    description="jax.nn.dot_product_attention through DLPack (implementation 'xla'; 'cudnn' on a GPU with JAX's "
                "CUDA plugin)",
    availability=_available,
    refuses=_refuses,
    max_seqlen=8192,
    causal=("none", "top_left"),
    softcap=False, alibi=False, attn_mask=True, gqa=True, varlen=True, dropout=False,
    backward=False, dv_ne_d=False, fully_masked="unsupported", memory="quadratic",
    deferred_claims=_claims,  # dtypes, devices, head_dims, window, lse, deterministic
)
def jax_attention(q, k, v, spec: Spec):
    """jax.nn.dot_product_attention."""
    claimed = jax_attention.claims.dtypes
    for name, t in (("q", q), ("k", k), ("v", v)):
        dname = str(t.dtype).replace("torch.", "")
        if dname not in claimed:  # JAX without x64 would silently compute float64 in float32
            raise TypeError(f"jax adapter: {name} is {dname}; claimed dtypes are {claimed}")
    if not spec.is_varlen:
        mask = bias = None
        m = spec.attn_mask
        if m is not None:
            m4 = _mask4(m)
            if _impl() == "cudnn":
                # JAX documents masks broadcastable to (B, N, T, S), but its cuDNN path rejects a
                # broadcast T or S ("Bias must have same seq length as QKV, got 2 and 1"; H200,
                # jax 0.11.2, docs/compatibility.md F15): materialise those two dims
                m4 = m4.expand(*m4.shape[:2], q.shape[2], k.shape[2])
            if m.dtype == torch.bool:
                mask = m4.contiguous()
            else:
                bias = m4.to(q.dtype).contiguous()
        out, lse = _call(q, k, v, spec, mask=mask, bias=bias)
        return Output(out, lse=lse)
    # varlen: one padded batch row per document, with JAX's sequence lengths
    segs = segments(spec)
    n = len(segs)
    hq, hkv, d, dv = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
    tq = max([q1 - q0 for q0, q1, _, _ in segs] + [1])
    tk = max([k1 - k0 for _, _, k0, k1 in segs] + [1])
    qp = q.new_zeros(n, hq, tq, d)
    kp = k.new_zeros(n, hkv, tk, d)
    vp = v.new_zeros(n, hkv, tk, dv)
    for i, (q0, q1, k0, k1) in enumerate(segs):
        qp[i, :, : q1 - q0] = q[0, :, q0:q1]
        kp[i, :, : k1 - k0] = k[0, :, k0:k1]
        vp[i, :, : k1 - k0] = v[0, :, k0:k1]
    q_len = torch.tensor([q1 - q0 for q0, q1, _, _ in segs], dtype=torch.int32)
    kv_len = torch.tensor([k1 - k0 for _, _, k0, k1 in segs], dtype=torch.int32)
    outp, lsep = _call(qp, kp, vp, spec, q_len=q_len.to(q.device), kv_len=kv_len.to(q.device))
    out = q.new_zeros(1, hq, q.shape[2], dv)
    lse = torch.full((1, hq, q.shape[2]), float("-inf"), device=q.device) if lsep is not None else None
    for i, (q0, q1, _, _) in enumerate(segs):
        out[0, :, q0:q1] = outp[i, :, : q1 - q0]
        if lse is not None:
            lse[0, :, q0:q1] = lsep[i, :, : q1 - q0]
    return Output(out, lse=lse)


jax = jax_attention  # the registry name
