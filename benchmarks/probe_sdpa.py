"""Probe what each SDPA backend really accepts on this machine (device, torch version).

For every backend x dtype x feature it records: runs / refused (the error) / wrong (vs float64).
The adapter claims in attnverify/adapters/sdpa.py were written from this script's output
(CPU: this machine; CUDA: the H200), see the comment there.
"""
import json, math, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

dev = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def ref(q, k, v, mask=None, causal=None, scale=None):
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    lq, lk = s.shape[-2:]
    i = torch.arange(lq)[:, None]; j = torch.arange(lk)[None]
    vis = torch.ones(lq, lk, dtype=torch.bool)
    if causal == "tl": vis = j <= i
    if causal == "br": vis = j <= i + lk - lq
    vis = vis.to(q.device)
    if mask is not None:
        if mask.dtype == torch.bool: vis = vis & mask
        else: s = s + mask.double()
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
    return p @ v


def attempt(backend, dt, feat, d=64, lq=33, lk=33, grad=False):
    torch.manual_seed(0)
    hq, hk = 4, 4
    mask = None; causal = None; kw = {}
    if feat == "gqa": hk = 2; kw["enable_gqa"] = True
    dv = d
    if feat == "dv_ne_d": dv = d // 2
    if feat in ("causal_tl_eq", "causal_tl_ne"): kw["is_causal"] = True; causal = "tl"
    if feat == "causal_tl_ne": lq, lk = 17, 33
    if feat in ("causal_br", "causal_br_lq_gt_lk"):
        from torch.nn.attention.bias import causal_lower_right
        lq, lk = (17, 33) if feat == "causal_br" else (33, 17)
        mask_obj = causal_lower_right(lq, lk); causal = "br"
    if feat == "headdim": d = {"d": d}["d"]
    q = torch.randn(2, hq, lq, d, device=dev, dtype=DT[dt])
    k = torch.randn(2, hk, lk, d, device=dev, dtype=DT[dt])
    v = torch.randn(2, hk, lk, dv, device=dev, dtype=DT[dt])
    if feat == "bool_mask": mask = torch.rand(lq, lk, device=dev) > 0.3
    if feat == "float_mask": mask = torch.randn(2, 1, lq, lk, device=dev, dtype=DT[dt])
    if feat == "fully_masked":
        mask = torch.rand(lq, lk, device=dev) > 0.3; mask[3] = False
    if feat == "scale": kw["scale"] = 0.37
    am = mask_obj if feat.startswith("causal_br") else mask
    for t in (q, k, v):
        t.requires_grad_(grad)
    try:
        with sdpa_kernel([BACKENDS[backend]]):
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=am, **kw)
            if grad: o.float().sum().backward()
    except Exception as e:
        return "refused: " + " ".join(str(e).split())[:300]
    r = ref(q.detach(), k.detach(), v.detach(), mask, causal, kw.get("scale"))
    if feat == "fully_masked":
        row = o[:, :, 3].detach()
        tag = "zeros" if bool((row == 0).all()) else "nan" if bool(row.isnan().all()) else "other"
        o = torch.cat([o[:, :, :3], o[:, :, 4:]], 2); r = torch.cat([r[:, :, :3], r[:, :, 4:]], 2)
    else:
        tag = "ok"
    err = ((o.double() - r).norm() / r.norm()).item()
    return f"{tag} relerr={err:.1e}"


res = {"device": dev, "torch": torch.__version__}
feats = ["plain", "scale", "gqa", "dv_ne_d", "causal_tl_eq", "causal_tl_ne", "causal_br", "causal_br_lq_gt_lk", "bool_mask", "float_mask", "fully_masked"]
for be in BACKENDS:
    for dt in DT:
        row = {f: attempt(be, dt, f) for f in feats}
        row["backward"] = attempt(be, dt, "plain", grad=True)
        for d in (40, 59, 96, 192, 256, 512):
            row[f"d{d}"] = attempt(be, dt, "headdim", d=d)
        res[f"{be}/{dt}"] = row
json.dump(res, sys.stdout, indent=1)
