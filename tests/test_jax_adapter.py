"""The jax adapter's own glue that needs no JAX: what it hands to jax.nn.dot_product_attention."""
import torch

from attnverify.adapters import jax_adapter as ja
from attnverify.spec import Spec


def _seen_mask(monkeypatch, impl, mask):
    seen = {}

    def fake_call(q, k, v, spec, mask=None, bias=None, q_len=None, kv_len=None):
        seen["mask"], seen["bias"] = mask, bias
        return torch.zeros(q.shape[:3] + v.shape[3:]), None

    monkeypatch.setattr(ja, "_impl", lambda: impl)
    monkeypatch.setattr(ja, "_call", fake_call)
    # bfloat16: claimed by both implementations (the claims are computed once, on first use, whatever _impl says later)
    q, k = torch.randn(1, 2, 3, 8, dtype=torch.bfloat16), torch.randn(1, 2, 5, 8, dtype=torch.bfloat16)
    ja.jax_attention(q, k, k.clone(), Spec(attn_mask=mask))
    return seen


def test_cudnn_gets_masks_with_full_query_and_key_dims(monkeypatch):
    """H200 thorough run (jax 0.11.2): the cuDNN path raised "Bias must have same seq length as QKV, got 2
    and 1" for a bool mask (1, 1, 2, 1), every property with such a mask failed (F15). The adapter expands
    T and S for cuDNN; XLA keeps the broadcast mask its docstring allows."""
    keys_broadcast = torch.tensor([[True], [False], [True]])  # (T, 1): one flag per query row
    seen = _seen_mask(monkeypatch, "cudnn", keys_broadcast)
    assert tuple(seen["mask"].shape) == (1, 1, 3, 5) and seen["bias"] is None
    assert torch.equal(seen["mask"][0, 0], keys_broadcast.expand(3, 5))
    rows_broadcast = torch.zeros(1, 5)  # additive bias, (1, S)
    assert tuple(_seen_mask(monkeypatch, "cudnn", rows_broadcast)["bias"].shape) == (1, 1, 3, 5)
    assert tuple(_seen_mask(monkeypatch, "xla", keys_broadcast)["mask"].shape) == (1, 1, 3, 1)


def test_misaligned_inputs_are_copied_before_dlpack():
    """H200 thorough run (jax 0.11.2): batch_head_independence sliced batch element 1 out of a bool mask
    (start 1 byte into its buffer); jax imported it without copying and the cuDNN executable failed with
    INTERNAL "Address of buffer 4 must be a multiple of 10" (F20). The adapter hands JAX only 16-byte
    aligned starts, and copies nothing that is already aligned and compact."""
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)[1:]  # starts 15 bytes in
    assert mask.data_ptr() % 16
    got = ja._importable(mask)
    assert got.data_ptr() % 16 == 0 and torch.equal(got, mask)
    half = torch.randn(9, 8, dtype=torch.float16)[1:]  # 16 bytes in: aligned, kept as is
    assert ja._importable(half).data_ptr() == half.data_ptr()
    bhsd = torch.randn(1, 4, 3, 8)[:, 1:].transpose(1, 2)  # compact permutation, 96 bytes in (aligned)
    assert ja._importable(bhsd).data_ptr() == bhsd.data_ptr()
    odd = torch.randn(3, 5, 8, dtype=torch.float16)[:, 1:]  # not compact: made contiguous
    assert ja._importable(odd).is_contiguous() and torch.equal(ja._importable(odd), odd)
    shifted = torch.randn(3 * 8 + 1, dtype=torch.float16)[1:].view(3, 8).t()  # compact, 2 bytes in
    kept = ja._importable(shifted)
    assert kept.data_ptr() % 16 == 0 and kept.stride() == shifted.stride() and torch.equal(kept, shifted)
