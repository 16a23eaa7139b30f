"""Recipe: a serving kernel with learnable sinks (gpt-oss) and fp8 inputs with FA3's per-(batch, kv head) descales."""
import torch

import attnverify as av


def sink_fp8_attention(q, k, v, sinks, q_descale=None, k_descale=None, v_descale=None, *, softmax_scale,
                       causal=False):
    """The kernel under test ("yours"; here in plain torch, the way an FA3-style kernel computes).

    BSHD: q (B, Lq, Hq, D), k and v (B, Lk, Hkv, D), bfloat16 or float8_e4m3fn; sinks float32 (Hq,);
    descales float32 (B, Hkv) or None (= 1); causal is bottom-right aligned. Returns out (B, Lq, Hq, D) bfloat16 and
    lse (B, Hq, Lq) float32, natural log, the sink included. q_descale * k_descale join the softmax scale, P is
    rounded to fp8 after the row max of the keys is subtracted, the sink joins the float32 denominator, and
    v_descale scales the normalised output."""
    b, lq, hq, _ = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv

    def per_head(d):  # (B, Hkv) -> (B, Hq, 1, 1): a query head reads its kv head's factor
        return 1.0 if d is None else d.float().repeat_interleave(g, dim=1)[:, :, None, None]

    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(g, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(g, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * (softmax_scale * per_head(q_descale) * per_head(k_descale))
    if causal:
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (lk - lq), float("-inf"))
    m = s.amax(dim=-1, keepdim=True) if lk else s.new_full((b, hq, lq, 1), float("-inf"))  # the keys' row max
    has_key = ~torch.isneginf(m)  # a visible key; not isfinite(m): a NaN or +Inf score must propagate, not read as none
    p = torch.exp(s - torch.where(has_key, m, torch.zeros_like(m)))  # in [0, 1]
    if q.dtype == torch.float8_e4m3fn:
        p = p.to(torch.float8_e4m3fn).float()  # the P that an fp8 P @ V product sees
    # the sink joins after the keys: rescale to max(m, sink), never exp(sink - m) (it overflows when the keys'
    # scores are far below the sink)
    mf = torch.maximum(m, sinks.float().view(1, hq, 1, 1))
    mf = torch.where(torch.isfinite(mf), mf, torch.zeros_like(mf))
    alpha = torch.where(has_key, torch.exp(m - mf), torch.zeros_like(m))
    denom = p.sum(dim=-1, keepdim=True) * alpha + torch.exp(sinks.float().view(1, hq, 1, 1) - mf)
    has = denom != 0  # not denom > 0: a NaN denominator (a NaN or Inf input) must reach the output
    out = torch.where(has, (p @ vf) * alpha / torch.where(has, denom, torch.ones_like(denom)), torch.zeros_like(denom))
    out = out * per_head(v_descale)
    lse = torch.where(has, mf + torch.log(denom), torch.full_like(denom, float("-inf")))
    return out.transpose(1, 2).to(torch.bfloat16), lse.squeeze(-1)


@av.adapter(
    "sink-fp8",
    dtypes=("bfloat16", "float8_e4m3fn"),  # bf16 runs the sink properties; e4m3 the fp8 ones (with sinks drawn)
    descales=True,  # spec.q_descale / k_descale / v_descale, float32 (B, Hkv), any of them None
    sinks=True,  # spec.sinks, float32 (Hq,)
    devices=("cpu", "cuda"),
    head_dims=(64, 128),
    causal=("none", "bottom_right"),
    gqa=True,
    lse=True,
    fully_masked="zeros",  # a row with no visible key (bottom-right causal, Lq > Lk): 0, and LSE = its sink
    backward=False,  # a serving kernel: forward only (fp8 calls are forward only whatever you claim)
)
def sink_fp8(q, k, v, spec: av.Spec):
    sinks = spec.sinks if spec.sinks is not None else torch.full((q.shape[1],), float("-inf"), device=q.device)
    out, lse = sink_fp8_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), sinks,
        spec.q_descale, spec.k_descale, spec.v_descale,
        softmax_scale=spec.resolved_scale(q.shape[-1]), causal=spec.causal == "bottom_right",
    )
    return av.Output(out.transpose(1, 2), lse=lse if spec.return_lse else None)
