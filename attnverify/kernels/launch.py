"""Host launchers: tensors + Spec -> grid, strides and compile-time flags for the Triton kernels.

Block sizes are parameters (`block_m`, `block_n`, and for the backward `bwd_block_m`, `bwd_block_n`),
so tests can run several tile partitions. `default_config(...)` gives the tiles the adapter uses:
large tiles under the interpreter (each inner-loop iteration costs milliseconds there), and on a GPU
a per-head-dim table tuned on an H200 (see BENCHMARKS.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton

from . import common, flash_bwd, flash_fwd, variants
from . import fp8 as fp8_launch

BIG = common.BIG


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class Config:
    """Tiles, warps and pipeline stages: the forward's; dK/dV's (`bwd_*`: BLOCK_M queries per inner step,
    BLOCK_N keys per program); dQ's (`dq_*`: BLOCK_M queries per program, BLOCK_N keys per inner
    step; by default dK/dV's transposed, with its warps and stages)."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 1
    bwd_block_m: int = 64
    bwd_block_n: int = 64
    bwd_warps: int = 4
    bwd_stages: int = 1
    dq_block_m: Optional[int] = None
    dq_block_n: Optional[int] = None
    dq_warps: Optional[int] = None
    dq_stages: Optional[int] = None
    # speed candidates (issue 25; kernels/variants.py says when each applies): forward FMA scaling, lazy
    # rescaling, TMA loads of K and V, warp specialisation; LPT: causal forward and dQ longest blocks first
    fwd_fma: bool = False
    fwd_lazy: bool = False
    fwd_tma: bool = False
    fwd_ws: bool = False
    lpt: bool = False
    # fewer compiles: kernels not specialised on lengths, head counts, windows (flash_fwd.NOSPEC), and the
    # strides of size-1 dims passed as 0 (any value addresses index 0 alike)
    nospec: bool = False
    # variants of the nospec twins (fewer compiles again; variants.py): tile strides unspecialised (`aligned`), causal,
    # bottom-right, window and sinks at run time (`rtmask`); each needs nospec
    aligned: bool = False
    rtmask: bool = False

    def __post_init__(self):
        variants.check(self)

    def dq(self) -> tuple:
        """(BLOCK_M, BLOCK_N, warps, stages) of the dQ kernel."""
        return (self.dq_block_m or self.bwd_block_n, self.dq_block_n or self.bwd_block_m,
                self.dq_warps or self.bwd_warps, self.dq_stages or self.bwd_stages)


# tiles used under the interpreter (and claimed by the adapter there)
INTERPRETER_CONFIG = Config(64, 64, bwd_block_m=64, bwd_block_n=64)


def default_config(head_dim: int, dtype: torch.dtype, device_type: str, head_dim_v: Optional[int] = None) -> Config:
    """The tiles below, with the speed candidates named in ATTNVERIFY_TRITON_VARIANT (read now) switched on."""
    return variants.from_env(_tile_config(head_dim, dtype, device_type, head_dim_v))


def _tile_config(head_dim: int, dtype: torch.dtype, device_type: str, head_dim_v: Optional[int] = None) -> Config:
    if device_type != "cuda" or interpreting():
        return INTERPRETER_CONFIG
    return replace(_cuda_tiles(head_dim, dtype, head_dim_v), nospec=NOSPEC_ON_GPU)


# Whether a GPU runs the `nospec` twins by default (issue 25): not specialised on lengths, head counts, windows and
# per-row strides, so the fuzzer's varied shapes compile 31% fewer kernels (the dev profile: 954 -> 662,
# benchmarks/dev_profile_keys.py); the same arithmetic (bit-identical outputs, tests/test_triton_nospec.py). Off until
# the perf gate has timed it (2026-12-04's candidates: -2% to -4% at D = 256 forward+backward, where the gate's margin
# is 0.5-7%): ATTNVERIFY_TRITON_VARIANT=nospec turns it on, `spec` off.
NOSPEC_ON_GPU = False


def _cuda_tiles(head_dim: int, dtype: torch.dtype, head_dim_v: Optional[int] = None) -> Config:
    # the larger of D and Dv sets the tiles: D = 96 with Dv = 160 asked 241 KiB of shared memory (H200: 227)
    bd = max(16, triton_next_pow2(max(head_dim, head_dim_v or head_dim)))
    if dtype == torch.float32:
        if bd <= 64:
            return Config(64, 32, 4, 3, 32, 64, 4, 2)
        if bd <= 128:
            return Config(32, 32, 4, 2, 32, 32, 4, 2)
        return Config(32, 16, 4, 1, 16, 32, 4, 1)
    # tuned on the H200, bf16, N = 8192 (benchmarks/tune_triton.py; BENCHMARKS.md "Triton kernel tiles, 2026-12-04").
    # Forward tiles stay 64x64 (the adapter's claimed tiles; other configurations use tiles that divide them).
    # Per kernel, microseconds no mask / causal: D <= 64 dK/dV 32x128 w4 s3 4898 / 3282 (64x128 w8 s3: 5940 / 3616),
    # dQ 64x64 w4 s3 2603 / 1407 (128x64 w8 s3: 2560 / 1758); D = 128 dK/dV 64x128 w8 s3 4518 / 2635 and dQ 128x64
    # w8 s3 2515 / 1334 (best of seven each); D = 256 forward 64x64 w4 s3 489 / 428 TFLOP/s (64x32 w4 s2: 416 / 395),
    # dK/dV 64x64 w8 s2 7701 / 4430 (32x64 w4 s1: 21534 / 18081), dQ 64x32 w4 s3 3413 / 1848 (64x32 w4 s1: 3984 / 2085)
    # Speed switches (benchmarks/perf_candidates.py on the H200, 2026-12-04 20:38, BENCHMARKS.md "Speed candidates"):
    # D <= 64 forward fma + lpt, +4.0% geometric mean over the gate's D = 64 rows (worst +1.4%); D = 256 causal
    # forward+backward tma + fma + lpt, +4.1% (worst +3.9%). D = 128 was not a miss and keeps the plain kernel.
    if bd <= 64:
        return Config(64, 64, 4, 3, 32, 128, 4, 3, dq_block_m=64, dq_block_n=64, dq_warps=4, dq_stages=3,
                      fwd_fma=True, lpt=True)
    if bd <= 128:
        return Config(64, 64, 4, 3, 64, 128, 8, 3)
    return Config(64, 64, 4, 3, 64, 64, 8, 2, dq_block_m=64, dq_block_n=32, dq_warps=4, dq_stages=3,
                  fwd_fma=True, fwd_tma=True, lpt=True)


def _head_dims(p, floor: int = 16) -> dict:
    """Head dims are runtime arguments (masks only), so D = 72 and 80 share one compiled kernel; the
    padded tiles and whether padding exists are compile-time. `floor`: the least tile (fp8 dots: 32)."""
    bd, bdv = max(floor, triton_next_pow2(p.d)), max(floor, triton_next_pow2(p.dv))
    return dict(HEAD_DIM=p.d, HEAD_DIM_V=p.dv, BLOCK_D=bd, BLOCK_DV=bdv, EVEN_D=p.d == bd, EVEN_DV=p.dv == bdv)


def _strides(t) -> tuple:
    return t.stride()


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclass
class Prepared:
    """Everything both directions need, derived once from the inputs and the Spec."""

    b: int
    hq: int
    hkv: int
    lq: int
    lk: int
    d: int
    dv: int
    n_batch: int  # programs along the batch axis: B, or the number of segments
    max_q: int
    max_k: int
    cu_q: Optional[torch.Tensor]
    cu_k: Optional[torch.Tensor]
    slopes: Optional[torch.Tensor]
    stride_az: int
    stride_ah: int
    scale: float
    qk_scale: float
    softcap_scale: float
    softcap_c2: float
    win_left: int
    win_right: int
    flags: dict
    sinks: Optional[torch.Tensor] = None  # float32 (Hq,) on q's device, or None
    descales: Optional[torch.Tensor] = None  # float32 (3, B, Hkv): q's, k's, v's descales (1 where absent), or None


def prepare(q, k, v, spec) -> Prepared:
    b, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    # the kernel indexes k and v with q's strides and lengths: anything inconsistent would be read
    # out of bounds, so it is refused here (the `contract` property checks that it is)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"triton attention: q, k, v must be (B, H, L, D); got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) and not fp8_launch.is_fp8(q.dtype):
        raise ValueError(f"triton attention: dtype {q.dtype} is not supported (float16, bfloat16, float32; "
                         f"float8_e4m3fn, float8_e5m2 forward only)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"triton attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"triton attention: batch sizes differ (q {b}, k {k.shape[0]}, v {v.shape[0]})")
    if k.shape[3] != d:
        raise ValueError(f"triton attention: q and k head dims differ (q {d}, k {k.shape[3]})")
    if v.shape[1] != hkv or v.shape[2] != lk:
        raise ValueError(f"triton attention: k and v differ in heads or length (k {tuple(k.shape[1:3])}, v {tuple(v.shape[1:3])})")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"triton attention: Hq={hq} is not a multiple of Hkv={hkv}")
    if spec.attn_mask is not None:
        raise NotImplementedError("triton attention: attn_mask is not implemented")
    if spec.dropout_p:
        raise NotImplementedError("triton attention: dropout is not implemented")
    scale = spec.resolved_scale(d)
    cu_q = cu_k = None
    n_batch, max_q, max_k = b, lq, lk
    if spec.is_varlen:
        if b != 1:
            raise ValueError("triton attention: varlen packs need B == 1")
        cu_q = torch.as_tensor(spec.cu_seqlens_q, device=q.device).to(torch.int32).contiguous()
        cu_k = torch.as_tensor(spec.cu_seqlens_k, device=q.device).to(torch.int32).contiguous()
        n_batch = cu_q.numel() - 1
        if spec.max_seqlen_q is not None and spec.max_seqlen_k is not None:
            max_q, max_k = int(spec.max_seqlen_q), int(spec.max_seqlen_k)
        else:
            max_q = int((cu_q[1:] - cu_q[:-1]).max()) if n_batch else 0
            max_k = int((cu_k[1:] - cu_k[:-1]).max()) if n_batch else 0
    slopes = None
    stride_az = stride_ah = 0
    if spec.alibi_slopes is not None:
        slopes = torch.as_tensor(spec.alibi_slopes, device=q.device).to(torch.float32).contiguous()
        if slopes.dim() == 1:
            stride_az, stride_ah = 0, 1
        else:
            stride_az, stride_ah = slopes.stride(0), slopes.stride(1)
    if spec.softcap is not None:
        c = float(spec.softcap)
        softcap_scale, softcap_c2 = scale / c, c * common.LOG2E_F
    else:
        softcap_scale, softcap_c2 = 1.0, 1.0
    win_left = win_right = BIG
    if spec.window is not None:
        left, right = spec.window
        win_left = BIG if left < 0 else int(left)
        win_right = BIG if right < 0 else int(right)
    flags = dict(
        IS_CAUSAL=spec.causal != "none",
        CAUSAL_BR=spec.causal == "bottom_right",
        HAS_WINDOW=spec.window is not None and tuple(spec.window) != (-1, -1),
        HAS_SOFTCAP=spec.softcap is not None,
        HAS_ALIBI=slopes is not None,
        IS_VARLEN=cu_q is not None,
        UPCAST=interpreting(),
        IEEE=q.dtype == torch.float32,
    )
    sinks = None
    if getattr(spec, "sinks", None) is not None:
        if tuple(spec.sinks.shape) != (hq,):
            raise ValueError(f"triton attention: spec.sinks must be (Hq,) = ({hq},), got {tuple(spec.sinks.shape)}")
        sinks = spec.sinks.detach().to(device=q.device, dtype=torch.float32).contiguous()
    return Prepared(b, hq, hkv, lq, lk, d, dv, n_batch, max_q, max_k, cu_q, cu_k, slopes, stride_az, stride_ah,
                    scale, scale * common.LOG2E_F, softcap_scale, softcap_c2, win_left, win_right, flags, sinks,
                    fp8_launch.descale_table(q, spec, b, hkv))


def forward(q, k, v, spec, *, block_m: Optional[int] = None, block_n: Optional[int] = None,
            num_warps: Optional[int] = None, num_stages: Optional[int] = None, prep: Optional[Prepared] = None,
            config: Optional[Config] = None):
    """Returns (out, lse, prep): out (B, Hq, Lq, Dv) in q's dtype, lse (B, Hq, Lq) float32 natural log.
    `config` replaces the default configuration; the other keywords override single fields of it."""
    v = fp8_launch.v_for_dot(v)  # fp8 on a GPU: V column-major (the one layout 8-bit wgmma reads); else v itself
    p = prep or prepare(q, k, v, spec)
    cfg = config or default_config(p.d, q.dtype, q.device.type, p.dv)
    bm, bn = block_m or cfg.block_m, block_n or cfg.block_n
    nw, ns = num_warps or cfg.num_warps, num_stages or cfg.num_stages
    out = torch.empty(p.b, p.hq, p.lq, p.dv, device=q.device, dtype=fp8_launch.out_dtype(q.dtype))
    lse = torch.empty(p.b, p.hq, p.lq, device=q.device, dtype=torch.float32)
    if p.lq == 0 or p.n_batch == 0 or p.max_q == 0:
        return out, lse, p
    extra = fp8_launch.launch_kwargs(p, q.dtype, bn)  # {} for a call without fp8 or descales: the kernel as before
    grid = (triton.cdiv(p.max_q, bm), p.n_batch * p.hq)
    dims = _head_dims(p, fp8_launch.min_tile(q.dtype))
    st = variants.strides if cfg.nospec else _strides
    not_fp8 = not fp8_launch.is_fp8(q.dtype)
    tiles, aligned = variants.tile_args(cfg, (q, k, v, out), aligned_ok=not_fp8)
    flags, rtf = variants.rtmask_args(cfg, dict(p.flags, HAS_SINKS=p.sinks is not None))
    variants.kernel(cfg, flash_fwd._attn_fwd, flash_fwd._attn_fwd_nospec, flash_fwd.TWINS, aligned_ok=not_fp8)[grid](
        q, k, v, out, lse, p.slopes if p.slopes is not None else lse,
        p.cu_q if p.cu_q is not None else lse, p.cu_k if p.cu_k is not None else lse,
        p.sinks if p.sinks is not None else lse,
        *tiles, *st(lse),
        p.stride_az, p.stride_ah,
        p.hq, p.hq // p.hkv, p.lq, p.lk,
        p.scale, p.qk_scale, p.softcap_scale, p.softcap_c2, p.win_left, p.win_right,
        **dims, BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=ns, **flags,
        **variants.fwd_switches(cfg, p, k, v, bn, dims, interpreting()), **extra, **aligned, **rtf,
    )
    return out, lse, p


def backward(q, k, v, out, lse, d_out, d_lse, spec, *, block_m: Optional[int] = None, block_n: Optional[int] = None,
             num_warps: Optional[int] = None, num_stages: Optional[int] = None, prep: Optional[Prepared] = None,
             config: Optional[Config] = None, d_sinks: Optional[torch.Tensor] = None):
    """Returns (dq, dk, dv) in the inputs' dtype. d_lse may be None. `block_m`/`block_n` set dK/dV's
    tiles and, transposed, dQ's; `config` replaces the default configuration. With sinks, `d_sinks`
    (float32 (Hq,)) receives their gradient: the LSE saved by the forward includes the sink, so the
    kernels' P and dS need no change, and dsink_h = -sum_{b,i} exp(sink_h - LSE_i) * delta_i."""
    p = prep or prepare(q, k, v, spec)
    fp8_launch.refuse_backward(q.dtype, p)
    cfg = config or default_config(p.d, q.dtype, q.device.type, p.dv)
    if block_m or block_n:
        cfg = replace(cfg, bwd_block_m=block_m or cfg.bwd_block_m, bwd_block_n=block_n or cfg.bwd_block_n,
                      dq_block_m=None, dq_block_n=None)
    if num_warps or num_stages:
        cfg = replace(cfg, bwd_warps=num_warps or cfg.bwd_warps, bwd_stages=num_stages or cfg.bwd_stages,
                      dq_warps=num_warps or cfg.dq_warps, dq_stages=num_stages or cfg.dq_stages)
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    if p.lq == 0 or p.lk == 0 or p.n_batch == 0:
        dq.zero_()
        dk.zero_()
        dv.zero_()
        if d_sinks is not None:  # no key: out = 0, so D = 0 and dsink_h = sum_i P_sink,i dLSE_i
            d_sinks.copy_(_sink_grad(p, lse, -d_lse if d_lse is not None else torch.zeros_like(lse)))
        return dq, dk, dv
    if p.flags["IS_VARLEN"]:
        # rows outside every segment (if cu_seqlens do not cover the pack) get no program
        dq.zero_()
        dk.zero_()
        dv.zero_()
    dims = _head_dims(p)
    delta = torch.empty(p.b, p.hq, p.lq, device=q.device, dtype=torch.float32)
    pre_m = 64
    dl = d_lse if d_lse is not None else delta
    st = variants.strides if cfg.nospec else _strides
    dl_strides = st(d_lse) if d_lse is not None else (0, 0, 0)
    tiles, aligned = variants.tile_args(cfg, (out, d_out))
    variants.kernel(cfg, flash_bwd._bwd_preprocess, flash_bwd._bwd_preprocess_nospec, flash_bwd.PRE_TWINS,
                    rtmask_ok=False)[(triton.cdiv(p.lq, pre_m), p.b * p.hq)](
        out, d_out, dl, delta, *tiles, *dl_strides, p.hq, p.lq,
        HEAD_DIM_V=p.dv, BLOCK_DV=dims["BLOCK_DV"], EVEN_DV=dims["EVEN_DV"], BLOCK_M=pre_m, HAS_DLSE=d_lse is not None,
        **aligned,
    )
    slopes = p.slopes if p.slopes is not None else delta
    cu_q = p.cu_q if p.cu_q is not None else delta
    cu_k = p.cu_k if p.cu_k is not None else delta
    flags, rtf = variants.rtmask_args(cfg, p.flags)
    common = dict(**dims, **flags, **rtf)
    bn = cfg.bwd_block_n
    tiles, aligned = variants.tile_args(cfg, (q, k, v, d_out, dk, dv))
    variants.kernel(cfg, flash_bwd._bwd_dkdv, flash_bwd._bwd_dkdv_nospec, flash_bwd.DKDV_TWINS)[
            (triton.cdiv(p.max_k, bn), p.n_batch * p.hkv)](
        q, k, v, d_out, lse, delta, dk, dv, slopes, cu_q, cu_k,
        *tiles,
        p.stride_az, p.stride_ah,
        p.hq, p.hkv, p.hq // p.hkv, p.lq, p.lk, p.lq,
        p.scale, p.qk_scale, p.softcap_scale, p.softcap_c2, p.win_left, p.win_right,
        BLOCK_M=cfg.bwd_block_m, BLOCK_N=bn, num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages, **common, **aligned,
    )
    # dQ: queries outer (a program per BLOCK_M of them), keys inner
    qm, qn, qw, qs = cfg.dq()
    tiles, aligned = variants.tile_args(cfg, (q, k, v, d_out, dq))
    variants.kernel(cfg, flash_bwd._bwd_dq, flash_bwd._bwd_dq_nospec, flash_bwd.DQ_TWINS)[
            (triton.cdiv(p.max_q, qm), p.n_batch * p.hq)](
        q, k, v, d_out, lse, delta, dq, slopes, cu_q, cu_k,
        *tiles,
        p.stride_az, p.stride_ah,
        p.hq, p.hq // p.hkv, p.lq, p.lk, p.lq,
        p.scale, p.qk_scale, p.softcap_scale, p.softcap_c2, p.win_left, p.win_right,
        BLOCK_M=qm, BLOCK_N=qn, num_warps=qw, num_stages=qs, **common, LPT=variants.lpt(cfg, p.flags), **aligned,
    )
    if d_sinks is not None:
        d_sinks.copy_(_sink_grad(p, lse, delta))
    return dq, dk, dv


def _sink_grad(p: Prepared, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """dsink_h = -sum_{b,i} P_sink,i delta_i (delta = D - dLSE); rows of LSE -inf (no key, no sink, or
    outside every varlen segment) contribute nothing."""
    if p.sinks is None:
        raise ValueError("triton attention: d_sinks was given but spec.sinks is None")
    psink = torch.exp(p.sinks.view(1, -1, 1) - lse)
    psink = torch.where(torch.isneginf(lse), torch.zeros_like(psink), psink)
    if p.flags["IS_VARLEN"]:  # rows past the last segment have no program: their delta is not written
        covered = torch.zeros(lse.shape[-1], dtype=torch.bool, device=lse.device)
        covered[: int(p.cu_q[-1])] = True
        psink = torch.where(covered, psink, torch.zeros_like(psink))
        delta = torch.where(covered, delta, torch.zeros_like(delta))
    return -(psink * delta).sum(dim=(0, 2))
