"""Shared plumbing for the adapters of external libraries (flash-attn, xformers, flashinfer, TE, JAX).

Importing this module imports none of those libraries and touches no GPU.

Availability of a GPU library is decided in three steps, cheapest first, and the answer is cached
for the life of the process:

1. `importlib.util.find_spec` -- is the package installed at all? ("not installed: pip install ...")
2. `cuda_present()` (attnverify.devices) -- asks NVML, so it creates no CUDA context ("no CUDA device").
3. a probe in a *separate* Python process (`probe(...)`): it imports the library and, where cheap,
   runs one tiny call on the GPU. A library whose binary does not match this torch, whose operators
   fail to load (xformers' NotImplementedError "No operator found"), or whose import crashes the
   interpreter is reported as unavailable with the probe's own words. The probe runs in a child so
   that the process driving Hypothesis never initialises CUDA (attnverify.isolation forks judges
   from it) and a crashing import costs nothing. ATTNVERIFY_PROBE_TIMEOUT (seconds, default 180)
   bounds it; ATTNVERIFY_SKIP_PROBE=1 skips step 3 (then the first real call reports any failure).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Callable, Dict, Optional, Tuple

import torch

from ..devices import cuda_present

_CACHE: Dict[str, Optional[str]] = {}

# The probe prints exactly one line starting with this marker: JSON {"ok": bool, "why": str, "info": {...}}
_MARK = "ATTNVERIFY-PROBE:"

_PROBE_PRELUDE = r"""
import json, sys, traceback
def _done(ok, why="", **info):
    print("%s" + json.dumps({"ok": ok, "why": why, "info": info}), flush=True)
    sys.exit(0)
try:
    pass
""" % _MARK

_PROBE_EPILOGUE = r"""
except SystemExit:
    raise
except BaseException as e:
    msg = (str(e).strip().splitlines() or [""])[0][:400]
    _done(False, f"{type(e).__name__}: {msg}")
"""


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent package
        return False


def probe(key: str, body: str, *, timeout: Optional[float] = None) -> Tuple[bool, str, dict]:
    """Run `body` (indented by 4 spaces, inside a try:) in a fresh interpreter; it must call
    `_done(True, **info)` or `_done(False, "why")`. Returns (ok, why, info); never raises."""
    if os.environ.get("ATTNVERIFY_SKIP_PROBE") == "1":
        return True, "", {"probe": "skipped (ATTNVERIFY_SKIP_PROBE=1)"}
    timeout = float(os.environ.get("ATTNVERIFY_PROBE_TIMEOUT", "180")) if timeout is None else timeout
    code = _PROBE_PRELUDE + "\n".join("    " + line for line in body.strip("\n").splitlines()) + "\n" + _PROBE_EPILOGUE
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return False, f"the probe of {key} did not finish within {timeout:g} s (ATTNVERIFY_PROBE_TIMEOUT)", {}
    except OSError as e:
        return False, f"could not start a probe process: {e}", {}
    for line in p.stdout.splitlines():
        if line.startswith(_MARK):
            try:
                d = json.loads(line[len(_MARK):])
            except ValueError:
                break
            return bool(d.get("ok")), str(d.get("why", "")), dict(d.get("info") or {})
    tail = (p.stderr.strip().splitlines() or ["no output"])[-1][:300]
    how = f"was killed by signal {-p.returncode}" if p.returncode < 0 else f"exited with status {p.returncode}"
    return False, f"the probe of {key} {how} before answering ({tail})", {}


def gpu_library_reason(key: str, module: str, pip_hint: str, body: str, *, info_sink: Optional[dict] = None,
                       extra_check: Optional[Callable[[], Optional[str]]] = None) -> Optional[str]:
    """The availability answer for a CUDA-only library (cached per process)."""
    if key in _CACHE:
        return _CACHE[key]
    why: Optional[str]
    if not installed(module):
        why = f"{module} is not installed ({pip_hint})"
    elif not cuda_present():
        why = f"no CUDA device here ({key} runs only on NVIDIA GPUs)"
    else:
        why = extra_check() if extra_check is not None else None
        if why is None:
            ok, msg, info = probe(key, body)
            if info_sink is not None:
                info_sink.update(info)
            why = None if ok else msg or f"the probe of {key} failed without a message"
    _CACHE[key] = why
    return why


def reset_cache() -> None:
    """Forget cached availability answers (tests)."""
    _CACHE.clear()


# ------------------------------------------------------------------------------------------ layouts


def bshd(t: torch.Tensor) -> torch.Tensor:
    """BHSD -> BSHD as a view (no copy); kernels that need a contiguous last dim copy only then."""
    return t.transpose(1, 2)


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def version_tuple(v: str) -> Tuple[int, ...]:
    out = []
    for part in str(v).split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def dist_version(name: str) -> Optional[str]:
    """Installed distribution version without importing the package."""
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def segments(spec) -> list:
    """[(q0, q1, k0, k1), ...] of a varlen Spec (cu_seqlens on any device)."""
    cq = torch.as_tensor(spec.cu_seqlens_q).tolist()
    ck = torch.as_tensor(spec.cu_seqlens_k).tolist()
    return list(zip(cq, cq[1:], ck, ck[1:]))


def varlen_args(spec, device):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of a varlen Spec as the packed-sequence APIs
    take them: int32 contiguous offsets on `device`, host-int maxima (the true ones when the Spec leaves
    them out: FA2/FA3 size their grids from them, FA4's backward its semaphores)."""
    cu_q, cu_k = (torch.as_tensor(c, device=device).to(torch.int32).contiguous()
                  for c in (spec.cu_seqlens_q, spec.cu_seqlens_k))
    segs = segments(spec)
    mq = int(spec.max_seqlen_q) if spec.max_seqlen_q is not None else max((b - a for a, b, _, _ in segs), default=0)
    mk = int(spec.max_seqlen_k) if spec.max_seqlen_k is not None else max((b - a for _, _, a, b in segs), default=0)
    return cu_q, cu_k, mq, mk


def positional_mask_only(spec) -> bool:
    """True when the spec hides keys only by causal/window/varlen (no attn_mask)."""
    return spec.attn_mask is None
