"""`attention_cases`: CaseRecipes drawn only from what an adapter claims.

Every choice is ordered simplest first, so a failing case shrinks toward: float32, B=1, one head,
Lq == Lk small, D=16, no mask, plain N(0, 1) values, contiguous memory, seed 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

from hypothesis import assume
from hypothesis import strategies as st

from ..case import CaseRecipe, build_case, build_probe
from ..timesplit import strategy_clock
from ._args import InvalidArgument, check_choice, check_int, check_order, check_tristate, resolve
from ._profiles import profile_limits
from ._shapes import head_dim_candidates, interesting_lengths, seqlens

DTYPE_ORDER = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2")
CAUSAL_ORDER = ("none", "top_left", "bottom_right")
LAYOUTS = ("contiguous", "transposed", "sliced", "offset", "expanded_kv")
VALUE_MODES = ("normal", "wide", "late_tile", "shift_up", "shift_down", "equal", "v_offset")
FULLY_MASKED_SOURCES = ("mask_rows", "bottom_right", "window", "varlen_empty", "key_dim_broadcast")
_FP8 = ("float8_e4m3fn", "float8_e5m2")


# adapter name -> the reason of the last draw its claims or `refuses` turned down, so that a property
# none of whose draws an adapter accepts can say why it was skipped (properties.driver, via last_refusal)
_LAST_REFUSAL: Dict[str, str] = {}


class Unclaimable(InvalidArgument):
    """The adapter's claims leave nothing this strategy can draw (a property then skips at once, with this reason:
    properties.driver). Raised only where it is certain; every other case goes to Hypothesis."""


def last_refusal(adapter_name: str) -> Optional[str]:
    """Why the adapter's claims or `refuses` turned down the last case drawn for it (None: none was)."""
    return _LAST_REFUSAL.get(adapter_name)


def note_refusal(adapter_name: str, why: str) -> None:
    """Record why the adapter's claims or `refuses` turned down a draw (the cache strategies call this too)."""
    _LAST_REFUSAL[adapter_name] = why


def forget_refusal(adapter_name: str) -> None:
    """Clear the record, so that a later skip says why *this* property's draws were refused."""
    _LAST_REFUSAL.pop(adapter_name, None)


@dataclass(frozen=True)
class _Cfg:
    adapter: Any
    limits: Any
    device: str
    dtypes: Tuple[str, ...]
    min_len: Any
    max_len: Any
    batch: Any
    causal: Tuple[str, ...]
    gqa: Any
    window: Any
    softcap: Any
    alibi: Any
    attn_mask: Any
    varlen: Any
    dropout: Any
    return_lse: Any
    extreme_values: Any
    layouts: Tuple[str, ...]
    poison: Any
    fully_masked: Any  # None: allowed when claimed; True: every case has one; False: never
    lq_ne_lk: Any
    dv_ne_d: Any
    scale: Any
    tiles: Tuple[int, ...]


# one strategy per denominator, made once (issue 25: the same strategy each draw; Hypothesis draws alike)
_ONE_IN = {den: st.integers(0, den - 1) for den in (2, 3, 4, 5, 6)}


def _flag(draw, arg, claimed: bool, den: int = 4) -> bool:
    """Tri-state feature switch: False/unclaimed -> False, True -> True, None -> drawn (1 in `den`)."""
    arg = resolve(draw, arg)
    if arg is False or not claimed:
        return False
    if arg is True:
        return True
    return draw(_ONE_IN[den] if den in _ONE_IN else st.integers(0, den - 1)) == den - 1


def attention_cases(
    *,
    adapter,
    profile: str = "dev",
    device: str = "auto",
    dtypes: Optional[Sequence[str]] = None,
    min_seqlen: int = 1,
    max_seqlen: Optional[int] = None,
    batch: Optional[int] = None,
    causal: Optional[Sequence[str]] = None,
    gqa: Optional[bool] = None,
    window: Optional[bool] = None,
    softcap: Optional[bool] = None,
    alibi: Optional[bool] = None,
    attn_mask: Optional[bool] = None,
    varlen: Optional[bool] = None,
    dropout: Optional[bool] = False,
    return_lse: Optional[bool] = None,
    extreme_values: Optional[bool] = None,
    layouts: Optional[Sequence[str]] = None,
    poison: Optional[bool] = False,
    fully_masked: Optional[bool] = None,
    lq_ne_lk: Optional[bool] = None,
    dv_ne_d: Optional[bool] = None,
    scale: Optional[bool] = None,
    backward: bool = False,
):
    """A strategy of `CaseRecipe`s for `adapter`, drawing only what it claims.

    Feature switches (`window`, `softcap`, `alibi`, `attn_mask`, `varlen`, `dropout`, `gqa`,
    `return_lse`, `poison`, `fully_masked`, `lq_ne_lk`, `dv_ne_d`, `scale`, `extreme_values`):
    None draws the feature sometimes when the adapter claims it, True always (an error when the
    adapter does not claim it), False never. Each may also be a strategy of those values.
    `backward=True` keeps to cases whose gradients are defined (no fp8). fp8 dtypes are drawn only when named in
    `dtypes` (the fp8 properties do, adding descales: properties/fp8.py).
    Build the tensors with `attnverify.build_case(recipe)` or `cases(...)`.
    """
    from ..adapters.base import Adapter

    if not isinstance(adapter, Adapter):
        raise InvalidArgument(f"adapter={adapter!r} must be an attnverify Adapter (see attnverify.adapters.registry.get)")
    claims = adapter.claims
    limits = profile_limits(profile)
    if device not in ("auto", "cpu", "cuda"):
        raise InvalidArgument(f"device={device!r} must be one of ('auto', 'cpu', 'cuda')")
    dev = adapter.run_device(device)
    if dev not in claims.devices:
        raise InvalidArgument(f"device={device!r}: {adapter.name} does not claim device {dev} (claims {claims.devices})")
    check_int("min_seqlen", min_seqlen, min_value=0)
    check_int("max_seqlen", max_seqlen, min_value=1, allow_none=True)
    check_int("batch", batch, min_value=1, allow_none=True)
    mx = max_seqlen if max_seqlen is not None else min(limits.max_len, claims.max_seqlen)
    if isinstance(mx, int) and mx > claims.max_seqlen:
        raise InvalidArgument(f"max_seqlen={mx} is larger than {adapter.name}'s claimed max_seqlen={claims.max_seqlen}")
    check_order("min_seqlen", min_seqlen, "max_seqlen", mx)

    dts = check_choice("dtypes", dtypes, DTYPE_ORDER)
    # fp8 only when asked for by name: the fp8 properties (properties/fp8.py) draw it with its descales; the
    # general properties transform inputs arithmetically, which fp8 tensors do not support
    want = tuple(d for d in DTYPE_ORDER if d in claims.dtypes and (d in dts if dts is not None else d not in _FP8))
    if backward:
        want = tuple(d for d in want if d not in _FP8)
    if not want:
        raise InvalidArgument(f"dtypes={dtypes!r}: none of them is claimed by {adapter.name} (claims {claims.dtypes}"
                              + ("; fp8 dtypes are drawn only when named in dtypes=" if dts is None else "") + ")")
    cz = check_choice("causal", causal, CAUSAL_ORDER)
    cz_t = tuple(c for c in CAUSAL_ORDER if c in claims.causal and (cz is None or c in cz))
    if not cz_t:
        raise InvalidArgument(f"causal={causal!r}: {adapter.name} claims only causal={claims.causal}")
    lay = check_choice("layouts", layouts, LAYOUTS)
    lay_t = tuple(x for x in LAYOUTS if lay is None or x in lay)
    if backward and lay is None:
        # check() cannot yet make gradient leaves of stride-0 (expanded) tensors; forward cases cover them
        lay_t = tuple(x for x in lay_t if x != "expanded_kv")

    tri = {}
    for name, val, claim in (
        ("gqa", gqa, claims.gqa), ("window", window, claims.window), ("softcap", softcap, claims.softcap),
        ("alibi", alibi, claims.alibi), ("attn_mask", attn_mask, claims.attn_mask), ("varlen", varlen, claims.varlen),
        ("dropout", dropout, claims.dropout), ("return_lse", return_lse, claims.lse),
        ("fully_masked", fully_masked, claims.fully_masked != "unsupported"),
        ("dv_ne_d", dv_ne_d, claims.dv_ne_d),
    ):
        v = check_tristate(name, val)
        if v is True and not claim:
            what = "fully-masked rows (fully_masked='unsupported')" if name == "fully_masked" else ("lse" if name == "return_lse" else name)
            raise InvalidArgument(f"{name}=True but {adapter.name} does not claim {what}")
        tri[name] = v
    for name, val in (("poison", poison), ("lq_ne_lk", lq_ne_lk), ("scale", scale), ("extreme_values", extreme_values)):
        tri[name] = check_tristate(name, val)
    if tri["fully_masked"] is True and not _fm_sources(claims, cz_t, tri):
        raise InvalidArgument(f"fully_masked=True: {adapter.name} claims no way to mask a whole row "
                              "(needs attn_mask, bottom_right causal, window or varlen)")
    hd = head_dim_candidates(claims, limits.head_dims)
    if not hd:
        raise InvalidArgument(f"profile={limits.name!r}: {adapter.name} claims none of the head dims {limits.head_dims}")
    why = _unclaimable(adapter, limits, min_seqlen, mx, hd, cz_t, tri)
    if why:
        raise Unclaimable(why)
    cfg = _Cfg(adapter, limits, dev, want, min_seqlen, mx, batch, cz_t, tri["gqa"], tri["window"], tri["softcap"],
               tri["alibi"], tri["attn_mask"], tri["varlen"], tri["dropout"], tri["return_lse"], tri["extreme_values"],
               lay_t, tri["poison"], tri["fully_masked"], tri["lq_ne_lk"], tri["dv_ne_d"], tri["scale"],
               tuple(claims.tiles or ()))
    return _case(cfg, hd)


def cases(**kwargs):
    """Like `attention_cases`, but yields built `Case`s (tensors made)."""
    return attention_cases(**kwargs).map(build_case)


def _unclaimable(adapter, limits, mn, mx, head_dims, causal_t, tri) -> Optional[str]:
    """Why no draw can hold what the switches force within the claims, naming the claim; None when one can (or when
    it is not certain: a length, a switch given as a strategy is left to Hypothesis)."""
    c = adapter.claims
    cap = (f"max_seqlen={c.max_seqlen}" if c.max_seqlen <= limits.max_len
           else f"lengths up to {limits.max_len} (the {limits.name} profile)")
    if isinstance(mx, int) and mx < 2:
        # an empty key segment (varlen, fully-masked rows allowed, min_seqlen 0) is the one way to Lq != Lk then
        empty_keys = c.varlen and tri["varlen"] is not False and tri["fully_masked"] is not False \
            and c.fully_masked != "unsupported" and not (isinstance(mn, int) and mn >= 1)
        if tri["lq_ne_lk"] is True and not empty_keys:
            return f"{adapter.name} claims {cap}: Lq != Lk needs two positions"
        if tri["fully_masked"] is True and set(_fm_sources(c, causal_t, tri)) <= {"bottom_right", "window"}:
            return (f"{adapter.name} claims {cap}: a row with no visible key needs Lq > Lk (bottom-right causal or a "
                    f"window; attn_mask and varlen, which mask a row at any length, are not claimed)")
    if tri["dv_ne_d"] is True and len(head_dims) < 2:
        return f"{adapter.name} claims one head dim ({head_dims[0]}) here: Dv != D needs two"
    return None


def _fm_sources(claims, causal_t, tri) -> Tuple[str, ...]:
    out = []
    if claims.attn_mask and tri.get("attn_mask") is not False:
        out += ["mask_rows", "key_dim_broadcast"]
    if "bottom_right" in causal_t:
        out.append("bottom_right")
    if claims.window and tri.get("window") is not False:
        out.append("window")
    if claims.varlen and tri.get("varlen") is not False:
        out.append("varlen_empty")
    return tuple(out)


@st.composite
def _case(draw, cfg: _Cfg, head_dims: Tuple[int, ...]):
    with strategy_clock():  # draw.strategy of the time split (attnverify.timesplit)
        return _draw_case(draw, cfg, head_dims)


def _draw_case(draw, cfg: _Cfg, head_dims: Tuple[int, ...]):
    claims, lim = cfg.adapter.claims, cfg.limits
    min_len = resolve(draw, cfg.min_len)
    max_len = resolve(draw, cfg.max_len)
    check_order("min_seqlen", min_len, "max_seqlen", max_len)
    tiles = cfg.tiles
    fm_ok = cfg.fully_masked is not False and claims.fully_masked != "unsupported"
    fm_force = resolve(draw, cfg.fully_masked) is True
    fm_src = draw(st.sampled_from(_fm_sources(claims, cfg.causal, {
        "attn_mask": cfg.attn_mask, "window": cfg.window, "varlen": cfg.varlen}))) if fm_force else None

    dtype = draw(st.sampled_from(cfg.dtypes))
    causal = "bottom_right" if fm_src == "bottom_right" else draw(st.sampled_from(cfg.causal))
    b_fixed = resolve(draw, cfg.batch) if cfg.batch is not None else None
    use_varlen = fm_src == "varlen_empty" or (fm_src is None and b_fixed in (None, 1)
                                               and _flag(draw, cfg.varlen, claims.varlen, den=6))
    lq_ne = resolve(draw, cfg.lq_ne_lk)

    # --- shapes ---------------------------------------------------------------------------------
    seg_q = seg_k = None
    if use_varlen:
        n = draw(st.integers(1, lim.max_segments))
        per = max(1, max_len // n)
        seg_len = seqlens(min_len=0, max_len=per, tiles=tiles)
        seg_q = [draw(seg_len) for _ in range(n)]
        same = (not draw(st.booleans())) if not lq_ne else False
        seg_k = list(seg_q) if same else [draw(seg_len) for _ in range(n)]
        if fm_src == "varlen_empty":
            i = draw(st.integers(0, n - 1))
            seg_q[i] = max(seg_q[i], 1)
            seg_k[i] = 0
        if not fm_ok:  # a query segment with no keys would be a fully-masked row
            seg_k = [max(kk, 1) if qq else kk for qq, kk in zip(seg_q, seg_k)]
        lq, lk = sum(seg_q), sum(seg_k)
        assume(min_len <= lq and min_len <= lk and lq <= max_len and lk <= max_len and lq > 0)
        if lq_ne:
            assume(lq != lk)
    else:
        lk = draw(seqlens(min_len=max(min_len, 1), max_len=max_len, tiles=tiles))
        rel = "free" if (lq_ne or fm_src == "bottom_right") else draw(st.sampled_from(("equal", "free", "decode")))
        if rel == "equal":
            lq = lk
        elif rel == "decode" and min_len <= 1:
            lq = 1
        else:
            lq = draw(seqlens(min_len=max(min_len, 1), max_len=max_len, tiles=tiles))
        if lq_ne:
            assume(lq != lk)
        if fm_src == "bottom_right":
            assume(lq > lk)
    cap = max(1, lim.max_numel // max(1, lq * lk))
    if use_varlen:
        b = 1
    elif b_fixed is not None:
        b = b_fixed
    else:
        b = draw(st.integers(1, max(1, min(lim.max_batch, cap))))
    use_gqa = _flag(draw, cfg.gqa, claims.gqa, den=2)
    hkv = draw(st.integers(1, max(1, min(lim.max_heads_kv, cap // b))))
    group = 1
    if use_gqa:
        groups = [g for g in (2, 4, 8, 16) if g <= lim.max_group and hkv * g * b <= cap] or [1]
        group = draw(st.sampled_from(groups))
    if cfg.gqa is True:
        assume(group > 1)
    hq = hkv * group
    d = draw(st.sampled_from(head_dims))
    dv = None
    if _flag(draw, cfg.dv_ne_d, claims.dv_ne_d, den=5):
        dv = draw(st.sampled_from([x for x in head_dims if x != d] or [d]))
        if dv == d:
            dv = None
    if cfg.dv_ne_d is True:
        assume(dv is not None)

    # --- positional features ----------------------------------------------------------------------
    win = None
    if fm_src == "window" or _flag(draw, cfg.window, claims.window, den=5):
        choices = (-1, 0, 1, 2, 3, 8, 16, 63, 64, 127)
        if fm_src == "window":  # bottom-right aligned: a negative reach past the keys empties rows
            win = (draw(st.sampled_from((0, 1, 3, 16))), draw(st.sampled_from((0, 1, 2))))
            assume(lq > lk + win[1])
        else:
            win = (draw(st.sampled_from(choices)), draw(st.sampled_from(choices)))
    cap_ = draw(st.sampled_from((30.0, 5.0, 1.0, 0.5, 50.0))) if _flag(draw, cfg.softcap, claims.softcap, den=5) else None
    use_alibi = _flag(draw, cfg.alibi, claims.alibi, den=5)

    # --- masks ------------------------------------------------------------------------------------
    mask, mask_shape, density, rows, key_block, garbage = "none", None, 0.7, (), None, 0.0
    mask_claimed = claims.attn_mask and not use_varlen
    want_mask = fm_src in ("mask_rows", "key_dim_broadcast") or _flag(draw, cfg.attn_mask, mask_claimed, den=4)
    if want_mask and not use_varlen:
        kinds = ("bool_random", "bool_padding", "float_random", "float_neg_inf", "bool_rows_off")
        if fm_src in ("mask_rows", "key_dim_broadcast"):
            kinds = ("bool_random", "bool_rows_off")
        mask = draw(st.sampled_from(kinds))
        full = (b, hq, lq, lk)
        if fm_src == "key_dim_broadcast":
            mask_shape = (draw(st.sampled_from((1, b))), draw(st.sampled_from((1, hq))), lq, 1)
            density = 0.5
        elif draw(st.booleans()):  # broadcast: size-1 dims anywhere, the key dim included
            mask_shape = tuple(1 if draw(st.booleans()) else n for n in full)
        density = draw(st.sampled_from((0.7, 0.3, 0.05, 1.0))) if fm_src != "key_dim_broadcast" else density
        if mask.startswith("bool") and fm_ok and (fm_src == "mask_rows" or draw(st.integers(0, 3)) == 3):
            rows = tuple(sorted(set(draw(st.lists(st.integers(0, lq - 1), min_size=1, max_size=3)))))
        if fm_ok and lk >= 2 and draw(st.integers(0, 4)) == 4 and (mask_shape is None or mask_shape[3] == lk):
            # a whole key tile hidden inside otherwise live rows
            edges = sorted({0, lk} | {x for x in interesting_lengths(max_len=lk, tiles=tiles) if x % 16 == 0})
            a0 = draw(st.sampled_from(edges[:-1]))
            key_block = (a0, draw(st.sampled_from([e for e in edges if e > a0])))
        if mask.startswith("bool") and mask_shape is None and draw(st.integers(0, 3)) == 3:
            garbage = draw(st.sampled_from((1e4, 3e4)))

    # --- values -----------------------------------------------------------------------------------
    extreme = resolve(draw, cfg.extreme_values)
    modes = VALUE_MODES if extreme is not False else ("normal",)
    if extreme is True:
        modes = VALUE_MODES[1:]
    mode = draw(st.sampled_from(modes))
    q_std = k_std = v_std = 1.0
    v_mean, late_from, late_boost, equal, shift = 0.0, None, 1.0, False, 0.0
    if mode == "wide":
        q_std = k_std = draw(st.sampled_from((3.2, 5.0, 10.0)))
    elif mode == "late_tile" and lk >= 2:
        edges = [x for x in interesting_lengths(max_len=lk - 1, tiles=tiles) if x % 16 == 0 and x > 0] or [lk // 2 or 1]
        late_from = draw(st.sampled_from(edges))
        late_boost = draw(st.sampled_from((8.0, 30.0, 100.0)))
    elif mode == "shift_up":
        shift = draw(st.sampled_from((1000.0, 100.0, 60.0)))
    elif mode == "shift_down":
        shift = draw(st.sampled_from((-1000.0, -120.0, -100.0)))
        q_std = k_std = 0.5
    elif mode == "equal":
        equal = True
    elif mode == "v_offset":
        v_mean = draw(st.sampled_from((10.0, -100.0)))
    sc = None
    if _flag(draw, cfg.scale, True, den=4):
        sc = draw(st.sampled_from((1.0, 0.5, 0.01, 2.0)))
    if shift:  # q[..., 0] = shift / scale must stay finite in the input dtype
        lim_abs = 3e4 if dtype == "float16" else (200.0 if dtype in _FP8 else 1e30)
        assume(abs(shift) / (sc if sc is not None else 1.0 / math.sqrt(d)) < lim_abs)
    if dtype in _FP8:
        q_std, k_std = min(q_std, 3.0), min(k_std, 3.0)

    # --- memory layout, dropout, poison, LSE ----------------------------------------------------------
    layout = "contiguous"
    if len(cfg.layouts) > 1 and draw(st.integers(0, 3)) == 3:
        layout = draw(st.sampled_from(cfg.layouts[1:] if cfg.layouts[0] == "contiguous" else cfg.layouts))
    elif len(cfg.layouts) == 1:
        layout = cfg.layouts[0]
    p_drop = 0.0
    if _flag(draw, cfg.dropout, claims.dropout, den=3):
        p_drop = draw(st.sampled_from((0.1, 0.5, 0.9)))
    if cfg.dropout is True:
        assume(p_drop > 0)
    lse = _flag(draw, cfg.return_lse, claims.lse, den=2)
    poison = ()
    if _flag(draw, cfg.poison, True, den=6):
        name = draw(st.sampled_from(("q", "k", "v")))
        hh = hq if name == "q" else hkv
        ll = lq if name == "q" else lk
        dd = (dv or d) if name == "v" else d
        val = draw(st.sampled_from(("nan", "inf", "-inf")))
        poison = ((name, draw(st.integers(0, b - 1)), draw(st.integers(0, hh - 1)), draw(st.integers(0, max(0, ll - 1))),
                   draw(st.integers(0, dd - 1)), val),)
        assume(ll > 0)
    if cfg.poison is True:
        assume(poison)
    seed = draw(st.integers(0, 2**31 - 1))

    r = CaseRecipe(
        batch=b, heads_q=hq, heads_kv=hkv, len_q=lq, len_k=lk, head_dim=d, head_dim_v=dv, dtype=dtype,
        device=cfg.device, seed=seed, q_std=q_std, k_std=k_std, v_std=v_std, v_mean=v_mean, late_from=late_from,
        late_boost=late_boost, equal_scores=equal, row_shift=shift, scale=sc, causal=causal, window=win,
        softcap=cap_, alibi=use_alibi, mask=mask, mask_shape=mask_shape, mask_density=density, masked_rows=rows,
        key_block=key_block, seqlens_q=seg_q, seqlens_k=seg_k, dropout_p=p_drop, return_lse=lse, poison=poison,
        masked_garbage=garbage, layout=layout,
    )
    _final_filter(r, cfg, fm_ok, fm_force)
    return r


def _risky(r: CaseRecipe) -> bool:
    """Could this recipe contain a fully-masked row?"""
    return bool(
        r.masked_rows or r.key_block is not None
        or (r.mask in ("bool_random", "float_neg_inf", "bool_rows_off"))
        or (r.causal == "bottom_right" and r.len_q > r.len_k)
        or r.window is not None
        or (r.seqlens_q is not None and any(q and not k for q, k in zip(r.seqlens_q, r.seqlens_k)))
        or (r.seqlens_q is not None and r.causal == "bottom_right")
    )


def fully_masked_row_count(r: CaseRecipe) -> int:
    """How many (b, h, i) query rows of the recipe see no key at all."""
    if not _risky(r):
        return 0
    from ..reference import visible_counts

    c = build_case(CaseRecipe.from_dict({**r.to_dict(), "device": "cpu", "poison": (), "dtype": "float32"}))
    s = c.spec
    if s.is_varlen:
        import torch

        # per segment: visibility inside the segment only
        n = 0
        cq, ck = torch.as_tensor(s.cu_seqlens_q).tolist(), torch.as_tensor(s.cu_seqlens_k).tolist()
        for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
            if q1 == q0:
                continue
            if k1 == k0:
                n += (q1 - q0) * r.heads_q
                continue
            seg = s.replace(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None)
            n += int((visible_counts(q1 - q0, k1 - k0, seg, 1, r.heads_q) == 0).sum())
        return n
    return int((visible_counts(r.len_q, r.len_k, s, r.batch, r.heads_q) == 0).sum())


def _final_filter(r: CaseRecipe, cfg: _Cfg, fm_ok: bool, fm_force: bool) -> None:
    if fm_force or (not fm_ok and _risky(r)):
        n = fully_masked_row_count(r)
        assume(n > 0 if fm_force else n == 0)
    if cfg.adapter.refuses is not None:
        from ..check import unclaimed

        # a CPU probe (never start CUDA here) without drawn values: a refusal is about shapes, layouts and the
        # spec (docs/adapters.md); the real case is asked again where it is judged
        why = unclaimed(cfg.adapter, build_probe(r, values=False))
        if why is not None:
            _LAST_REFUSAL[cfg.adapter.name] = why
        assume(why is None)
