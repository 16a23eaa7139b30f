"""Deliberately wrong attention implementations, each with one bug, and the case that exposes it.

Used by tests/test_diagnose.py (the diagnosis must name each bug) and by docs/diagnosis.md, which is
regenerated with `python tests/_wrong_for_diagnosis.py > docs/diagnosis.md`.

The implementations are written here, in eager PyTorch, independently of attnverify.diagnose's
float64 engine: a diagnosis that only recognised its own code would prove nothing.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attnverify as av  # noqa: E402
from attnverify.case import CaseRecipe, build_case  # noqa: E402
from attnverify.spec import Output  # noqa: E402
from attnverify.visibility import row_key_indices, visible  # noqa: E402

ALL = dict(
    dtypes=("float16", "bfloat16", "float32", "float64"), devices=("cpu",), head_dims=lambda d: 1 <= d <= 256,
    causal=("none", "top_left", "bottom_right"), window=True, softcap=True, alibi=True, attn_mask=True, gqa=True,
    varlen=False, dropout=True, backward=False, lse=True, fully_masked="zeros", register=False,
)


def _visibility(lq, lk, causal, window, strict=False, device="cpu"):
    return visible(*row_key_indices(lq, lk, device), causal, window, strict_diag=strict)


def eager(q, k, v, spec, *, scale=None, causal=None, strict=False, window="spec", kv_map="grouped",
          softcap_first=False, fully_masked="zeros", lse_base2=False, dropout_rescale=True, pad_to=None,
          kv_of_batch: Optional[Tuple[int, int]] = None, last_tile_scores: Optional[Tuple[int, float]] = None,
          acc_dtype=None):
    """Eager attention in float32 with knobs for one bug at a time."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = hq // hkv
    if kv_of_batch is not None:  # batch dst reads the K/V of batch src
        dst, src = kv_of_batch
        k, v = k.clone(), v.clone()
        k[dst], v[dst] = k[src], v[src]
    idx = (torch.arange(hq) % hkv) if kv_map == "interleaved" else (torch.arange(hq) // g)
    kk, vv = k[:, idx].float(), v[:, idx].float()
    qf = q.float()
    sc = spec.resolved_scale(d) if scale is None else scale
    causal = spec.causal if causal is None else causal
    window = spec.window if window == "spec" else window
    n_pad = 0
    if pad_to and lk % pad_to:
        n_pad = pad_to - lk % pad_to
        kk = torch.cat([kk, torch.zeros(b, hq, n_pad, d)], 2)
        vv = torch.cat([vv, torch.zeros(b, hq, n_pad, vv.shape[-1])], 2)
    raw = qf @ kk.transpose(-1, -2)
    if spec.softcap is not None:
        s = spec.softcap * torch.tanh(raw / spec.softcap) * sc if softcap_first else spec.softcap * torch.tanh(raw * sc / spec.softcap)
    else:
        s = raw * sc
    if last_tile_scores is not None:
        t, f = last_tile_scores
        s0 = ((lk - 1) // t) * t
        s[..., s0:lk] = s[..., s0:lk] * f
    vis = _visibility(lq, lk + n_pad, causal, window, strict)
    # positions are those of the real keys: a padded key j >= lk is 'after' every real one
    vis = vis.expand(b, hq, lq, lk + n_pad).clone()
    if spec.attn_mask is not None:
        m = spec.attn_mask.expand(b, hq, lq, lk)
        if m.dtype == torch.bool:
            vis[..., :lk] &= m
        else:
            s[..., :lk] = s[..., :lk] + m.float()
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)
    fm = torch.isneginf(lse)
    p = torch.exp(s - torch.where(fm, torch.zeros_like(lse), lse).unsqueeze(-1))
    keep = None
    if spec.dropout_p > 0:
        gen = torch.Generator().manual_seed(int(spec.seed or 0))
        keep = torch.rand(b, hq, lq, lk, generator=gen) >= spec.dropout_p
        p = p * keep.float()
        if dropout_rescale:
            p = p / (1 - spec.dropout_p)
    if acc_dtype is not None:  # P.V summed key by key in a low-precision accumulator
        acc = torch.zeros(b, hq, lq, vv.shape[-1], dtype=acc_dtype)
        pl, vl = p.to(acc_dtype), vv.to(acc_dtype)
        for j in range(lk):
            acc = acc + pl[..., j:j + 1] * vl[..., j:j + 1, :]
        out = acc.float()
    else:
        out = p @ vv
    if fully_masked == "nan":
        out = torch.where(fm.unsqueeze(-1), torch.full_like(out, math.nan), out)
    elif fully_masked == "mean_v":
        out = torch.where(fm.unsqueeze(-1), vv[..., :lk, :].mean(-2, keepdim=True).expand_as(out), out)
        lse = torch.where(fm, torch.full_like(lse, math.log(lk)), lse)
    elif fully_masked == "unmasked":
        s_all = raw[..., :lk] * sc
        out = torch.where(fm.unsqueeze(-1), torch.softmax(s_all, -1) @ vv[..., :lk, :], out)
        lse = torch.where(fm, torch.logsumexp(s_all, -1), lse)
    if lse_base2:
        lse = lse / math.log(2.0)
    return Output(out.to(q.dtype), lse=lse if spec.return_lse else None, dropout_mask=keep)


def online_no_rescale(q, k, v, spec, tile=16):
    """Flash-style loop over key tiles that forgets exp(m_old - m_new) on both l and acc."""
    b, hq, lq, d = q.shape
    lk = k.shape[2]
    s = (q.float() @ k.float().transpose(-1, -2)) * spec.resolved_scale(d)
    vis = _visibility(lq, lk, spec.causal, spec.window)
    s = s.masked_fill(~vis, -math.inf)
    m = torch.full((b, hq, lq, 1), -math.inf)
    l = torch.zeros(b, hq, lq, 1)
    acc = torch.zeros(b, hq, lq, v.shape[-1])
    for j0 in range(0, lk, tile):
        st = s[..., j0:j0 + tile]
        m_new = torch.maximum(m, st.amax(-1, keepdim=True))
        p = torch.exp(st - torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new)))
        l = l + p.sum(-1, keepdim=True)  # BUG: missing l * exp(m - m_new)
        acc = acc + p @ v[..., j0:j0 + tile, :].float()  # BUG: missing acc * exp(m - m_new)
        m = m_new
    out = torch.where(l > 0, acc / l.clamp_min(1e-30), torch.zeros_like(acc))
    return Output(out.to(q.dtype))


@dataclass
class Wrong:
    name: str
    bug: str
    adapter: av.Adapter
    recipe: CaseRecipe
    expected: Optional[str]  # the explanation key it must be named with (prefix), or a signature key, or None

    def case(self):
        return build_case(self.recipe)


def _mk(name, fn: Callable, **claims):
    kw = dict(ALL)
    kw.update(claims)
    return av.adapter(name, **kw)(fn)


def zoo():
    W = []

    def add(name, bug, fn, recipe, expected, **claims):
        W.append(Wrong(name, bug, _mk(name, fn, **claims), recipe, expected))

    add("br_as_tl", "implements causal top-left while claiming bottom-right",
        lambda q, k, v, s: eager(q, k, v, s, causal="top_left"),
        CaseRecipe(len_q=12, len_k=24, causal="bottom_right", seed=1), "causal_top_left")
    add("tl_as_br", "implements causal bottom-right while claiming top-left",
        lambda q, k, v, s: eager(q, k, v, s, causal="bottom_right"),
        CaseRecipe(len_q=12, len_k=24, causal="top_left", seed=2), "causal_bottom_right")
    add("no_diagonal", "causal mask j < i: excludes the diagonal",
        lambda q, k, v, s: eager(q, k, v, s, strict=True),
        CaseRecipe(len_q=20, len_k=20, causal="top_left", seed=3), "diagonal_excluded")
    add("window_narrow_left", "window left bound exclusive (one key too few on the left)",
        lambda q, k, v, s: eager(q, k, v, s, window=(s.window[0] - 1, s.window[1])),
        CaseRecipe(len_q=24, len_k=24, window=(4, 2), seed=4), "window_off_by_one_left-")
    add("window_wide_right", "window right bound one key too far",
        lambda q, k, v, s: eager(q, k, v, s, window=(s.window[0], s.window[1] + 1)),
        CaseRecipe(len_q=24, len_k=24, window=(3, 1), seed=5), "window_off_by_one_right+")
    add("no_scale", "forgets the softmax scale",
        lambda q, k, v, s: eager(q, k, v, s, scale=1.0),
        CaseRecipe(len_q=16, len_k=16, head_dim=32, q_std=0.5, k_std=0.5, seed=6), "scale_missing")
    add("double_scale", "scale applied as 2/sqrt(D)",
        lambda q, k, v, s: eager(q, k, v, s, scale=2 * s.resolved_scale(q.shape[-1])),
        CaseRecipe(len_q=16, len_k=16, head_dim=64, seed=7), "scale_doubled")
    add("ignores_given_scale", "uses 1/sqrt(D) even when a scale is given",
        lambda q, k, v, s: eager(q, k, v, s, scale=1.0 / math.sqrt(q.shape[-1])),
        CaseRecipe(len_q=16, len_k=16, head_dim=32, scale=0.4, seed=8), "scale_default")
    add("softcap_first", "softcap applied to q.k before the scale",
        lambda q, k, v, s: eager(q, k, v, s, softcap_first=True),
        CaseRecipe(len_q=16, len_k=16, head_dim=16, softcap=2.0, q_std=2.0, k_std=2.0, seed=9), "softcap_before_scale")
    add("gqa_interleaved", "query head h reads kv head h % Hkv",
        lambda q, k, v, s: eager(q, k, v, s, kv_map="interleaved"),
        CaseRecipe(heads_q=6, heads_kv=2, len_q=12, len_k=12, seed=10), "gqa_interleaved")
    add("masked_rows_nan", "fully-masked rows give NaN though it declares zeros",
        lambda q, k, v, s: eager(q, k, v, s, fully_masked="nan"),
        CaseRecipe(len_q=12, len_k=12, mask="bool_rows_off", masked_rows=(2, 7), seed=11), "fully_masked_nan")
    add("masked_rows_mean", "fully-masked rows give mean(V)",
        lambda q, k, v, s: eager(q, k, v, s, fully_masked="mean_v"),
        CaseRecipe(len_q=12, len_k=12, mask="bool_rows_off", masked_rows=(0, 5), seed=12), "fully_masked_mean_v")
    add("masked_rows_unmasked", "fully-masked rows attend every key (mask dropped for them)",
        lambda q, k, v, s: eager(q, k, v, s, fully_masked="unmasked"),
        CaseRecipe(len_q=12, len_k=12, mask="bool_rows_off", masked_rows=(3,), seed=13), "fully_masked_unmasked")
    add("lse_log2", "returns the LSE in base 2",
        lambda q, k, v, s: eager(q, k, v, s, lse_base2=True),
        CaseRecipe(len_q=16, len_k=16, return_lse=True, seed=14), "lse_base2")
    add("dropout_unscaled", "kept dropout probabilities not divided by (1 - p)",
        lambda q, k, v, s: eager(q, k, v, s, dropout_rescale=False),
        CaseRecipe(len_q=16, len_k=16, dropout_p=0.25, seed=15), "dropout_not_rescaled")
    add("batch_crosstalk", "batch 1 reads the K/V of batch 0",
        lambda q, k, v, s: eager(q, k, v, s, kv_of_batch=(1, 0)),
        CaseRecipe(batch=3, heads_q=2, heads_kv=2, len_q=10, len_k=10, seed=16), "kv_cross")
    add("pad_keys_counted", "keys padded to the 16-wide tile with zeros and not masked",
        lambda q, k, v, s: eager(q, k, v, s, pad_to=16),
        CaseRecipe(len_q=12, len_k=20, seed=17), "padded_keys_16", tiles=(16, 16))
    add("no_rescale", "online softmax without the exp(m_old - m_new) rescale (16-key tiles)",
        lambda q, k, v, s: online_no_rescale(q, k, v, s, 16),
        CaseRecipe(len_q=16, len_k=48, late_from=32, late_boost=3.0, seed=18), "missing_rescale_16", tiles=(16, 16))
    add("last_tile_dropped", "loop bound stops one key tile early (last 16-key tile never read)",
        lambda q, k, v, s: _skip_last(q, k, v, s, 16),
        CaseRecipe(len_q=16, len_k=40, seed=19), "last_tile_skipped_16", tiles=(16, 16))
    add("last_tile_hot", "scores of the last key tile multiplied by 1.5 (a tile-local bug no semantics explains)",
        lambda q, k, v, s: eager(q, k, v, s, last_tile_scores=(16, 1.5)),
        CaseRecipe(len_q=32, len_k=72, head_dim=64, seed=20), "last_key_tile", tiles=(16, 16))
    add("fp16_accumulator", "P.V accumulated key by key in float16 instead of float32",
        lambda q, k, v, s: eager(q, k, v, s, acc_dtype=torch.float16),
        CaseRecipe(len_q=768, len_k=768, head_dim=16, causal="top_left", dtype="float16", v_mean=4.0, seed=21), "grows_with_lk")
    add("noisy", "adds 1% random noise to the output (nothing to name)",
        lambda q, k, v, s: Output(eager(q, k, v, s).out + 0.01 * torch.randn(
            q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(0)).to(q.dtype)),
        CaseRecipe(len_q=16, len_k=16, seed=22), None)
    return W


def _skip_last(q, k, v, spec, tile):
    lk = k.shape[2]
    s0 = ((lk - 1) // tile) * tile
    hide = torch.ones(lk, dtype=torch.bool)
    hide[s0:] = False
    mask = hide.view(1, 1, 1, lk).expand(q.shape[0], q.shape[1], q.shape[2], lk)
    return eager(q, k, v, spec.replace(attn_mask=mask))


def run_one(w: Wrong):
    """check + diagnose one wrong implementation: (CheckResult, Diagnosis)."""
    from attnverify.diagnose import diagnose_result

    case = w.case()
    res = av.check(w.adapter, case, backward=False)
    keep = None
    if case.spec.dropout_p > 0:
        keep = w.adapter(case.q, case.k, case.v, case.spec).dropout_mask
    return res, diagnose_result(res, adapter=w.adapter, dropout_mask=keep)


def named(diag, expected: Optional[str]) -> bool:
    """Is `expected` the diagnosis (the best explanation, or the first signature when nothing fits)?"""
    if expected is None:
        return diag.summary.startswith("no simple explanation")
    if diag.best is not None:
        return diag.best.key == expected or diag.best.key.startswith(expected)
    return bool(diag.signatures) and diag.signatures[0].key == expected


def markdown() -> str:
    lines = [
        "# What the diagnosis says about deliberately wrong implementations",
        "",
        "Each row is one implementation in `tests/_wrong_for_diagnosis.py` with a single bug, checked on the",
        "case beside it with `av.check` and diagnosed with `attnverify.diagnose.diagnose_result`, exactly as the",
        "run does for each failure it finds (in the process that judged it, beside the case file: the HTML",
        "report only reads it). `tests/test_diagnose.py` asserts every row; regenerate this page with",
        "`python tests/_wrong_for_diagnosis.py > docs/diagnosis.md`.",
        "",
        "How it works: the case is recomputed in float64 under each alternative semantics (other causal",
        "alignment, diagonal excluded, window bound off by one, scale missing/doubled/squared/default, softcap",
        "before scale, GQA interleaved, fully-masked rows as zeros/NaN/mean(V)/unmasked, LSE base 2 or without",
        "its max, dropout not rescaled, a batch or head reading another's K/V, padded tail keys counted, last key",
        "tile skipped, online softmax without rescale, an fp8 descale ignored, sinks ignored or added to the",
        "numerator). A case the engine does not reproduce without an alternative (a KV-cache call, chunked",
        "attention: features it does not model) is named nothing, with a note saying so; sinks and descales are",
        "tested in `tests/test_diagnose_serving.py`. An alternative explains the output when the output is",
        "within 3x the norm-wise tolerance of it, at least 4x closer than to the reference, with NaN/Inf in the",
        "same places. When none does, error signatures are measured (last key tile, running-max jumps, growth",
        "with the number of keys, some heads only, fully-masked rows only); when nothing fits the report says",
        "\"no simple explanation\".",
        "",
        "| implementation | bug | case | check | diagnosis given | expected | named correctly |",
        "|---|---|---|---|---|---|---|",
    ]
    for w in zoo():
        res, diag = run_one(w)
        failing = ", ".join(c.name for c in res.comparisons if not c.passed) or "-"
        ok = named(diag, w.expected)
        got = diag.summary
        if diag.best is not None:
            got = f"{diag.best.title} (`{diag.best.key}`, residual {diag.best.residual:.1e} vs {diag.best.ref_residual:.1e})"
        elif diag.signatures:
            got = f"signature: {diag.signatures[0].title} (`{diag.signatures[0].key}`; {diag.signatures[0].detail})"
        lines.append(f"| `{w.name}` | {w.bug} | {w.case().describe()} | {res.status} ({failing}) | {got} | "
                     f"`{w.expected or 'no simple explanation'}` | {'yes' if ok else 'NO'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
