"""benchmarks/dev_profile_keys.py: the Triton compile keys a profile launches, counted on a CPU with the stand-in sm_90
driver (nothing compiled). Its key parsing names each argument's part; its count of a property's launches grows with
the cases that differ, and `nospec` (the default on a GPU) gives fewer keys than the specialised kernels."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import dev_profile_keys  # noqa: E402


def test_parse_key_names_each_part_and_reads_warps_and_stages():
    key = ("[('*fp16', 'D'), ('i32', ''), ('constexpr', 1), ('tensordesc<fp16[1, 1, 64, 256]>', None), "
           "('constexpr', True)]CUDAOptions(num_warps=8, num_ctas=1, num_stages=3, debug=False)")
    parts = dev_profile_keys.parse_key(key, ["Q", "seq_k_arg", "stride_qk", "DESC_K", "IS_CAUSAL"])
    assert parts["Q"] == ("*fp16", "D") and parts["seq_k_arg"] == ("i32", "")
    assert parts["stride_qk"] == ("constexpr", 1) and parts["IS_CAUSAL"] == ("constexpr", True)
    assert parts["num_warps"] == "8" and parts["num_stages"] == "3"
    assert dev_profile_keys.arg_class("seq_k_arg", parts["seq_k_arg"]).startswith("ints")
    assert dev_profile_keys.arg_class("Q", parts["Q"]).startswith("pointers")
    keys = [dict(a=("i32", "D"), b=1), dict(a=("i32", ""), b=1), dict(a=("i32", ""), b=2)]
    assert dev_profile_keys.collapse(keys, lambda n, p: False) == 3
    assert dev_profile_keys.collapse(keys, lambda n, p: n == "a") == 2  # a alone makes one difference


def _count(variant: str, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([ROOT] + sys.path), TRITON_DEFAULT_FP_FUSION="1",
               ATTNVERIFY_TRITON_VARIANT=variant)
    out = tmp_path / f"{variant}.json"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "dev_profile_keys.py"), "--props",
                          "gradients_match_reference", "--max-examples", "4", "--seed", "1", "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="needs Triton's NVIDIA backend (the pip wheel has it) to bind for sm_90 without a GPU")
def test_counts_every_kernel_of_a_gradient_property_and_nospec_gives_fewer(tmp_path):
    spec, nospec = _count("spec", tmp_path), _count("nospec", tmp_path)
    keys = spec["per_property"]["gradients_match_reference"]
    assert {n for n, _ in keys} == {"_attn_fwd", "_bwd_preprocess", "_bwd_dkdv", "_bwd_dq"}
    assert spec["n_errors"] == 0 and len(keys) > 4  # the examples differ: more than one kernel of each
    assert len(nospec["per_property"]["gradients_match_reference"]) < len(keys)
