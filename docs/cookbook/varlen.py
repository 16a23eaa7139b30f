"""Recipe: a varlen kernel over packed documents (flash-attn's `flash_attn_varlen_func` shape) -- docs/adapters.md."""
import torch

import attnverify as av

try:
    from flash_attn import flash_attn_varlen_func  # the real kernel: CUDA, fp16/bf16
except ImportError:  # where it is missing: the plain-torch stand-in beside this file (same signature)
    from _standins import flash_attn_varlen_func


@av.adapter(
    "varlen-kernel",
    dtypes=("float16", "bfloat16"),
    devices=("cuda",),
    head_dims=lambda d: d <= 256,
    max_seqlen=16384,
    causal=("none", "bottom_right"),  # applied inside each document
    window=True, softcap=True, gqa=True,
    varlen=True,  # attnverify draws packed cases: B == 1 and spec.cu_seqlens_q / cu_seqlens_k
    backward=True,
    fully_masked="zeros",  # an empty key segment, or bottom-right causal with Lq_i > Lk_i, gives rows of 0
)
def varlen_kernel(q, k, v, spec: av.Spec):
    b, hq, lq, _ = q.shape
    lk = k.shape[2]
    if spec.is_varlen:  # B == 1: documents packed along the sequence
        cu_q, cu_k = spec.cu_seqlens_q, spec.cu_seqlens_k
        max_q, max_k = spec.max_seqlen_q, spec.max_seqlen_k
    else:  # a padded batch is a pack of B documents of equal length
        cu_q = torch.arange(b + 1, dtype=torch.int32) * lq
        cu_k = torch.arange(b + 1, dtype=torch.int32) * lk
        max_q, max_k = lq, lk
    # (B, H, L, D) -> (B * L, H, D): the packed "THD" layout (a view when B == 1)
    pack = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])  # noqa: E731
    out = flash_attn_varlen_func(
        pack(q), pack(k), pack(v),
        cu_q.to(q.device, torch.int32), cu_k.to(q.device, torch.int32), max_q, max_k,
        softmax_scale=spec.scale,
        causal=spec.causal == "bottom_right",
        window_size=spec.window if spec.window is not None else (-1, -1),
        softcap=spec.softcap or 0.0,
    )
    return out.reshape(b, lq, hq, -1).transpose(1, 2)  # (B * Lq, H, Dv) -> (B, H, Lq, Dv)
