"""The repo's own tests: they run next to attnverify's properties (`pytest --adapter=mykernel`)."""
import torch

import mykernel_fixed


def test_shape_and_dtype():
    q = torch.randn(2, 3, 5, 16, dtype=torch.float16)
    out = mykernel_fixed.attention(q, q, q, causal=True)
    assert out.shape == q.shape and out.dtype == torch.float16
