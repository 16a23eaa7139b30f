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


def fa4_paged_head_dim_check(d, dv, page_size, causal, wl, wr):
    """FA4 4.0.0b36's SM90 forward on a paged call, transcribed for the stand-ins (not the adapter's code):
    interface.py builds FlashAttentionForwardSm90(paged_kv_non_tma=page_size not in [None, tile_n]) with tile_n from
    _tile_size_fwd_sm90 and (causal, local) from _resolve_causal_local_window; flash_fwd.py rounds the head dims
    to 16 (check_hdim_oob = head_dim != tile_hdim); flash_fwd_sm90.py line 66 asserts use_tma_KV or not
    check_hdim_oob."""
    if wl is not None and wr is not None and wl < 0 and wr < 0:
        wl = wr = None
    if causal:
        wr = 0
    local = False
    if wl is not None or wr is not None:
        causal, local = (True, False) if (wl is None and wr == 0) else (False, True)
    if d <= 64:
        tile_n = 128
    elif d <= 96:
        tile_n = 128 if causal or local else 144
    elif d <= 128:
        tile_n = 128
    elif d <= 192:
        tile_n = 96 if local else (128 if dv <= 128 else 112)
    else:
        tile_n = 64 if local else 80
    use_tma_kv = page_size == tile_n
    check_hdim_oob, check_hdim_v_oob = d != -(-d // 16) * 16, dv != -(-dv // 16) * 16
    assert use_tma_kv or not (check_hdim_oob or check_hdim_v_oob), "Paged KV does not support irregular head dim"
