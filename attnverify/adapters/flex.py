"""`flex`: torch.compile'd `torch.nn.attention.flex_attention.flex_attention`.

Every SPEC feature is a block mask (`create_block_mask`) plus a score_mod, written once, generically:
the feature switches and their parameters live in small tensors that the mods capture, so one
compiled graph serves causal (both alignments), windows, softcap and ALiBi, with and without GQA
(`enable_gqa=True` always). Four graph *variants* exist because their captured inputs differ:
plain, varlen (document ids + a segment table), bool mask, float mask. Nothing is a Python number
inside the mods, so changing a window or a slope never recompiles.

Compilation is the cost on the CPU: a cold compile of inductor's C++ flex template takes about 18 s for
a process's first graph and 3-5 s for later ones on two cores, a warm one (inductor's FX-graph cache hit)
about 1 s; the whole ci profile took 21 min cold and 3 min warm (BENCHMARKS.md). The adapter therefore

- keeps one `torch.compile(flex_attention, fullgraph=True)` for the process; dynamo caches a graph
  per (shapes, dtype, variant, scale), and changing a window, slope, cap or mask *value* reuses it;
- points TORCHINDUCTOR_CACHE_DIR at ~/.cache/attnverify/inductor unless you chose a directory, so
  compiled kernels survive the process (cache that directory in CI; seed the run, e.g.
  `--attn-seed 0`, so the same shapes come back and hit it);
- declares min_timeout (900 s on a CPU), so that a cold compile is not killed by the per-example
  timeout (a killed compile caches nothing);
- raises dynamo's recompile limits and turns on `fail_on_recompile_limit_hit`, so a long run can
  never fall back silently to eager flex_attention (a different, unfused implementation);
- compiles with static shapes on the CPU. Dynamic shapes (ATTNVERIFY_FLEX_DYNAMIC=1, or `auto` for
  dynamo's automatic dynamic) trip an inductor bug in torch 2.13: cpp_flex_attention_template.py
  turns the symbolic q/kv block sizes back into `cur_qSplitSize`/`cur_kvSplitSize` with a plain
  `str.replace`, so replacing `ks1` also rewrites `ks15` into `cur_qSplitSize5` and g++ fails
  (19 of 21 varied cases failed to compile with dynamic=True here; docs/compatibility.md has a
  standalone reproduction). Static shapes never create those symbols.

Claims on the CPU (torch 2.13.0+cpu, established by running the cases of
tests/test_external_adapters.py against the float64 reference; figures in docs/compatibility.md):

- forward only, no LSE: with inputs that require grad flex_attention raises "FlexAttention does not
  support backward on CPU", and inductor refuses `return_lse` on the CPU ("torch.compile on CPU only
  supports inference and `return_lse` is not supported yet");
- dtypes fp32, fp16, bf16; head dims 8..512 including odd ones (8, 16, 40, 59, 72, 128, 256, 512
  compiled and matched); Dv != D; any Lq, Lk (partial blocks are the kernel's tails);
- fully-masked rows (bottom-right causal with Lq > Lk, empty varlen segments, masked rows): the
  output is 0 -> fully_masked="zeros";
- bitwise repeatable (one compiled kernel, OpenMP over independent rows) -> deterministic=True.

Sinks and chunked local attention (issue 23) are this adapter's own construction from what the
FlexAttention docs offer (a score_mod may read captured tensors, a mask_mod is any boolean rule of
(b, h, q_idx, kv_idx)); flex has no sink argument. A sink is one more key at index Lk with zero key and
value rows, visible to every query, whose score the score_mod replaces by the head's sink logit; the
chunk rule is a term of the mask_mod (per varlen segment, like the other positional rules).

Measured, not a claim: a query row holding NaN comes back as 0 instead of NaN (the kernel's masking
treats the NaN scores as masked), so `nonfinite_inputs_propagate` fails -- a finding about flex on
the CPU, recorded in docs/compatibility.md.

On CUDA (Triton templates; not yet run on the H200): forward and backward, LSE through
`return_aux=AuxRequest(lse=True)` (or `return_lse=True` on older torch), fp16/bf16/fp32.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..spec import Output, Spec
from ._external import segments, version_tuple
from ._findings import DIFFERENT_KV, NAN_Q_ROW_SWALLOWED, VARLEN_LEAK
from ..devices import cuda_present
from .base import adapter

_TORCH = version_tuple(torch.__version__)
# Captured tensors are padded to powers of two (at least these), so their sizes are static even
# when the inputs' are symbolic: see _compiled for the inductor bug this avoids.
_NSEG_MIN = 16
_L_MIN = 128
_B_MIN = 8

# measured on this machine's CPU build (see the module docstring and docs/compatibility.md)
_CPU_HEAD_DIMS = lambda d: 8 <= d <= 512  # noqa: E731
_CPU_FULLY_MASKED = "zeros"

_STATE: dict = {}


def _availability() -> Optional[str]:
    if _TORCH < (2, 5):
        return f"torch {torch.__version__} has no usable flex_attention (needs torch >= 2.5)"
    try:
        from torch.nn.attention import flex_attention as _  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the torch build
        return f"torch.nn.attention.flex_attention does not import: {type(e).__name__}: {e}"
    if not cuda_present():
        import shutil

        if not (shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or shutil.which("clang++")):
            return "torch.compile on the CPU needs a C++ compiler (g++/clang++), and none is on PATH"
    return None


def _cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "attnverify", "inductor")


def _use_cache_dir() -> None:
    """TORCHINDUCTOR_CACHE_DIR -> ~/.cache/attnverify/inductor unless the user chose one (inductor
    writes its own default, a per-boot temp dir, into the variable once it has used it)."""
    cur = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cur is not None:
        try:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir

            if os.path.abspath(cur) != os.path.abspath(default_cache_dir()):
                return  # the user's choice
        except Exception:
            return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _cache_dir()


def _compiled():
    """The process-wide compiled flex_attention (created on first use)."""
    fn = _STATE.get("compiled")
    if fn is not None:
        return fn
    _use_cache_dir()
    import torch._dynamo as dynamo
    from torch.nn.attention.flex_attention import flex_attention

    cfg = dynamo.config
    for name, value in (("recompile_limit", 1 << 20), ("cache_size_limit", 1 << 20),
                        ("accumulated_recompile_limit", 1 << 20), ("accumulated_cache_size_limit", 1 << 20)):
        if hasattr(cfg, name) and getattr(cfg, name) < value:
            setattr(cfg, name, value)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True  # never fall back to eager flex_attention silently
    # static shapes by default: dynamic ones trip the inductor bug described in the module docstring
    # on most graphs (measured: 19 of 21 varied cases failed to compile with dynamic=True)
    dynamic = {"1": True, "auto": None}.get(os.environ.get("ATTNVERIFY_FLEX_DYNAMIC", "0"), False)
    fn = torch.compile(flex_attention, dynamic=dynamic, fullgraph=True)
    _STATE["compiled"] = fn
    return fn


def _pow2(n: int, least: int) -> int:
    n = max(int(n), least, 1)
    return 1 << (n - 1).bit_length()


# ------------------------------------------------------------------------------------------- mods
# Everything a mod reads is a tensor: ip = int32 [causal_mode, left, right, use_cap, Lq, Lk, chunk, has_sink],
# fp = float32 [cap], sl = float32 (B, Hq) ALiBi slopes (zeros when unused), sk = float32 (Hq,) sink logits.
# causal_mode: 0 none, 1 top-left, 2 bottom-right; left/right: -1 unbounded; chunk: 0 none.
# Sinks are one more key, index Lk, with a zero key and value row: the mask lets every query see it and the
# score_mod replaces its score by the head's sink (unscaled, uncapped, no ALiBi), so the softmax's
# denominator gains exp(sink) and the numerator nothing (docs/adapters.md, "Sinks").


def _visible(ip, qp, kp, off):
    mode, left, right, chunk = ip[0], ip[1], ip[2], ip[6]
    v = (mode == 0) | ((mode == 1) & (kp <= qp)) | ((mode == 2) & (kp <= qp + off))
    c = torch.clamp(chunk, min=1)  # the chunk rule (a query at position qp + off sees keys of its own chunk)
    v = v & ((chunk <= 0) | (torch.div(qp + off, c, rounding_mode="floor") == torch.div(kp, c, rounding_mode="floor")))
    return v & ((left < 0) | (kp >= qp + off - left)) & ((right < 0) | (kp <= qp + off + right))


def _score(s, ip, fp, sl, b, h, qp, kp, off):
    s = torch.where(ip[3] > 0, fp[0] * torch.tanh(s / fp[0]), s)
    return s - sl[b, h] * (qp + off - kp).abs()


def _with_sink(mask_mod, score_mod, ip, sk):
    """Mods that add the sink column (key index Lk) to the given ones."""
    def sink_mask(b, h, qi, ki):
        return ((ip[7] > 0) & (ki == ip[5])) | mask_mod(b, h, qi, ki)

    def sink_score(s, b, h, qi, ki):
        return torch.where((ip[7] > 0) & (ki == ip[5]), sk[h], score_mod(s, b, h, qi, ki))

    return sink_mask, sink_score


def _mods(variant: str, t: dict):
    mask_mod, score_mod = _base_mods(variant, t)
    if "sk" in t:
        return _with_sink(mask_mod, score_mod, t["ip"], t["sk"])
    return mask_mod, score_mod


def _base_mods(variant: str, t: dict):
    ip, fp, sl = t["ip"], t["fp"], t["sl"]
    if variant == "varlen":
        docq, dock, tab = t["docq"], t["dock"], t["tab"]

        def geo(qi, ki):
            dq, dk = docq[qi], dock[ki]
            return qi - tab[0, dq], ki - tab[2, dk], tab[3, dq] - tab[1, dq], dq == dk

        def mask_mod(b, h, qi, ki):
            qp, kp, off, same = geo(qi, ki)
            return same & _visible(ip, qp, kp, off)

        def score_mod(s, b, h, qi, ki):
            qp, kp, off, _ = geo(qi, ki)
            return _score(s, ip, fp, sl, b, h, qp, kp, off)

        return mask_mod, score_mod
    if variant == "bool":
        bm = t["bm"]

        def mask_mod(b, h, qi, ki):
            return _visible(ip, qi, ki, ip[5] - ip[4]) & bm[b, h, qi, ki]

        def score_mod(s, b, h, qi, ki):
            return _score(s, ip, fp, sl, b, h, qi, ki, ip[5] - ip[4])

        return mask_mod, score_mod
    if variant == "float":
        fb = t["fb"]

        def mask_mod(b, h, qi, ki):
            return _visible(ip, qi, ki, ip[5] - ip[4])

        def score_mod(s, b, h, qi, ki):
            return _score(s, ip, fp, sl, b, h, qi, ki, ip[5] - ip[4]) + fb[b, h, qi, ki]

        return mask_mod, score_mod

    def mask_mod(b, h, qi, ki):
        return _visible(ip, qi, ki, ip[5] - ip[4])

    def score_mod(s, b, h, qi, ki):
        return _score(s, ip, fp, sl, b, h, qi, ki, ip[5] - ip[4])

    return mask_mod, score_mod


def _tensors(spec: Spec, b: int, hq: int, lq: int, lk: int, device) -> tuple:
    """(variant, captured tensors) for this call."""
    mode = {"none": 0, "top_left": 1, "bottom_right": 2}[spec.causal]
    left, right = spec.window if spec.window is not None else (-1, -1)
    cap = float(spec.softcap) if spec.softcap is not None else 1.0
    chunk = int(spec.attention_chunk) if spec.attention_chunk is not None else 0
    has_sink = spec.sinks is not None
    t = {
        "ip": torch.tensor([mode, left, right, 1 if spec.softcap is not None else 0, lq, lk, chunk, int(has_sink)],
                           dtype=torch.int32, device=device),
        "fp": torch.tensor([cap], dtype=torch.float32, device=device),
        "sl": torch.zeros(_pow2(b, _B_MIN), hq, dtype=torch.float32, device=device),
    }
    if has_sink:  # differentiable: the suite's gradient of spec.sinks flows through the captured tensor
        t["sk"] = spec.sinks.to(device=device, dtype=torch.float32)
    lk = lk + 1 if has_sink else lk  # captured tables cover the sink column too
    if spec.alibi_slopes is not None:
        s = torch.as_tensor(spec.alibi_slopes, device=device).float()
        t["sl"][:b] = (s.view(1, hq) if s.dim() == 1 else s.view(b, hq)).expand(b, hq)
    if spec.is_varlen:
        segs = segments(spec)
        nseg = _pow2(len(segs), _NSEG_MIN)
        docq = torch.zeros(_pow2(lq, _L_MIN), dtype=torch.int32)  # padded: static sizes (see _compiled)
        dock = torch.zeros(_pow2(lk, _L_MIN), dtype=torch.int32)
        tab = torch.zeros(4, nseg, dtype=torch.int32)  # rows: q start, q length, k start, k length
        for i, (q0, q1, k0, k1) in enumerate(segs):  # the segments cover every query and key
            docq[q0:q1] = i
            dock[k0:k1] = i
            tab[:, i] = torch.tensor([q0, q1 - q0, k0, k1 - k0], dtype=torch.int32)
        t.update(docq=docq.to(device), dock=dock.to(device), tab=tab.to(device))
        return "varlen", t
    m = spec.attn_mask
    if m is not None:
        m4 = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape)).to(device)
        shape = (_pow2(b, 1), hq, _pow2(lq, _L_MIN), _pow2(lk, _L_MIN))  # padded: static sizes
        if m.dtype == torch.bool:
            t["bm"] = torch.zeros(shape, dtype=torch.bool, device=device)
            t["bm"][:b, :, :lq, :lk - has_sink] = m4.expand(b, hq, lq, lk - has_sink)
            return "bool", t
        t["fb"] = torch.zeros(shape, dtype=torch.float32, device=device)
        t["fb"][:b, :, :lq, :lk - has_sink] = m4.to(torch.float32).expand(b, hq, lq, lk - has_sink)
        return "float", t
    return "plain", t


def _claims(cuda: bool) -> dict:
    if cuda:
        return dict(dtypes=("float16", "bfloat16", "float32"), devices=("cuda",),
                    head_dims=(16, 32, 64, 128, 256), backward=True, lse=True, fully_masked="zeros",
                    deterministic=False, tiles=(128, 64), dv_ne_d=True, sinks=True, attention_chunk=True)
    return dict(dtypes=("float16", "bfloat16", "float32"), devices=("cpu",), head_dims=_CPU_HEAD_DIMS,
                backward=False, lse=False, fully_masked=_CPU_FULLY_MASKED, deterministic=True,
                tiles=(128, 128), dv_ne_d=True, sinks=True, attention_chunk=True)


_DIFFERENT_KV = ("accepts k and v of different lengths and returns finite numbers where eager flex_attention "
                 "raises (docs/compatibility.md F8)")
# F16: FlexAttention's own document-mask recipe for packed sequences, on both devices
_DOC_LEAK = ("computes whole key blocks and masks inside them, so packed documents that share a block multiply "
             "each other's values by P = 0: NaN in one document's V made 4,736 outputs of other documents NaN "
             "(B=1 Hq=2 Hkv=1 Lq=74 Lk=197 D=32 fp32, cu_seqlens_k=[0,65,68,196,197]; the document mask_mod is "
             "FlexAttention's own recipe; docs/compatibility.md F16, benchmarks/repro_flex_docmask_nan.py)")
_CPU_FINDINGS = {
    "nonfinite_inputs_propagate": {"why": "compiled flex_attention on the CPU (torch 2.13) returns 0 for a query row "
                                          "holding NaN (docs/compatibility.md F2)", "match": NAN_Q_ROW_SWALLOWED},
    "contract": {"why": "compiled flex_attention on the CPU (torch 2.13) " + _DIFFERENT_KV, "match": DIFFERENT_KV},
    "no_out_of_bounds": {"why": "compiled flex_attention on the CPU (torch 2.13) " + _DOC_LEAK, "match": VARLEN_LEAK},
}
# thorough run on the H200 (torch 2.11), 2026-12-03
_GPU_FINDINGS = {
    "contract": {"why": "compiled flex_attention on CUDA (torch 2.11, H200) " + _DIFFERENT_KV, "match": DIFFERENT_KV},
    "no_out_of_bounds": {"why": "flex_attention on CUDA (torch 2.11, H200) " + _DOC_LEAK, "match": VARLEN_LEAK},
}


def _machine_claims() -> dict:
    """Asked on first use, not at import (NVML: no CUDA context, fork stays safe). min_timeout: cold compiles take
    about 18 s for a process's first graph on two cores, 3-5 s for later ones, longer under load, and one example
    may compile a dozen graphs (repeat_and_interleave_stable); a judge killed mid-compile caches nothing, so the
    next run would time out again."""
    cuda = cuda_present()
    return dict(_claims(cuda), known_failures=_GPU_FINDINGS if cuda else _CPU_FINDINGS,
                max_seqlen=16384 if cuda else 4096, min_timeout=300.0 if cuda else 900.0)


@adapter(
    "flex",
    description="torch.compile(flex_attention) with generic block masks and score_mods",
    availability=_availability,
    deferred_claims=_machine_claims,  # what depends on the device: _claims, known_failures, max_seqlen, min_timeout
    causal=("none", "top_left", "bottom_right"),
    window=True, softcap=True, alibi=True, attn_mask=True, gqa=True, varlen=True, dropout=False,
    # the kernel is block-sparse, but create_block_mask evaluates the mask_mod on the whole (Lq, Lk)
    # grid (B x H x Lq x Lk booleans) on every call: the call as a whole is quadratic in memory
    memory="quadratic",
)
def flex(q, k, v, spec: Spec):
    """torch.compile'd flex_attention."""
    _use_cache_dir()
    from torch.nn.attention.flex_attention import create_block_mask

    b, hq, lq, d = q.shape
    lk = k.shape[2]
    variant, t = _tensors(spec, b, hq, lq, lk, q.device)
    mask_mod, score_mod = _mods(variant, t)
    if spec.sinks is not None:  # the sink column: a zero key and a zero value row at index Lk
        k = torch.cat([k, k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])], dim=2)
        v = torch.cat([v, v.new_zeros(v.shape[0], v.shape[1], 1, v.shape[3])], dim=2)
    block_mask = create_block_mask(mask_mod, b, hq, lq, k.shape[2], device=q.device)
    fn = _compiled()
    kw = dict(score_mod=score_mod, block_mask=block_mask, scale=spec.resolved_scale(d), enable_gqa=True)
    want_lse = bool(spec.return_lse) and q.is_cuda
    if want_lse:
        try:
            from torch.nn.attention.flex_attention import AuxRequest

            out, aux = fn(q, k, v, return_aux=AuxRequest(lse=True), **kw)
            return Output(out, lse=aux.lse)
        except ImportError:
            out, lse = fn(q, k, v, return_lse=True, **kw)
            return Output(out, lse=lse)
    return fn(q, k, v, **kw)
