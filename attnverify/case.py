"""A Case: the tensors and Spec of one attention call, plus the recipe that rebuilds it.

Large tensors are never stored element by element: a `CaseRecipe` holds shapes, a seed and
distribution parameters, and `build_case(recipe)` makes the same tensors again anywhere (this is
what `attnverify repro` replays). Cases made from raw tensors save them to a .pt beside the JSON.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from .case_masks import recipe_mask
from .torch_threads import one_thread
from .sink_logits import make_sinks
from .spec import Spec

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
for _n in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _n):
        DTYPES[_n] = getattr(torch, _n)

MASK_KINDS = ("none", "bool_random", "bool_padding", "bool_rows_off", "float_random", "float_neg_inf")


@dataclass
class CaseRecipe:
    """Everything needed to rebuild a case; plain JSON-able values only."""

    batch: int = 1
    heads_q: int = 1
    heads_kv: int = 1
    len_q: int = 16
    len_k: int = 16
    head_dim: int = 32
    head_dim_v: Optional[int] = None
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    # values: q, k, v ~ N(0, std^2)
    q_std: float = 1.0
    k_std: float = 1.0
    v_std: float = 1.0
    v_mean: float = 0.0
    # a late key tile whose scores tower over the earlier ones: keys [late_from, Lk) scaled by late_boost
    late_from: Optional[int] = None
    late_boost: float = 1.0
    equal_scores: bool = False  # all keys identical -> all scores equal in a row
    # add this constant to every score (k[..., 0] = 1 for all keys, q[..., 0] = shift / scale):
    # softmax must not change, LSE moves by exactly the shift
    row_shift: float = 0.0
    # spec
    scale: Optional[float] = None
    causal: str = "none"
    window: Optional[Tuple[int, int]] = None
    softcap: Optional[float] = None
    alibi: bool = False
    mask: str = "none"
    mask_shape: Optional[Tuple[int, int, int, int]] = None  # broadcast shape; 1 = broadcast dim
    mask_density: float = 0.7
    masked_rows: Tuple[int, ...] = ()  # query rows with no visible key (bool masks)
    # keys [a, b) hidden from every query (a fully-masked key tile inside otherwise live rows);
    # made as a bool mask when mask == "none", else written into the drawn mask (False / -inf)
    key_block: Optional[Tuple[int, int]] = None
    seqlens_q: Optional[List[int]] = None  # varlen segments (B must be 1)
    seqlens_k: Optional[List[int]] = None
    dropout_p: float = 0.0
    return_lse: bool = False
    # NaN/Inf: (tensor, b, h, i, d, value) entries, e.g. ("q", 0, 0, 3, 0, "nan")
    poison: Tuple[Tuple[Any, ...], ...] = ()
    # huge finite values written at masked-out key positions (must not change the output)
    masked_garbage: float = 0.0
    layout: str = "contiguous"  # contiguous | transposed | sliced | expanded_kv | offset
    tags: Tuple[str, ...] = ()
    # a KV-cache call (attnverify/paged.py) when cache_lens is set: keys cached per batch before the call,
    # caches of num_pages pages (or rows) of page_size slots, the block table of a paged cache, new_len keys
    # appended, garbage (nan | huge | mixed | none) in every slot no sequence uses, split-KV partitions
    cache_lens: Optional[List[int]] = None
    paged: bool = False
    page_size: int = 0
    num_pages: int = 0
    block_table: Optional[List[List[int]]] = None
    cache_batch_idx: Optional[List[int]] = None
    cache_leftpad: Optional[List[int]] = None  # the slot each batch's cached keys start at (Spec.cache_leftpad)
    new_len: int = 0
    garbage: str = "none"
    num_splits: Optional[int] = None
    # fp8 (attnverify/fp8.py): descales drawn per (batch, kv head) by this kind (fp8.DESCALE_KINDS), the inputs
    # quantized as saturate(x / descale); None: no descales (fp8 inputs are the values cast, saturating)
    descales: Optional[str] = None
    # one key (index) whose score towers `dominant_gap` above the others in every row (q[..., 0] = 1 and that
    # key's k[..., 0] = gap / scale): the softmax is dominated by it and P's small entries meet fp8's flush
    dominant_key: Optional[int] = None
    dominant_gap: float = 0.0
    # every key shares this component along head dim 0 (k[..., 0] += key_offset): a per-row constant added to the
    # scores, so out, LSE and dQ are unchanged in exact arithmetic (sum_j dS_ij = 0 cancels it from dQ), while the
    # partial sums of a dQ accumulator carry it (issue 20: a half dQ accumulator, with a dominant first key)
    key_offset: float = 0.0
    # learnable sinks (Spec.sinks) from their description {"kind", "level", "seed"} (attnverify/sink_logits.py)
    sinks: Optional[Dict[str, Any]] = None
    attention_chunk: Optional[int] = None  # chunked local attention (Spec.attention_chunk)

    def to_dict(self) -> dict:
        """dataclasses.asdict's result (containers copied, tuples kept tuples), without its deep copy of every
        leaf: the recipe's leaves are numbers and strings (issue 25: asdict was 4% of a judged example)."""
        return {name: _plain(getattr(self, name)) for name in _recipe_fields()}

    @classmethod
    def from_dict(cls, d: dict) -> "CaseRecipe":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"CaseRecipe: unknown field(s) {sorted(unknown)} (a case saved by a newer attnverify?)")
        d = dict(d)
        for key in ("window", "mask_shape", "key_block"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        for key in ("masked_rows", "tags"):
            if key in d and d[key] is not None:
                d[key] = tuple(d[key])
        if "poison" in d:
            d["poison"] = tuple(tuple(p) for p in d["poison"])
        return cls(**d)


@functools.lru_cache(maxsize=None)
def _recipe_fields() -> Tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(CaseRecipe))


def _plain(v):
    if isinstance(v, (list, tuple)):
        return type(v)(_plain(x) for x in v)
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    spec: Spec = field(default_factory=Spec)
    seed: int = 0  # drives the upstream gradient and anything else random in a check
    recipe: Optional[CaseRecipe] = None
    label: str = ""
    # set only on a probe (build_probe): the device the case stands for while its tensors are on the CPU
    stands_for: Optional[str] = None

    @property
    def dtype(self) -> str:
        return str(self.q.dtype).replace("torch.", "")

    @property
    def device(self) -> str:
        """The case's device: where its tensors are, or for a probe, the device it stands for."""
        return self.stands_for or self.q.device.type

    @property
    def shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {"q": tuple(self.q.shape), "k": tuple(self.k.shape), "v": tuple(self.v.shape)}

    def describe(self) -> str:
        if self.spec.cache_seqlens is not None:
            from .paged import describe

            return describe(self)
        b, hq, lq, d = self.q.shape
        hkv, lk, dv = self.k.shape[1], self.k.shape[2], self.v.shape[3]
        s = self.spec
        parts = [f"B={b} Hq={hq} Hkv={hkv} Lq={lq} Lk={lk} D={d}" + (f" Dv={dv}" if dv != d else ""), self.dtype]
        if s.scale is not None:
            parts.append(f"scale={s.scale:g}")
        if s.causal != "none":
            parts.append(f"causal={s.causal}")
        if s.window is not None:
            parts.append(f"window={s.window}")
        if s.softcap is not None:
            parts.append(f"softcap={s.softcap:g}")
        if s.alibi_slopes is not None:
            parts.append("alibi")
        if s.attn_mask is not None:
            parts.append(f"mask={str(s.attn_mask.dtype).replace('torch.', '')}{tuple(s.attn_mask.shape)}")
        if s.is_varlen:
            parts.append(f"cu_seqlens_q={torch.as_tensor(s.cu_seqlens_q).tolist()} cu_seqlens_k={torch.as_tensor(s.cu_seqlens_k).tolist()}")
        if s.dropout_p:
            parts.append(f"dropout_p={s.dropout_p:g} seed={s.seed}")
        if self.recipe is not None:
            r = self.recipe
            if r.q_std != 1 or r.k_std != 1:
                parts.append(f"q_std={r.q_std:g} k_std={r.k_std:g}")
            if r.late_from is not None:
                parts.append(f"late tile from {r.late_from} x{r.late_boost:g}")
            if r.equal_scores:
                parts.append("equal scores")
            if r.row_shift:
                parts.append(f"row_shift={r.row_shift:g}")
            if r.poison:
                parts.append(f"poison={list(r.poison)}")
            if r.key_block is not None:
                parts.append(f"keys {r.key_block[0]}..{r.key_block[1] - 1} hidden")
            if r.masked_rows:
                parts.append(f"rows {list(r.masked_rows)} fully masked")
            if r.layout != "contiguous":
                parts.append(f"layout={r.layout}")
            if r.dominant_key is not None and r.len_k:
                parts.append(f"key {r.dominant_key % r.len_k} dominant (+{r.dominant_gap:g})")
            if r.key_offset:
                parts.append(f"key_offset={r.key_offset:g}")
        if s.has_descales:
            parts.append(describe_descales(s))
        parts.extend(describe_sinks_chunk(s))
        return " ".join(parts)

    def case_id(self, recipe_dict: Optional[dict] = None) -> str:
        """A stable id: of the recipe (`recipe_dict`: its to_dict(), when the caller has it), else of the values."""
        if self.recipe is not None:
            d = recipe_dict if recipe_dict is not None else self.recipe.to_dict()
            blob = json.dumps(d, sort_keys=True, default=str).encode()
        else:
            h = hashlib.sha1()
            for t in (self.q, self.k, self.v):
                h.update(t.detach().cpu().float().numpy().tobytes())
            blob = h.hexdigest().encode()
        return hashlib.sha1(blob).hexdigest()[:12]

    def to_dict(self) -> dict:
        recipe = None if self.recipe is None else self.recipe.to_dict()
        return {
            "id": self.case_id(recipe),
            "label": self.label,
            "seed": self.seed,
            "describe": self.describe(),
            "shapes": {k: list(v) for k, v in self.shapes.items()},
            "dtype": self.dtype,
            "device": self.device,
            "recipe": recipe,
        }

    def save(self, path_json: str) -> str:
        """Write the case (recipe JSON; tensors to .pt when no recipe can rebuild them)."""
        d = self.to_dict()
        if self.recipe is None:
            pt = path_json[:-5] + ".pt" if path_json.endswith(".json") else path_json + ".pt"
            s = self.spec
            torch.save(
                {
                    "q": self.q.detach().cpu(), "k": self.k.detach().cpu(), "v": self.v.detach().cpu(),
                    "spec": {f.name: getattr(s, f.name) for f in dataclasses.fields(s)},
                },
                pt,
            )
            d["tensors"] = pt.rsplit("/", 1)[-1]
        with open(path_json, "w") as f:
            json.dump(d, f, indent=1, default=str)
        return path_json


def describe_descales(s: Spec) -> str:
    def one(d):
        d = d.flatten().tolist()
        return ",".join(f"{x:.3g}" for x in d[:4]) + (",..." if len(d) > 4 else "")

    return " ".join(f"{n}=[{one(getattr(s, n))}]" for n in ("q_descale", "k_descale", "v_descale")
                    if getattr(s, n) is not None)


def describe_sinks_chunk(s: Spec) -> List[str]:
    """The sinks (per head, as drawn) and the attention chunk of a call, for a case's one-line description."""
    parts = []
    if s.sinks is not None:
        x = torch.as_tensor(s.sinks).flatten().tolist()
        parts.append("sinks=[" + ",".join(f"{v:.3g}" for v in x[:4]) + (",...]" if len(x) > 4 else "]"))
    if s.attention_chunk is not None:
        parts.append(f"attention_chunk={s.attention_chunk}")
    return parts


def load_case(path_json: str, device: Optional[str] = None) -> Case:
    import os

    with open(path_json) as f:
        d = json.load(f)
    if d.get("recipe"):
        r = CaseRecipe.from_dict(d["recipe"])
        if device:
            r.device = device
        return build_case(r, label=d.get("label", ""))
    if not d.get("tensors"):
        raise ValueError(f"{path_json}: neither a recipe nor saved tensors; cannot rebuild this case")
    blob = torch.load(os.path.join(os.path.dirname(path_json), d["tensors"]), weights_only=False)
    dev = device or d.get("device", "cpu")
    spec = Spec(**blob["spec"])
    return Case(blob["q"].to(dev), blob["k"].to(dev), blob["v"].to(dev), spec, seed=d.get("seed", 0), label=d.get("label", ""))


def _validate(r: CaseRecipe) -> None:
    def bad(arg, why):
        return ValueError(f"CaseRecipe({arg}=...): {why}")

    for name in ("batch", "heads_q", "heads_kv", "head_dim"):
        if getattr(r, name) < 1:
            raise bad(name, "must be >= 1")
    if r.len_q < 0 or r.len_k < 0:
        raise bad("len_q/len_k", "must be >= 0")
    if r.heads_q % r.heads_kv:
        raise bad("heads_q", f"heads_q={r.heads_q} must be a multiple of heads_kv={r.heads_kv}")
    if r.dtype not in DTYPES:
        raise bad("dtype", f"{r.dtype!r} is not one of {sorted(DTYPES)}")
    if r.mask not in MASK_KINDS:
        raise bad("mask", f"{r.mask!r} is not one of {MASK_KINDS}")
    if r.key_block is not None and (len(r.key_block) != 2 or r.key_block[0] > r.key_block[1]):
        raise bad("key_block", f"{r.key_block!r}: give (first, end) with first <= end")
    if r.key_block is not None and r.seqlens_q is not None:
        raise bad("key_block", "a hidden key block is a mask, and masks do not combine with varlen")
    if (r.seqlens_q is None) != (r.seqlens_k is None):
        raise bad("seqlens_q", "give seqlens_q and seqlens_k together")
    if r.seqlens_q is not None:
        if r.batch != 1:
            raise bad("batch", "varlen packs need batch=1")
        if len(r.seqlens_q) != len(r.seqlens_k):
            raise bad("seqlens_k", "as many key segments as query segments")
        if sum(r.seqlens_q) != r.len_q or sum(r.seqlens_k) != r.len_k:
            raise bad("seqlens_q", f"segments must sum to len_q={r.len_q} and len_k={r.len_k}")
    if r.descales is not None:
        from .fp8 import DESCALE_KINDS, is_fp8

        if r.descales not in DESCALE_KINDS:
            raise bad("descales", f"{r.descales!r} is not one of {DESCALE_KINDS} (or None)")
        if not is_fp8(r.dtype):
            raise bad("descales", f"descales scale fp8 inputs; dtype is {r.dtype!r}")
        if r.cache_lens is not None:
            raise bad("descales", "descales with a KV cache are not part of the semantics yet")
    if r.layout == "v_colmajor" and r.cache_lens is not None:
        raise bad("layout", "v_colmajor is a layout of a plain (B, H, L, D) call, not of a KV cache")
    if r.cache_leftpad is not None and r.cache_lens is None:
        raise bad("cache_leftpad", "left padding is for a KV-cache case: give cache_lens too")
    if r.cache_lens is not None:
        from .paged import validate_recipe

        validate_recipe(r)


def build_case(r: CaseRecipe, *, label: str = "", values: bool = True) -> Case:
    """Rebuild the tensors and Spec of a recipe, deterministically (CPU generator, then moved).

    `values=False` (a probe for the claims, see build_probe) leaves the normal draws of q, k and v out:
    zeros, with every other part of the recipe applied (poison, row shift, masks, layouts)."""
    _validate(r)
    if r.cache_lens is not None:
        from .paged import build_cache_case

        return build_cache_case(r, label, values=values)
    gen = torch.Generator().manual_seed(int(r.seed))
    dt = DTYPES[r.dtype]
    dv = r.head_dim_v or r.head_dim
    b, hq, hkv, lq, lk, d = r.batch, r.heads_q, r.heads_kv, r.len_q, r.len_k, r.head_dim
    if values:
        q = torch.randn(b, hq, lq, d, generator=gen, dtype=torch.float64) * r.q_std
        k = torch.randn(b, hkv, lk, d, generator=gen, dtype=torch.float64) * r.k_std
        v = torch.randn(b, hkv, lk, dv, generator=gen, dtype=torch.float64) * r.v_std + r.v_mean
    else:  # issue 25: a probe took 0.9 ms of CPU with its values drawn, 0.2 ms without (dev draws); its zeros are
        # made in the input dtype (fp8: float64, quantized below), so the cast below has nothing to do: a quarter of
        # the memory written for half inputs, no read (the edits below assign or add single values: the same result)
        zdt = torch.float64 if r.dtype.startswith("float8") else dt
        q, k, v = (torch.zeros(s, dtype=zdt) for s in ((b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, dv)))
    if r.equal_scores and lk:
        k[:] = k[:, :, :1, :]
    if r.late_from is not None and 0 <= r.late_from < lk:
        k[:, :, r.late_from:, :] *= r.late_boost
    if r.row_shift:
        k[..., 0] = 1.0
        q[..., 0] = r.row_shift / Spec(scale=r.scale).resolved_scale(d)
    if r.dominant_key is not None and lk:  # (taken modulo Lk, so a shrunk Lk keeps its dominant key)
        q[..., 0] = 1.0
        k[:, :, r.dominant_key % lk, 0] = r.dominant_gap / Spec(scale=r.scale).resolved_scale(d)
    if r.key_offset and lk:
        k[..., 0] += r.key_offset
    mask = recipe_mask(r, gen)
    slopes = None
    if r.alibi:
        slopes = (2.0 ** (-8.0 * torch.arange(1, hq + 1, dtype=torch.float64) / hq)).float()
    cu_q = cu_k = None
    max_q = max_k = None
    if r.seqlens_q is not None:
        cu_q = torch.tensor([0] + list(_cumsum(r.seqlens_q)), dtype=torch.int32)
        cu_k = torch.tensor([0] + list(_cumsum(r.seqlens_k)), dtype=torch.int32)
        max_q, max_k = max(r.seqlens_q, default=0), max(r.seqlens_k, default=0)
    for entry in r.poison:
        name, bi, hi, i, di, val = entry
        t = {"q": q, "k": k, "v": v}[name]
        t[bi, hi, i, di] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(val, val)
    if r.masked_garbage and mask is not None and mask.dtype == torch.bool and mask.shape[0] == b:
        # keys hidden from every query of every head carry huge values: must not reach the output
        hidden = ~mask.expand(b, hq, lq, lk).any(dim=2).any(dim=1)  # (b, lk)
        k[hidden.unsqueeze(1).expand(b, hkv, lk)] = r.masked_garbage
        v[hidden.unsqueeze(1).expand(b, hkv, lk)] = r.masked_garbage
    dev = torch.device(r.device)
    descales = {}
    if r.dtype.startswith("float8"):  # quantized as a serving stack does: saturate(x / descale)
        from .fp8 import draw_descales, quantize

        if r.descales is not None:
            descales = {f"{n}_descale": draw_descales(r.descales, t, hkv, r.dtype, gen)
                        for n, t in (("q", q), ("k", k), ("v", v))}
        q, k, v = (quantize(t, descales.get(f"{n}_descale"), r.dtype) for n, t in (("q", q), ("k", k), ("v", v)))
    # laid out on the target device: moving a strided view copies it into contiguous memory
    q, k, v = (_layout(t.to(dt).to(dev), r.layout, i) for i, t in enumerate((q, k, v)))
    if mask is not None:
        # a float mask in the input dtype (fp8: float32, the dtype its scores are formed in); float64 inputs get
        # a float64 mask holding float32 values (SDPA documents "a float mask of the same type as query")
        fp8 = r.dtype.startswith("float8")
        mdt = torch.float32 if dt == torch.float64 or fp8 else dt
        mask = mask.to(dev) if mask.dtype == torch.bool else mask.to(dev, mdt).to(torch.float32 if fp8 else dt)
    spec = Spec(
        scale=r.scale, causal=r.causal, window=r.window, softcap=r.softcap,
        alibi_slopes=None if slopes is None else slopes.to(dev), attn_mask=mask,
        dropout_p=r.dropout_p, seed=r.seed if r.dropout_p else None,
        cu_seqlens_q=None if cu_q is None else cu_q.to(dev), cu_seqlens_k=None if cu_k is None else cu_k.to(dev),
        max_seqlen_q=max_q, max_seqlen_k=max_k, return_lse=r.return_lse, num_splits=r.num_splits,
        **{n: t.to(dev) for n, t in descales.items()},
        sinks=None if r.sinks is None else make_sinks(hq, r.sinks, dev), attention_chunk=r.attention_chunk,
    )
    return Case(q, k, v, spec, seed=int(r.seed), recipe=r, label=label)


def build_probe(r: CaseRecipe, *, label: str = "", values: bool = True) -> Case:
    """The recipe's case built on the CPU, standing for `r.device` (case.device reports it): what the
    process that drives the examples may inspect (shapes, strides, alignment, claims) without starting
    CUDA, which must stay unstarted there for forked judges to use it. Same values and layouts as
    build_case: both draw on the CPU generator. `values=False` (the strategies' claim filter): same
    shapes, dtypes, strides, layouts, mask shapes and spec, but q, k and v are not drawn (build_case)."""
    cpu = dataclasses.replace(r, device="cpu")
    with one_thread():  # see torch_threads: the driving process stays off OpenMP's pool
        case = build_case(cpu, label=label, values=values)
    case.recipe = r
    case.stands_for = r.device
    return case


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def _layout(t: torch.Tensor, layout: str, which: int) -> torch.Tensor:
    """Same values, different memory: what a kernel must handle through strides."""
    if layout == "contiguous":
        return t.contiguous()
    if layout == "transposed":  # BSHD storage viewed as BHSD
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "sliced":  # every other element of a wider last dim
        wide = torch.empty(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype, device=t.device)
        wide[..., ::2] = t
        wide[..., 1::2] = float("nan")
        return wide[..., ::2]
    if layout == "offset":  # non-zero storage offset, NaN around
        # 32 bytes in: 16-byte alignment is kept, because alignment has a mode of its own
        # (no_out_of_bounds, "unaligned"); misaligned here, every property on CUDA would test it
        off = max(1, 32 // t.element_size())
        flat = torch.full((t.numel() + 2 * off,), float("nan"), dtype=t.dtype, device=t.device)
        flat[off:off + t.numel()] = t.reshape(-1)
        return flat[off:off + t.numel()].view(t.shape)
    if layout == "v_colmajor":  # V stored with the sequence innermost (FA3's fp8 V), q and k contiguous
        return t.transpose(-1, -2).contiguous().transpose(-1, -2) if which == 2 else t.contiguous()
    if layout == "expanded_kv":  # stride-0 batch for k and v when every batch shares them
        if which == 0 or t.shape[0] == 1:
            return t.contiguous()
        return t[:1].expand(t.shape).clone()[:1].expand(t.shape)
    raise ValueError(f"CaseRecipe(layout={layout!r}): use contiguous, transposed, sliced, offset, expanded_kv or v_colmajor")
