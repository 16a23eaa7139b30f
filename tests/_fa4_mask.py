"""FlashAttention-4's visibility rule, for the tests' stand-ins of the library (test_external_adapters, test_fa4_serving)."""
import torch


def fa4_keep(lq, lk, causal, wl, wr):
    """FlashAttention-4's mask (interface.py _resolve_causal_local_window + mask.py): only None is unbounded,
    a window is dropped only when both sides are negative, causal sets right = 0; bottom-right aligned."""
    if wl is not None and wr is not None and wl < 0 and wr < 0:
        wl = wr = None
    if causal:
        wr = 0
    i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if wr is not None:
        keep &= j <= i + lk - lq + wr
    if wl is not None:
        keep &= j >= i + lk - lq - wl
    return keep
