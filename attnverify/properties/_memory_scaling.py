"""memory_scaling: peak extra memory at N, 2N, 4N has no N x N part (memory="linear")."""
from __future__ import annotations

import math
import time
from typing import Dict, List

import torch
from hypothesis import strategies as st

from ..case import DTYPES
from ..check import unpack_output
from .base import ExampleResult, Property
from ..devices import cuda_present
from ._guards import _interpreted_triton, _skipped

N_MIN = 64  # the smallest N measured (4N = 256 keys)


class MemoryScaling(Property):
    name = "memory_scaling"
    doc = ("For adapters claiming memory='linear': the peak extra memory of a call at N, 2N and 4N has no N x N "
           "part (fitted a + bN + cN^2; the cN^2 part at 4N must stay under 1/8 of one score matrix in the input "
           "dtype). Measured with torch.cuda.max_memory_allocated on a GPU, with the profiler's allocation events "
           "on a CPU. The result states the N x N payload avoided.")

    def skip_reason(self, adapter):
        if adapter.claims.memory != "linear":
            return f"{adapter.name} does not claim memory='linear'"
        try:
            dev = adapter.run_device("auto")
        except ValueError:
            return None
        return None if self._configs(adapter, dev) else self._why_none(adapter, dev)

    def _why_none(self, adapter, device) -> str:
        from ._memory_configs import why_no_config

        return why_no_config(adapter, adapter.run_device(device))

    def _configs(self, adapter, device) -> List[dict]:
        from ._memory_configs import claimed_configs

        return claimed_configs(self._all_configs(adapter, device), adapter)

    def _all_configs(self, adapter, device) -> List[dict]:
        c = adapter.claims
        dev = adapter.run_device(device)
        order = ("bfloat16", "float16", "float32") if dev == "cuda" else ("float32", "bfloat16", "float16")
        dtype = next((x for x in order if x in c.dtypes), c.dtypes[0])
        hd = next((x for x in ((128, 64, 32, 16) if dev == "cuda" else (32, 64, 16)) if c.head_dim_ok(x)), None)
        if hd is None:
            hd = next((x for x in range(16, 257) if c.head_dim_ok(x)), 16)
        # large enough that one score matrix dwarfs fixed workspaces and their size steps (SDPA FLASH on the
        # CPU changes its split size at 1024 keys), small enough for the Triton interpreter on a CPU
        n0 = 2048 if dev == "cuda" else 512
        # at least N_MIN: below it one score matrix at 4N is the size of a correct kernel's workspace steps, and
        # the fit read those as an N x N part: a correct chunked kernel failed at N = 16 in float32 (5 KiB of
        # quadratic part, 2 KiB allowed) and at N = 32 in bfloat16 fwd+bwd (per-chunk 5 KiB buffers alive at the
        # peak: 2, 3, 7 of them for 2, 4, 8 chunks; 4 KiB allowed)
        while 4 * n0 > c.max_seqlen and n0 > N_MIN:
            n0 //= 2
        heads = 8 if dev == "cuda" else 1  # one head on a CPU: the Triton interpreter's time grows with (N/64)^2 * heads
        causal = next((m for m in c.causal if m != "none"), None)
        out = []
        for mode in (("fwd", "fwd+bwd") if c.backward else ("fwd",)):
            for cz in (("none", causal) if causal and "none" in c.causal else ((causal,) if causal else ("none",))):
                out.append({"device": dev, "dtype": dtype, "head_dim": hd, "n": n0, "batch": 1, "heads": heads,
                            "mode": mode, "causal": cz})
        return out

    def strategy(self, adapter, profile, device):
        configs = self._configs(adapter, device)
        if not configs:
            from .driver import PropertySkipped

            raise PropertySkipped(self._why_none(adapter, device))
        return st.sampled_from(configs)

    def examples(self, adapter, profile, device):
        if self.skip_reason(adapter):
            return []
        return self._configs(adapter, device)[:1]

    def run_example(self, adapter, drawn) -> ExampleResult:
        from ..measure import peak_extra_bytes

        t0 = time.perf_counter()
        cfg = dict(drawn)
        dev = torch.device(cfg["device"])
        if dev.type == "cuda" and not cuda_present():
            return _skipped("memory_scaling: no CUDA device here")
        if dev.type == "cpu" and _interpreted_triton(adapter):
            # measured: the bundled kernel's fwd showed only its output (0.06 / 0.13 / 0.26 MiB) and took 30-90 s
            return _skipped("memory_scaling: under the Triton interpreter (TRITON_INTERPRET=1) a kernel's buffers are "
                            "numpy arrays that the CPU profiler does not see, and N=2048 takes minutes: measure on a GPU")
        dt = DTYPES[cfg["dtype"]]
        from ..spec import Spec

        spec = Spec(causal=cfg["causal"])
        peaks = {}
        try:
            for mult in (1, 2, 4):
                n = cfg["n"] * mult
                g = torch.Generator().manual_seed(n)
                shape = (cfg["batch"], cfg["heads"], n, cfg["head_dim"])
                q, k, v = (torch.randn(*shape, generator=g).to(dev, dt) for _ in range(3))
                bwd = cfg["mode"] == "fwd+bwd"
                if bwd:
                    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
                    d_out = torch.randn(*shape, generator=g).to(dev, dt)

                def call(q=q, k=k, v=v):
                    if bwd:
                        o = unpack_output(adapter(q, k, v, spec))[0]
                        grads = torch.autograd.grad([o], [q, k, v], [d_out])
                        return o, grads
                    with torch.no_grad():
                        return unpack_output(adapter(q, k, v, spec))[0]

                # warm-up only on a GPU (compilation, autotuning, cuBLAS workspaces); a CPU run has none worth
                # the time, and a one-time allocation at N only lowers the fitted quadratic part
                peaks[n] = peak_extra_bytes(call, dev, warmup=dev.type == "cuda")
                del q, k, v
        except Exception as e:
            return ExampleResult(False, f"[{adapter.name}] memory_scaling: the call raised {type(e).__name__}: {e}",
                                 severity=1e30, status="error")
        verdict = judge_memory_scaling(peaks, batch=cfg["batch"], heads=cfg["heads"], elem_size=torch.empty(0, dtype=dt).element_size(),
                                       causal=cfg["causal"] != "none")
        where = (f"{cfg['mode']} {cfg['dtype']} B={cfg['batch']} H={cfg['heads']} D={cfg['head_dim']} "
                 f"causal={cfg['causal']} on {dev.type} ({'torch.cuda.max_memory_allocated' if dev.type == 'cuda' else 'profiler allocation events'})")
        text = f"[{adapter.name}] memory_scaling {where}:\n{verdict['text']}"
        rec = {"adapter": adapter.name, "status": "passed" if verdict["passed"] else "failed", "comparisons": [],
               "memory": {**verdict, "config": cfg}}
        return ExampleResult(verdict["passed"], text if not verdict["passed"] else "",
                             severity=verdict["severity"], records=[rec], seconds=time.perf_counter() - t0)


def judge_memory_scaling(peaks: Dict[int, int], *, batch: int, heads: int, elem_size: int,
                         causal: bool = False, fraction: float = 0.125) -> dict:
    """Pure verdict from measured peaks {N: extra bytes} at N, 2N, 4N.

    Fit e(N) = a + bN + cN^2 through the three points; the quadratic part at 4N, c (4N)^2, must stay below
    `fraction` of one (B, H, 4N, 4N) score matrix in the input dtype (the payload a linear kernel avoids).
    """
    ns = sorted(peaks)
    if len(ns) != 3 or ns[1] != 2 * ns[0] or ns[2] != 4 * ns[0]:
        raise ValueError(f"judge_memory_scaling: need peaks at N, 2N, 4N; got {ns}")
    e1, e2, e4 = (float(peaks[n]) for n in ns)
    n4 = ns[2]
    quad4 = 16.0 / 6.0 * ((e4 - e2) - 2.0 * (e2 - e1))  # c * (4N)^2
    payload4 = float(batch * heads * n4 * n4 * elem_size)
    growth = e4 / e2 if e2 > 0 else (1.0 if e4 <= 0 else math.inf)
    limit = fraction * payload4
    passed = quad4 < limit
    mib = lambda x: x / 2**20  # noqa: E731
    lines = [
        "  peak extra memory: " + ", ".join(f"N={n}: {mib(peaks[n]):.2f} MiB" for n in ns)
        + f" (x{growth:.2f} from 2N to 4N; linear ~2, quadratic ~4)",
        f"  quadratic part at N={n4}: {mib(quad4):.2f} MiB (allowed < {mib(limit):.2f} MiB = {fraction:g} x payload)",
        f"  N x N payload {'avoided' if passed else 'NOT avoided'}: one score matrix B*H*N^2*{elem_size} B at N={n4} "
        f"= {mib(payload4):.1f} MiB" + (" (causal: a dense kernel would still store it)" if causal else ""),
    ]
    return {"passed": passed, "peaks": {int(n): int(peaks[n]) for n in ns}, "quadratic_bytes_at_4n": quad4,
            "payload_bytes_at_4n": payload4, "growth_2n_to_4n": growth, "limit_bytes": limit,
            "severity": max(0.0, quad4 / limit) if limit > 0 else (1e30 if quad4 > 0 else 0.0),
            "text": "\n".join(lines)}
