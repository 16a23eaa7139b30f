"""Error / bound of each precision zoo member (and of the bug-free kernel they share) on fixed cases.

    python benchmarks/precision_ratios.py --json benchmarks/results/precision_ratios.json

Per member and case: for every compared output, rel_L2(output) / its norm-wise bound under the per-case
rule (> 1 fails), and the worst element's error over its element-wise bound (elem_ratios); the worst output is
what catches the member (docs/tolerances.md, BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import attnverify as av
from attnverify.zoo import get_member
from attnverify.zoo._precision import PRECISION_MEMBERS

CASES = {
    "corpus long-keys 64x256 D64 fp16": dict(len_q=64, len_k=256, head_dim=64, dtype="float16"),
    "corpus long-keys 64x256 D64 bf16": dict(len_q=64, len_k=256, head_dim=64, dtype="bfloat16"),
    "64x128 D64 fp16": dict(len_q=64, len_k=128, head_dim=64, dtype="float16"),
    "64x1024 D64 fp16": dict(len_q=64, len_k=1024, head_dim=64, dtype="float16"),
    "64x256 D64 fp16 q,k std 3.2": dict(len_q=64, len_k=256, head_dim=64, dtype="float16", q_std=3.2, k_std=3.2),
    "32x256 D64 fp16 mean(V) 10": dict(len_q=32, len_k=256, head_dim=64, dtype="float16", v_mean=10.0),
    # the backward members' corpus entries (attnverify/strategies/_corpus.py), as the ci profile runs them
    "corpus backward-dominant-first-key-offset": dict(len_q=64, len_k=256, head_dim=64, dtype="float16",
                                                      dominant_key=0, dominant_gap=5.0, key_offset=4.0, seed=18, return_lse=False),
    "corpus backward-dominant-key-wide-head": dict(len_q=16, len_k=64, head_dim=256, dtype="float16",
                                                   dominant_key=0, dominant_gap=8.0, seed=19, return_lse=False),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    from attnverify.adapters.base import adapter
    from attnverify.zoo._members import FLASH
    from attnverify.zoo._precision import precision_attention

    ok = adapter("zoo-precision-control", register=False, **FLASH)(lambda q, k, v, s: precision_attention(q, k, v, s, None))
    rows = {}
    t0 = time.time()
    for name in ("control",) + PRECISION_MEMBERS:
        a = ok if name == "control" else get_member(name).adapter
        rows[name] = {}
        for label, kw in CASES.items():
            if kw["dtype"] not in a.claims.dtypes:
                continue
            case = av.build_case(av.CaseRecipe(**dict(dict(batch=1, heads_q=2, heads_kv=2, return_lse=True, seed=0), **kw)))
            res = av.check(a, case, backward=a.claims.backward, keep_tensors=False)
            ratios = {c.name: c.rel_l2 / c.tol_norm for c in res.comparisons if c.tol_norm > 0}
            # element-wise: the worst element's error over its bound (a member may fail there only)
            elem = {c.name: c.max_abs / c.allowed_at_worst for c in res.comparisons if c.allowed_at_worst}
            worst = max(ratios, key=ratios.get)
            rows[name][label] = {"status": res.status, "ratios": ratios, "elem_ratios": elem, "worst": worst}
            print(f"{name:24s} {label:34s} {res.status:7s} worst {worst} {ratios[worst]:.2f}  "
                  + " ".join(f"{k}={v:.2f}" for k, v in ratios.items())
                  + "  elem " + " ".join(f"{k}={v:.2f}" for k, v in elem.items()), flush=True)
    out = {"torch": torch.__version__, "cases": CASES, "rows": rows, "seconds": time.time() - t0}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
