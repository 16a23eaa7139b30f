"""KV-cache calls (paged, contiguous, with append and split-KV): what they mean, and cases of them.

The semantics are flash_attn_with_kvcache's. In a cache call q is (B, Hq, Lq, D) as everywhere, and
k and v are caches of layout (N, S, Hkv, D) / (N, S, Hkv, Dv):

- paged (`spec.block_table` (B, max_blocks) int32, `spec.page_size` = S): the keys of batch b are slots
  0 .. cache_seqlens[b] - 1 of the pages block_table[b, 0], block_table[b, 1], ... (slot t lives in page
  block_table[b, t // S] at offset t % S); pages may be shared between sequences, and table entries past
  the last page a sequence needs are never read;
- contiguous (`block_table` None): the keys of batch b are the first cache_seqlens[b] slots of cache row
  cache_batch_idx[b] (default b);
- left padding (`spec.cache_leftpad` (B,) int32, flash_attn_with_kvcache's cache_leftpad): batch b's cached
  keys are slots cache_leftpad[b] .. cache_seqlens[b] - 1 instead (cache_seqlens[b] - cache_leftpad[b] keys;
  slots below cache_leftpad[b] are padding, never read), paged or contiguous; key positions (causal, window,
  ALiBi) count from the first of them; an append still lands at cache_seqlens[b];
- append (`spec.k_new`, `spec.v_new` (B, Hkv, Lnew, D)): before attending, the adapter writes them in
  place into batch b's slots cache_seqlens[b] .. cache_seqlens[b] + Lnew - 1, then attends to all
  cache_seqlens[b] + Lnew keys; nothing else in the caches changes;
- causal is bottom-right over prefix + new keys (query i sees key j when j <= i + L_b - Lq);
- `spec.num_splits` (any call): split-KV partitions; the result is the same as without splitting.

Every slot no sequence uses may hold anything (NaN, huge values): it must not reach the result.
The float64 reference's reading of these rules is attnverify.reference.paged; the adapters have their own.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

GARBAGE_KINDS = ("nan", "huge", "mixed", "none")
HUGE = 3.0e4  # finite in float16, and a score of ~1e4 * |q| drowns every real key


def _ints(t) -> List[int]:
    return [int(x) for x in torch.as_tensor(t).reshape(-1).tolist()]


def validate_spec(s) -> None:
    """Spec.__post_init__'s checks of the cache fields (each error names the argument and the fix)."""
    def bad(arg, why):
        return ValueError(f"Spec({arg}=...): {why}")

    if s.num_splits is not None and (isinstance(s.num_splits, bool) or not isinstance(s.num_splits, int)
                                     or s.num_splits < 1):
        raise bad("num_splits", f"{s.num_splits!r}: give an int >= 1 (1 = no split), or None for the adapter's choice")
    cache = s.cache_seqlens is not None
    if s.block_table is not None and not cache:
        raise bad("block_table", "a paged cache needs cache_seqlens (B,) too")
    if s.block_table is not None and (s.page_size is None or int(s.page_size) < 1):
        raise bad("page_size", f"{s.page_size!r}: a paged cache needs page_size >= 1 (slots per page, k.shape[1])")
    if s.page_size is not None and s.block_table is None:
        raise bad("page_size", "page_size without block_table: give the block table, or leave page_size out")
    if (s.k_new is None) != (s.v_new is None):
        raise bad("k_new", "give k_new and v_new together")
    if s.k_new is not None and not cache:
        raise bad("k_new", "appending needs a cache: give cache_seqlens (and the caches as k and v)")
    if s.cache_leftpad is not None and not cache:
        raise bad("cache_leftpad", "left padding is for a KV-cache call: give cache_seqlens (B,) too")
    if s.cache_leftpad is not None and getattr(s.cache_leftpad, "dim", lambda: 1)() != 1:
        raise bad("cache_leftpad", f"give one start slot per batch, (B,) int32; got shape {tuple(s.cache_leftpad.shape)}")
    if s.cache_batch_idx is not None and (not cache or s.block_table is not None):
        raise bad("cache_batch_idx", "only for a contiguous cache (cache_seqlens given, block_table None)")
    if cache and (s.is_varlen or s.attn_mask is not None or s.dropout_p > 0):
        raise bad("cache_seqlens", "a KV-cache call does not combine with cu_seqlens, attn_mask or dropout")


def cache_dims(k: torch.Tensor) -> Tuple[int, int, int]:
    """(N, S, Hkv) of a cache tensor (N, S, Hkv, D)."""
    if k.dim() != 4:
        raise ValueError(f"a KV cache must be 4-D (N, S, Hkv, D); got shape {tuple(k.shape)}")
    return int(k.shape[0]), int(k.shape[1]), int(k.shape[2])


def leftpads(spec) -> List[int]:
    """cache_leftpad per batch (0s without it)."""
    lens = _ints(spec.cache_seqlens)
    return [0] * len(lens) if spec.cache_leftpad is None else _ints(spec.cache_leftpad)


def key_lengths(spec) -> List[int]:
    """Keys each batch attends to: cache_seqlens[b] - cache_leftpad[b] (+ Lnew when appending)."""
    new = 0 if spec.k_new is None else int(spec.k_new.shape[2])
    return [c - p + new for c, p in zip(_ints(spec.cache_seqlens), leftpads(spec))]


def unclaimed_serving(claims, case) -> Optional[str]:
    """Why an adapter's serving claims do not cover this case (values the feature names do not say)."""
    s = case.spec
    if s.num_splits is not None and s.num_splits not in claims.num_splits:
        return f"does not claim num_splits={s.num_splits} (claims {claims.num_splits})"
    if s.block_table is not None and not claims.page_size_ok(int(s.page_size)):
        return f"does not claim page size {int(s.page_size)}"
    return None


def describe(case) -> str:
    s = case.spec
    b, hq, lq, d = case.q.shape
    n, sz, hkv = cache_dims(case.k)
    dv = case.v.shape[-1]
    lens = _ints(s.cache_seqlens)
    kind = f"paged N={n} page_size={sz}" if s.block_table is not None else f"cache rows={n} slots={sz}"
    parts = [f"B={b} Hq={hq} Hkv={hkv} Lq={lq} D={d}" + (f" Dv={dv}" if dv != d else ""), case.dtype, kind,
             f"cache_seqlens={lens}"]
    if s.block_table is not None:
        parts.append(f"block_table={torch.as_tensor(s.block_table).tolist()}")
    if s.cache_batch_idx is not None:
        parts.append(f"cache_batch_idx={_ints(s.cache_batch_idx)}")
    if s.cache_leftpad is not None:
        parts.append(f"cache_leftpad={_ints(s.cache_leftpad)}")
    if s.k_new is not None:
        parts.append(f"append Lnew={int(s.k_new.shape[2])}")
    if s.num_splits is not None:
        parts.append(f"num_splits={s.num_splits}")
    for f in ("scale", "softcap"):
        if getattr(s, f) is not None:
            parts.append(f"{f}={getattr(s, f):g}")
    if s.causal != "none":
        parts.append(f"causal={s.causal}")
    if s.window is not None:
        parts.append(f"window={s.window}")
    if s.alibi_slopes is not None:
        parts.append("alibi")
    from .case import describe_sinks_chunk

    parts.extend(describe_sinks_chunk(s))
    if case.recipe is not None and case.recipe.garbage != "none":
        parts.append(f"garbage={case.recipe.garbage} in unused slots")
    return " ".join(parts)


def partial_pages_note(case) -> Optional[str]:
    """For a paged case with garbage: which batches end inside a page (cache_seqlens plus the append not a multiple
    of the page size), so that garbage shares a page -- a block a kernel may load whole -- with their last keys.
    A line for failure messages (a declared finding's `match` can ask for it); None for other cases."""
    s = case.spec
    garbage = getattr(case.recipe, "garbage", "none") if case.recipe is not None else "none"
    if s.block_table is None or s.cache_seqlens is None or garbage == "none":
        return None
    size = int(case.k.shape[1])
    new = 0 if s.k_new is None else int(s.k_new.shape[2])
    ends = [b for b, n in enumerate(_ints(s.cache_seqlens)) if (n + new) % size]
    if not ends:
        return "note: every batch ends on a page boundary: no garbage shares a page with a key"
    return f"note: batch(es) {ends} end inside a page: the slots after their last key, in that page, hold {garbage}"


# ------------------------------------------------------------------------------------------- recipes


def validate_recipe(r) -> None:
    def bad(arg, why):
        return ValueError(f"CaseRecipe({arg}=...): {why}")

    lens = list(r.cache_lens)
    if len(lens) != r.batch or any(c < 0 for c in lens):
        raise bad("cache_lens", f"{lens}: one length >= 0 per batch (batch={r.batch})")
    if r.new_len < 0:
        raise bad("new_len", "must be >= 0")
    pads = _recipe_pads(r)
    if len(pads) != r.batch or any(not 0 <= p <= c for p, c in zip(pads, lens)):
        raise bad("cache_leftpad", f"{pads}: one start slot per batch with 0 <= cache_leftpad[b] <= cache_lens[b] {lens}")
    want = max(c - p + r.new_len for c, p in zip(lens, pads))
    if r.len_k != want:
        raise bad("len_k", f"a cache case has len_k = max(cache_lens - cache_leftpad) + new_len = {want}")
    if r.garbage not in GARBAGE_KINDS:
        raise bad("garbage", f"{r.garbage!r} is not one of {GARBAGE_KINDS}")
    if r.mask != "none" or r.seqlens_q is not None or r.dropout_p or r.key_block is not None or r.poison:
        raise bad("cache_lens", "a cache case takes no mask, varlen, dropout, key_block or poison")
    if r.layout != "contiguous":
        raise bad("layout", "cache cases are built contiguous")
    if r.page_size < 1 or r.num_pages < 1:
        raise bad("page_size", "page_size (slots per page or per cache row) and num_pages must be >= 1")
    if r.paged and (not r.block_table or len(r.block_table) != r.batch
                    or len({len(row) for row in r.block_table}) != 1):
        raise bad("block_table", "one row per batch, all of the same length (B, max_blocks)")
    for b, c in enumerate(lens):
        for t in range(c + r.new_len):
            _slot(r, b, t)  # raises for a slot outside the cache


def _recipe_pads(r) -> List[int]:
    return list(r.cache_leftpad) if r.cache_leftpad is not None else [0] * len(r.cache_lens)


def _slot(r, b: int, t: int) -> Tuple[int, int]:
    """(page or cache row, offset) of batch b's slot t in a recipe."""
    if r.paged:
        row, j = r.block_table[b] if b < len(r.block_table) else [], t // r.page_size
        if j >= len(row) or not 0 <= row[j] < r.num_pages:
            raise ValueError(f"CaseRecipe(block_table=...): batch {b} slot {t} needs table entry {j}, a page in "
                             f"[0, {r.num_pages}); the row is {row}")
        return int(row[j]), t % r.page_size
    idx = r.cache_batch_idx[b] if r.cache_batch_idx is not None else b
    if t >= r.page_size or not 0 <= idx < r.num_pages:
        raise ValueError(f"CaseRecipe(page_size=...): batch {b} slot {t} in cache row {idx} lies outside the "
                         f"cache ({r.num_pages} rows of {r.page_size} slots)")
    return int(idx), t


def build_cache_case(r, label: str = "", *, values: bool = True):
    """The tensors and Spec of a cache recipe (called by case.build_case). `values=False` (the strategies'
    claim probe): zeros for q, k, v and the appended keys, no garbage slots; shapes, layouts and spec the same."""
    from .case import DTYPES, Case
    from .spec import Spec

    gen = torch.Generator().manual_seed(int(r.seed))
    dt, dev = DTYPES[r.dtype], torch.device(r.device)
    dv = r.head_dim_v or r.head_dim
    b, hq, hkv, lq, d = r.batch, r.heads_q, r.heads_kv, r.len_q, r.head_dim
    n, sz = r.num_pages, r.page_size
    shapes = ((b, hq, lq, d), (n, sz, hkv, d), (n, sz, hkv, dv), (b, hkv, r.new_len, d), (b, hkv, r.new_len, dv))
    if values:
        q, k, v, k_new, v_new = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes)
        q, k, k_new = q * r.q_std, k * r.k_std, k_new * r.k_std
        v, v_new = v * r.v_std + r.v_mean, v_new * r.v_std + r.v_mean
    else:
        q, k, v, k_new, v_new = (torch.zeros(*s, dtype=dt) for s in shapes)  # (the .to(dt) below: no copy)
    if r.garbage != "none" and values:
        used = torch.zeros(n, sz, dtype=torch.bool)
        for bi, (c, pad) in enumerate(zip(r.cache_lens, _recipe_pads(r))):
            for t in range(pad, c):  # the left padding below cache_leftpad[b] is garbage too
                used[_slot(r, bi, t)] = True
        fill = {"nan": math.nan, "huge": HUGE}.get(r.garbage)
        if fill is None:  # mixed: NaN, +huge, -huge by slot
            g = torch.tensor([math.nan, HUGE, -HUGE], dtype=torch.float64)[torch.arange(n * sz) % 3].view(n, sz)
        else:
            g = torch.full((n, sz), fill, dtype=torch.float64)
        k = torch.where(used[:, :, None, None], k, g[:, :, None, None])
        v = torch.where(used[:, :, None, None], v, g[:, :, None, None])
    slopes = None
    if r.alibi:
        slopes = (2.0 ** (-8.0 * torch.arange(1, hq + 1, dtype=torch.float64) / hq)).float().to(dev)
    i32 = dict(dtype=torch.int32, device=dev)
    spec = Spec(
        scale=r.scale, causal=r.causal, window=r.window, softcap=r.softcap, alibi_slopes=slopes,
        return_lse=r.return_lse, cache_seqlens=torch.tensor(list(r.cache_lens), **i32),
        block_table=torch.tensor(r.block_table, **i32) if r.paged else None,
        page_size=sz if r.paged else None,
        cache_batch_idx=None if r.cache_batch_idx is None else torch.tensor(list(r.cache_batch_idx), **i32),
        cache_leftpad=None if r.cache_leftpad is None else torch.tensor(list(r.cache_leftpad), **i32),
        k_new=k_new.to(dt).to(dev) if r.new_len else None, v_new=v_new.to(dt).to(dev) if r.new_len else None,
        num_splits=r.num_splits,
    )
    q, k, v = (t.to(dt).to(dev).contiguous() for t in (q, k, v))
    return Case(q, k, v, spec, seed=int(r.seed), recipe=r, label=label)


def snapshot_caches(case):
    """Copies of the caches as they are before a call (an append writes into them in place)."""
    return case.k.detach().clone(), case.v.detach().clone()


def with_caches(case, k, v, spec=None):
    """The case with other caches (fresh copies for one more call) and maybe another spec."""
    from .case import Case

    return Case(case.q, k, v, spec or case.spec, seed=case.seed, recipe=case.recipe, label=case.label)
