"""The fixed-grid baseline: check the zoo the way a parametrized test file does.

Modelled on flash-attn's `tests/test_flash_attn.py::test_flash_attn_output`: a fixed cartesian grid
of seqlen pairs x head dims x causal x dtype x a feature variant (plain, and each feature of that
file's own axes the member claims: GQA, ALiBi, local window, softcap 50), random normal inputs from
a fixed seed, and the file's criterion:

    max|out - ref| <= 2 * max|out_pt - ref|          (and 3x for dq, dk, dv when backward is claimed)

where `ref` is float64 attention (the file upcasts to fp32; float64 here) and `out_pt` the same
attention computed in the input dtype the way the file's `attention_ref(upcast=False,
reorder_ops=True)` does (scores, softmax and P @ V in fp16/bf16). Both are computed here,
independently of attnverify's reference, tolerances and check: this is the *other* approach.

What such a grid does not look at, it cannot catch: the LSE, determinism, inputs modified in place,
dropout statistics (the file compares dropout through a debug-returned mask), varlen packs (another
test in that file), masks other than causal/window, fully-masked-row conventions beyond what the
grid's shapes produce. The runner stops at a member's first failing configuration (`pytest -x`), and
gives up on a member after `budget_s` seconds (reported as not caught, with the share of the grid run).

    python -m attnverify.zoo.grid [--member NAME ...] [--budget 180] [--json PATH]
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Iterator, List, Optional, Tuple

import torch

from ..visibility import positional_visibility

SEQLENS = ((113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (1023, 1024), (1, 239), (239, 1))
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 256)
CAUSAL = (False, True)
DTYPES = ("float16", "bfloat16")
BATCH = 2
HEADS = 4  # query heads; K/V heads 4 (mha) or 2 (gqa, where claimed)
OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
SOFTCAP = 50.0


@dataclass(frozen=True)
class GridConfig:
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    dtype: str
    mha_type: str = "mha"
    alibi: bool = False
    local: bool = False
    softcap: float = 0.0

    def describe(self) -> str:
        s = f"seqlen=({self.seqlen_q}, {self.seqlen_k}) d={self.head_dim} causal={self.causal} {self.dtype}"
        if self.mha_type != "mha":
            s += f" {self.mha_type}"
        if self.alibi:
            s += " alibi"
        if self.local:
            s += " local"
        if self.softcap:
            s += f" softcap={self.softcap:g}"
        return s


@dataclass
class GridResult:
    member: str
    caught: bool = False
    first_config: str = ""  # the first failing configuration
    first_index: Optional[int] = None  # 1-based, among the configurations run
    first_seconds: Optional[float] = None
    configs_run: int = 0
    configs_total: int = 0  # the member's whole grid (claimed configurations)
    seconds: float = 0.0
    finding: str = ""
    budget_exhausted: bool = False
    skipped: int = 0  # configurations outside the member's claims
    status: str = "missed"  # caught | missed | unavailable | error
    reason: str = ""
    errors: List[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


VARIANTS = ("plain", "gqa", "alibi", "local", "softcap")


def grid_configs(adapter) -> Iterator[GridConfig]:
    """The member's grid, in the order pytest runs flash-attn's stacked parametrize decorators (the
    decorator nearest the function varies slowest): seqlen pair, head dim, causal, variant, dtype.

    flash-attn's file takes the full product of its feature axes (mha_type x alibi x local x softcap
    x ...); to keep a CPU baseline finite, each claimed feature is one extra variant here instead."""
    c = adapter.claims
    dtypes = [d for d in DTYPES if d in c.dtypes] or (["float32"] if "float32" in c.dtypes else [])
    variants = ["plain"] + [v for v, ok in (("gqa", c.gqa), ("alibi", c.alibi), ("local", c.window),
                                             ("softcap", c.softcap)) if ok]
    causal = CAUSAL if any(m != "none" for m in c.causal) else (False,)
    for (sq, sk), d, cz, var, dt in itertools.product(SEQLENS, HEAD_DIMS, causal, variants, dtypes):
        if not c.head_dim_ok(d) or max(sq, sk) > c.max_seqlen:
            continue
        yield GridConfig(sq, sk, d, cz, dt, mha_type="gqa" if var == "gqa" else "mha", alibi=var == "alibi",
                         local=var == "local", softcap=SOFTCAP if var == "softcap" else 0.0)


def _causal_mode(adapter) -> str:
    modes = [m for m in adapter.claims.causal if m != "none"]
    return "bottom_right" if "bottom_right" in modes else (modes[0] if modes else "none")


def make_inputs(cfg: GridConfig, adapter, seed: int = 0):
    """q, k, v, the Spec of one configuration, and the generator (for the upstream gradient)."""
    from ..spec import Spec

    g = torch.Generator().manual_seed(seed)  # the test file seeds every test the same way
    dt = getattr(torch, cfg.dtype)
    hkv = HEADS // 2 if cfg.mha_type == "gqa" else HEADS
    q = torch.randn(BATCH, HEADS, cfg.seqlen_q, cfg.head_dim, generator=g).to(dt)
    k = torch.randn(BATCH, hkv, cfg.seqlen_k, cfg.head_dim, generator=g).to(dt)
    v = torch.randn(BATCH, hkv, cfg.seqlen_k, cfg.head_dim, generator=g).to(dt)
    window = None
    if cfg.local:
        w = torch.randint(0, cfg.seqlen_k, (2,), generator=g)
        window = (int(w[0]), int(w[1]))
    slopes = torch.rand(BATCH, HEADS, generator=g) * 0.3 if cfg.alibi else None
    spec = Spec(causal=_causal_mode(adapter) if cfg.causal else "none", window=window,
                softcap=cfg.softcap or None, alibi_slopes=slopes)
    return q, k, v, spec, g


def _visibility(lq, lk, spec) -> Optional[torch.Tensor]:
    return positional_visibility(lq, lk, spec.causal, spec.window)


def attention_ref(q, k, v, spec, *, upcast: bool):
    """flash-attn's `attention_ref`: upcast=True -> float64 here; upcast=False -> all in the input dtype
    (with reorder_ops: the scale applied to K). Fully-masked rows give 0."""
    dt = torch.float64 if upcast else q.dtype
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, 1)
    v = v.repeat_interleave(g, 1)
    lq, lk, d = q.shape[2], k.shape[2], q.shape[3]
    scale = spec.resolved_scale(d)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale if upcast else torch.matmul(q, (k * scale).transpose(-1, -2))
    if spec.softcap is not None:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    if spec.alibi_slopes is not None:
        i = torch.arange(lq, dtype=torch.float64)[:, None]
        j = torch.arange(lk, dtype=torch.float64)[None, :]
        bias = -spec.alibi_slopes.double()[:, :, None, None] * (i + lk - lq - j).abs()
        scores = scores + bias.to(dt)
    vis = _visibility(lq, lk, spec)
    if vis is not None:
        scores = scores.masked_fill(~vis, -math.inf)
        dead = ~vis.any(-1)[:, None]
        scores = scores.masked_fill(dead, 0.0)  # keep softmax finite; the rows are zeroed below
    attn = torch.softmax(scores, dim=-1).to(v.dtype)
    if vis is not None:
        attn = attn.masked_fill(dead, 0.0)
    return torch.matmul(attn, v)


def _max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    e = (x.detach().double() - ref.detach().double()).abs().max()
    return float(e) if x.numel() else 0.0


def _run_with_grads(fn, q, k, v, d_out, backward: bool):
    q, k, v = (t.detach().clone().requires_grad_(backward) for t in (q, k, v))
    with torch.enable_grad() if backward else torch.no_grad():
        out = fn(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), d_out.to(out.dtype)) if backward else (None, None, None)
    return out.detach(), grads


def check_config(adapter, cfg: GridConfig, seed: int = 0) -> Tuple[bool, str]:
    """One grid test: (passed, what failed)."""
    from ..check import unpack_output

    q, k, v, spec, g = make_inputs(cfg, adapter, seed)
    bwd = adapter.claims.backward
    d_out = torch.randn(BATCH, HEADS, cfg.seqlen_q, v.shape[-1], dtype=torch.float64, generator=g)
    ref, ref_g = _run_with_grads(lambda a, b, c: attention_ref(a, b, c, spec, upcast=True), q, k, v, d_out, bwd)
    pt, pt_g = _run_with_grads(lambda a, b, c: attention_ref(a, b, c, spec, upcast=False), q, k, v, d_out, bwd)
    out, got_g = _run_with_grads(lambda a, b, c: unpack_output(adapter(a, b, c, spec))[0], q, k, v, d_out, bwd)
    problems = []
    e, b = _max_err(out, ref), _max_err(pt, ref)
    if not e <= OUT_FACTOR * b:  # NaN fails, as in the test file
        problems.append(f"out: max err {e:.3g} > {OUT_FACTOR:g} x {b:.3g}")
    if bwd:
        for name, g, rg, pg in zip(("dq", "dk", "dv"), got_g, ref_g, pt_g):
            e, b = _max_err(g, rg), _max_err(pg, rg)
            if not e <= GRAD_FACTOR * b:
                problems.append(f"{name}: max err {e:.3g} > {GRAD_FACTOR:g} x {b:.3g}")
    return (not problems), "; ".join(problems)


def _claimed(adapter, cfg: GridConfig) -> Optional[str]:
    """Why the member does not claim this configuration (None: it does). No tensors are made."""
    c = adapter.claims
    if cfg.dtype not in c.dtypes:
        return f"dtype {cfg.dtype}"
    if not c.head_dim_ok(cfg.head_dim):
        return f"head dim {cfg.head_dim}"
    if max(cfg.seqlen_q, cfg.seqlen_k) > c.max_seqlen:
        return "sequence length"
    if cfg.causal and _causal_mode(adapter) == "none":
        return "causal"
    for feat, on in (("gqa", cfg.mha_type != "mha"), ("alibi", cfg.alibi), ("window", cfg.local), ("softcap", bool(cfg.softcap))):
        if on and not c.feature(feat):
            return feat
    if c.fully_masked == "unsupported" and (cfg.causal or cfg.local):
        from ..spec import Spec

        spec = Spec(causal=_causal_mode(adapter) if cfg.causal else "none")
        vis = _visibility(cfg.seqlen_q, cfg.seqlen_k, spec)
        if (vis is not None and not bool(vis.any(-1).all())) or cfg.local:
            return "fully-masked rows, which the member declares unsupported"
    return None


def run_grid(member, *, budget_s: float = 180.0, seed: int = 0, max_configs: Optional[int] = None,
             stop_at_first: bool = True) -> GridResult:
    """Run the member's grid until its first failing configuration (or the budget / the end)."""
    adapter = member.adapter if hasattr(member, "adapter") else member
    name = getattr(member, "name", adapter.name)
    res = GridResult(name)
    why = adapter.unavailable_reason()
    if why:
        res.status, res.reason = "unavailable", why
        return res
    cfgs = list(grid_configs(adapter))
    runnable = []
    for cfg in cfgs:
        if _claimed(adapter, cfg) is None:
            runnable.append(cfg)
        else:
            res.skipped += 1
    res.configs_total = len(runnable)
    t0 = time.perf_counter()
    for i, cfg in enumerate(runnable, 1):
        if max_configs is not None and i > max_configs:
            break
        if time.perf_counter() - t0 > budget_s:
            res.budget_exhausted = True
            break
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ok, what = check_config(adapter, cfg, seed)
        except Exception as e:  # a crash is a failing test in a grid too
            ok, what = False, f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        res.configs_run = i
        if not ok and not res.caught:
            res.caught, res.status = True, "caught"
            res.first_config, res.first_index = cfg.describe(), i
            res.first_seconds = time.perf_counter() - t0
            res.finding = what
            if stop_at_first:
                break
    res.seconds = time.perf_counter() - t0
    return res


def main(argv=None) -> int:
    from . import ZOO, get_member

    ap = argparse.ArgumentParser(prog="python -m attnverify.zoo.grid", description="fixed-grid baseline over the zoo")
    ap.add_argument("--member", action="append", default=[])
    ap.add_argument("--budget", type=float, default=180.0, help="seconds per member before giving up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    members = [get_member(p.strip()) for n in a.member for p in n.split(",") if p.strip()] or list(ZOO)
    rows = []
    for m in members:
        r = run_grid(m, budget_s=a.budget, seed=a.seed)
        rows.append(r)
        if r.caught:
            print(f"{m.name:28s} caught  config #{r.first_index}/{r.configs_total} after {r.first_seconds:6.2f}s: "
                  f"{r.first_config} ({r.finding})", flush=True)
        else:
            tail = " (budget spent)" if r.budget_exhausted else ""
            print(f"{m.name:28s} {r.status:7s} {r.configs_run}/{r.configs_total} configs in {r.seconds:.1f}s{tail} {r.reason}",
                  flush=True)
    n = sum(r.caught for r in rows)
    print(f"\ngrid caught {n}/{len(rows)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([r.to_dict() for r in rows], f, indent=1)
    return 0 if n == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
