"""A stranger's gpt-oss style serving kernel (learnable sinks, sliding window, fp8 e4m3 with FA3-style descales)
and its adapter, written from docs/adapters.md ("fp8 with descales", "Sinks", recipe 7) alone.

The kernel (plain torch, standing for a Triton / CUDA kernel) is
``gptoss_attention(q, k, v, sinks, *, sm_scale, window_left=-1, q_descale=None, k_descale=None, v_descale=None)``:

- BHSD: q (B, Hq, Lq, D), k and v (B, Hkv, Lk, D), bfloat16 or float8_e4m3fn (one dtype for the three);
- always causal, bottom-right aligned (a decoder: query row i is position i + Lk - Lq), with an optional sliding
  window of ``window_left`` keys to the left (gpt-oss's alternate layers use 128);
- ``sinks`` (Hq,) per-head logits in any float dtype (gpt-oss keeps them in bf16), in every row's denominator;
- descales float32 (B, Hkv) or None: q_descale * k_descale join the softmax scale, v_descale scales the output;
- an online softmax over key tiles of 32, its running max starting at the sink (so the sink never overflows), P
  rounded to e4m3 after the running max is subtracted (the fp8 P @ V product), float32 accumulators;
- returns (out bfloat16 (B, Hq, Lq, D), lse float32 (B, Hq, Lq), natural log, the sink included). Forward only.

``BUGS`` names deliberately wrong variants (a real kernel's mistakes); each has its own adapter below.
"""

from __future__ import annotations

import torch

import attnverify as av

TILE = 32
FP8 = torch.float8_e4m3fn
BUGS = ("descale_dropped", "sink_in_numerator", "p_fp8_before_max")


def gptoss_attention(q, k, v, sinks, *, sm_scale, window_left=-1, q_descale=None, k_descale=None, v_descale=None,
                     _bug=None):
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if q.dtype not in (torch.bfloat16, FP8) or not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"gptoss_attention: q, k, v must all be bfloat16 or float8_e4m3fn; got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or hq % hkv:
        raise ValueError(f"gptoss_attention: shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if (q_descale is not None or k_descale is not None or v_descale is not None) and q.dtype != FP8:
        raise ValueError("gptoss_attention: descales are for float8_e4m3fn inputs only")
    g = hq // hkv

    def per_head(x):  # (B, Hkv) -> (B, Hq, 1, 1)
        return 1.0 if x is None else x.float().repeat_interleave(g, dim=1)[:, :, None, None]

    scale = sm_scale * per_head(q_descale) * per_head(k_descale)
    if _bug == "descale_dropped":
        scale = sm_scale * per_head(q_descale)
    qf = q.float()
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    sink = sinks.float().view(1, hq, 1, 1).expand(b, hq, lq, 1)
    m = sink.clone()  # the running max starts at the sink: exp(sink - m) <= 1 always
    finite_m = torch.isfinite(m)
    l_sum = torch.where(finite_m, torch.ones_like(m), torch.zeros_like(m))  # exp(sink - m) = 1 (0 for a -inf sink)
    acc = torch.zeros(b, hq, lq, v.shape[3])
    pos = torch.arange(lq)[:, None] + (lk - lq)
    for n0 in range(0, lk, TILE):
        j = torch.arange(n0, min(n0 + TILE, lk))[None, :]
        s = (qf @ kf[:, :, n0:n0 + TILE].transpose(-1, -2)) * scale
        visible = j <= pos
        if window_left >= 0:
            visible &= j >= pos - window_left
        s = s.masked_fill(~visible, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        if _bug == "p_fp8_before_max":
            p = torch.exp(s).to(FP8).float() * torch.exp(-m_safe) if q.dtype == FP8 else torch.exp(s - m_safe)
        else:
            p = torch.exp(s - m_safe)
            if q.dtype == FP8:
                p = p.to(FP8).float()
        alpha = torch.exp(m - m_safe)
        l_sum = l_sum * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + p @ vf[:, :, n0:n0 + TILE]
        m = m_new
    if _bug == "sink_in_numerator":  # the sink's weight added to every output element, as if its value row were 1
        acc = acc + torch.where(torch.isfinite(sink), torch.exp(sink - torch.where(torch.isfinite(m), m, 0.0)), 0.0)
    has = l_sum != 0  # not `> 0`: a NaN sum (a NaN input) must stay NaN, not become a row of zeros
    out = torch.where(has, acc / torch.where(has, l_sum, torch.ones_like(l_sum)), torch.zeros_like(acc))
    out = out * per_head(v_descale)
    lse = torch.where(has, torch.where(torch.isfinite(m), m, 0.0) + torch.log(l_sum), float("-inf"))
    return out.to(torch.bfloat16), lse.squeeze(-1)


CLAIMS = dict(
    dtypes=("bfloat16", "float8_e4m3fn"),
    descales=True,
    sinks=True,
    devices=("cpu",),  # plain torch here
    head_dims=(64,),  # gpt-oss's head size
    causal=("bottom_right",),  # a decoder kernel: always causal, bottom-right aligned
    window=True,  # sliding window to the left; the right bound is the causal one
    gqa=True,
    lse=True,
    fully_masked="zeros",  # a row with no visible key: 0, and LSE = its sink
    backward=False,
)


def _call(q, k, v, spec: av.Spec, bug=None):
    if spec.causal != "bottom_right":
        raise NotImplementedError(f"gptoss_attention is always causal (bottom-right); asked causal={spec.causal!r}")
    if spec.window is not None and spec.window[1] not in (-1, 0) and spec.window[1] < 0:
        raise NotImplementedError(f"window {spec.window}")
    sinks = spec.sinks if spec.sinks is not None else torch.full((q.shape[1],), float("-inf"))
    out, lse = gptoss_attention(q, k, v, sinks, sm_scale=spec.resolved_scale(q.shape[-1]),
                                window_left=spec.window[0] if spec.window is not None else -1,
                                q_descale=spec.q_descale, k_descale=spec.k_descale, v_descale=spec.v_descale, _bug=bug)
    return av.Output(out, lse=lse if spec.return_lse else None)


@av.adapter("gptoss-sink-fp8", register=False, **CLAIMS)  # a file adapter: --adapter path.py:gptoss_sink_fp8
def gptoss_sink_fp8(q, k, v, spec: av.Spec):
    return _call(q, k, v, spec)


def _wrong(bug):
    return av.adapter(f"gptoss-sink-fp8-{bug}", register=False, **CLAIMS)(
        lambda q, k, v, spec: _call(q, k, v, spec, bug))


gptoss_sink_fp8_descale_dropped = _wrong("descale_dropped")
gptoss_sink_fp8_sink_in_numerator = _wrong("sink_in_numerator")
gptoss_sink_fp8_p_fp8_before_max = _wrong("p_fp8_before_max")
