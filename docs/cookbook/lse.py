"""Recipe: a kernel that returns the log-sum-exp, in base 2 (FlashInfer's `single_prefill_with_kv_cache` shape)."""
import math

import torch

import attnverify as av

try:
    from flashinfer import single_prefill_with_kv_cache  # the real kernel: CUDA, fp16/bf16, inference only
except ImportError:  # where it is missing: the plain-torch stand-in beside this file (same signature)
    from _standins import single_prefill_with_kv_cache


def _refuses(case):
    """Per-case limits the claims cannot express: FlashInfer's window has a left bound only."""
    if case.spec.window is not None:
        left, right = case.spec.window
        if left < 0 or (right >= 0 and case.spec.causal != "bottom_right"):
            return "the window must be (left >= 0, -1), or any right bound under bottom-right causal"
    return None


@av.adapter(
    "lse-kernel",
    refuses=_refuses,
    dtypes=("float16", "bfloat16"),
    devices=("cuda",),
    head_dims=(64, 128, 256),
    max_seqlen=16384,
    causal=("none", "bottom_right"),
    window=True, softcap=True, gqa=True,
    lse=True,  # returns Output(out, lse=...) when spec.return_lse
    backward=False,  # inference kernel: no gradients (the least claim, written out)
    fully_masked="unsupported",  # undocumented: such rows are never drawn, and ignored where they occur
)
def lse_kernel(q, k, v, spec: av.Spec):
    outs, lses = [], []
    for b in range(q.shape[0]):  # one request at a time; (H, L, D) -> (L, H, D) is FlashInfer's "NHD"
        res = single_prefill_with_kv_cache(
            q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1),
            causal=spec.causal == "bottom_right",
            sm_scale=spec.resolved_scale(q.shape[-1]),  # a number: resolved_scale(D) gives 1/sqrt(D) when unset
            window_left=spec.window[0] if spec.window is not None else -1,
            logits_soft_cap=spec.softcap,
            return_lse=spec.return_lse,
        )
        out, lse = res if spec.return_lse else (res, None)
        outs.append(out.transpose(0, 1))
        if lse is not None:
            lses.append(lse.transpose(0, 1).float() * math.log(2.0))  # base 2 -> natural log, (Lq, H) -> (H, Lq)
    out = torch.stack(outs)
    return av.Output(out, lse=torch.stack(lses)) if spec.return_lse else out
