"""A stranger's MLA kernels in DeepSeek's absorbed form, written the way FlashMLA documents them, and their adapters,
written from docs/adapters.md, docs/guide.md and the README alone.

Decode (``flash_mla_with_kvcache``, FlashMLA's README and its docstring; plain torch standing for the CUDA kernel)::

    tile_scheduler_metadata, num_splits = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                                      tile_scheduler_metadata, num_splits, softmax_scale=None, causal=False,
                                      attn_sink=None)

- ``q`` (batch, seq_len_q, num_heads_q, 576): 512 latent ("nope", the absorbed W_UK applied) + 64 rope columns;
- ``k_cache`` (num_blocks, 64, 1, 576): the paged latent cache, page ("block") size 64, ONE kv head (MQA mode); the
  scores use all 576 columns; V is the first ``head_dim_v`` = 512 columns of the same cache (no V argument);
- ``block_table`` int32 (batch, max_num_blocks_per_seq), ``cache_seqlens`` int32 (batch,);
- ``softmax_scale`` defaults to 1 / sqrt(576); ``causal`` is bottom-right aligned (FlashMLA's reference:
  ``tril(diagonal=s_k - s_q)``), for MTP / speculative decoding with seq_len_q > 1;
- returns ``out`` (batch, seq_len_q, num_heads_q, 512) in q's dtype and ``lse`` (batch, num_heads_q, seq_len_q)
  float32, natural log; a query row with no attendable key gets out 0 and lse +inf (FlashMLA's tests/ref.py: "Correct
  for q tokens which has no attendable k": ``lse[lonely_q_mask] = float("+inf")``); bfloat16 and float16; forward only;
- ``attn_sink`` (num_heads_q,) float32: "If presented, the final output will be scaled by exp(lse) / (exp(lse) +
  exp(attn_sink)). Have no affect on the returned softmax_lse" (flash_mla_interface.py): the sink joins the output's
  denominator, the returned LSE is over the keys alone -- declared as ``sink_in_lse=False``.

Prefill (FlashMLA's dense "MHA mode": ``flash_attn_varlen_func``-like, head_dim_qk 192 = 128 nope + 64 rope, head_dim_v
128, separate k and v, forward and backward): ``mla_prefill(q, k, v, softmax_scale=None, causal=False)`` on BSHD tensors.

``DECODE_BUGS`` / ``PREFILL_BUGS`` are the mistakes a kernel author makes; each has an adapter with the right one's
claims (``flashmla_like_<bug>``, ``mla_prefill_like_<bug>``).
"""

from __future__ import annotations

import torch

import attnverify as av

PAGE = 64
D_QK, D_V = 576, 512
DECODE_BUGS = (
    "v_wrong_slice",  # V read from the last 512 columns of the cache (the rope assumed first), not the first 512
    "rope_dropped",  # the score from the 512 latent columns only: the 64 rope columns left out
    "lse_base2",  # the LSE returned in base 2 (the kernel's exp2 domain), not natural log
    "page_index_off_by_one",  # physical page numbers read 1-based: block_table[b, i] + 1
    "sink_ignored",  # attn_sink dropped: the output's denominator without the sink (check and mla_latent_views see it,
    # tests/test_stranger_mla_chunk.py)
)
PREFILL_BUGS = (
    "latent_grad_overwritten",  # V a view of K (one latent): dV written over dK's first columns, not added
)


def get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k):
    """Scheduling metadata (opaque here): (tile_scheduler_metadata, num_splits)."""
    b = cache_seqlens.shape[0]
    return torch.zeros(1, 8, dtype=torch.int32), torch.arange(b + 1, dtype=torch.int32)


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                           softmax_scale=None, causal=False, attn_sink=None, *, _bug=None):
    if q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != q.dtype:
        raise TypeError(f"flash_mla_with_kvcache: bf16/fp16 only, q and k_cache alike; got {q.dtype}, {k_cache.dtype}")
    b, s_q, h_q, d = q.shape
    if d != D_QK or head_dim_v != D_V:
        raise ValueError(f"flash_mla_with_kvcache: head_dim must be 576 and head_dim_v 512; got {d}, {head_dim_v}")
    if k_cache.dim() != 4 or k_cache.shape[1] != PAGE or k_cache.shape[2] != 1 or k_cache.shape[3] != d:
        raise ValueError(f"flash_mla_with_kvcache: k_cache must be (num_blocks, 64, 1, 576); got {tuple(k_cache.shape)}")
    if block_table.dtype != torch.int32 or cache_seqlens.dtype != torch.int32:
        raise TypeError("flash_mla_with_kvcache: block_table and cache_seqlens must be int32")
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    out = q.new_zeros(b, s_q, h_q, head_dim_v)
    lse = torch.full((b, h_q, s_q), float("inf"), dtype=torch.float32, device=q.device)
    for i in range(b):
        n = int(cache_seqlens[i])
        pages = block_table[i, :(n + PAGE - 1) // PAGE].long()
        if _bug == "page_index_off_by_one":
            pages = pages + 1
        lat = k_cache[pages.clamp(max=k_cache.shape[0] - 1)].reshape(-1, d)[:n].float()  # (n, 576)
        kk = lat[:, :D_V] if _bug == "rope_dropped" else lat
        qq = q[i].float()[..., :D_V] if _bug == "rope_dropped" else q[i].float()
        vv = lat[:, -head_dim_v:] if _bug == "v_wrong_slice" else lat[:, :head_dim_v]
        s = torch.einsum("qhd,nd->hqn", qq, kk) * scale  # (h_q, s_q, n)
        if causal:
            vis = torch.ones(s_q, n, dtype=torch.bool, device=q.device).tril(diagonal=n - s_q)
            s = s.masked_fill(~vis, float("-inf"))
        m = s.amax(-1, keepdim=True) if n else s.new_full((h_q, s_q, 1), float("-inf"))
        live = m != float("-inf")  # NaN and +Inf scores propagate
        e = torch.exp(s - torch.where(live, m, torch.zeros_like(m)))
        den = e.sum(-1, keepdim=True)
        o = torch.where(live, (e @ vv) / torch.where(live, den, torch.ones_like(den)), torch.zeros_like(den))
        row_lse = (m + torch.log(den)).squeeze(-1)
        if attn_sink is not None and _bug != "sink_ignored":  # out * exp(lse) / (exp(lse) + exp(sink)); lse as it is
            sink = attn_sink.float().to(q.device)[:, None]  # "-inf has no effect" (FlashMLA's later docstring)
            keep = torch.where(torch.isneginf(sink), torch.ones_like(row_lse), torch.sigmoid(row_lse - sink))
            o = o * keep.unsqueeze(-1)
        out[i] = o.transpose(0, 1).to(q.dtype)
        if _bug == "lse_base2":
            row_lse = row_lse / torch.log(torch.tensor(2.0))
        lse[i] = torch.where(live.squeeze(-1), row_lse, torch.full_like(row_lse, float("inf")))  # FlashMLA: +inf
    return out, lse


def _as_pages(latent):
    """A plain call's latent (B, 1, Lk, 576) as a paged cache of 64-slot pages: (B * nb, 64, 1, 576), table (B, nb)."""
    b, _, lk, d = latent.shape
    nb = max(1, -(-lk // PAGE))
    pool = latent.new_zeros(b, nb * PAGE, 1, d)
    pool[:, :lk] = latent.transpose(1, 2)
    table = torch.arange(b * nb, dtype=torch.int32, device=latent.device).reshape(b, nb)
    return pool.reshape(b * nb, PAGE, 1, d), table


def _decode_refusal(q, k, v, spec):
    """Per-case limits: FlashMLA's one latent kv head, 576/512, V the first 512 columns of K."""
    if q.shape[-1] != D_QK or v.shape[-1] != D_V:
        return f"FlashMLA decode: head dims 576 (q, k) and 512 (v) only; got {q.shape[-1]}, {v.shape[-1]}"
    heads_kv = k.shape[2] if spec.cache_seqlens is not None else k.shape[1]
    if heads_kv != 1:
        return f"FlashMLA decode: one latent kv head (MQA mode); got {heads_kv}"
    if not torch.equal(v, k[..., :D_V]):  # the kernel has no V argument: V is the cache's first 512 columns
        return "FlashMLA decode: V must be the first 512 columns of K (one latent cache)"
    return None


DECODE_CLAIMS = dict(
    dtypes=("bfloat16", "float16"),
    devices=("cpu",),  # plain torch here; the real kernel is CUDA (SM90)
    head_dims=(D_QK, D_V),
    dv_ne_d=True,
    latent_kv=True,  # no V argument: V is the first 512 columns of the latent cache (only mla_latent_views draws it)
    gqa=True,  # h_q query heads on one latent kv head
    causal=("none", "bottom_right"),
    lse=True,
    # a query row with no visible key (bottom-right causal, s_q > cache_seqlens): out 0 and LSE +inf, FlashMLA's
    # convention (its tests/ref.py: "lse[lonely_q_mask] = float('+inf')"), declared instead of rewritten to -inf
    fully_masked="zeros",
    keyless_lse="+inf",
    # attn_sink: the output's denominator has it, the returned LSE has not (FlashMLA's docstring: "Have no affect on
    # the returned softmax_lse"), declared instead of adding the sink back into the LSE
    sinks=True,
    sink_in_lse=False,
    paged=True,  # block_table with pages of 64 (with latent_kv the paged properties skip: they draw K and V apart)
    page_sizes=(PAGE,),
    refuses=lambda case: _decode_refusal(case.q, case.k, case.v, case.spec),
)


def _decode_call(q, k, v, spec: av.Spec, bug=None):
    reason = _decode_refusal(q, k, v, spec)
    if reason:
        raise NotImplementedError(reason)
    if spec.cache_seqlens is None:  # a plain call: the latent as pages of 64
        k_cache, table = _as_pages(k)
        lens = torch.full((q.shape[0],), k.shape[2], dtype=torch.int32, device=q.device)
    else:
        k_cache, table, lens = k, spec.block_table, spec.cache_seqlens
    meta, splits = get_mla_metadata(lens, q.shape[2] * q.shape[1], 1)
    out, lse = flash_mla_with_kvcache(q.transpose(1, 2), k_cache, table, lens, D_V, meta, splits,
                                      softmax_scale=spec.scale, causal=spec.causal == "bottom_right",
                                      attn_sink=spec.sinks, _bug=bug)
    out = out.transpose(1, 2)
    return av.Output(out, lse=lse) if spec.return_lse else out


@av.adapter("flashmla-like", register=False, **DECODE_CLAIMS)  # --adapter path.py:flashmla_like
def flashmla_like(q, k, v, spec: av.Spec):
    return _decode_call(q, k, v, spec)


def _wrong_decode(bug):
    return av.adapter(f"flashmla-like-{bug.replace('_', '-')}", register=False, **DECODE_CLAIMS)(
        lambda q, k, v, spec: _decode_call(q, k, v, spec, bug))


flashmla_like_v_wrong_slice = _wrong_decode("v_wrong_slice")
flashmla_like_rope_dropped = _wrong_decode("rope_dropped")
flashmla_like_sink_ignored = _wrong_decode("sink_ignored")
flashmla_like_lse_base2 = _wrong_decode("lse_base2")
flashmla_like_page_index_off_by_one = _wrong_decode("page_index_off_by_one")


# ---- the prefill ("MHA mode") kernel: 192/128, separate k and v, forward and backward ----

def _attend(q, k, v, scale, causal):
    """BSHD float math: (out, lse (B, H, Lq))."""
    lq, lk = q.shape[1], k.shape[1]
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(g, 2)) * scale
    if causal:
        vis = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
        s = s.masked_fill(~vis, float("-inf"))
    dead = torch.isneginf(s).all(-1, keepdim=True)  # a row with no visible key: 0 (not nan_to_num, which would
    p = torch.where(dead, torch.zeros_like(s), torch.softmax(s, -1))  # also swallow a NaN or Inf input)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.float().repeat_interleave(g, 2)), torch.logsumexp(s, -1)


class _MlaPrefill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, bug):
        ctx.save_for_backward(q, k, v)
        ctx.scale, ctx.causal, ctx.bug = scale, causal, bug
        # one latent: V a view of K's first columns (the same storage), which the kernel's backward may fuse
        ctx.fused = v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        return _attend(q, k, v, scale, causal)[0].to(q.dtype)

    @staticmethod
    def backward(ctx, g):
        q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = _attend(q, k, v, ctx.scale, ctx.causal)[0]
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), g.float())
        if ctx.bug == "latent_grad_overwritten" and ctx.fused:  # one dKV buffer: dV stored over dK, not added
            dk = dk.clone()
            dk[..., :dv.shape[-1]] = dv
            dv = torch.zeros_like(dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def mla_prefill(q, k, v, softmax_scale=None, causal=False, *, _bug=None):
    """q (B, Lq, H, 192), k (B, Lk, Hk, 192), v (B, Lk, Hk, 128): FlashMLA's dense MHA-mode prefill."""
    if q.dtype not in (torch.bfloat16, torch.float16) or not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"mla_prefill: bf16/fp16 only, one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if (q.shape[-1], k.shape[-1], v.shape[-1]) not in ((192, 192, 128), (128, 128, 128)):
        raise ValueError(f"mla_prefill: head dims (qk, v) must be (192, 128) or (128, 128); got "
                         f"{q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
    if k.shape[:3] != v.shape[:3] or q.shape[2] % k.shape[2] or q.shape[0] != k.shape[0]:
        raise ValueError(f"mla_prefill: shapes do not fit: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _MlaPrefill.apply(q, k, v, scale, causal, _bug)


PREFILL_CLAIMS = dict(
    dtypes=("bfloat16", "float16"),
    devices=("cpu",),
    head_dims=(128, 192),
    dv_ne_d=True,
    gqa=True,
    causal=("none", "bottom_right"),
    backward=True,
    refuses=lambda case: None if (case.q.shape[-1], case.v.shape[-1]) in ((192, 128), (128, 128))
    else "mla_prefill: head dims (qk, v) (192, 128) or (128, 128) only",
)


def _prefill_call(q, k, v, spec: av.Spec, bug=None):
    out = mla_prefill(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=spec.scale,
                      causal=spec.causal == "bottom_right", _bug=bug)
    return out.transpose(1, 2)


@av.adapter("mla-prefill-like", register=False, **PREFILL_CLAIMS)
def mla_prefill_like(q, k, v, spec: av.Spec):
    return _prefill_call(q, k, v, spec)


mla_prefill_like_latent_grad_overwritten = av.adapter(
    "mla-prefill-like-latent-grad-overwritten", register=False, **PREFILL_CLAIMS)(
    lambda q, k, v, spec: _prefill_call(q, k, v, spec, "latent_grad_overwritten"))
