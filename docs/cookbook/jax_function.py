"""Recipe: a JAX function, called from torch through DLPack, with gradients through jax.vjp."""
import functools

import jax
import jax.numpy as jnp
import torch

import attnverify as av


@functools.partial(jax.jit, static_argnames=("causal", "scale"))
def jax_attention(q, k, v, *, causal: bool, scale: float):
    """q (B, T, N, H), k and v (B, S, K, H): jax.nn.dot_product_attention's BTNH layout; N % K == 0."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)  # query head n reads kv head n // (N // K)
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    if causal:  # bottom-right aligned
        visible = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + (s - t)
        logits = jnp.where(visible, logits, -jnp.inf)
    dead = jnp.all(jnp.isneginf(logits), axis=-1, keepdims=True)  # rows with no visible key
    p = jnp.where(dead, 0.0, jax.nn.softmax(jnp.where(dead, 0.0, logits), axis=-1))
    out = jnp.einsum("bkgts,bskh->btkgh", p, v.astype(jnp.float32))
    return out.reshape(b, t, n, v.shape[-1]).astype(q.dtype)


def _to_jax(t: torch.Tensor):
    return jax.dlpack.from_dlpack(t.detach().contiguous())  # zero-copy for a contiguous tensor


def _to_torch(x) -> torch.Tensor:
    return torch.from_dlpack(x)  # zero-copy


class JaxAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        f = functools.partial(jax_attention, causal=causal, scale=scale)
        out, ctx.vjp = jax.vjp(f, *(_to_jax(t) for t in (q, k, v)))  # keeps what backward needs, in JAX
        return _to_torch(out)

    @staticmethod
    def backward(ctx, d_out):
        dq, dk, dv = ctx.vjp(_to_jax(d_out))
        return _to_torch(dq), _to_torch(dk), _to_torch(dv), None, None


@av.adapter(
    "jax-kernel",
    dtypes=("float32", "bfloat16"),
    devices=("cpu",),  # JAX's CPU backend here; with a JAX CUDA plugin, claim "cuda" as well
    head_dims=lambda d: d <= 256,
    causal=("none", "bottom_right"),
    gqa=True, dv_ne_d=True,
    backward=True,
    fully_masked="zeros",
    deterministic=True,
)
def jax_kernel(q, k, v, spec: av.Spec):
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"jax_kernel: claims float32 and bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}")
    bthd = lambda t: t.transpose(1, 2)  # noqa: E731 - BHSD <-> BTNH, views
    out = JaxAttention.apply(bthd(q), bthd(k), bthd(v), spec.causal == "bottom_right",
                             spec.resolved_scale(q.shape[-1]))
    return bthd(out)
