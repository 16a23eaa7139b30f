"""Run by tests/test_prewarm.py in a fresh process without TRITON_INTERPRET: a user's Triton adapter (the bundled
kernels behind a narrow claim set, with a prewarm hook) compiled for sm_90 by the stand-in driver
(benchmarks/standin_driver.py), on CPU tensors, never launched.

    python tests/_prewarm_standin.py run|prewarm WORKERS PROPS EXAMPLES    # TRITON_CACHE_DIR set by the caller

`run`: the properties' own calls (each example judged by the property, its verdict ignored: the kernels do not
run here); `prewarm`: attnverify.prewarm.run_prewarm on WORKERS processes. Prints one JSON line: the kernels
this step added to TRITON_CACHE_DIR (folders holding a .cubin) and, for the pre-warm, its counts.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import standin_driver  # noqa: E402

import attnverify as av  # noqa: E402
from attnverify.triton_prewarm import compile_only_here  # noqa: E402


def _flash(q, k, v, spec):
    from attnverify.kernels.autograd import flash_attention

    out, lse = flash_attention(q, k, v, spec)
    return av.Output(out, lse=lse if spec.return_lse else None)


# what a user's conftest.py would declare for a bf16 kernel of head dim 64: no window, no ALiBi, no varlen
@av.adapter("user_triton_d64", register=False, dtypes=("bfloat16",), devices=("cpu",), head_dims=(64,),
            causal=("none", "bottom_right"), backward=True, lse=True, max_seqlen=128, prewarm=compile_only_here)
def user_triton_d64(q, k, v, spec):
    return _flash(q, k, v, spec)


def kernels(cache):
    return {os.path.relpath(r, cache) for r, _, fs in os.walk(cache) if any(f.endswith(".cubin") for f in fs)}


def main(step, workers, props, examples):
    from attnverify.properties import get_property
    from attnverify.properties.base import ExampleResult
    from attnverify.properties.driver import run_property

    standin_driver.install(cuda_tiles=True)
    cache = os.environ["TRITON_CACHE_DIR"]
    before = kernels(cache)
    out = {"step": step}
    props = [get_property(p) for p in props.split(",")]
    if step == "run":
        def verdict_ignored(prop, adapter, drawn):
            prop.run_example(adapter, drawn)
            return ExampleResult(True, status="passed")

        for p in props:
            run_property(p, user_triton_d64, profile="dev", seed=3, max_examples=examples, device="cpu",
                         runner=verdict_ignored, database=None)
    else:
        from attnverify.prewarm import run_prewarm

        res = run_prewarm([(user_triton_d64, p) for p in props], profile="dev", seed=3, max_examples=examples,
                          device="cpu", workers=workers)
        out.update({k: v for k, v in res.items() if k != "per_property"})
    out["new_kernels"] = sorted(kernels(cache) - before)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
