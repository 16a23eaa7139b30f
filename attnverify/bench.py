"""`attnverify bench`: speed and peak memory of adapters side by side, with proof of which kernel ran.

    attnverify bench --adapter sdpa-flash --adapter triton --dtype bf16 --seqlens 1024,2048 --head-dim 128 \\
        --causal --backward --out bench/

For every adapter and sequence length N (Lq = Lk = N): forward and forward+backward time, TFLOP/s and
peak extra memory, one markdown table (printed; with --out also DIR/bench.md and DIR/bench.json).

How it measures (the benchmark plan of the project's first seed):
- timing: on a GPU `triton.testing.do_bench` (median; it synchronises and times with CUDA events, so
  asynchronous launches are accounted for; warm-up 25 ms, 100 ms of repetitions) or, without triton,
  CUDA events around each repetition after warm-up calls; on a CPU the wall-clock median of
  repetitions after warm-up calls (synchronous).
- inputs: random normal (never zeros), drawn once per (adapter, N), contiguous BHSD; the upstream
  gradient likewise; gradients are taken with torch.autograd.grad (nothing accumulates).
- FLOPs: forward 2 * B * Hq * (visible (i, j) pairs) * (D + Dv), so causal counts only its half;
  forward+backward 3.5 x the forward (2 matmuls forward, 5 backward).
- peak memory: the extra bytes allocated during one call beyond what existed before it (inputs
  excluded), after a warm-up call: torch.cuda.max_memory_allocated on a GPU, the profiler's allocation
  events (CPU allocator) on a CPU.
- proof: one call per adapter under torch.profiler; the aten operators and, on a GPU, the CUDA kernels
  that ran are listed, and matched against what the adapter is meant to run (e.g. sdpa-flash must show
  `_scaled_dot_product_flash_attention`): a framework call can silently pick another implementation.
- a correctness check (attnverify.check against the float64 reference) on a small instance of the
  same configuration, so a fast wrong kernel cannot top the table unnoticed.

Exit status: 0 measured; 1 a correctness check failed or the intended kernel was not seen; 2 usage error.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

from .devices import cuda_present
# the measurement lives in attnverify/measure.py (the properties use it too); importable from here as before
from .measure import peak_extra_bytes, profile_names, synchronize, time_call

DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "half": "float16", "float16": "float16",
    "fp32": "float32", "float": "float32", "float32": "float32", "fp64": "float64", "float64": "float64",
}

# What each built-in adapter must visibly run: a regex over the profiled operator and kernel names, per device.
# None: no expectation (the names are still listed).
EXPECTED: Dict[str, Dict[str, Optional[str]]] = {
    "sdpa-math": {"cpu": r"_scaled_dot_product_attention_math", "cuda": r"_scaled_dot_product_attention_math"},
    "sdpa-flash": {"cpu": r"_scaled_dot_product_flash_attention_for_cpu",
                   "cuda": r"_scaled_dot_product_flash_attention\b|flash_fwd"},
    "sdpa-efficient": {"cpu": None, "cuda": r"_scaled_dot_product_efficient_attention|fmha_cutlass|efficient_attention"},
    "sdpa-cudnn": {"cpu": None, "cuda": r"_scaled_dot_product_cudnn_attention|cudnn"},
    "sdpa": {"cpu": r"_scaled_dot_product_(flash_attention_for_cpu|attention_math)",
             "cuda": r"_scaled_dot_product_(flash_attention|efficient_attention|cudnn_attention|attention_math)"},
    # the bundled kernel: its jit kernel on a GPU; under the CPU interpreter the launches are invisible to the
    # profiler, so its autograd.Function (`FlashAttention`) is what shows that the bundled path ran
    "triton": {"cpu": r"^FlashAttention$", "cuda": r"_attn_fwd"},
    "naive": {"cpu": r"aten::(bmm|matmul)", "cuda": r"aten::(bmm|matmul)"},
}

# ------------------------------------------------------------------------------------ proof of kernel


def proof(adapter_name: str, names: dict, device) -> dict:
    """Did the intended implementation run? {"ok": True/False/None, "matched": name, "expected": regex}."""
    exp = EXPECTED.get(adapter_name, {}).get(torch.device(device).type)
    allnames = list(names.get("kernels", [])) + list(names.get("ops", []))
    if exp is None:
        return {"ok": None, "matched": None, "expected": None}
    rx = re.compile(exp)
    hit = next((n for n in allnames if rx.search(n)), None)
    return {"ok": hit is not None, "matched": hit, "expected": exp}


def visible_pairs(lq: int, lk: int, causal: str) -> int:
    """(i, j) pairs a query attends to: Lq*Lk, or the causal triangle (top-left / bottom-right)."""
    if causal == "none":
        return lq * lk
    off = 0 if causal == "top_left" else lk - lq
    return int(sum(max(0, min(lk, i + off + 1)) for i in range(lq)))


def attention_flops(b: int, hq: int, lq: int, lk: int, d: int, dv: int, causal: str, mode: str) -> float:
    f = 2.0 * b * hq * visible_pairs(lq, lk, causal) * (d + dv)
    return f * (3.5 if mode == "fwd+bwd" else 1.0)


# -------------------------------------------------------------------------------------------- runs


def _versions(device) -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
         "cpu_count": os.cpu_count()}
    try:
        import triton

        v["triton"] = triton.__version__
    except Exception:
        v["triton"] = "not installed"
    try:
        from . import __version__

        v["attnverify"] = __version__
    except Exception:
        pass
    if torch.device(device).type == "cuda":
        v["cuda"] = torch.version.cuda
        v["cudnn"] = torch.backends.cudnn.version()
        v["gpu"] = torch.cuda.get_device_name(device)
    else:
        v["cpu"] = platform.processor() or platform.machine()
        v["torch_threads"] = torch.get_num_threads()
        try:
            v["load_average"] = os.getloadavg()[0]
        except OSError:
            pass
    return v


class _Usage(Exception):
    pass


def _usage(msg: str) -> _Usage:
    return _Usage(msg)


def _parse_ints(text: str, what: str) -> List[int]:
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise _usage(f"--{what} {text!r}: give comma-separated integers, e.g. 1024,2048") from None
    if not vals or any(x < 1 for x in vals):
        raise _usage(f"--{what} {text!r}: give positive integers")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnverify bench", description="speed and peak memory of adapters side by side, "
                                "with proof (profiler names) of which kernel ran")
    p.add_argument("--adapter", action="append", help="adapter name or import path; repeat or comma list "
                   "(default: the built-ins available here)")
    p.add_argument("--dtype", default="auto", help="bf16, fp16, fp32 (default: bf16 on a GPU, fp32 on a CPU)")
    p.add_argument("--seqlens", default=None, help="comma list of N = Lq = Lk (default 1024,2048,4096,8192 on a GPU; "
                   "256,512 on a CPU)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", default="auto", help="batch size, or auto: 16384 // N on a GPU (tokens fixed), 1 on a CPU")
    p.add_argument("--heads", default="auto", help="query heads, or auto: 2048 // D on a GPU, 4 on a CPU")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); default = --heads")
    p.add_argument("--causal", action="store_true", help="causal mask (top-left; bottom-right where only that is claimed)")
    p.add_argument("--backward", action="store_true", help="also time forward+backward")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--warmup", type=int, default=3, help="CPU / CUDA-event warm-up calls (do_bench warms up by time)")
    p.add_argument("--rep", type=int, default=10, help="CPU repetitions (median)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check on a small instance")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting new measurements after this many seconds")
    p.add_argument("--out", default=None, help="folder for bench.md and bench.json")
    p.add_argument("--json", action="store_true", help="print JSON instead of the markdown table")
    return p


def _device(pref: str) -> str:
    if pref == "auto":
        return "cuda" if cuda_present() else "cpu"
    if pref == "cuda" and not cuda_present():
        raise _usage("--device cuda: no CUDA device is present here")
    return pref


def _resolve_adapters(names: Optional[Sequence[str]], device: str):
    from .adapters.registry import UnknownAdapterError, get, resolve

    if not names:
        default = ["sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "triton", "sdpa-math"] if device == "cuda" \
            else ["naive", "sdpa-math", "sdpa-flash"]
        return [get(n) for n in default]
    try:
        return resolve(list(names))
    except UnknownAdapterError as e:
        raise _usage(str(e)) from None


def _shape(ns, n: int, d: int, device: str):
    """(batch, query heads, kv heads) for sequence length n."""
    try:
        b = int(ns.batch) if ns.batch != "auto" else (max(1, 16384 // n) if device == "cuda" else 1)
        hq = int(ns.heads) if ns.heads != "auto" else (max(1, 2048 // d) if device == "cuda" else 4)
    except ValueError:
        raise _usage(f"--batch {ns.batch!r} / --heads {ns.heads!r}: give an integer or auto") from None
    hkv = int(ns.kv_heads) if ns.kv_heads else hq
    if min(b, hq, hkv) < 1 or hq % hkv:
        raise _usage(f"--heads {hq} must be a positive multiple of --kv-heads {hkv} (and --batch >= 1)")
    return b, hq, hkv


def _causal_mode(adapter, want: bool) -> Optional[str]:
    if not want:
        return "none" if "none" in adapter.claims.causal else None
    for m in ("top_left", "bottom_right"):  # identical when Lq == Lk
        if m in adapter.claims.causal:
            return m
    return None


def _inputs(b, hq, hkv, n, d, dtype, device, seed, grad):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(b, h, n, d, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = mk(hq), mk(hkv), mk(hkv)
    do = mk(hq)
    if grad:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    return q, k, v, do


def _calls(adapter, q, k, v, do, spec):
    from .check import unpack_output

    def fwd():
        with torch.no_grad():
            return unpack_output(adapter(q, k, v, spec))[0]

    def fwd_bwd():
        o = unpack_output(adapter(q, k, v, spec))[0]
        return torch.autograd.grad([o], [q, k, v], [do])

    return fwd, fwd_bwd


def _sanity(adapter, dtype, d, hq, hkv, n, causal, device, backward):
    """attnverify.check on a small instance of the configuration: 'ok', or what failed."""
    from .case import Case
    from .check import check, unclaimed
    from .spec import Spec

    h = max(1, min(hkv, 2))
    g = hq // hkv
    q, k, v, _ = _inputs(1, h * g, h, n, d, dtype, device, 7, False)
    case = Case(q, k, v, Spec(causal=causal), seed=7, label="bench sanity")
    why = unclaimed(adapter, case)
    if why:
        return {"status": "skipped", "text": why}
    res = check(adapter, case, backward=backward and adapter.claims.backward, keep_tensors=False)
    worst = max(res.comparisons, key=lambda c: (c.rel_l2 / c.tol_norm) if c.tol_norm else 0.0, default=None)
    detail = f"{worst.name} rel L2 {worst.rel_l2:.1e}" if worst is not None else ""
    if res.passed:
        return {"status": "ok", "text": f"ok ({detail}; {case.describe()})"}
    if res.status == "error":
        return {"status": "error", "text": "error: " + (res.error or "").splitlines()[0][:120]}
    bad = ", ".join(f"{c.name} rel L2 {c.rel_l2:.1e} > {c.tol_norm:.1e}" for c in res.failing())
    return {"status": "failed", "text": f"FAILED ({bad})"}


def run_bench(ns) -> dict:
    device = _device(ns.device)
    dname = DTYPE_ALIASES.get(str(ns.dtype).lower()) if ns.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    if dname is None:
        raise _usage(f"--dtype {ns.dtype!r}: use one of bf16, fp16, fp32, fp64")
    dtype = getattr(torch, dname)
    seqlens = _parse_ints(ns.seqlens, "seqlens") if ns.seqlens else ([1024, 2048, 4096, 8192] if device == "cuda" else [256, 512])
    d = int(ns.head_dim)
    if d < 1:
        raise _usage(f"--head-dim {d}: must be >= 1")
    adapters = _resolve_adapters(ns.adapter, device)
    t_begin = time.perf_counter()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device, "dtype": dname, "head_dim": d,
            "seqlens": seqlens, "causal": bool(ns.causal), "backward": bool(ns.backward),
            "versions": _versions(device), "cpu_warmup": ns.warmup, "cpu_rep": ns.rep}
    rows, adapters_info = [], []
    from .case import Case
    from .check import unclaimed
    from .spec import Spec

    failed_any = False
    for a in adapters:
        info = {"adapter": a.name, "claims": a.claims.summary(), "unavailable": a.unavailable_reason()}
        adapters_info.append(info)
        if info["unavailable"]:
            continue
        if device not in a.claims.devices:
            info["unavailable"] = f"{a.name} does not claim device {device}"
            continue
        causal = _causal_mode(a, ns.causal)
        if causal is None:
            info["unavailable"] = f"{a.name} does not claim {'causal' if ns.causal else 'non-causal'} attention"
            continue
        info["causal"] = causal
        for n in seqlens:
            b, hq, hkv = _shape(ns, n, d, device)
            row = {"adapter": a.name, "n": n, "batch": b, "heads": hq, "kv_heads": hkv, "head_dim": d, "causal": causal}
            rows.append(row)
            if ns.budget_s is not None and time.perf_counter() - t_begin > ns.budget_s:
                row["skipped"] = f"time budget ({ns.budget_s:g} s) spent"
                continue
            spec = Spec(causal=causal)
            modes = ["fwd"] + (["fwd+bwd"] if ns.backward and a.claims.backward else [])
            try:
                q, k, v, do = _inputs(b, hq, hkv, n, d, dtype, device, 1234 + n, "fwd+bwd" in modes)
                why = unclaimed(a, Case(q, k, v, spec=spec))  # the claims and `refuses` judge what is timed
                if why:
                    row["skipped"] = why
                    del q, k, v, do
                    continue
                if ns.backward and not a.claims.backward:
                    row["fwd+bwd_skipped"] = f"{a.name} does not claim backward"
                fwd, fwd_bwd = _calls(a, q, k, v, do, spec)
                for mode in modes:
                    call = fwd if mode == "fwd" else fwd_bwd
                    r = call()  # first call: compile / autotune / allocate, not timed
                    synchronize(device)
                    del r
                    t = time_call(call, device, warmup=ns.warmup, rep=ns.rep)
                    row[f"{mode}_ms"] = t["ms"]
                    row["timing"] = t["method"]
                    row[f"{mode}_tflops"] = attention_flops(b, hq, n, n, d, d, causal, mode) / (t["ms"] * 1e-3) / 1e12
                    row[f"{mode}_peak_bytes"] = peak_extra_bytes(call, device, warmup=False)
                    if "proof" not in info or mode == "fwd+bwd":
                        names = profile_names(call, device)
                        info.setdefault("names", {})[mode] = names
                        if mode == "fwd":
                            info["proof"] = proof(a.name, names, device)
                del q, k, v, do, fwd, fwd_bwd
            except Exception as e:  # one adapter's failure is a row, not the end of the benchmark
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if device == "cuda":
                torch.cuda.empty_cache()
        if not ns.no_check and any(r.get("fwd_ms") for r in rows if r["adapter"] == a.name):
            n0 = min(seqlens) if device == "cuda" else min(min(seqlens), 256)
            _, hq, hkv = _shape(ns, n0, d, device)
            try:
                info["check"] = _sanity(a, dtype, d, hq, hkv, n0, causal, device, ns.backward)
            except Exception as e:
                info["check"] = {"status": "error", "text": f"check raised {type(e).__name__}: {e}"}
            if info["check"]["status"] in ("failed", "error"):
                failed_any = True
        if info.get("proof", {}).get("ok") is False:
            failed_any = True
    meta["seconds"] = time.perf_counter() - t_begin
    timing = next((r["timing"] for r in rows if r.get("timing")), "")
    meta["timing"] = timing
    return {"meta": meta, "rows": rows, "adapters": adapters_info, "failed": failed_any}


# ------------------------------------------------------------------------------------------ output


def _fmt(x, spec=".3f", missing="-"):
    if x is None:
        return missing
    try:
        return format(float(x), spec)
    except (TypeError, ValueError):
        return str(x)


def _md_escape(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def to_markdown(result: dict) -> str:
    m, v = result["meta"], result["meta"]["versions"]
    dev = v.get("gpu") or (f"CPU ({v.get('cpu', '?')}, {v.get('cpu_count')} cores, {v.get('torch_threads')} torch threads"
                           + (f", load average {v['load_average']:.1f} at the start" if "load_average" in v else "") + ")")
    lines = [
        f"### attnverify bench ({m['date']})",
        "",
        f"- device: {dev}; torch {v['torch']}, triton {v.get('triton')}"
        + (f", CUDA {v.get('cuda')}, cuDNN {v.get('cudnn')}" if m["device"] == "cuda" else "")
        + f", Python {v['python']}",
        f"- dtype {m['dtype']}, head dim {m['head_dim']}, N = Lq = Lk in {m['seqlens']}; "
        f"mask: {'causal' if m['causal'] else 'none'}; " + ("forward and forward+backward" if m["backward"] else "forward only"),
        f"- timing: {m.get('timing') or '-'}; first call (compile/autotune) excluded; inputs random normal, contiguous BHSD",
        "- TFLOP/s: forward 2·B·Hq·pairs·(D+Dv) with pairs = visible (i, j) (causal counts its half); "
        "forward+backward 3.5x forward",
        "- peak: extra bytes allocated during one call beyond the inputs ("
        + ("torch.cuda.max_memory_allocated" if m["device"] == "cuda" else "profiler allocation events of the CPU allocator") + ")",
        "",
        "| N | B x Hq/Hkv | adapter | fwd ms | fwd TFLOP/s | fwd peak MiB | fwd+bwd ms | fwd+bwd TFLOP/s | fwd+bwd peak MiB | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = sorted(result["rows"], key=lambda r: (r["n"], [a["adapter"] for a in result["adapters"]].index(r["adapter"])))
    for r in rows:
        note = r.get("error") or r.get("skipped") or r.get("fwd+bwd_skipped") or ""
        mib = lambda x: None if x is None else x / 2**20  # noqa: E731
        lines.append("| " + " | ".join([
            str(r["n"]), f"{r['batch']} x {r['heads']}/{r['kv_heads']}", r["adapter"],
            _fmt(r.get("fwd_ms")), _fmt(r.get("fwd_tflops"), ".3g"), _fmt(mib(r.get("fwd_peak_bytes")), ".1f"),
            _fmt(r.get("fwd+bwd_ms")), _fmt(r.get("fwd+bwd_tflops"), ".3g"), _fmt(mib(r.get("fwd+bwd_peak_bytes")), ".1f"),
            _md_escape(note)]) + " |")
    lines += ["", "Which implementation ran (torch.profiler, one forward call; backward names where timed), and a "
              "correctness check against the float64 reference on a small instance of the same configuration:", "",
              "| adapter | intended kernel seen | check | kernels / operators that ran (by time) |", "|---|---|---|---|"]
    for a in result["adapters"]:
        if a.get("unavailable"):
            lines.append(f"| {a['adapter']} | - | - | unavailable: {_md_escape(a['unavailable'])} |")
            continue
        p = a.get("proof") or {}
        if p.get("ok") is True:
            seen = f"yes: `{_md_escape(p['matched'])}`"
        elif p.get("ok") is False:
            seen = f"**NO** (expected /{_md_escape(p['expected'])}/)"
        else:
            seen = "no expectation registered" if a.get("names") else "-"
        names = a.get("names", {})
        parts = []
        for mode in ("fwd", "fwd+bwd"):
            nm = names.get(mode)
            if not nm:
                continue
            shown = (nm.get("kernels") or [])[:4] + (nm.get("top_ops") or [])[:4]
            parts.append(f"{mode}: " + ", ".join(f"`{_md_escape(x[:90])}`" for x in shown))
        chk = (a.get("check") or {}).get("text", "-")
        lines.append(f"| {a['adapter']} | {seen} | {_md_escape(chk)} | {'; '.join(parts) or '-'} |")
    lines.append("")
    lines.append(f"({m['seconds']:.1f} s)")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = build_parser()
    try:
        ns = p.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code in (0, None) else 2
    try:
        result = run_bench(ns)
    except _Usage as e:
        print(f"attnverify bench: {e}", file=sys.stderr)
        return 2
    md = to_markdown(result)
    if ns.out:
        os.makedirs(ns.out, exist_ok=True)
        with open(os.path.join(ns.out, "bench.md"), "w") as f:
            f.write(md + "\n")
        with open(os.path.join(ns.out, "bench.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
    if ns.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        print(md)
    return 1 if result["failed"] else 0


if __name__ == "__main__":  # python -m attnverify.bench
    sys.exit(main())
