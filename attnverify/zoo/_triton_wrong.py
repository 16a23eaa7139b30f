"""Small Triton flash-attention forward kernels with one deliberate bug each (zoo members).

One parametrised kernel, `_zoo_fwd`, is a plain FlashAttention-2 forward (online softmax in base 2,
fp32 statistics, top-left causal, grouped K/V heads, LSE out) written independently of the bundled
kernel in attnverify/kernels. A compile-time `BUG` switch turns on one defect at a time:

    no_rescale        the accumulator and row sum are not multiplied by exp(m_old - m_new)
    first_tile_max    the running max is taken from the first key tile only
    pad_zero          keys past Lk in the last tile are loaded as 0 and scored (score 0, not -inf)
    diag_excluded     causal bound j < i instead of j <= i (the diagonal itself is hidden)
    lse_base2         the LSE is stored in base-2 units (m2 + log2 l), as the Triton tutorial keeps it
    unwritten_rows    (host bug) grid = Lq // BLOCK_M instead of cdiv: the last partial query tile is
                      never computed, so its rows keep the zeros the output was allocated with

Triton is imported only inside `_kernel()`, on first use. Without a CUDA device the kernel runs
under the Triton interpreter; TRITON_INTERPRET=1 is set (if unset) before the jit function is
defined. Under the interpreter dot operands are upcast to fp32 (its bf16 tl.dot is wrong), and fp32 -> bf16
conversions are rounded to nearest even by hand (the Triton 3.9 interpreter truncates toward zero
when converting to bf16, a bias of about -u/2 that a v_mean offset turns into a failing output for
an otherwise correct kernel; measured in tests/test_zoo.py). Tiles are one fixed
config, BLOCK_M = 64 and BLOCK_N = 32: small enough that the ci profile's short sequences cross key
tiles, large enough to keep the interpreter's cost (about 30 ms per program and 15 ms per loop
iteration on these 2-core machines) at a second or so per call.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import threading

import torch

from ..spec import Output, Spec
from ..devices import cuda_present

BLOCK_M = 64
BLOCK_N = 32
BUGS = ("none", "no_rescale", "first_tile_max", "pad_zero", "diag_excluded", "lse_base2", "unwritten_rows")
_BUG_ID = {"none": 0, "no_rescale": 1, "first_tile_max": 2, "pad_zero": 3, "diag_excluded": 4, "lse_base2": 6,
           "unwritten_rows": 7}

_lock = threading.Lock()
_cache = {}


def triton_unavailable():
    """None when the zoo's Triton kernels can run here, else why not."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'attnverify[triton]')"
    if _interpreting() and "fwd" not in _cache and "triton" in sys.modules \
            and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return ("no CUDA GPU, and triton was imported before TRITON_INTERPRET=1 was set: the interpreter cannot "
                "be switched on any more (set TRITON_INTERPRET=1 before importing triton)")
    return None


def _interpreting() -> bool:
    return not cuda_present()


def _kernel():
    """Define (once) and return the jit kernel. Imports Triton here, never at module import."""
    with _lock:
        if "fwd" in _cache:
            return _cache["fwd"]
        if _interpreting():
            # the interpreter is chosen when a @triton.jit function is defined: set it before
            os.environ.setdefault("TRITON_INTERPRET", "1")
        import triton
        import triton.language as tl

        @triton.jit
        def _lowp(x, DT: tl.constexpr, RNE: tl.constexpr):
            """x (fp32) -> DT. RNE: round to nearest even by hand first (the interpreter truncates to bf16)."""
            if RNE:
                b = x.to(tl.uint32, bitcast=True)
                b = b + 0x7FFF + ((b >> 16) & 1)
                x = ((b >> 16) << 16).to(tl.float32, bitcast=True)
            return x.to(DT)

        # jit functions find their callees among the module's globals, not in this closure
        globals()["_lowp"] = _lowp

        @triton.jit
        def _zoo_fwd(
            Q, K, V, O, LSE,
            stride_qz, stride_qh, stride_qm, stride_qk,
            stride_kz, stride_kh, stride_kn, stride_kk,
            stride_vz, stride_vh, stride_vn, stride_vk,
            stride_oz, stride_oh, stride_om, stride_ok,
            H, GROUP, seq_q, seq_k, qk_scale,
            HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            IS_CAUSAL: tl.constexpr, UPCAST: tl.constexpr, RNE: tl.constexpr, BUG: tl.constexpr,
        ):
            # BUG ids: 0 none, 1 no_rescale, 2 first_tile_max, 3 pad_zero, 4 diag_excluded, 6 lse_base2
            #          (7 unwritten_rows is a host-side grid bug)
            start_m = tl.program_id(0)
            off_zh = tl.program_id(1)
            off_z = off_zh // H
            off_h = off_zh % H
            off_hk = off_h // GROUP
            offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, HEAD_DIM)
            offs_dv = tl.arange(0, HEAD_DIM_V)
            q_ptrs = Q + off_z * stride_qz + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qk
            q = tl.load(q_ptrs, mask=offs_m[:, None] < seq_q, other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
            offs_n0 = tl.arange(0, BLOCK_N)
            kt_ptrs = K + off_z * stride_kz + off_hk * stride_kh + offs_n0[None, :] * stride_kn + offs_d[:, None] * stride_kk
            v_ptrs = V + off_z * stride_vz + off_hk * stride_vh + offs_n0[:, None] * stride_vn + offs_dv[None, :] * stride_vk
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
            for start_n in range(0, seq_k, BLOCK_N):
                offs_n = start_n + offs_n0
                in_k = offs_n < seq_k
                kt = tl.load(kt_ptrs + start_n * stride_kn, mask=in_k[None, :], other=0.0)
                v = tl.load(v_ptrs + start_n * stride_vn, mask=in_k[:, None], other=0.0)
                if UPCAST:
                    qk = tl.dot(q, kt.to(tl.float32))
                else:
                    qk = tl.dot(q, kt)
                s = qk * qk_scale
                if BUG != 3:
                    s = tl.where(in_k[None, :], s, float("-inf"))
                if IS_CAUSAL:
                    if BUG == 4:
                        s = tl.where(offs_n[None, :] < offs_m[:, None], s, float("-inf"))
                    else:
                        s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
                if BUG == 2:
                    if start_n == 0:
                        m_new = tl.maximum(m_i, tl.max(s, 1))
                    else:
                        m_new = m_i
                else:
                    m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.math.exp2(m_i - m_new)
                p = tl.math.exp2(s - m_new[:, None])
                if BUG == 1:
                    l_i = l_i + tl.sum(p, 1)
                else:
                    l_i = l_i * alpha + tl.sum(p, 1)
                p_lo = _lowp(p, V.dtype.element_ty, RNE)
                if UPCAST:
                    pv = tl.dot(p_lo.to(tl.float32), v.to(tl.float32))
                else:
                    pv = tl.dot(p_lo, v)
                if BUG == 1:
                    acc = acc + pv
                else:
                    acc = acc * alpha[:, None] + pv
                m_i = m_new
            out = acc / l_i[:, None]
            if BUG == 6:
                lse = m_i + tl.math.log2(l_i)  # base-2 units, never converted
            else:
                lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
            o_ptrs = O + off_z * stride_oz + off_h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_ok
            tl.store(o_ptrs, _lowp(out, O.dtype.element_ty, RNE), mask=offs_m[:, None] < seq_q)
            tl.store(LSE + off_zh * seq_q + offs_m, lse, mask=offs_m < seq_q)

        _cache["fwd"] = (_zoo_fwd, triton)
        return _cache["fwd"]


def zoo_flash_forward(q, k, v, spec: Spec, *, bug: str = "none"):
    """Run the zoo's Triton forward with one bug switched on; returns an `Output` (LSE when asked)."""
    if bug not in _BUG_ID:
        raise ValueError(f"bug={bug!r}: one of {BUGS}")
    kern, triton = _kernel()
    b, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    if spec.causal not in ("none", "top_left"):
        raise ValueError(f"the zoo's Triton kernel implements causal='top_left' only, not {spec.causal!r}")
    for n, x in (("D", d), ("Dv", dv)):
        if x < 16 or x & (x - 1):
            raise ValueError(f"{n}={x}: the zoo's Triton kernel takes powers of two >= 16")
    out = torch.zeros(b, hq, lq, dv, dtype=q.dtype, device=q.device)
    lse = torch.zeros(b, hq, lq, dtype=torch.float32, device=q.device)
    n_m = lq // BLOCK_M if bug == "unwritten_rows" else triton.cdiv(lq, BLOCK_M)
    if n_m > 0 and lk > 0 and b * hq > 0:
        qk_scale = spec.resolved_scale(d) * 1.4426950408889634
        kern[(n_m, b * hq)](
            q, k, v, out, lse,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            hq, hq // hkv, lq, lk, qk_scale,
            HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            IS_CAUSAL=spec.causal != "none", UPCAST=_interpreting(),
            RNE=_interpreting() and q.dtype == torch.bfloat16,
            BUG=_BUG_ID[bug],
        )
    return Output(out, lse=lse if spec.return_lse else None)

