"""Recipe: a BSHD kernel (flash-attn's `flash_attn_func` shape) -- docs/adapters.md, "A BSHD kernel"."""
import attnverify as av

try:
    from flash_attn import flash_attn_func  # the real kernel: CUDA, fp16/bf16
except ImportError:  # where it is missing: the plain-torch stand-in beside this file (same signature)
    from _standins import flash_attn_func


@av.adapter(
    "bshd-kernel",
    dtypes=("float16", "bfloat16"),
    devices=("cuda",),
    head_dims=lambda d: d <= 256,
    max_seqlen=16384,
    causal=("none", "bottom_right"),  # flash-attn aligns causal to the bottom-right corner
    window=True, softcap=True, alibi=True, gqa=True,
    backward=True,  # flash_attn_func is an autograd.Function: gradients come through it
    fully_masked="zeros",  # "If the row of the mask is all zero, the output will be zero."
)
def bshd_kernel(q, k, v, spec: av.Spec):
    # attnverify hands BHSD tensors; the kernel wants BSHD: transpose views, no copies
    out = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        softmax_scale=spec.scale,  # None means 1/sqrt(D) for both
        causal=spec.causal == "bottom_right",
        window_size=spec.window if spec.window is not None else (-1, -1),
        softcap=spec.softcap or 0.0,
        alibi_slopes=spec.alibi_slopes,
    )
    return out.transpose(1, 2)  # BSHD -> BHSD, again a view
