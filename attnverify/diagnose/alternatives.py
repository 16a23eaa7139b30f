"""The alternative semantics worth trying for a case: (key, title, Variant) for each that differs from the
SPEC here, and the key-tile widths to try."""
from __future__ import annotations

import math
from typing import List, Sequence

import torch

from .engine import Variant

TILE_CANDIDATES = (16, 32, 64, 128)


def alternatives_for(case, spec, tiles: Sequence[int], declared_fm: str, has_keep: bool, has_fm: bool):
    """(key, title, Variant) for every alternative that differs from the SPEC for this case."""
    q, k = case.q, case.k
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    alts = []
    base_fm = declared_fm if declared_fm in ("zeros", "nan") else "zeros"
    V = lambda **kw: Variant(fully_masked=base_fm, **kw)  # noqa: E731
    if spec.causal == "top_left" and lq != lk:
        alts.append(("causal_bottom_right", "causal mask aligned bottom-right (flash-attn) instead of top-left", V(causal="bottom_right")))
    if spec.causal == "bottom_right" and lq != lk:
        alts.append(("causal_top_left", "causal mask aligned top-left (SDPA is_causal) instead of bottom-right", V(causal="top_left")))
    if spec.causal != "none":
        alts.append(("diagonal_excluded", "causal mask excludes the diagonal (j < i instead of j <= i)", V(strict_diag=True)))
        alts.append(("causal_ignored", "causal mask ignored", V(causal="none")))
    else:
        alts.append(("causal_applied", "a causal mask applied though none was asked (top-left)", V(causal="top_left")))
        if lq != lk:
            alts.append(("causal_applied_br", "a causal mask applied though none was asked (bottom-right)", V(causal="bottom_right")))
    if spec.window is not None:
        left, right = spec.window
        for dl, dr, what in ((1, 0, "left bound one too wide"), (-1, 0, "left bound one too narrow"),
                             (0, 1, "right bound one too wide"), (0, -1, "right bound one too narrow")):
            nl, nr = (left + dl if left >= 0 else -1), (right + dr if right >= 0 else -1)
            if (nl, nr) != (left, right) and nl >= -1 and nr >= -1 and not (left >= 0 and nl < 0) and not (right >= 0 and nr < 0):
                alts.append((f"window_off_by_one_{'left' if dl else 'right'}{'+' if (dl or dr) > 0 else '-'}",
                             f"window {what}: ({nl}, {nr}) instead of ({left}, {right})", V(window=(nl, nr))))
        alts.append(("window_ignored", "window ignored", V(window=None)))
    alts += _chunk_alternatives(spec, V, b, lq, lk)
    sc = spec.resolved_scale(d)
    dv = case.v.shape[-1]
    if dv < d and case.v.shape[:3] == k.shape[:3] and bool(torch.equal(case.v.detach().cpu(), k[..., :dv].detach().cpu())):
        alts.append(("latent_v_last", f"V read from K's last {dv} columns, not its first {dv} (MLA: V is the latent, "
                     f"the first Dv columns of K)", V(latent="v_last")))
        alts.append(("latent_rope_dropped", f"the scores from the first {dv} columns only: K's and q's last {d - dv} "
                     f"(rope) columns left out of the score (MLA)", V(latent="rope_dropped", scale=sc)))
    default = 1.0 / math.sqrt(d)
    alts.append(("scale_missing", f"softmax scale missing (1 used instead of {sc:.4g})", V(scale=1.0)))
    alts.append(("scale_doubled", f"softmax scale doubled ({2 * sc:.4g} instead of {sc:.4g})", V(scale=2 * sc)))
    alts.append(("scale_squared", f"softmax scale applied twice ({sc * sc:.4g} instead of {sc:.4g})", V(scale=sc * sc)))
    if spec.scale is not None and abs(sc - default) > 1e-12 * default:
        alts.append(("scale_default", f"the default scale 1/sqrt(D) = {default:.4g} used instead of the given {sc:.4g}", V(scale=default)))
    if spec.softcap is not None:
        alts.append(("softcap_before_scale", f"softcap applied before the scale: c*tanh(q.k/c)*scale (c={spec.softcap:g})",
                     V(softcap=spec.softcap * sc)))
        alts.append(("softcap_ignored", "softcap ignored", V(softcap=None)))
    if hkv != hq and hkv > 1:
        alts.append(("gqa_interleaved", f"GQA heads mapped interleaved (h % {hkv}) instead of grouped (h // {hq // hkv})",
                     V(kv_map="interleaved")))
    if has_fm:
        for mode, title in (("zeros", "fully-masked rows give 0 (and LSE -inf)"), ("nan", "fully-masked rows give NaN"),
                            ("mean_v", "fully-masked rows give mean(V) (uniform weights over all keys)"),
                            ("unmasked", "fully-masked rows attend every key as if unmasked")):
            if mode != declared_fm and not (declared_fm == "unsupported" and mode == "zeros"):
                alts.append((f"fully_masked_{mode}", title, Variant(fully_masked=mode)))
    alts.append(("lse_base2", "LSE in base 2 (log2 instead of natural log)", V(lse_mode="base2")))
    alts.append(("lse_no_max", "LSE without the row max added back (log of the rescaled sum)", V(lse_mode="no_max")))
    if has_keep and spec.dropout_p > 0:
        alts.append(("dropout_not_rescaled", f"dropout keeps not rescaled by 1/(1-p) (p={spec.dropout_p:g})", V(dropout_rescale=False)))
    for name in ("q", "k", "v"):
        if getattr(spec, f"{name}_descale") is not None:
            alts.append((f"{name}_descale_ignored", f"{name}_descale ignored (taken as 1)", V(descale_ignored=name)))
    if spec.sinks is not None:
        alts.append(("sink_ignored", "sinks ignored (left out of the softmax denominator and the LSE)", V(sink="ignored")))
        alts.append(("sink_in_numerator", "the sink added to the numerator too (its value row taken as 1, not 0)",
                     V(sink="numerator")))
    if spec.cu_seqlens_q is None:
        for t in tiles:
            if 0 < t and lk % t:
                alts.append((f"padded_keys_{t}", f"padded tail keys counted: keys {lk}..{lk + t - lk % t - 1} of the last "
                             f"{t}-wide tile enter the softmax with score 0", V(pad_to=t)))
    for t in tiles:
        if 0 < t < lk:
            alts.append((f"last_tile_skipped_{t}", f"last key tile skipped (keys {((lk - 1) // t) * t}..{lk - 1}, tile {t})",
                         V(skip_last_tile=t)))
    for t in tiles:
        if 0 < t < lk:
            alts.append((f"missing_rescale_{t}", f"online softmax without rescale: accumulator and sum not multiplied by "
                         f"exp(m_old - m_new) when the running max rises (key tile {t})", V(online=(t, "no_rescale"))))
            alts.append((f"missing_rescale_acc_{t}", "online softmax rescales the sum but not the output accumulator "
                         f"when the running max rises (key tile {t})", V(online=(t, "no_rescale_acc"))))
            alts.append((f"missing_rescale_sum_{t}", "online softmax rescales the output accumulator but not the sum "
                         f"when the running max rises (key tile {t})", V(online=(t, "no_rescale_sum"))))
    return alts


def _chunk_alternatives(spec, V, b, lq, lk):
    """Chunked local attention's mistakes (Spec.attention_chunk = C): the ones that differ on this case."""
    c = spec.attention_chunk
    if not c:
        return []
    if spec.cu_seqlens_q is None:
        segs = [(lq, lk, b * lk if b > 1 else 0)]
    else:
        cq, ck = spec.cu_seqlens_q.tolist(), spec.cu_seqlens_k.tolist()
        segs = [(cq[n + 1] - cq[n], ck[n + 1] - ck[n], ck[n]) for n in range(len(cq) - 1)]
    alts = [("chunk_ignored", f"attention_chunk={c} ignored (no chunk limit)", V(chunk="ignored")),
            ("chunk_boundary_early", f"chunk boundaries one key early: a query also sees the last key of the previous "
             f"chunk and not its own chunk's last (attention_chunk={c})", V(chunk="early")),
            ("chunk_boundary_late", f"chunk boundaries one key late: a query misses its chunk's first key and sees the "
             f"next chunk's first (attention_chunk={c})", V(chunk="late")),
            ("chunk_next_position", f"the query's chunk taken at position p + 1 (attention_chunk={c})",
             V(chunk="next_position"))]
    if any(sq != sk for sq, sk, _ in segs):
        alts.append(("chunk_top_left", f"chunks counted from the query index i, not its position i + Lk - Lq (top-left; "
                     f"attention_chunk={c})", V(chunk="top_left")))
    if any(k0 % c for _, _, k0 in segs) or (spec.cu_seqlens_q is None and b > 1 and lk % c):
        alts.append(("chunk_packed_origin", "chunks counted from the position in the packed batch (the document's or "
                     f"batch entry's first key not subtracted; attention_chunk={c})", V(chunk="packed")))
    if any(sk % c for _, sk, _ in segs):
        alts.append(("chunk_last_partial_free", f"no chunk limit in the last, partial chunk (Lk % {c} != 0)",
                     V(chunk="last_partial_free")))
    return alts


def tile_candidates(tiles) -> List[int]:
    out: List[int] = []
    if tiles:
        t = tiles[1] if isinstance(tiles, (tuple, list)) and len(tiles) == 2 else tiles
        if isinstance(t, int) and t > 0:
            out.append(int(t))
    for t in TILE_CANDIDATES:
        if t not in out:
            out.append(t)
    return out
