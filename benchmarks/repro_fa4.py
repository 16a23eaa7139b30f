"""Standalone: FlashAttention-4 (flash_attn.cute, SM90 path) findings F17, F18, F37 and F40 (docs/compatibility.md).

    pip install flash-attn-4                    # 4.0.0b36 was measured ("flash-attn-4[cu13]" with CUDA 13)
    python benchmarks/repro_fa4.py              # on an H100/H200; needs torch and flash_attn.cute only
    python benchmarks/repro_fa4.py hdim 16 64   # F18's head-dim sweep (default: 13 head dims)
    python benchmarks/repro_fa4.py sink_lse     # F37: LSE +inf when a learnable sink tops its row by > 88.7
    python benchmarks/repro_fa4.py dv_bwd       # F40: the backward with Dv != D (Dv < D) fails to compile

Prints one JSON line per check. Every tensor is compared with a float64 reference computed here:
rel_l2 and max_abs are the kernel's error, eager_rel_l2 that of the same formula run eagerly in the
input dtype (upstream's yardstick: a kernel within ~2x of it is right), bad the fraction of elements
whose error exceeds twice the eager maximum plus one rounding, nan the kernel's NaN count. Inputs are
randn with seed 0, not attnverify's draws.

Measured on an H200 (torch 2.11.0+cu130, flash-attn-4 4.0.0b36, nvidia-cutlass-dsl 4.8.1 cu13, 2026-12-03):
- F17 (varlen leak): NaN in v of segment 1 (keys 129..131, no queries) -> nan_per_segment [320, 0, 0, 0]:
  all of segment 0 (5 rows x 2 heads x 32), whose last key tile runs into segment 1. NaN in k: none.
  The clean varlen output is right (rel L2 1.8e-4).
- F18 (backward accumulator head-dim stride): dQ of rows >= 64 wrong, and with GQA dK/dV of rows >= 64,
  whenever D rounded up to 16 is not a multiple of 32. Lq=65 Lk=2 D=16 causal: dQ of row 64 is 0 where
  0.629 is expected. Hq=6 Hkv=3 Lq=Lk=576 D=16: dQ bad 87% in the GQA call *and* in the call on repeated
  K/V (the two agree, which is why attnverify's gqa_equals_repeated_kv saw only dK/dV: F19, the same bug),
  dK/dV bad 87% with GQA and right without. D=72 bf16 causal Lq=Lk=7232: dQ rel L2 1.14. D=64: all right.
  deterministic=True and False give the same numbers. `hdim` sweep (Hq=4 Hkv=2 Lq=Lk=256 fp16): D = 8,
  16, 40, 48, 72, 80 wrong from row 64 (dQ, dK, dV: rel L2 0.87-1.16, 71-74% of elements), D = 24, 32,
  56, 64, 96, 128 right (rel L2 <= 3.2e-4, below the eager fp16 error), D = 112: the backward does not
  compile (MLIRError "failed to partition (112,80) with tiled_mma", F21).
- F37 (`sink_lse`, sinks' LSE overflow): attnverify's H200 run of 2026-12-05 saw LSE +inf against a finite
  reference (0.7705 with scores near -1000; 87.54 and 99.34 with sinks of level 30), output right. Predicted from
  softmax.py Softmax.finalize (row_sum += exp2(sink * log2(e) - row_max_scaled), float32): +inf once the sink
  tops the row's max score by 88.72. This subcommand on the H200 (2026-12-05, B=1 H=2 Lq=Lk=64 D=32): +inf rows
  exactly as predicted (0 of 128 up to 88 above the row max, 116-117 at 88.5, all from 89), output right, and dsink
  (dLSE = 1) 64 per head (the reference's) up to 88, 3-9 at 88.5, 0 from 89: the +inf rows drop out of it.
- F40 (`dv_bwd`): attnverify's H200 run of 2026-12-05 saw `fully_masked_rows` shrink to B=1 Lq=10 Lk=3 D=64 Dv=32
  fp16 window (2, 0) with the backward raising "MLIRError: Operation creation failed" (the forward right). The
  subcommand tries the backward for several (D, Dv) with Dv < D, plain and windowed: not yet run on the H200.
"""
import json
import math

import torch
from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

DEV = "cuda"
F16, BF16, F64 = torch.float16, torch.bfloat16, torch.float64


def emit(**kw):
    print(json.dumps(kw), flush=True)


def r4(x):
    return float(f"{x:.4g}")


def keep_mask(lq, lk, causal=False, window=(None, None)):
    """FA4's mask, bottom-right aligned: row i sees key j when i+lk-lq-left <= j <= i+lk-lq+right (None: unbounded)."""
    i = torch.arange(lq, device=DEV)[:, None] + lk - lq
    j = torch.arange(lk, device=DEV)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool, device=DEV)
    if causal:
        keep &= j <= i
    if window[1] is not None:
        keep &= j <= i + window[1]
    if window[0] is not None:
        keep &= j >= i - window[0]
    return keep


def attention(q, k, v, keep, scale):
    """Eager attention on BSHD tensors in their own dtype, GQA grouped; a row without a key gives 0, LSE -inf."""
    g = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(g, 1), v.transpose(1, 2).repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    has = keep.any(-1, keepdim=True)
    lse = s.detach().masked_fill(~keep, -math.inf).logsumexp(-1)
    p = torch.softmax(s.masked_fill(~(keep | ~has), -math.inf), -1) * has
    return (p @ v).transpose(1, 2), lse


def fwd_bwd(fn, q, k, v, do, dtype):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do.to(dtype))
    return dict(out=out.detach(), lse=lse.detach(), dq=dq, dk=dk, dv=dv)


def stats(x, ref, eager):
    eps = torch.finfo(x.dtype).eps  # plus one rounding of the largest value, as upstream's atol
    x, ref, eager = (t.detach().double() for t in (x, ref, eager))
    fin = torch.isfinite(ref)  # LSE of a row without a key: -inf, checked for equality
    e, ee = (x - ref)[fin].abs(), (eager - ref)[fin].abs()
    n = ref[fin].norm().item() or 1.0
    res = dict(rel_l2=r4(e.norm().item() / n), max_abs=r4(e.max().item()), eager_rel_l2=r4(ee.norm().item() / n),
               bad=r4((e > 2 * ee.max() + eps * ref[fin].abs().max()).double().mean().item()),
               nan=int(x.isnan().sum()))
    if not fin.all():
        res["nonfinite_equal"] = bool((x[~fin] == ref[~fin]).all())
    return res


def compare(a, ref, eager, names=("out", "lse", "dq", "dk", "dv")):
    return {n: stats(a[n], ref[n], eager[n]) for n in names if n in a}


def f17():
    cq, ck = [0, 5, 5, 136, 138], [0, 129, 132, 388, 389]
    torch.manual_seed(0)
    q = torch.randn(cq[-1], 2, 32, device=DEV, dtype=F16)
    k, v = (torch.randn(ck[-1], 1, 32, device=DEV, dtype=F16) for _ in range(2))
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=DEV) for c in (cq, ck))
    mq, mk = (max(b - a for a, b in zip(c, c[1:])) for c in (cq, ck))
    segs = list(zip(cq, cq[1:], ck, ck[1:]))

    def run(k_, v_):
        return flash_attn_varlen_func(q, k_, v_, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq,
                                      max_seqlen_k=mk, softmax_scale=32 ** -0.5, deterministic=True,
                                      return_lse=True)[0]

    ref = torch.zeros(cq[-1], 2, 32, dtype=F64, device=DEV)
    for q0, q1, k0, k1 in segs:
        if q1 > q0 and k1 > k0:
            ref[q0:q1] = attention(*(t[None].double() for t in (q[q0:q1], k[k0:k1], v[k0:k1])),
                                   keep_mask(q1 - q0, k1 - k0), 32 ** -0.5)[0][0]
    clean = run(k, v)
    emit(check="F17 clean varlen output vs float64", rel_l2=r4(((clean.double() - ref).norm() / ref.norm()).item()))
    for which in ("k", "v"):
        k2, v2 = k.clone(), v.clone()
        (k2 if which == "k" else v2)[ck[1]:ck[2]] = math.nan  # segment 1: keys 129..131, no queries
        out = run(k2, v2)
        emit(check=f"F17 NaN in {which} of segment 1 (keys 129..131)", expected="no NaN anywhere (segment 1 has no rows)",
             nan_per_segment=[int(out[q0:q1].isnan().sum()) for q0, q1, _, _ in segs],
             max_change_finite=r4((out - clean).nan_to_num(0.0).abs().max().item()))


def f18(det):
    for c in (dict(b=1, h=1, lq=65, lk=2, d=16, window=(None, None)),
              dict(b=2, h=3, lq=7872, lk=6464, d=72, window=(16, 2))):
        torch.manual_seed(0)
        b, h, lq, lk, d = c["b"], c["h"], c["lq"], c["lk"], c["d"]
        q = torch.randn(b, lq, h, d, device=DEV, dtype=F16)
        k, v = (torch.randn(b, lk, h, d, device=DEV, dtype=F16) for _ in range(2))
        do = torch.randn(b, lq, h, d, device=DEV, dtype=F16)
        keep, scale = keep_mask(lq, lk, True, c["window"]), d ** -0.5
        a = fwd_bwd(lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=scale, causal=True, window_size=c["window"],
                                                    deterministic=det, return_lse=True), q, k, v, do, F16)
        ref = fwd_bwd(lambda q, k, v: attention(q, k, v, keep, scale), q, k, v, do, F64)
        eager = fwd_bwd(lambda q, k, v: attention(q, k, v, keep, scale), q, k, v, do, F16)
        row_err = (a["dq"].double() - ref["dq"]).abs().amax(dim=(0, 2, 3))  # per query row
        worst = int(row_err.argmax())
        emit(check=f"F18 causal B={b} H={h} Lq={lq} Lk={lk} D={d} fp16 window={c['window']}", deterministic=det,
             rows_without_key=int((~keep.any(-1)).sum()), **compare(a, ref, eager),
             dq_worst_row=worst, dq_worst_row_got=r4(a["dq"][:, worst].abs().max().item()),
             dq_worst_row_expected=r4(ref["dq"][:, worst].abs().max().item()))


def f19(det):
    for c in (dict(l=576, d=16, dtype=F16, causal=False), dict(l=7232, d=16, dtype=F16, causal=False),
              dict(l=7232, d=72, dtype=BF16, causal=True), dict(l=576, d=64, dtype=F16, causal=False)):
        torch.manual_seed(0)
        hq, hkv, l, d, dt = 6, 3, c["l"], c["d"], c["dtype"]
        g = hq // hkv
        q, do = (torch.randn(1, l, hq, d, device=DEV, dtype=dt) for _ in range(2))
        k, v = (torch.randn(1, l, hkv, d, device=DEV, dtype=dt) for _ in range(2))
        keep, scale = keep_mask(l, l, c["causal"]), d ** -0.5

        def fa4(q, k, v):
            return flash_attn_func(q, k, v, softmax_scale=scale, causal=c["causal"], deterministic=det, return_lse=True)

        gqa = fwd_bwd(fa4, q, k, v, do, dt)
        rep = fwd_bwd(fa4, q, k.repeat_interleave(g, 2), v.repeat_interleave(g, 2), do, dt)
        for n in ("dk", "dv"):  # back to Hkv heads: sum over each group's query heads
            rep[n] = rep[n].double().view(1, l, hkv, g, d).sum(3)
        ref = fwd_bwd(lambda q, k, v: attention(q, k, v, keep, scale), q, k, v, do, F64)
        eager = fwd_bwd(lambda q, k, v: attention(q, k, v, keep, scale), q, k, v, do, dt)
        name = f"F19 B=1 Hq={hq} Hkv={hkv} Lq=Lk={l} D={d} {str(dt)[6:]} causal={c['causal']}"
        for call, a in (("gqa", gqa), ("repeated_kv", rep)):
            emit(check=name, call=call, deterministic=det, **compare(a, ref, eager))
        emit(check=name, call="gqa vs repeated_kv", deterministic=det,
             **{n: r4(((gqa[n].double() - rep[n].double()).norm() / rep[n].double().norm()).item())
                for n in ("out", "dq", "dk", "dv")})


def rounded(d, multiple):
    return -(-d // multiple) * multiple


def hdim_sweep(dims, l=256):
    """The suspected cause of F18/F19: for head dims up to 128 the SM90 backward kernel rounds its tile
    head dim to a multiple of 16 (flash_bwd_sm90.py: 64 with dKV_swapAB, else 16), while interface.py
    allocates and post-processes the fp32 dQ (and, for GQA, dK/dV) accumulators with the head dim rounded
    to 32. Where the two differ (D = 16, 48, 72, 80, 112, ...) accumulator blocks after the first 64 rows
    are read from the wrong place. One GQA call per D (Hq=4, Hkv=2, Lq=Lk=l, fp16): dQ for every D,
    dK/dV through the GQA accumulators."""
    for d in dims:
        torch.manual_seed(0)
        q, do = (torch.randn(1, l, 4, d, device=DEV, dtype=F16) for _ in range(2))
        k, v = (torch.randn(1, l, 2, d, device=DEV, dtype=F16) for _ in range(2))
        keep, scale = keep_mask(l, l), d ** -0.5
        try:
            a = fwd_bwd(lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=scale, return_lse=True), q, k, v, do, F16)
        except Exception as e:
            emit(check=f"hdim D={d}", error=f"{type(e).__name__}: {str(e)[:200]}")
            continue
        ref = fwd_bwd(lambda q, k, v: attention(q, k, v, keep, scale), q, k, v, do, F64)
        eager = fwd_bwd(lambda q, k, v: attention(q, k, v, keep, scale), q, k, v, do, F16)
        res = compare(a, ref, eager)
        for n in ("dq", "dk", "dv"):  # the first sequence row with an element past the eager bound
            err, bound = (a[n].double() - ref[n]).abs(), 2 * (eager[n].double() - ref[n]).abs().max() + 1e-3
            rows = (err > bound).any(-1).any(-1)[0].nonzero()
            res[n]["first_bad_row"] = int(rows[0]) if len(rows) else None
        emit(check=f"hdim D={d} B=1 Hq=4 Hkv=2 Lq=Lk={l} fp16", kernel_tile_hdim=rounded(d, 16),
             accum_hdim=rounded(d, 32), predicted_wrong=rounded(d, 16) != rounded(d, 32),
             **{n: res[n] for n in ("out", "dq", "dk", "dv")})
        torch.cuda.empty_cache()


def sink_lse(dtypes=(F16, BF16), gaps=(0.0, 80.0, 88.0, 88.5, 89.0, 90.0, 100.0, 1000.0)):
    """F37: a learnable sink `gap` above every score of its rows (each row's own max, float64 from the inputs). FA4's
    Softmax.finalize adds exp2(sink * log2(e) - row_max * scale_log2) to the row sum in float32: predicted +inf (and
    LSE +inf) where sink - row_max >= 128 ln 2 = 88.72. Prints the measured LSE against the float64 reference, the
    output's error (the exact output is within e^-gap of 0 there), and the sink's gradient for dLSE = 1, dO = 0
    (exact: the sum over rows of P_sink)."""
    b, h, lq, lk, d = 1, 2, 64, 64, 32  # D=32: no F18 in the backward
    g = torch.Generator(device=DEV).manual_seed(0)
    for dt in dtypes:
        q, k, v = (torch.randn(b, n, h, d, device=DEV, generator=g).mul(0.5).to(dt) for n in (lq, lk, lk))
        scale = d ** -0.5
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale  # (b, h, lq, lk)
        row_max = s.amax(-1)
        for gap in gaps:
            sink = (row_max.amax(dim=(0, 2)) + gap).float().requires_grad_()  # per head: gap above its best score
            out, lse = flash_attn_func(q, k, v, softmax_scale=scale, learnable_sink=sink, return_lse=True)
            try:
                (dsink,) = torch.autograd.grad((out, lse), sink, (torch.zeros_like(out), torch.ones_like(lse)))
                dsink = [r4(x) for x in dsink.tolist()]
            except Exception as e:  # the forward's numbers still print
                dsink = f"{type(e).__name__}: {str(e)[:200]}"
            sk = sink.detach().double()[None, :, None, None].expand(b, h, lq, 1)
            full = torch.cat([s, sk], -1)
            ref_lse = full.logsumexp(-1)
            p = torch.exp(full - ref_lse[..., None])
            ref_out = torch.einsum("bhqk,bkhd->bqhd", p[..., :-1], v.double())
            ref_dsink = p[..., -1].sum(dim=(0, 2))  # dLSE = 1, dO = 0: sum over rows of P_sink
            margin = sk[..., 0] - row_max
            emit(check=f"sink_lse {str(dt)[6:]} B={b} H={h} Lq=Lk={lq} D={d} sink = row max + {gap}",
                 predicted_inf_rows=int((margin >= 128 * math.log(2)).sum()), rows=b * h * lq,
                 lse_inf_rows=int(torch.isposinf(lse).sum()), lse_nan=int(lse.isnan().sum()),
                 lse_first=r4(lse.flatten()[0].item()), ref_lse_first=r4(ref_lse.flatten()[0].item()),
                 lse_max_abs_err_finite=r4((lse.double() - ref_lse)[torch.isfinite(lse)].abs().max().item())
                 if torch.isfinite(lse).any() else None,
                 out_max_abs_err=r4((out.double() - ref_out).abs().max().item()), out_nan=int(out.isnan().sum()),
                 dsink=dsink, ref_dsink=[r4(x) for x in ref_dsink.tolist()])


def dv_bwd(pairs=((64, 32), (64, 48), (32, 16), (96, 64), (128, 64), (128, 96), (192, 128)), dt=F16):
    """F40: FA4's backward with a value head dim below the q/k one. For each (D, Dv): B=1 Hq=Hkv=1, Lq=10 Lk=3 with a
    (2, 0) window (attnverify's shrunk case) and Lq=Lk=128 without; prints whether the backward runs and its errors
    against the float64 reference, or the exception it raises."""
    for d, dv in pairs:
        for lq, lk, window in ((10, 3, (2, 0)), (128, 128, (None, None))):
            torch.manual_seed(0)
            q = torch.randn(1, lq, 1, d, device=DEV)
            k = torch.randn(1, lk, 1, d, device=DEV)
            v, do = torch.randn(1, lk, 1, dv, device=DEV), torch.randn(1, lq, 1, dv, device=DEV)
            keep, scale = keep_mask(lq, lk, window=window), d ** -0.5
            label = f"dv_bwd D={d} Dv={dv} Lq={lq} Lk={lk} window={window} {str(dt)[6:]}"
            try:
                a = fwd_bwd(lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=scale, window_size=window,
                                                            return_lse=True), q, k, v, do, dt)
            except Exception as e:
                emit(check=label, error=f"{type(e).__name__}: {str(e)[:200]}")
                continue
            ref = fwd_bwd(lambda q, k, v: attention(q, k, v, keep, scale), q, k, v, do, F64)
            eager = fwd_bwd(lambda q, k, v: attention(q, k, v, keep, scale), q, k, v, do, dt)
            emit(check=label, **compare(a, ref, eager, names=("out", "dq", "dk", "dv")))
            torch.cuda.empty_cache()


if __name__ == "__main__":
    import sys

    emit(torch=torch.__version__, gpu=torch.cuda.get_device_name(), capability=torch.cuda.get_device_capability())
    if sys.argv[1:2] == ["hdim"]:  # python benchmarks/repro_fa4.py hdim 16 32 48 ...
        hdim_sweep([int(x) for x in sys.argv[2:]] or [8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 96, 112, 128])
        sys.exit(0)
    if sys.argv[1:2] == ["sink_lse"]:  # python benchmarks/repro_fa4.py sink_lse: F37, well under a minute
        sink_lse()
        sys.exit(0)
    if sys.argv[1:2] == ["dv_bwd"]:  # python benchmarks/repro_fa4.py dv_bwd: F40
        dv_bwd()
        sys.exit(0)
    for fn, args in ((f17, ()), (f18, (True,)), (f18, (False,)), (f19, (True,)), (f19, (False,))):
        try:
            fn(*args)
        except Exception as e:  # one failing check must not hide the others
            emit(check=fn.__name__, args=list(args), error=f"{type(e).__name__}: {str(e)[:300]}")
        torch.cuda.empty_cache()
