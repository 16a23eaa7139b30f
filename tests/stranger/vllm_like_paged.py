"""A stranger's paged-decode kernel, written the way vLLM's paged attention v1 exposes it, and its adapter.

The kernel (plain torch, standing for a CUDA kernel) is ``paged_attention(out, query, key_cache, value_cache,
num_kv_heads, scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes=None)``:

- ``query`` (num_seqs, num_heads, head_size): one query token per sequence (decode only);
- ``key_cache`` / ``value_cache`` (num_blocks, num_kv_heads, block_size, head_size): a BHSD-like pool;
- ``block_tables`` int32 (num_seqs, max_num_blocks_per_seq), ``seq_lens`` int32 (num_seqs,) >= 1;
- ``alibi_slopes`` float32 (num_heads,) or None: ``qk += slope * (token_idx - seq_len + 1)``;
- the result is written into ``out`` (num_seqs, num_heads, head_size); nothing is returned: no LSE, no backward.

What vLLM documents for it, and so what the adapter claims: fp16 / bf16 / fp32, head sizes 64, 80, 96, 112, 120,
128, 192, 256, block sizes 8, 16, 32, GQA (num_heads % num_kv_heads == 0), ALiBi per head. ``BUGS`` holds the
names of deliberately wrong variants (a real kernel's mistakes); each has its own adapter below
(``vllm_like_paged_<bug>``), claiming what the right one claims.
"""

from __future__ import annotations

import torch

import attnverify as av

BLOCK_SIZES = (8, 16, 32)
HEAD_SIZES = (64, 80, 96, 112, 120, 128, 192, 256)
BUGS = ("block_index_off_by_one", "seq_lens_minus_one", "partial_block_full")


def paged_attention(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
                    max_seq_len, alibi_slopes=None, *, _bug=None):
    num_seqs, num_heads, head_size = query.shape
    if key_cache.shape[1:] != (num_kv_heads, block_size, head_size) or value_cache.shape != key_cache.shape:
        raise ValueError(f"paged_attention: caches must be (num_blocks, {num_kv_heads}, {block_size}, {head_size}); "
                         f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"paged_attention: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"paged_attention: block_size {block_size} not in {BLOCK_SIZES}")
    if head_size not in HEAD_SIZES:
        raise ValueError(f"paged_attention: head_size {head_size} not in {HEAD_SIZES}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not (
            query.dtype == key_cache.dtype == value_cache.dtype == out.dtype):
        raise TypeError(f"paged_attention: dtypes {query.dtype}, {key_cache.dtype}, {value_cache.dtype}, {out.dtype}")
    group = num_heads // num_kv_heads
    for s in range(num_seqs):
        n = int(seq_lens[s])
        if _bug == "seq_lens_minus_one":
            n -= 1
        n_blocks = (n + block_size - 1) // block_size
        if _bug == "partial_block_full":
            n = n_blocks * block_size  # reads the last block whole, the unused slots included
        blocks = block_tables[s, :n_blocks].long()
        if _bug == "block_index_off_by_one":  # entry i + 1 of the row-major table (the next row's first at the end)
            flat = block_tables.reshape(-1)
            idx = s * block_tables.shape[1] + torch.arange(n_blocks, device=flat.device) + 1
            blocks = flat[idx.clamp(max=flat.numel() - 1)].long()
        # (blocks, Hkv, block_size, D) -> (Hkv, blocks * block_size, D), the first n tokens
        keys = key_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_size)[:, :n].float()
        vals = value_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_size)[:, :n].float()
        keys, vals = keys.repeat_interleave(group, 0), vals.repeat_interleave(group, 0)  # (Hq, n, D)
        qk = torch.einsum("hd,hnd->hn", query[s].float(), keys) * scale
        if alibi_slopes is not None:
            pos = torch.arange(n, device=query.device, dtype=torch.float32) - (int(seq_lens[s]) - 1)
            qk = qk + alibi_slopes.float()[:, None] * pos[None, :]
        p = torch.softmax(qk, dim=-1)
        out[s] = torch.einsum("hn,hnd->hd", p, vals).to(out.dtype)


def _refusal(q, spec):
    """Per-case limits the claims cannot express: one query token per sequence, ALiBi slopes per head only."""
    if q.shape[2] != 1:
        return "decode only: one query token per sequence (Lq = 1)"
    if spec.alibi_slopes is not None and spec.alibi_slopes.dim() != 1:
        return "alibi_slopes must be (num_heads,)"
    return None


def _as_pool(t, block_size):
    """A plain call's k or v (B, Hkv, Lk, D) as a pool of blocks (B * nb, Hkv, block_size, D), zero-padded."""
    b, h, lk, d = t.shape
    nb = max(1, -(-lk // block_size))
    pad = t.new_zeros(b, h, nb * block_size, d)
    pad[:, :, :lk] = t
    return pad.reshape(b, h, nb, block_size, d).permute(0, 2, 1, 3, 4).reshape(b * nb, h, block_size, d), nb


CLAIMS = dict(
    dtypes=("float16", "bfloat16", "float32"),
    devices=("cpu",),  # plain torch here; the real kernel is CUDA
    head_dims=HEAD_SIZES,
    causal=("none", "bottom_right"),  # one query token: it is the last one, it sees every key either way
    gqa=True,
    alibi=True,
    paged=True,
    page_sizes=BLOCK_SIZES,
    refuses=lambda case: _refusal(case.q, case.spec),
)


def _call(q, k, v, spec: av.Spec, bug=None):
    reason = _refusal(q, spec)
    if reason:
        raise NotImplementedError(reason)
    num_seqs, num_heads, _, head_size = q.shape
    if spec.cache_seqlens is None:  # a plain call: each batch's keys as a run of blocks of 16
        if k.shape[:3] != v.shape[:3] or k.shape[-1] != head_size or v.shape[-1] != head_size:
            raise ValueError(f"vllm_like_paged: k {tuple(k.shape)} and v {tuple(v.shape)} do not fit q {tuple(q.shape)}")
        block_size = 16
        key_cache, nb = _as_pool(k, block_size)
        value_cache, _ = _as_pool(v, block_size)
        block_tables = torch.arange(num_seqs * nb, dtype=torch.int32, device=q.device).reshape(num_seqs, nb)
        seq_lens = torch.full((num_seqs,), k.shape[2], dtype=torch.int32, device=q.device)
    else:  # k, v are attnverify's pools (N, S, Hkv, D): vLLM's is (N, Hkv, S, D)
        block_size = spec.page_size
        key_cache, value_cache = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        block_tables, seq_lens = spec.block_table, spec.cache_seqlens
    out = q.new_empty(num_seqs, num_heads, head_size)
    paged_attention(out, q[:, :, 0].contiguous(), key_cache, value_cache, key_cache.shape[1],
                    spec.resolved_scale(head_size), block_tables, seq_lens, block_size,
                    int(seq_lens.max()), alibi_slopes=spec.alibi_slopes, _bug=bug)
    return out[:, :, None]


@av.adapter("vllm-like-paged", register=False, **CLAIMS)  # a file adapter: --adapter path.py:vllm_like_paged
def vllm_like_paged(q, k, v, spec: av.Spec):
    return _call(q, k, v, spec)


def _wrong(bug):
    return av.adapter(f"vllm-like-paged-{bug}", register=False, **CLAIMS)(
        lambda q, k, v, spec: _call(q, k, v, spec, bug))


vllm_like_paged_block_index_off_by_one = _wrong("block_index_off_by_one")
vllm_like_paged_seq_lens_minus_one = _wrong("seq_lens_minus_one")
vllm_like_paged_partial_block_full = _wrong("partial_block_full")
