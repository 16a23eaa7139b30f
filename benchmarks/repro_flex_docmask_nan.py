"""Standalone: FlexAttention's document mask on CUDA lets a NaN in one packed document reach the others
(F16, docs/compatibility.md).

    python benchmarks/repro_flex_docmask_nan.py          # cuda if present, and cpu
    python benchmarks/repro_flex_docmask_nan.py cpu      # one device

Packed documents (cu_seqlens) expressed with FlexAttention's own recipe: a mask_mod that keeps a key
when it belongs to the query's document. NaN goes into the values of document 1 (keys 65..67; it has
no queries). A kernel that never reads masked keys, or skips them, leaves every other document finite;
one that multiplies P = 0 by a NaN value row spreads it. Prints one JSON line per device: NaN count per
document, and the largest change of finite outputs (0 when nothing else moved).

Measured through attnverify (H200, torch 2.11.0+cu130): 4,736 output values of other documents NaN on
CUDA; the CPU template passed the same property.
"""
import json
import sys

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

CU_Q, CU_K = [0, 5, 5, 72, 74], [0, 65, 68, 196, 197]
HQ, HKV, D = 2, 1, 32


def doc_ids(cu, device):
    lengths = torch.tensor([b - a for a, b in zip(cu, cu[1:])], device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)


def run(device):
    torch.manual_seed(0)
    dq, dk = doc_ids(CU_Q, device), doc_ids(CU_K, device)

    def same_doc(b, h, q_idx, kv_idx):
        return dq[q_idx] == dk[kv_idx]

    block_mask = create_block_mask(same_doc, 1, 1, CU_Q[-1], CU_K[-1], device=device)
    flex = torch.compile(flex_attention)
    q = torch.randn(1, HQ, CU_Q[-1], D, device=device)
    k, v = (torch.randn(1, HKV, CU_K[-1], D, device=device) for _ in range(2))
    with torch.no_grad():
        clean = flex(q, k, v, block_mask=block_mask, enable_gqa=True)
        v_nan = v.clone()
        v_nan[:, :, CU_K[1]:CU_K[2]] = float("nan")
        out = flex(q, k, v_nan, block_mask=block_mask, enable_gqa=True)
    docs = list(zip(CU_Q, CU_Q[1:]))
    print(json.dumps(dict(device=device, torch=torch.__version__,
                          expected="no NaN anywhere (document 1 has no queries)",
                          nan_per_document=[int(out[:, :, a:b].isnan().sum()) for a, b in docs],
                          max_change_finite=float((out - clean).nan_to_num(0.0).abs().max()))), flush=True)


if __name__ == "__main__":
    devices = sys.argv[1:] or (["cuda"] if torch.cuda.is_available() else []) + ["cpu"]
    for dev in devices:
        try:
            run(dev)
        except Exception as e:  # one device failing must not hide the other
            print(json.dumps(dict(device=dev, error=f"{type(e).__name__}: {str(e)[:300]}")), flush=True)
