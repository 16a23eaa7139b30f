"""scripts/kernel_fingerprint.py: its comparison flags any differing kernel (exit 1), and its compiles for sm_90 on a
machine without a GPU give hashes that tell configurations apart and repeat exactly."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "kernel_fingerprint.py"


def _tool():
    spec = importlib.util.spec_from_file_location("kernel_fingerprint", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _doc(results, triton="3.9.0"):
    return {"triton": triton, "source": "t", "attnverify": "/x", "results": results}


H1 = {"ttgir": "aaaa", "ptx": "bbbb", "smem": 1024}


def test_compare_counts_each_kind_of_difference(capsys):
    kfp = _tool()
    a = {"fwd.x/_attn_fwd": H1, "decode.y/_combine": H1, "fwd.ws": {"error": "RuntimeError: boom"}, "bwd.z/_bwd_dq": H1}
    assert kfp.compare(_doc(a), _doc(dict(a))) == 0
    b = dict(a)
    b["decode.y/_combine"] = dict(H1, ptx="cccc")  # one PTX hash
    b["fwd.ws"] = H1  # an error that went away
    del b["bwd.z/_bwd_dq"]  # a kernel one side no longer compiles
    assert kfp.compare(_doc(a), _doc(b)) == 3
    out = capsys.readouterr().out
    assert "DIFF decode.y/_combine: ptx" in out and "DIFF fwd.ws: error" in out and "DIFF bwd.z/_bwd_dq: only in A" in out
    assert "1 identical, 3 differing" in out


IR = """    %cst = arith.constant dense<0xFF800000> : tensor<16xf32>
    %cst_0 = arith.constant dense<0.000000e+00> : tensor<16xf32>
    %1 = arith.cmpf oeq, %0, %cst : tensor<16xf32>
    %2 = arith.select %1, %cst_0, %0 : tensor<16xi1>, tensor<16xf32>"""


def test_ttgir_hash_ignores_only_the_order_of_constants():
    kfp = _tool()
    swapped = IR.replace("%cst_0", "%cst_X").replace("%cst ", "%cst_0 ").replace("%cst :", "%cst_0 :").replace(
        "%cst_X", "%cst")
    lines = swapped.splitlines()
    reordered = "\n".join([lines[1], lines[0], *lines[2:]])  # the same constants, declared the other way round
    assert reordered != IR and kfp._constants_at_uses(reordered) == kfp._constants_at_uses(IR)
    assert kfp._constants_at_uses(IR.replace("0.000000e+00", "1.000000e+00")) != kfp._constants_at_uses(IR)  # a value
    wrong_use = IR.replace("arith.select %1, %cst_0, %0", "arith.select %1, %cst, %0")  # a use of the other constant
    assert kfp._constants_at_uses(wrong_use) != kfp._constants_at_uses(IR)
    twice = IR + "\n    %cst = arith.constant dense<1.0> : tensor<16xf32>"
    assert kfp._constants_at_uses(twice) == twice  # ambiguous: hashed as it is


def test_compare_cli_exit_status(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_doc({"fwd.x/_attn_fwd": H1})))
    b.write_text(json.dumps(_doc({"fwd.x/_attn_fwd": dict(H1, smem=2048)})))
    same = subprocess.run([sys.executable, str(SCRIPT), "--compare", str(a), str(a)], capture_output=True, text=True)
    differ = subprocess.run([sys.executable, str(SCRIPT), "--compare", str(a), str(b)], capture_output=True, text=True)
    assert same.returncode == 0, same.stdout + same.stderr
    assert differ.returncode == 1 and "DIFF fwd.x/_attn_fwd: smem" in differ.stdout


def test_compiles_for_sm90_without_a_gpu(tmp_path):
    pytest.importorskip("triton.backends.nvidia.driver", reason="this Triton has no NVIDIA backend to compile with")
    cases = "decode.fp16_d64_paged_sinks_1split,decode.bf16_d64_batchidx_append_4split"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it compiles: no interpreter
    env["PYTHONPATH"] = str(ROOT)
    docs = []
    for i in range(2):
        out = tmp_path / f"{i}.json"
        r = subprocess.run([sys.executable, str(SCRIPT), "--only", cases, "--json", str(out)], env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        docs.append(json.loads(out.read_text()))
    res = docs[0]["results"]
    assert sorted(res) == ["decode.bf16_d64_batchidx_append_4split/_combine",
                           "decode.bf16_d64_batchidx_append_4split/_decode_partial",
                           "decode.fp16_d64_paged_sinks_1split/_decode_partial"]
    assert docs[0]["results"] == docs[1]["results"]  # deterministic
    one, four = (res[f"decode.{c}/_decode_partial"] for c in ("fp16_d64_paged_sinks_1split", "bf16_d64_batchidx_append_4split"))
    assert one["ptx"] != four["ptx"] and one["ttgir"] != four["ttgir"]  # the hashes tell configurations apart
    assert docs[0]["attnverify"] == str(ROOT)


def test_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(SCRIPT), "--only", "decode.*"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "unset TRITON_INTERPRET" in r.stderr


def test_against_names_a_ref_that_is_not_a_commit():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(SCRIPT), "--against", "no-such-ref-kfp"], env=env, capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode != 0 and "--against no-such-ref-kfp: not a commit" in r.stderr
