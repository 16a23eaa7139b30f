"""Standalone: onnxruntime's CPU `Attention` (ONNX opset 23) rejects an `attn_mask` broadcast along the keys
(F22, docs/compatibility.md).

    python benchmarks/repro_ort_mask_broadcast.py      # pip install onnx onnxruntime numpy

The operator documents attn_mask as "Shape must be broadcastable to 4D tensor with shape (batch_size,
q_num_heads, q_sequence_length, total_sequence_length)", so (B, 1, Lq, 1) -- one bit per query row, the
shape attnverify's corpus draws -- is valid. onnxruntime 1.31.1 fails with "inconsistent
total_sequence_length (between attn_mask and past_key and past_value)". The same mask expanded to
(B, 1, Lq, Lk) is the control: it runs and matches numpy. Prints one JSON line per mask shape.
"""
import json

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

B, H, LQ, LK, D = 2, 2, 9, 20, 16


def session():
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("Q", "K", "V")]
    vi.append(helper.make_tensor_value_info("attn_mask", TensorProto.BOOL, None))
    node = helper.make_node("Attention", ["Q", "K", "V", "attn_mask"], ["Y"])
    graph = helper.make_graph([node], "g", vi, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def numpy_attention(q, k, v, mask):
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def main():
    print(json.dumps(dict(onnx=onnx.__version__, onnxruntime=ort.__version__)), flush=True)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, LQ, D), dtype=np.float32)
    k = rng.standard_normal((B, H, LK, D), dtype=np.float32)
    v = rng.standard_normal((B, H, LK, D), dtype=np.float32)
    rows = np.ones((B, 1, LQ, 1), dtype=bool)
    rows[0, 0, 3] = False  # one fully-masked row: the operator documents a zero output row
    sess = session()
    for name, mask in (("(B, 1, Lq, 1) broadcast along the keys", rows),
                       ("(B, 1, Lq, Lk) the same mask expanded (control)", np.broadcast_to(rows, (B, 1, LQ, LK)).copy())):
        try:
            y = sess.run(None, dict(Q=q, K=k, V=v, attn_mask=mask))[0]
            ref = np.nan_to_num(numpy_attention(q, k, v, mask))  # fully-masked rows: 0
            print(json.dumps(dict(mask=name, ran=True, max_abs_err=float(np.abs(y - ref).max()))), flush=True)
        except Exception as e:  # noqa: BLE001 - the failure is the finding
            msg = str(e)
            print(json.dumps(dict(mask=name, ran=False, error=msg[msg.find("inconsistent"):][:120] or msg[:200])),
                  flush=True)


if __name__ == "__main__":
    main()
