"""The zoo's sink and chunked-attention members (issue 23): a kernel that adds learnable sinks to a finished
softmax (out * exp(LSE - LSE'), LSE' = logaddexp(LSE, sink), the way split-KV combines fold a sink in) and one
with chunked local attention, each with one bug of the kind such kernels shipped."""
from __future__ import annotations

import torch

from .. import visibility
from ..adapters.base import adapter
from ..adapters.naive import naive_attention
from ..spec import Output

# A FlashAttention-class kernel with learnable sinks (gpt-oss; FA3/FA4 `learnable_sink`): half and fp32 inputs,
# head dims multiple of 8 up to 256, bottom-right causal, sliding window, GQA, varlen, LSE, backward incl. dsinks.
SINKS = dict(
    dtypes=("float16", "bfloat16", "float32"), devices=("cpu",), head_dims=lambda d: 8 <= d <= 256 and d % 8 == 0,
    max_seqlen=4096, causal=("none", "bottom_right"), window=True, gqa=True, varlen=True, backward=True, lse=True,
    fully_masked="zeros", sinks=True,
)
# A chunked local attention kernel (Llama 4 `attention_chunk`): the same, chunks instead of sinks, no varlen.
CHUNKED = dict(
    dtypes=("float16", "bfloat16", "float32"), devices=("cpu",), head_dims=lambda d: 8 <= d <= 256 and d % 8 == 0,
    max_seqlen=4096, causal=("none", "bottom_right"), window=True, gqa=True, backward=True, lse=True,
    fully_masked="zeros", attention_chunk=True,
)
SINK_BUGS = ("sink_numerator", "sink_lse_ignored", "sink_grad_zero")
NEG = -1e30  # stands for a -inf sink inside logaddexp, so that no gradient becomes inf - inf


def sinks_attend(q, k, v, spec, bug=None):
    """Attention with spec.sinks folded into a finished softmax; `bug` one of SINK_BUGS or None (correct)."""
    if bug is not None and bug not in SINK_BUGS:
        raise ValueError(f"sinks_attend(bug={bug!r}): use one of {SINK_BUGS} or None")
    base = naive_attention(q, k, v, spec.replace(sinks=None, return_lse=True), return_keep=False)
    if spec.sinks is None:
        return Output(base.out, lse=base.lse if spec.return_lse else None)
    out0, lse0 = base.out.float(), base.lse.float()
    sinks = spec.sinks.detach() if bug == "sink_grad_zero" else spec.sinks
    sink = torch.where(torch.isfinite(sinks), sinks, torch.full_like(sinks, NEG)).float().to(q.device)[None, :, None]
    if spec.is_varlen:  # rows past the last segment belong to no sequence: no sink there
        pad = torch.zeros(lse0.shape[-1], dtype=torch.bool, device=q.device)
        pad[int(torch.as_tensor(spec.cu_seqlens_q)[-1]):] = True
        sink = torch.where(pad, torch.full_like(lse0, NEG), sink)
    lse = torch.logaddexp(lse0, sink)
    out = out0 * torch.exp(lse0 - lse)[..., None]
    if bug == "sink_numerator":  # the sink's weight lands on a value row of ones
        out = out + torch.exp(sink - lse)[..., None]
    if bug == "sink_grad_zero":
        out = out + 0.0 * spec.sinks.sum()
    lse_out = lse0 if bug == "sink_lse_ignored" else torch.where(lse <= NEG / 2, torch.full_like(lse, -float("inf")), lse)
    return Output(out.to(q.dtype), lse=lse_out if spec.return_lse else None)


def chunk_attend(q, k, v, spec, bug=None):
    """Chunked local attention through a bool mask; bug "chunk_off_by_one" puts the query at position p + 1."""
    if spec.attention_chunk is None:
        return naive_attention(q, k, v, spec, return_keep=False)
    lq, lk = q.shape[2], k.shape[2]
    i, j, diag = visibility.row_key_indices(lq, lk, q.device)
    shift = 1 if bug == "chunk_off_by_one" else 0
    vis = visibility.visible(i, j, diag, spec.causal, spec.window)
    vis &= torch.div(j, spec.attention_chunk, rounding_mode="floor") == \
        torch.div(diag + shift, spec.attention_chunk, rounding_mode="floor")
    return naive_attention(q, k, v, spec.replace(attention_chunk=None, causal="none", window=None, attn_mask=vis),
                           return_keep=False)


def _sink_member(name, bug):
    @adapter(f"zoo-{name}", register=False, description=f"zoo (sinks): {bug}", **SINKS)
    def impl(q, k, v, spec):
        return sinks_attend(q, k, v, spec, bug)

    return impl


def _chunk_member(name, bug):
    @adapter(f"zoo-{name}", register=False, description=f"zoo (chunked): {bug}", **CHUNKED)
    def impl(q, k, v, spec):
        return chunk_attend(q, k, v, spec, bug)

    return impl


SMR, CHUNK = "sinks_match_reference", "chunked_matches_reference"


def sink_members():
    from ._members import ZooMember as Z

    return [
        Z("sink-in-numerator", "the sink's weight exp(sink - LSE) is added to the output as if its value row were ones",
          "a sink handled as an ordinary key in the P @ V product (two of three sink paths wrong in a Metal port)",
          _sink_member("sink-in-numerator", "sink_numerator"), (SMR, "sink_as_extra_key"), "eager"),
        Z("sink-lse-ignored", "the output has the sink, the returned LSE does not",
          "LSE written before the sink joins the denominator (a split-KV merge or the next layer then sees no sink)",
          _sink_member("sink-lse-ignored", "sink_lse_ignored"), (SMR, "sink_limits"), "eager"),
        Z("sink-grad-zero", "the sink's gradient is zero (the forward is right)",
          "a backward that never accumulates dsinks = sum_i P_sink,i (dLSE_i - D_i)",
          _sink_member("sink-grad-zero", "sink_grad_zero"), (SMR,), "autograd"),
        Z("chunk-off-by-one", "the query's chunk is taken at position p + 1 (the chunk boundary one position early)",
          "chunked local attention with the boundary off by one (Llama 4 attention_chunk)",
          _chunk_member("chunk-off-by-one", "chunk_off_by_one"), (CHUNK,), "eager"),
    ]


__all__ = ["sink_members", "sinks_attend", "chunk_attend", "SINKS", "CHUNKED", "SINK_BUGS"]


# An MLA kernel in the absorbed form (K and V views of one latent): head dims 576/512 and 192/128, one latent head.
MLA = dict(
    dtypes=("float16", "bfloat16", "float32"), devices=("cpu",), head_dims=(128, 192, 512, 576), dv_ne_d=True,
    causal=("none", "bottom_right"), gqa=True, backward=True,
)


class _LatentDkDropped(torch.autograd.Function):
    """naive's forward; the backward, when V aliases K's storage, writes dV over the latent (the dK path lost)."""

    @staticmethod
    def forward(ctx, q, k, v, spec):
        ctx.spec = spec
        ctx.alias = v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        ctx.save_for_backward(q, k, v)
        return naive_attention(q, k, v, spec, return_keep=False).out

    @staticmethod
    def backward(ctx, g):
        q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = naive_attention(q, k, v, ctx.spec, return_keep=False).out
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
        if ctx.alias:
            dk = torch.zeros_like(dk)
        return dq, dk, dv, None


def mla_members():
    from ._members import ZooMember as Z

    @adapter("zoo-mla-latent-dk-dropped", register=False, description="zoo (MLA): dK path dropped for latent K/V", **MLA)
    def impl(q, k, v, spec):
        return _LatentDkDropped.apply(q, k, v, spec)

    return [Z("mla-latent-dk-dropped", "with K and V views of one latent, the latent's gradient is dV alone (dK dropped)",
              "latent K/V treated as separate copies in an absorbed-MLA backward (one gradient overwrites the other)",
              impl, ("mla_latent_views",), "autograd")]
