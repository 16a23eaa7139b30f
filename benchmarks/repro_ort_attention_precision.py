"""Standalone: the precision of onnxruntime's CPU `Attention` (ONNX opset 23) in float16 and float64
(F23 and F24, docs/compatibility.md).

    python benchmarks/repro_ort_attention_precision.py      # pip install onnx onnxruntime numpy

Relative L2 error against a float64 numpy reference over 200 random cases (B=1, H=1, L=9, D=16, q and k of
std 3.2, the spread at which attnverify's shrunk cases failed), for:
- onnxruntime float16 (with and without softmax_precision=FLOAT) beside a float16 baseline that rounds
  only the inputs and the output (float32 products and softmax), and beside the same baseline with Q and K
  first multiplied by sqrt(scale) and rounded to float16 -- the operator's documented pattern
  ("Q*sqrt(scale) K*sqrt(scale) ... MatMul");
- onnxruntime float64 (ONNX T1 lists double; ORT's CPU kernel is registered for float and float16 only,
  so the graph runs through the operator's function body) beside float32.
Prints one JSON line per variant: median and max relative L2 error.
"""
import json

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

L, D, N = 9, 16, 200


def session(tp, **attrs):
    vi = [helper.make_tensor_value_info(n, tp, None) for n in ("Q", "K", "V")]
    node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"], **attrs)
    graph = helper.make_graph([node], "g", vi, [helper.make_tensor_value_info("Y", tp, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def attention(q, k, v, scale):
    s = (q @ k.transpose(0, 1, 3, 2)) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


def main():
    print(json.dumps(dict(onnx=onnx.__version__, onnxruntime=ort.__version__)), flush=True)
    rng = np.random.default_rng(0)
    scale = D ** -0.5
    sessions = {"ort float16": (session(TensorProto.FLOAT16), np.float16),
                "ort float16 softmax_precision=FLOAT": (session(TensorProto.FLOAT16, softmax_precision=1), np.float16),
                "ort float32": (session(TensorProto.FLOAT), np.float32),
                "ort float64": (session(TensorProto.DOUBLE), np.float64)}
    errs = {k: [] for k in list(sessions) + ["baseline float16 (fp32 math)", "baseline float16, Q and K pre-scaled in fp16"]}
    for _ in range(N):
        q, k = (rng.standard_normal((1, 1, L, D)) * 3.2 for _ in range(2))
        v = rng.standard_normal((1, 1, L, D))
        ref = attention(q, k, v, scale)
        for name, (sess, dt) in sessions.items():
            y = sess.run(None, dict(Q=q.astype(dt), K=k.astype(dt), V=v.astype(dt)))[0]
            errs[name].append(rel(y, ref))
        h = [x.astype(np.float16).astype(np.float32) for x in (q, k, v)]
        errs["baseline float16 (fp32 math)"].append(rel(attention(*h, scale).astype(np.float16), ref))
        r = np.float32(np.sqrt(scale))
        qs, ks = ((x * r).astype(np.float16).astype(np.float32) for x in h[:2])
        errs["baseline float16, Q and K pre-scaled in fp16"].append(rel(attention(qs, ks, h[2], 1.0).astype(np.float16), ref))
    for name, e in errs.items():
        print(json.dumps(dict(variant=name, median_rel_l2=float(np.median(e)), max_rel_l2=float(np.max(e)))), flush=True)


if __name__ == "__main__":
    main()
