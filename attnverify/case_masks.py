"""The mask of a CaseRecipe: drawn from the recipe's generator, so `build_case` rebuilds the same one anywhere."""
from __future__ import annotations

import math

import torch


def recipe_mask(r, gen: torch.Generator):
    """The attention mask a CaseRecipe asks for (its kind, shape, density, hidden key block and fully-masked
    rows), drawn from `gen`; None for no mask. Float masks are float64 here (the case casts them)."""
    b, h, lq, lk = r.batch, r.heads_q, r.len_q, r.len_k
    shape = tuple(r.mask_shape) if r.mask_shape is not None else (b, h, lq, lk)
    full = (b, h, lq, lk)
    for s, f in zip(shape, full):
        if s not in (1, f):
            raise ValueError(f"CaseRecipe(mask_shape={shape}): each dim must be 1 or {full}")
    if r.mask == "none" and r.key_block is None:
        return None
    if r.mask == "none":  # only a hidden key block: a bool mask broadcast over everything but keys
        kshape = tuple(shape[:3]) + (lk,) if r.mask_shape is not None else (1, 1, 1, lk)
        m = torch.ones(kshape, dtype=torch.bool)
        a, z = r.key_block
        m[..., max(0, a):min(lk, z)] = False
        return m
    if r.mask in ("bool_random", "bool_rows_off"):
        m = torch.rand(shape, generator=gen) < r.mask_density
    elif r.mask == "bool_padding":  # key padding: each batch keeps a prefix of keys
        keep = torch.randint(max(1, lk // 2), lk + 1, (shape[0],), generator=gen) if lk else torch.zeros(shape[0], dtype=torch.long)
        m = (torch.arange(lk)[None, :] < keep[:, None]).view(shape[0], 1, 1, lk).expand(shape[0], shape[1], shape[2], lk)
        m = m.contiguous()
    elif r.mask == "float_random":
        m = torch.randn(shape, generator=gen, dtype=torch.float64) * 2.0
    else:  # float_neg_inf: additive mask with -inf holes
        m = torch.where(torch.rand(shape, generator=gen) < r.mask_density, torch.zeros(shape, dtype=torch.float64),
                        torch.full(shape, -math.inf, dtype=torch.float64))
    if r.key_block is not None and m.shape[3] == lk:
        a, z = r.key_block
        m = m.clone()
        m[..., max(0, a):min(lk, z)] = False if m.dtype == torch.bool else -math.inf
    if r.masked_rows:
        if m.dtype == torch.bool:
            m = m.expand(full).clone() if m.shape[2] == 1 and lq > 1 else m.clone()
            for i in r.masked_rows:
                if i < m.shape[2]:
                    m[:, :, i, :] = False
        else:
            m = m.expand(full).clone() if m.shape[2] == 1 and lq > 1 else m.clone()
            for i in r.masked_rows:
                if i < m.shape[2]:
                    m[:, :, i, :] = -math.inf
    return m
