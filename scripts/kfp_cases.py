"""The launch configurations scripts/kernel_fingerprint.py compiles: every Triton kernel attnverify ships.

Each case calls the project's own host launcher (launch.forward, launch.backward, serving.paged_decode) on CPU
tensors of the right shapes, dtypes and layouts, so the kernels are compiled with exactly the arguments,
tiles and specialisations a GPU run gets (launch.default_config(d, dtype, "cuda") plus any candidate named).
A case is (name, dtype, head dim, spec keywords, candidate switches); its kernels are named after it.
"""
from __future__ import annotations

from dataclasses import replace

# forward (kernels/flash_fwd.py, flash_fwd_variants.py): candidates on top of the default configuration, which
# already has the adopted ones (fma + lpt at D <= 64, tma + fma + lpt at D > 128)
FWD = [
    ("bf16_d64", "bfloat16", 64, {}, ""),
    ("fp16_d64_causal", "float16", 64, {"causal": "bottom_right"}, ""),
    ("bf16_d128_causal", "bfloat16", 128, {"causal": "bottom_right"}, ""),
    ("bf16_d256", "bfloat16", 256, {}, ""),
    ("fp16_d256_causal", "float16", 256, {"causal": "bottom_right"}, ""),
    ("fp16_d72", "float16", 72, {}, ""),
    ("fp16_d80_window", "float16", 80, {"window": (32, 0)}, ""),
    ("bf16_d128_softcap_alibi", "bfloat16", 128, {"softcap": 30.0, "alibi": True}, ""),
    ("fp32_d64_causal_tl", "float32", 64, {"causal": "top_left"}, ""),
    ("bf16_d64_varlen", "bfloat16", 64, {"varlen": True}, ""),
    ("bf16_d128_sinks", "bfloat16", 128, {"sinks": True}, ""),
    ("bf16_d128_gqa_causal", "bfloat16", 128, {"causal": "bottom_right", "hkv": 1}, ""),
    ("bf16_d128_fma_lazy", "bfloat16", 128, {}, "fma,lazy"),
    ("bf16_d72_causal_lazy", "bfloat16", 72, {"causal": "bottom_right"}, "lazy"),
    ("bf16_d128_tma", "bfloat16", 128, {}, "tma"),
    ("fp16_d80_tma_causal", "float16", 80, {"causal": "bottom_right"}, "tma,fma"),
    ("bf16_d128_ws", "bfloat16", 128, {}, "ws"),
    ("bf16_d128_lpt_causal", "bfloat16", 128, {"causal": "bottom_right"}, "lpt"),
    ("bf16_d64_nospec", "bfloat16", 64, {}, "nospec"),
    # the nospec twins' compile-count variants (kernels/variants.py): tile strides unspecialised, mask flags at run time
    ("bf16_d64_aligned", "bfloat16", 64, {}, "aligned"),
    ("fp16_d80_window_aligned", "float16", 80, {"window": (32, 0)}, "aligned"),
    ("bf16_d128_softcap_alibi_rtmask", "bfloat16", 128, {"softcap": 30.0, "alibi": True}, "rtmask"),
    ("fp16_d64_causal_rtmask", "float16", 64, {"causal": "bottom_right"}, "rtmask"),
    ("bf16_d128_sinks_aligned_rtmask", "bfloat16", 128, {"sinks": True}, "aligned,rtmask"),
    ("fp16_d256_causal_aligned_rtmask", "float16", 256, {"causal": "bottom_right"}, "aligned,rtmask"),
]

# fp8 forward (kernels/fp8.py): V column-major as launch.forward makes it on a GPU (fp8.v_for_dot)
FP8 = [
    ("e4m3_d128", "float8_e4m3fn", 128, {}, ""),
    ("e4m3_d128_descale_causal", "float8_e4m3fn", 128, {"causal": "bottom_right", "descale": "qkv"}, ""),
    ("e4m3_d64_descale_k_gqa", "float8_e4m3fn", 64, {"descale": "k", "hkv": 2}, ""),
    ("e5m2_d256_descale_sinks", "float8_e5m2", 256, {"descale": "qkv", "sinks": True}, ""),
    ("e4m3_d128_descale_causal_aligned_rtmask", "float8_e4m3fn", 128, {"causal": "bottom_right", "descale": "qkv"},
     "aligned,rtmask"),  # aligned does not apply to fp8: the nospec twin's rtmask variant
]

# backward (kernels/flash_bwd.py: _bwd_preprocess, _bwd_dkdv, _bwd_dq)
BWD = [
    ("bf16_d64", "bfloat16", 64, {}, ""),
    ("fp16_d64_causal", "float16", 64, {"causal": "bottom_right"}, ""),
    ("bf16_d128", "bfloat16", 128, {}, ""),
    ("bf16_d128_causal_dlse", "bfloat16", 128, {"causal": "bottom_right", "dlse": True}, ""),
    ("fp16_d128_gqa", "float16", 128, {"hkv": 1}, ""),
    ("bf16_d256", "bfloat16", 256, {}, ""),
    ("fp16_d256_causal", "float16", 256, {"causal": "bottom_right"}, ""),
    ("fp16_d72", "float16", 72, {}, ""),
    ("fp16_d80_window", "float16", 80, {"window": (32, 0)}, ""),
    ("bf16_d128_softcap_alibi", "bfloat16", 128, {"softcap": 30.0, "alibi": True}, ""),
    ("fp32_d64_causal_tl", "float32", 64, {"causal": "top_left"}, ""),
    ("bf16_d64_varlen_causal", "bfloat16", 64, {"varlen": True, "causal": "bottom_right"}, ""),
    ("bf16_d128_sinks", "bfloat16", 128, {"sinks": True}, ""),
    ("bf16_d64_nospec", "bfloat16", 64, {}, "nospec"),
    ("bf16_d64_aligned", "bfloat16", 64, {}, "aligned"),
    ("bf16_d128_causal_dlse_aligned", "bfloat16", 128, {"causal": "bottom_right", "dlse": True}, "aligned"),
    ("bf16_d128_softcap_alibi_rtmask", "bfloat16", 128, {"softcap": 30.0, "alibi": True}, "rtmask"),
    ("fp16_d80_window_rtmask", "float16", 80, {"window": (32, 0)}, "rtmask"),
    ("fp16_d256_causal_aligned_rtmask", "float16", 256, {"causal": "bottom_right"}, "aligned,rtmask"),
    ("bf16_d64_varlen_causal_aligned_rtmask", "bfloat16", 64, {"varlen": True, "causal": "bottom_right"},
     "aligned,rtmask"),
]

# split-KV decode (kernels/decode.py) and, where it splits, the LSE combine (kernels/combine.py), through
# serving.paged_decode: splits None = the GPU's own choice (several here: the caches hold 1024 keys)
DECODE = [
    ("bf16_d128_paged_gqa", "bfloat16", 128, {"hkv": 1, "paged": True}),
    ("fp16_d64_paged_sinks_1split", "float16", 64, {"paged": True, "sinks": True, "splits": 1}),
    ("bf16_d128_paged_sinks_causal", "bfloat16", 128, {"paged": True, "sinks": True, "causal": "bottom_right",
                                                      "lq": 4}),
    ("fp16_d80_contig_window_leftpad", "float16", 80, {"window": (64, 0), "leftpad": True}),
    ("bf16_d64_batchidx_append_4split", "bfloat16", 64, {"batch_idx": True, "append": 3, "splits": 4}),
    ("bf16_d128_paged_softcap_alibi", "bfloat16", 128, {"paged": True, "softcap": 30.0, "alibi": True}),
    ("fp32_d64_paged_causal_tl", "float32", 64, {"paged": True, "causal": "top_left", "lq": 2}),
    ("bf16_d256_paged", "bfloat16", 256, {"paged": True, "hkv": 2}),
]

B, H, LQ, LK = 2, 4, 300, 300


def cases():
    """-> [(family, name, callable)]: calling it launches (compiles) the family's kernels for that case."""
    out = [("fwd", c[0], (lambda c=c: forward(*c[1:]))) for c in FWD]
    out += [("fp8", c[0], (lambda c=c: forward(*c[1:]))) for c in FP8]
    out += [("bwd", c[0], (lambda c=c: backward(*c[1:]))) for c in BWD]
    out += [("decode", c[0], (lambda c=c: decode(*c[1:]))) for c in DECODE]
    return out


def _spec(kw, h, lq, lk, hkv):
    import torch

    from attnverify.spec import Spec

    args = {"causal": kw.get("causal", "none")}
    for key in ("window", "softcap"):
        if key in kw:
            args[key] = kw[key]
    if kw.get("alibi"):
        args["alibi_slopes"] = torch.rand(h)
    if kw.get("varlen"):
        args.update(cu_seqlens_q=torch.tensor([0, 100, lq], dtype=torch.int32),
                    cu_seqlens_k=torch.tensor([0, 90, lk], dtype=torch.int32), max_seqlen_q=lq - 100,
                    max_seqlen_k=lk - 90)
    if kw.get("sinks"):
        args["sinks"] = torch.zeros(h)
    for which in kw.get("descale", ""):
        args[f"{which}_descale"] = torch.ones(B, hkv)
    return Spec(**args)


def _inputs(dt, d, kw):
    import torch

    dtype = getattr(torch, dt)
    hkv = kw.get("hkv", H)
    bb = 1 if kw.get("varlen") else B
    q = torch.randn(bb, H, LQ, d).to(dtype)
    k, v = (torch.randn(bb, hkv, LK, d).to(dtype) for _ in range(2))
    if dtype.itemsize == 1:  # fp8: the layout launch.forward gives V on a GPU (keys contiguous)
        v = v.transpose(-1, -2).contiguous().transpose(-1, -2)
    return q, k, v, _spec(kw, H, LQ, LK, hkv), dtype


def _config(d, dtype, var):
    from attnverify.kernels import launch, variants

    cfg = launch.default_config(d, dtype, "cuda")
    return replace(cfg, **variants.parse(var)) if var else cfg


def forward(dt, d, kw, var):
    from attnverify.kernels import launch

    q, k, v, spec, dtype = _inputs(dt, d, kw)
    launch.forward(q, k, v, spec, config=_config(d, dtype, var))


def backward(dt, d, kw, var):
    import torch

    from attnverify.kernels import launch

    q, k, v, spec, dtype = _inputs(dt, d, kw)
    cfg = _config(d, dtype, var)
    out = torch.randn(q.shape[:3] + v.shape[3:]).to(dtype)  # what the forward would give (not compiled here)
    lse = torch.randn(q.shape[:3])
    d_lse = torch.zeros_like(lse) if kw.get("dlse") else None
    d_sinks = torch.zeros(H) if kw.get("sinks") else None
    launch.backward(q, k, v, out, lse, torch.randn_like(out), d_lse, spec, config=cfg, d_sinks=d_sinks)


def decode(dt, d, kw):
    import torch

    from attnverify.kernels import serving

    dtype = getattr(torch, dt)
    hkv, lq, page, cap = kw.get("hkv", H), kw.get("lq", 1), 16, 1024
    q = torch.randn(B, H, lq, d).to(dtype)
    extra = {}
    seqlens = torch.tensor([700, 1000 - kw.get("append", 0)], dtype=torch.int32)
    if kw.get("paged"):
        n = B * cap // page
        kc, vc = (torch.randn(n, page, hkv, d).to(dtype) for _ in range(2))
        extra["block_table"] = torch.randperm(n, dtype=torch.int32).reshape(B, cap // page)
    else:
        kc, vc = (torch.randn(B + 1, cap, hkv, d).to(dtype) for _ in range(2))
        if kw.get("batch_idx"):
            extra["cache_batch_idx"] = torch.tensor([2, 0], dtype=torch.int32)
    if kw.get("append"):
        extra["k_new"], extra["v_new"] = (torch.randn(B, hkv, kw["append"], d).to(dtype) for _ in range(2))
    if kw.get("leftpad"):
        extra["cache_leftpad"] = torch.tensor([5, 0], dtype=torch.int32)
    if kw.get("alibi"):
        extra["alibi_slopes"] = torch.rand(H)
    if kw.get("sinks"):
        extra["sinks"] = torch.zeros(H)
    serving.paged_decode(q, kc, vc, seqlens, num_splits=kw.get("splits"), causal=kw.get("causal", "none"),
                         window=kw.get("window"), softcap=kw.get("softcap"), **extra)
