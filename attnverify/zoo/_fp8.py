"""The zoo's fp8 members (issue 23): an FA3-class fp8 forward (q, k, v in fp8 with per-(batch, kv head) descales,
P rounded to fp8 for P @ V after the row max is subtracted, out in bfloat16), each with one bug of the kind fp8
attention kernels shipped: a descale dropped (vllm #51363: garbage output), a descale applied twice, the V descale
folded into P before its fp8 cast, and P cast to fp8 before the max is subtracted."""
from __future__ import annotations

import torch

from .. import visibility
from ..adapters.base import adapter
from ..spec import Output

# An FA3-class fp8 forward: e4m3 inputs (the dtype FA3's fp8 path takes), descales, head dims 64/128/256, causal
# bottom-right, GQA, LSE; no masks, varlen, sinks or backward (fp8 calls are forward only).
FP8 = dict(
    dtypes=("float8_e4m3fn",), devices=("cpu",), head_dims=(64, 128, 256), max_seqlen=4096,
    causal=("none", "bottom_right"), gqa=True, lse=True, fully_masked="zeros", descales=True, sinks=True,
)
# FA3's fp8 forward tile over keys: P is rounded relative to the running max of the tiles seen so far
BLOCK_N = 128
FP8_BUGS = ("descale_dropped", "descale_twice", "v_descale_on_p", "p_cast_before_max")


def _factor(d, heads, like):
    if d is None:
        return torch.ones(like.shape[0], heads, 1, 1, dtype=torch.float32, device=like.device)
    d = d.to(device=like.device, dtype=torch.float32)
    return d.repeat_interleave(heads // d.shape[1], dim=1)[:, :, None, None]


def fp8_attend(q, k, v, spec, bug=None, *, tiled: bool = False):
    """The fp8 forward; `bug` one of FP8_BUGS or None (correct); `tiled` (correct only): FA3's online softmax over
    key tiles of BLOCK_N, P rounded to fp8 relative to the running max (benchmarks/calibrate_tolerances.py
    calibrates the fp8 tolerance on it)."""
    if bug is not None and bug not in FP8_BUGS:
        raise ValueError(f"fp8_attend(bug={bug!r}): use one of {FP8_BUGS} or None")
    if not str(q.dtype).startswith("torch.float8"):
        raise TypeError(f"fp8_attend: fp8 inputs only, got {q.dtype}")
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    qd, kd, vd = _factor(spec.q_descale, hq, q), _factor(spec.k_descale, hq, q), _factor(spec.v_descale, hq, q)
    if bug == "descale_dropped":  # the K descale never reaches the kernel
        kd = torch.ones_like(kd)
    elif bug == "descale_twice":  # applied when quantizing and again in the kernel
        kd = kd * kd
    g = hq // hkv
    kk = k.float().repeat_interleave(g, dim=1)
    vv = v.float().repeat_interleave(g, dim=1)
    s = torch.matmul(q.float(), kk.transpose(-1, -2)) * (qd * kd * spec.resolved_scale(d))
    vis = visibility.positional_visibility(lq, lk, spec.causal, spec.window, q.device)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    sink = None
    if spec.sinks is not None:  # FA3's learnable_sink: joins the denominator, not the max
        sink = spec.sinks.to(device=q.device, dtype=torch.float32)[None, :, None, None].expand(b, hq, lq, 1)
    if bug is None and tiled:
        return _online(s, vv, vd, sink, q.dtype, spec.return_lse)
    full = s if sink is None else torch.cat([s, sink], dim=-1)
    dead = torch.isneginf(full).all(dim=-1, keepdim=True)
    lse = torch.logsumexp(torch.where(dead, torch.zeros_like(full), full), dim=-1, keepdim=True)
    lse = torch.where(dead, torch.full_like(lse, float("-inf")), lse)
    dead = torch.isneginf(s).all(dim=-1, keepdim=True)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    fp8 = q.dtype
    if bug == "p_cast_before_max":  # exp(s) rounded to fp8, the max taken out afterwards in float32
        p8 = torch.exp(s).to(fp8).float()
        norm = torch.where(torch.isfinite(lse), torch.exp(-lse), torch.zeros_like(lse))
        out = torch.matmul(p8, vv) * norm * vd
    elif bug == "v_descale_on_p":  # P * v_descale rounded to fp8 (subnormal for small descales), not out * v_descale
        p8 = (torch.exp(s - m) * vd).to(fp8).float()
        out = torch.matmul(p8, vv) * torch.where(torch.isfinite(lse), torch.exp(m - lse), torch.zeros_like(lse))
    else:
        p8 = torch.exp(s - m).to(fp8).float()
        out = torch.matmul(p8, vv) * torch.where(torch.isfinite(lse), torch.exp(m - lse), torch.zeros_like(lse)) * vd
    out = torch.where(dead, torch.zeros_like(out), out)
    return Output(out.to(torch.bfloat16), lse=lse.squeeze(-1) if spec.return_lse else None)


def _online(s, vv, vd, sink, fp8, return_lse):
    """FA3's forward loop over key tiles: running max m, running sum l (float32, from unrounded P), accumulator
    acc += fp8(exp(s - m)) @ V rescaled by exp(m_old - m); the sink joins l at the end; out = acc / l * v_descale."""
    shape = s.shape[:-1] + (1,)
    m = torch.full(shape, float("-inf"), dtype=torch.float32, device=s.device)
    l = torch.zeros(shape, dtype=torch.float32, device=s.device)
    acc = torch.zeros(*s.shape[:-1], vv.shape[-1], dtype=torch.float32, device=s.device)
    for j0 in range(0, s.shape[-1], BLOCK_N):
        st = s[..., j0:j0 + BLOCK_N]
        m_new = torch.maximum(m, st.amax(dim=-1, keepdim=True))
        m_use = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        alpha = torch.where(torch.isfinite(m), torch.exp(m - m_use), torch.zeros_like(m))
        p = torch.exp(st - m_use)
        l = l * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p.to(fp8).float(), vv[..., j0:j0 + BLOCK_N, :])
        m = m_new
    m_use = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    if sink is not None:
        big = torch.isfinite(sink) & (sink > m_use)  # rescale to the sink where it tops the keys (no overflow)
        m_fin = torch.where(big, sink, m_use)
        l = l * torch.exp(m_use - m_fin) + torch.where(torch.isfinite(sink), torch.exp(sink - m_fin), torch.zeros_like(l))
        acc = acc * torch.exp(m_use - m_fin)
        m_use = m_fin
    out = torch.where(l > 0, acc / torch.where(l > 0, l, torch.ones_like(l)), torch.zeros_like(acc)) * vd
    lse = torch.where(l > 0, m_use + torch.log(torch.where(l > 0, l, torch.ones_like(l))), torch.full_like(l, float("-inf")))
    return Output(out.to(torch.bfloat16), lse=lse.squeeze(-1) if return_lse else None)


def fp8_online_adapter(name: str = "fp8-online"):
    """The correct, tiled fp8 engine as an adapter (FP8's claims): a kernel-like fp8 implementation to calibrate on."""
    @adapter(name, register=False, description="FA3-like fp8 forward: online softmax over key tiles, P cast to fp8 "
                                               "after the running max is subtracted",
             **dict(FP8, dtypes=("float8_e4m3fn", "float8_e5m2")))
    def impl(q, k, v, spec):
        return fp8_attend(q, k, v, spec, tiled=True)

    return impl


def _fp8_member(name, bug):
    @adapter(f"zoo-{name}", register=False, description=f"zoo (fp8): {bug}", **FP8)
    def impl(q, k, v, spec):
        return fp8_attend(q, k, v, spec, bug)

    return impl


F8, LIN = "fp8_matches_reference", "descale_linearity"


def fp8_members():
    from ._members import ZooMember as Z

    return [
        Z("fp8-descale-dropped", "k_descale is ignored (scores off by that factor)",
          "descales dropped on the way to the fp8 kernel (garbage output)",
          _fp8_member("fp8-descale-dropped", "descale_dropped"), (F8, LIN), "eager"),
        Z("fp8-descale-twice", "k_descale is applied twice",
          "a descale applied when quantizing and again inside the kernel",
          _fp8_member("fp8-descale-twice", "descale_twice"), (F8, LIN), "eager"),
        Z("fp8-v-descale-on-p", "P is multiplied by v_descale before its fp8 cast (instead of the output)",
          "V's descale folded into P: for serving descales (amax/448) P lands in fp8's subnormal range",
          _fp8_member("fp8-v-descale-on-p", "v_descale_on_p"), (F8, LIN), "eager"),
        Z("fp8-p-cast-before-max", "P = exp(s) is rounded to fp8 before the row max is taken out",
          "an fp8 P cast placed before the max subtraction (saturates above 448, flushes below 2^-9)",
          _fp8_member("fp8-p-cast-before-max", "p_cast_before_max"), (F8,), "eager"),
    ]


__all__ = ["fp8_members", "fp8_attend", "fp8_online_adapter", "FP8", "FP8_BUGS"]
