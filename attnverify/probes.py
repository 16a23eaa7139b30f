"""Declared vs observed conventions of each adapter (causal alignment, fully-masked rows, LSE, NaN).

Declared: from the adapter's claims. Observed: four tiny probes, each compared with the float64
reference, run during the run in the judging child (`ConventionsJob` through the run's runner) on the
device the run uses for the adapter, and journaled as a `conventions` record that the report reads.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from .devices import cuda_present
from .properties.base import ExampleResult


def _pick(adapter, device: Optional[str] = None):
    c = adapter.claims
    if device in c.devices:
        dev = device
    else:
        dev = "cpu" if "cpu" in c.devices else ("cuda" if "cuda" in c.devices and cuda_present() else None)
    dt = next((d for d in ("float32", "float16", "bfloat16", "float64") if d in c.dtypes), None)
    hd = next((d for d in (32, 64, 16, 128) if c.head_dim_ok(d)), None)
    return dev, dt, hd


def declared(adapter) -> Dict[str, str]:
    c = adapter.claims
    causal = [m for m in c.causal if m != "none"]
    return {"causal": "/".join(causal) or "none", "fully_masked": c.fully_masked,
            "lse": "natural log" if c.lse else "not returned", "nan": "row-local (SPEC)"}


def observe(adapter, device: Optional[str] = None) -> Dict[str, str]:
    from .case import CaseRecipe, build_case
    from .check import unpack_output
    from .reference import reference_forward

    dev, dt, hd = _pick(adapter, device)
    if dev is None or dt is None or hd is None:
        return {k: "not probed (no claimed device/dtype here)" for k in ("causal", "fully_masked", "lse", "nan")}
    c = adapter.claims
    obs: Dict[str, str] = {}

    # every probe call stays inside the claims: an adapter that claims only causal modes ("leave 'none' out and
    # every case is causal", docs/adapters.md) is probed with its first causal mode (the probes' rows stay valid:
    # Lq == Lk, a masked or NaN row is the same row under either alignment)
    plain = "none" if "none" in c.causal else c.causal[0]

    def run(**kw):
        base = dict(len_q=8, len_k=8, head_dim=hd, dtype=dt, device=dev, seed=3, causal=plain)
        base.update(kw)
        r = CaseRecipe(**base)
        case = build_case(r)
        with torch.no_grad():
            out, lse, _ = unpack_output(adapter(case.q, case.k, case.v, case.spec))
        return case, out.detach().to("cpu", torch.float64), (None if lse is None else lse.detach().to("cpu", torch.float64))

    def close(a, b):
        fin = torch.isfinite(b)
        return bool(torch.equal(torch.isfinite(a), fin)) and bool(((a - b).abs()[fin] <= 5e-2 * (b.abs()[fin] + 1)).all())

    try:
        mode = next((m for m in c.causal if m != "none"), None)
        if mode is None:
            obs["causal"] = "n/a (no causal claimed)"
        else:
            case, out, _ = run(causal=mode, len_q=6, len_k=12)
            tl = reference_forward(case.q, case.k, case.v, case.spec.replace(causal="top_left")).out
            br = reference_forward(case.q, case.k, case.v, case.spec.replace(causal="bottom_right")).out
            obs["causal"] = "top_left" if close(out, tl) else "bottom_right" if close(out, br) else "neither alignment"
    except Exception as e:
        obs["causal"] = f"probe raised {type(e).__name__}"
    try:
        if c.attn_mask:
            case, out, _ = run(mask="bool_rows_off", masked_rows=(2,))
            row = out[0, 0, 2]
            vmean = case.v.to("cpu", torch.float64)[0, 0].mean(0)
            obs["fully_masked"] = ("nan" if bool(torch.isnan(row).all()) else "zeros" if bool((row == 0).all())
                                   else "mean(V)" if bool(((row - vmean).abs() < 5e-2).all()) else "other values")
        else:
            obs["fully_masked"] = "n/a (no attn_mask claimed)"
    except Exception as e:
        obs["fully_masked"] = f"probe raised {type(e).__name__}"
    try:
        if c.lse:
            case, out, lse = run(return_lse=True)
            ref = reference_forward(case.q, case.k, case.v, case.spec).lse
            if lse is None:
                obs["lse"] = "not returned"
            elif close(lse.reshape(ref.shape), ref):
                obs["lse"] = "natural log"
            elif close(lse.reshape(ref.shape), ref / math.log(2)):
                obs["lse"] = "base 2"
            else:
                obs["lse"] = "other"
        else:
            obs["lse"] = "not returned"
    except Exception as e:
        obs["lse"] = f"probe raised {type(e).__name__}"
    try:
        case, out, _ = run(poison=(("q", 0, 0, 3, 0, "nan"),))
        bad = torch.isnan(out[0, 0]).any(-1)
        obs["nan"] = ("swallowed (no NaN out)" if not bool(bad.any()) else "row-local (SPEC)" if bad.tolist() == [i == 3 for i in range(8)]
                      else f"spreads to {int(bad.sum())} rows")
    except Exception as e:
        obs["nan"] = f"probe raised {type(e).__name__}"
    return obs


class ConventionsJob:
    """Property-shaped, so the run's runner probes the adapter in its judging child (a crash or hang
    costs the probe only). drawn: {"device": the run's device for this adapter}."""

    name = "conventions"
    cost = 4.0
    needs = ()

    def run_example(self, adapter, drawn) -> ExampleResult:
        dev = (drawn or {}).get("device")
        observed = observe(adapter, dev)
        return ExampleResult(True, records=[{"device": _pick(adapter, dev)[0], "declared": declared(adapter),
                                             "observed": observed}])


CONVENTIONS_JOB = ConventionsJob()  # one object: handed to the judging child before it forks (runner.prepare)


def probe_record(runner, adapter, device: Optional[str]) -> dict:
    """The journal's `conventions` record for one adapter on one device, probed through `runner`."""
    res = runner(CONVENTIONS_JOB, adapter, {"device": device})
    if res.passed and res.records:
        r = res.records[0]
        return {"event": "conventions", "adapter": adapter.name, "device": r.get("device"),
                "declared": r.get("declared") or {}, "observed": r.get("observed") or {}, "note": ""}
    why = (res.message or res.status).strip().splitlines()
    return {"event": "conventions", "adapter": adapter.name, "device": device, "declared": declared(adapter),
            "observed": {}, "note": f"probe failed ({res.status}): {why[0] if why else '?'}"}
