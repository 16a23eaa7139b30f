"""Standalone: cuDNN's SDPA forward + backward on a non-blocking side stream, B=1 H=2 Lq=1 Lk=65 D=64 fp16 (H200).

    python benchmarks/repro_cudnn_side_stream.py            # ~20-90 s; every call in a child process of its own
    python benchmarks/repro_cudnn_side_stream.py --quick    # phase 1 only (the case alone, as the property runs it)

Seen once (H200, torch 2.11.0+cu130, 2026-12-04): `non_default_stream[sdpa-cudnn]` did not finish within 60 s on
B=1 Hq=Hkv=2 Lq=1 Lk=65 D=64 fp16, no mask, no causal, in a ci run with 6 pytest workers sharing the GPU; every
neighbour of the case (Hq=1, Lq=Lk=65, Lk=64, Lk=63, Lq=64, D=16) passed right after, and the case itself was not
run again. The property writes q, k, v and the upstream gradient dO on a non-blocking side stream behind a GPU sleep
(`torch.cuda._sleep`, ~50-70 ms), calls SDPA on that stream and runs the backward from the caller's stream.

Every configuration runs in a child process of its own with a deadline (a hang there is a result, not the end of
this script); the child prints a line per step, so a hang says where it stopped (the faulthandler dump says in
which Python frame: a host-side wait, e.g. in `torch.cuda.synchronize`, means a GPU kernel that does not end).
A call that finishes is compared with a float64 reference of the math (out, dQ, dK, dV).

Phase 1: the case as the property runs it, alone on the GPU (3 calls in one child).
Phase 2 (side by side, as in the 6-worker run): the case twice more; the same call on the side stream without
the sleeps, on the default stream with and without them, forward only; and two neighbours (Hq=1, Lk=64).

One line per child: ok (with the largest relative error), WRONG (which tensors), RAISES (the error), HANG (the last
step reached, the frame it waited in), CRASH (exit status). Exit status 0 while the case hangs, raises or is wrong
in some child (the finding reproduces), 1 when every child of the case is right (not reproduced), 2 without a GPU.
No attnverify needed.

Run on the H200 on 2026-12-04 at 20:38 UTC (torch 2.11.0+cu130, cuDNN 91900; benchmarks/h200_cudnn_stream.sh):
NOT reproduced -- phase 1 ok (0.0011 of max |ref|, 10.1 s for the child, mostly CUDA/cuDNN start-up), phase 2 all
eight ok (7.4-9.9 s each). F35 is withdrawn (docs/compatibility.md); the script stays as the record of the check.
"""
import json
import os
import subprocess
import sys
import time

CASE = dict(b=1, h=2, lq=1, lk=65, d=64, dtype="float16")
DEADLINE = float(os.environ.get("REPRO_DEADLINE", "40"))  # s per child: a healthy child needs ~5-10 s

# (label, the case's fields changed, mode): mode "property" = side stream + sleeps + backward, as the property
PHASE1 = [("case, as the property (alone)", {}, "property")]
PHASE2 = [
    ("case, as the property (2)", {}, "property"),
    ("case, as the property (3)", {}, "property"),
    ("case, side stream, no sleep", {}, "side"),
    ("case, default stream, sleeps", {}, "default_sleep"),
    ("case, default stream, plain", {}, "plain"),
    ("case, side stream + sleeps, forward only", {}, "forward"),
    ("neighbour Hq=1, as the property", {"h": 1}, "property"),
    ("neighbour Lk=64, as the property", {"lk": 64}, "property"),
]


def child(cfg):
    """One configuration, `calls` times; prints JSON lines: a step per line, then the result."""
    import faulthandler

    faulthandler.dump_traceback_later(max(1.0, DEADLINE - 4), exit=False)  # to stderr: where it waits
    t0 = time.perf_counter()

    def step(what, **kw):
        print(json.dumps({"step": what, "t": round(time.perf_counter() - t0, 3), **kw}), flush=True)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    c, mode = {**CASE, **cfg["change"]}, cfg["mode"]
    dt = getattr(torch, c["dtype"])
    step("imported", torch=torch.__version__, cudnn=torch.backends.cudnn.version())
    sleep_cycles = 100_000_000  # attnverify's NonDefaultStream.SLEEP_CYCLES
    side = torch.cuda.Stream()  # from PyTorch's pool: cudaStreamNonBlocking

    def late(t, sleep):
        x = torch.full_like(t, float("nan"))
        if sleep:
            torch.cuda._sleep(sleep_cycles)
        x.copy_(t)
        return x

    class OnBackward(torch.autograd.Function):  # identity; the upstream gradient is rewritten on the side stream
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                x = late(g, True)
            cur.wait_stream(side)
            x.record_stream(cur)
            return x

    worst, bad = 0.0, []
    for call in range(cfg["calls"]):
        g = torch.Generator().manual_seed(call)
        q64, k64, v64 = (torch.randn(c["b"], c["h"], n, c["d"], generator=g, dtype=torch.float64)
                         for n in (c["lq"], c["lk"], c["lk"]))
        do64 = torch.randn(c["b"], c["h"], c["lq"], c["d"], generator=g, dtype=torch.float64)
        ref = [t.requires_grad_(True) for t in (q64.clone(), k64.clone(), v64.clone())]
        rout = F.scaled_dot_product_attention(*ref)
        rgrads = torch.autograd.grad(rout, ref, do64)
        q, k, v = (t.to("cuda", dt).requires_grad_(True) for t in (q64, k64, v64))
        do = do64.to("cuda", dt)
        torch.cuda.synchronize()
        step("inputs ready", call=call)
        backward = mode != "forward"
        if mode in ("property", "side", "forward"):
            caller = torch.cuda.current_stream()
            side.wait_stream(caller)
            with torch.cuda.stream(side):
                ql, kl, vl = (late(t, mode != "side") for t in (q, k, v))
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    out = F.scaled_dot_product_attention(ql, kl, vl)
                if mode == "property":
                    out = OnBackward.apply(out)
            caller.wait_stream(side)
            out.record_stream(caller)
        else:
            ins = (late(t, True) for t in (q, k, v)) if mode == "default_sleep" else (q, k, v)
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                out = F.scaled_dot_product_attention(*ins)
        step("forward launched", call=call)
        grads = torch.autograd.grad(out, (q, k, v), do) if backward else ()
        step("backward launched" if backward else "no backward", call=call)
        torch.cuda.synchronize()
        step("synchronized", call=call)
        for name, got, exp in zip(("out", "dq", "dk", "dv"), (out, *grads), (rout, *rgrads)):
            got = got.detach().double().cpu()
            if not torch.isfinite(got).all():
                bad.append(f"{name} call {call}: {int((~torch.isfinite(got)).sum())} non-finite")
                continue
            rel = float((got - exp.detach()).abs().max() / exp.detach().abs().max().clamp_min(1e-6))
            worst = max(worst, rel)
            if rel > 0.02:  # fp16 with fp32 accumulation is ~1e-3 here
                bad.append(f"{name} call {call}: max error {rel:.3g} of max |ref|")
    faulthandler.cancel_dump_traceback_later()
    print(json.dumps({"result": "wrong" if bad else "ok", "worst_rel": worst, "bad": bad[:6],
                      "t": round(time.perf_counter() - t0, 3)}), flush=True)


def start(label, change, mode, calls):
    cfg = {"label": label, "change": change, "mode": mode, "calls": calls}
    p = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(cfg)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    return cfg, p, time.perf_counter()


def finish(cfg, p, t0):
    try:
        out, err = p.communicate(timeout=max(0.1, DEADLINE - (time.perf_counter() - t0)))
        hung = False
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        hung = True
    lines = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    steps = [ln for ln in lines if "step" in ln]
    res = next((ln for ln in lines if "result" in ln), None)
    last = f"{steps[-1]['step']} (call {steps[-1].get('call', '-')}, t={steps[-1]['t']} s)" if steps else "none"
    frames = [ln.strip() for ln in err.splitlines() if ln.strip().startswith("File ")][:3]
    if hung:
        status, shown = "hang", f"HANG: no end within {DEADLINE:g} s; last step: {last}; waiting in: " \
                                f"{' <- '.join(frames) or '(no dump)'}"
    elif res is not None:
        status = res["result"]
        shown = (f"ok, largest error {res['worst_rel']:.2g} of max |ref| ({res['t']} s)" if status == "ok"
                 else "WRONG: " + "; ".join(res["bad"]))
    elif p.returncode < 0:
        status, shown = "crash", f"CRASH: killed by signal {-p.returncode} after step {last}"
    else:  # a Python exception: its last line
        tail = [ln for ln in err.strip().splitlines() if ln.strip()][-1:] or [f"exit status {p.returncode}"]
        status, shown = "raises", f"RAISES after step {last}: {tail[0][:240]}"
    versions = next((s for s in steps if s["step"] == "imported"), {})
    row = {"label": cfg["label"], "mode": cfg["mode"], "case": {**CASE, **cfg["change"]}, "status": status,
           "shown": shown, "seconds": round(time.perf_counter() - t0, 1), "torch": versions.get("torch"),
           "cudnn": versions.get("cudnn")}
    print(f"{cfg['label']:44} {shown}", flush=True)
    return row


def main(quick):
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this reproduces a finding on an NVIDIA GPU (H200, torch 2.11)")
        return 2
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}; "
          f"case {CASE}; {DEADLINE:g} s per child", flush=True)
    rows = []
    print("phase 1: alone", flush=True)
    for label, change, mode in PHASE1:
        rows.append(finish(*start(label, change, mode, 3)))
    if not quick:
        print("phase 2: side by side", flush=True)
        running = [start(label, change, mode, 2) for label, change, mode in PHASE2]
        rows += [finish(*r) for r in running]
    for r in rows:
        print("ROW " + json.dumps(r))
    of_case = [r for r in rows if r["mode"] == "property" and r["case"] == CASE]
    seen = sorted({r["status"] for r in of_case if r["status"] != "ok"})
    print(f"the case as the property runs it: {len(of_case)} children, "
          + ", ".join(f"{sum(r['status'] == s for r in of_case)} {s}" for s in sorted({r['status'] for r in of_case})))
    print("cuDNN side-stream finding: " + (f"REPRODUCED ({', '.join(seen)})" if seen else "NOT reproduced"))
    return 0 if seen else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        sys.exit(main("--quick" in sys.argv[1:]))
