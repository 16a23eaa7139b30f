"""ONNX Runtime on the CPU: the ONNX `Attention` operator and the com.microsoft contrib operators.

Three adapters, each a one-node graph built with `onnx.helper` and run by `onnxruntime.InferenceSession`
on the CPUExecutionProvider. Importing this module imports neither onnx nor onnxruntime; a session is
built once per (operator, attributes, input names, dtype) -- the graphs have symbolic shapes -- and kept
for the process, so a run builds a handful.

`onnx-attention` -- ONNX `Attention` (opset 23; opset 24 for `nonpad_kv_seqlen`), onnx 1.23 /
onnxruntime 1.31, from `onnx.defs.get_schema("Attention", 23).doc`:
- 4D inputs "(batch_size, q_num_heads, q_sequence_length, head_size)"; V "(..., v_head_size)" (Dv != D);
  GQA/MQA "`q_num_heads % kv_num_heads == 0`"; `scale` "Default value is `1/sqrt(head_size)`";
  `softcap` applied to Q*K^T before the mask ("softcap (if provided)" then "at_mask---Add").
- `attn_mask`: "A boolean mask where a value of `True` indicates that the element should take part in
  attention ... or a float mask ... that is added", "broadcastable to 4D".
- `is_causal`: "bottom-right (offset-aware) alignment: query `i` attends key `j` iff `j <= i +
  past_sequence_length`". Without a cache the offset is 0, which is SPEC's top-left; SPEC's bottom-right
  with Lk >= Lq is the same call with the first Lk - Lq keys passed as `past_key` / `past_value` (the
  operator concatenates them); with Lq > Lk, opset 24's `nonpad_kv_seqlen` = Lk gives the negative
  offset ("the leading query rows have an empty key set ... and are fully masked").
- "A fully-masked query row ... produces a zero output row ..., not `NaN`" -> fully_masked="zeros".
- T1: bfloat16, float16, float, double; ORT's CPU kernel is registered for float and float16 only
  (attention.cc: "REGISTER_ONNX_KERNEL_TYPED(float) REGISTER_ONNX_KERNEL_TYPED(MLFloat16)"), so only those
  are claimed: bf16 has no implementation, and double runs through the operator's function body, measured
  wrong three ways (F23). fp16 asks for `softmax_precision` = FLOAT (it changes nothing, F24). No LSE, dropout, window, ALiBi, varlen, backward.

`ort-mha` -- com.microsoft `MultiHeadAttention` (CPU kernel of onnxruntime 1.31; schema doc from
`onnxruntime.capi._pybind_state.get_all_operator_schema()`): 3D `(batch_size, sequence_length,
hidden_size)` inputs and one `num_heads` (no GQA); `attention_bias` "added to QxK' with shape (batch_size
or 1, num_heads or 1, sequence_length, total_sequence_length)" (float masks; the adapter expands the two
sequence dimensions); `key_padding_mask` "(batch_size, sequence_length, total_sequence_length)", "value 0
means padding", filled with `mask_filter_value` "Default value is -10000.0f" (bool masks shared by all
heads; a fully-masked row is then a mean of V -> fully_masked="unsupported"); `unidirectional` "Whether
every token can only attend to previous tokens" (top-left, claimed with Lq == Lk only: measured different
from both alignments with Lq != Lk); float/float16.

`ort-gqa` -- com.microsoft `GroupQueryAttention`: always a KV-cache call. "query and key must have the
same sequence length when past_key is not provided" (the kernel's words), so Lq == Lk is one prompt
call and Lk > Lq passes the first Lk - Lq keys as `past_key`/`past_value` with `seqlens_k` "(total_
sequence_lengths - 1)"; "When past context is present, sequence_length > 1 requires batch_size == 1".
`causal` "Default value is 1" (bottom-right over past + new; 0 for none); `local_window_size`
"left_window_size for causal local attention" (measured: W keys including the query's own, so SPEC's
left bound l is W = l + 1; "Must be -1 when causal is 0"); `softcap`; `attention_bias` as for MHA;
float/float16; the CPU kernel's "head_size must be a multiple of 8"; `head_sink` "1D tensor with shape
(num_heads). Each head has a smooth factor adding to the denominator of softmax" -> sinks.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Optional, Tuple

import torch

from ..spec import Spec
from .base import adapter

_AVAIL: dict = {}
_NP_DTYPES = {torch.float16: "float16", torch.float32: "float32", torch.float64: "float64"}


def _available() -> Optional[str]:
    if "why" not in _AVAIL:
        missing = [m for m in ("onnx", "onnxruntime") if importlib.util.find_spec(m) is None]
        _AVAIL["why"] = (f"{' and '.join(missing)} not installed (pip install onnx onnxruntime)" if missing else None)
    return _AVAIL["why"]


def _tp(dtype: torch.dtype) -> int:
    from onnx import TensorProto

    return {torch.float16: TensorProto.FLOAT16, torch.float32: TensorProto.FLOAT, torch.float64: TensorProto.DOUBLE,
            torch.bool: TensorProto.BOOL, torch.int32: TensorProto.INT32, torch.int64: TensorProto.INT64}[dtype]


@functools.lru_cache(maxsize=None)
def _session(op: str, domain: str, opset: int, attrs: Tuple, inputs: Tuple, n_out: int):
    """One InferenceSession per (operator, attributes, (input name or '', dtype) ...): shapes are symbolic."""
    import onnxruntime as ort
    from onnx import helper

    names = [n for n, _ in inputs]
    vinfo = [helper.make_tensor_value_info(n, _tp(dt), None) for n, dt in inputs if n]
    outs = ["out", "present_key", "present_value"][:n_out]
    node = helper.make_node(op, names, outs, domain=domain, **dict(attrs))
    out_dt = _tp(inputs[0][1])
    graph = helper.make_graph([node], op, vinfo, [helper.make_tensor_value_info(o, out_dt, None) for o in outs])
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = 10
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _run(op: str, feeds: dict, attrs: dict, *, domain: str = "", opset: int = 23, order=(), n_out: int = 1):
    """Run one node: `order` names the operator's inputs in position ('' for an omitted optional one)."""
    last = max(i for i, n in enumerate(order) if n in feeds)
    inputs = tuple((n, feeds[n].dtype) if n in feeds else ("", None) for n in order[:last + 1])
    sess = _session(op, domain, opset, tuple(sorted(attrs.items())), inputs, n_out)
    arrays = {n: t.detach().cpu().contiguous().numpy() for n, t in feeds.items()}
    return torch.from_numpy(sess.run(None, arrays)[0].copy())


def _check_dtypes(name: str, claimed, *ts) -> None:
    for t in ts:
        dname = str(t.dtype).replace("torch.", "")
        if dname not in claimed:
            raise TypeError(f"{name} adapter: {dname} is not among its claimed dtypes {claimed}")


def _mask4(m: torch.Tensor) -> torch.Tensor:
    return m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))


# ------------------------------------------------------------------------------------ ONNX Attention

_ATTN_ORDER = ("Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen")
# T1 lists double, but onnxruntime/core/providers/cpu/llm/attention.cc registers the CPU kernel for float and
# MLFloat16 only ("REGISTER_ONNX_KERNEL_TYPED(float) REGISTER_ONNX_KERNEL_TYPED(MLFloat16)"): a double graph runs
# through the operator's function body, measured wrong three ways (F23) -> not claimed
_ATTN_DTYPES = ("float16", "float32")

_F24 = ("onnxruntime 1.31 (CPU) float16 Attention is less accurate than the float16 baseline (float32 products and "
        "softmax): median relative L2 error 1.27x, max 1.48x the baseline's over 200 cases, and softmax_precision="
        "FLOAT changes no bit (docs/compatibility.md F24; benchmarks/repro_ort_attention_precision.py)")
_FP16_ONLY_OUT = r"^(?![\s\S]*non-finite)[\s\S]*shrunk case: [^\n]*\bfloat16\b[\s\S]*\bout: MISMATCH"
# F24 shows on nearly every float16 case of forward_matches_reference (strict there); the other properties draw
# fewer float16 cases of their own and a seed may give none that shows it: a ci run of 2026-12-04 (seed
# 1485498219) passed four of them, XPASS(strict) -> not strict there (a pass is a pass, a matching failure known)
_ATTN_FINDINGS = {
    "forward_matches_reference": {"why": _F24, "match": _FP16_ONLY_OUT},
    **{p: {"why": _F24, "match": _FP16_ONLY_OUT, "strict": False} for p in (
        "causal_alignment", "row_shift_invariance", "outputs_fully_written",
        "no_out_of_bounds", "kv_permutation_invariance", "batch_head_independence", "value_scaling",
        "gqa_equals_repeated_kv")},
    "fully_masked_rows": {"why": _F24, "match": _FP16_ONLY_OUT},
    # F25 (a row an Inf in q leaves without a key comes back NaN) is no longer a failure: the property takes NaN or the
    # declared 0 there since 2026-12-05; F24 shows on this property's float16 cases when its draws give one
    "nonfinite_inputs_propagate": {"why": _F24, "match": _FP16_ONLY_OUT, "strict": False},
}


def _attn_refuses(case) -> Optional[str]:
    if case.spec.causal == "bottom_right" and case.spec.attn_mask is not None and case.q.shape[2] > case.k.shape[2]:
        # opset 24's nonpad_kv_seqlen: "the kv_sequence dimension of `attn_mask` can be shorter than K" --
        # with a mask the external-cache call is not SPEC's; claimed without a mask only
        return "onnx-attention: bottom-right causal with Lq > Lk goes through nonpad_kv_seqlen, not combined with a mask"
    return None


@adapter(
    "onnx-attention",
    on_request_cpu="ci profile 229 s on a 2-core CPU",
    description="ONNX Attention operator (opset 23/24) on onnxruntime's CPU execution provider",
    availability=_available, refuses=_attn_refuses, known_failures=_ATTN_FINDINGS,
    dtypes=_ATTN_DTYPES, devices=("cpu",), head_dims=lambda d: 1 <= d <= 512, max_seqlen=4096,
    causal=("none", "top_left", "bottom_right"), softcap=True, attn_mask=True, gqa=True, dv_ne_d=True,
    fully_masked="zeros", deterministic=True,
)
def onnx_attention(q, k, v, spec: Spec):
    """onnx Attention-23: 4D Q/K/V, past_key for bottom-right causal, nonpad_kv_seqlen (24) for Lq > Lk."""
    _check_dtypes("onnx-attention", _ATTN_DTYPES, q, k, v)
    lq, lk = q.shape[2], k.shape[2]
    attrs = {} if spec.scale is None else {"scale": float(spec.scale)}  # a FLOAT attribute: 1/sqrt(D) by default
    if q.dtype == torch.float16:  # "If softmax precision is not provided, the same precision as the input ... is used"
        attrs["softmax_precision"] = 1  # TensorProto.FLOAT: a float32 softmax, as fp16 attention is meant to be used
    if spec.softcap is not None:
        attrs["softcap"] = float(spec.softcap)
    feeds = {"Q": q, "K": k, "V": v}
    opset = 23
    if spec.attn_mask is not None:
        m = _mask4(spec.attn_mask)
        # onnxruntime 1.31 rejects a mask broadcast along the keys or the queries, which the operator allows
        # ("broadcastable to 4D"): "inconsistent total_sequence_length (between attn_mask and past_key and
        # past_value)", "inconsistent q_sequence_length (between attn_mask and Q)"
        # (docs/compatibility.md F22, benchmarks/repro_ort_mask_broadcast.py): the last dim is materialised
        m = m.expand(*m.shape[:2], lq, lk)
        feeds["attn_mask"] = m if m.dtype == torch.bool else m.to(q.dtype)
    if spec.causal != "none":
        attrs["is_causal"] = 1
    if spec.causal == "bottom_right" and lk > lq:
        p = lk - lq  # the cache: keys before the last Lq
        feeds.update(K=k[:, :, p:], V=v[:, :, p:], past_key=k[:, :, :p], past_value=v[:, :, :p])
    elif spec.causal == "bottom_right" and lq > lk:
        opset = 24
        feeds["nonpad_kv_seqlen"] = torch.full((q.shape[0],), lk, dtype=torch.int64)
    n_out = 3 if "past_key" in feeds else 1
    return _run("Attention", feeds, attrs, opset=opset, order=_ATTN_ORDER, n_out=n_out).to(q.device)


# ------------------------------------------------------------------------------ contrib operators


def _bsh(t: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B, L, H * D), ORT's 3D layout."""
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], t.shape[1] * t.shape[3])


def _unbsh(y: torch.Tensor, hq: int) -> torch.Tensor:
    b, lq, hd = y.shape
    return y.reshape(b, lq, hq, hd // hq).transpose(1, 2)


def _bias(m: torch.Tensor, q: torch.Tensor, lk: int) -> torch.Tensor:
    """A float mask as `attention_bias` "(batch_size or 1, num_heads or 1, sequence_length, total_sequence_length)"."""
    m4 = _mask4(m)
    return m4.expand(m4.shape[0], m4.shape[1], q.shape[2], lk).to(q.dtype)


_MHA_ORDER = ("query", "key", "value", "bias", "key_padding_mask", "attention_bias", "past_key", "past_value")
_CONTRIB_DTYPES = ("float16", "float32")


def _mha_refuses(case) -> Optional[str]:
    s = case.spec
    if s.causal == "top_left" and case.q.shape[2] != case.k.shape[2]:
        return "ort-mha: unidirectional is claimed with Lq == Lk only (its alignment is neither top-left nor bottom-right)"
    m = s.attn_mask
    if m is not None and m.dtype == torch.bool and _mask4(m).shape[1] != 1:
        return "ort-mha: a bool mask goes in key_padding_mask (batch_size, sequence_length, total_sequence_length): no head dim"
    return None


@adapter(
    "ort-mha",
    on_request_cpu="ci profile 154 s on a 2-core CPU",
    description="onnxruntime com.microsoft MultiHeadAttention on the CPU execution provider",
    availability=_available, refuses=_mha_refuses,
    dtypes=_CONTRIB_DTYPES, devices=("cpu",), head_dims=lambda d: 1 <= d <= 512, max_seqlen=4096,
    causal=("none", "top_left"), attn_mask=True, gqa=False, dv_ne_d=True, fully_masked="unsupported",
    deterministic=True,
)
def ort_mha(q, k, v, spec: Spec):
    """com.microsoft MultiHeadAttention: (B, L, H*D) inputs, attention_bias / key_padding_mask, unidirectional."""
    _check_dtypes("ort-mha", _CONTRIB_DTYPES, q, k, v)
    b, hq, lq, _ = q.shape
    lk = k.shape[2]
    if k.shape[1] != hq:
        raise ValueError(f"ort-mha: MultiHeadAttention has one num_heads; k has {k.shape[1]} heads, q {hq}")
    attrs = {"num_heads": hq, "scale": float(spec.resolved_scale(q.shape[-1]))}
    if spec.causal == "top_left":
        attrs["unidirectional"] = 1
    feeds = {"query": _bsh(q), "key": _bsh(k), "value": _bsh(v)}
    m = spec.attn_mask
    if m is not None and m.dtype == torch.bool:
        feeds["key_padding_mask"] = _mask4(m)[:, 0].expand(b, lq, lk).to(torch.int32)
    elif m is not None:
        feeds["attention_bias"] = _bias(m, q, lk)
    return _unbsh(_run("MultiHeadAttention", feeds, attrs, domain="com.microsoft", opset=21, order=_MHA_ORDER), hq).to(q.device)


_GQA_ORDER = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos_cache",
              "sin_cache", "position_ids", "attention_bias", "head_sink")


def _gqa_refuses(case) -> Optional[str]:
    s = case.spec
    b, lq, lk = case.q.shape[0], case.q.shape[2], case.k.shape[2]
    if lq > lk:
        return "ort-gqa: a KV-cache operator; Lq > Lk is no cache call (query and key the same length without past_key)"
    if lk > lq and lq > 1 and b > 1:
        return "ort-gqa: 'When past context is present, sequence_length > 1 requires batch_size == 1'"
    if s.window is not None:
        left, right = s.window
        if s.causal == "none" or left < 0:
            return "ort-gqa: local_window_size is a left window of causal attention ('Must be -1 when causal is 0')"
    if s.attn_mask is not None and s.attn_mask.dtype == torch.bool:
        return "ort-gqa: attention_bias is additive (float masks only)"
    return None


@adapter(
    "ort-gqa",
    description="onnxruntime com.microsoft GroupQueryAttention (KV cache) on the CPU execution provider",
    availability=_available, refuses=_gqa_refuses,
    # the CPU kernel: "head_size must be a multiple of 8" (INVALID_ARGUMENT otherwise)
    dtypes=_CONTRIB_DTYPES, devices=("cpu",), head_dims=lambda d: d % 8 == 0 and 8 <= d <= 512, max_seqlen=4096,
    causal=("none", "bottom_right"), window=True, softcap=True, attn_mask=True, gqa=True, dv_ne_d=False,
    fully_masked="unsupported", deterministic=True,
    # head_sink: "1D tensor with shape (num_heads). Each head has a smooth factor adding to the denominator of
    # softmax" (schema, onnxruntime 1.31.1): a per-head sink logit, SPEC's sinks (measured on the CPU kernel: 2e-7
    # from the float64 sink reference in float32, 1.6e-3 in float16)
    sinks=True,
    # the schema's inputs "query T" and "head_sink T" (T: float16, bfloat16, float; onnxruntime 1.31.1
    # get_all_operator_schema): a float16 call takes its sink logits in float16. Rounding a float32 logit there moved a
    # one-key row's output by 2.4e-4 (1.15x the bound; the kernel itself at 0.39 of it on the rounded logit): 2026-12-05
    sink_dtype="input",
)
def ort_gqa(q, k, v, spec: Spec):
    """com.microsoft GroupQueryAttention: Lq == Lk as a prompt, Lk > Lq with the first Lk - Lq keys as past_key."""
    _check_dtypes("ort-gqa", _CONTRIB_DTYPES, q, k, v)
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if v.shape[-1] != k.shape[-1]:
        raise ValueError("ort-gqa: value must have the key's head size (kv_hidden_size)")
    attrs = {"num_heads": hq, "kv_num_heads": hkv, "scale": float(spec.resolved_scale(q.shape[-1])),
             "causal": 0 if spec.causal == "none" else 1}
    if spec.softcap is not None:
        attrs["softcap"] = float(spec.softcap)
    if spec.window is not None:
        attrs["local_window_size"] = int(spec.window[0]) + 1  # W keys, the query's own included
    p = lk - lq
    feeds = {"query": _bsh(q), "key": _bsh(k[:, :, p:]), "value": _bsh(v[:, :, p:]),
             "seqlens_k": torch.full((b,), lk - 1, dtype=torch.int32),
             "total_sequence_length": torch.tensor(lk, dtype=torch.int32)}
    if p:
        feeds.update(past_key=k[:, :, :p], past_value=v[:, :, :p])
    if spec.attn_mask is not None:
        feeds["attention_bias"] = _bias(spec.attn_mask, q, lk)
    if spec.sinks is not None:  # the input has the query's type T
        feeds["head_sink"] = spec.sinks.to(q.dtype)
    y = _run("GroupQueryAttention", feeds, attrs, domain="com.microsoft", opset=21, order=_GQA_ORDER, n_out=3)
    return _unbsh(y, hq).to(q.device)
