"""cache_leftpad (flash_attn_with_kvcache's left padding): batch b's cached keys are slots cache_leftpad[b] ..
cache_seqlens[b] - 1, an append lands at cache_seqlens[b]. Spec, claims, recipes, the reference's reading, and
the property kv_cache_leftpad through a user's conftest adapter (right, and wrong in the way kernels were)."""
from __future__ import annotations

import pytest
import torch

import attnverify as av
from attnverify.case import CaseRecipe, build_case
from attnverify.paged import key_lengths
from attnverify.reference import reference_forward
from attnverify.reference.paged import cache_after

I32 = dict(dtype=torch.int32)


@pytest.mark.parametrize("kw, match", [
    (dict(cache_leftpad=torch.zeros(1, **I32)), "cache_leftpad.*cache_seqlens"),
    (dict(cache_seqlens=torch.ones(1, **I32), cache_leftpad=torch.zeros(1, 1, **I32)), "cache_leftpad.*one start slot"),
])
def test_spec_rejects_bad_leftpad_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        av.Spec(**kw)


def test_claims_and_recipes_reject_bad_leftpad_by_name():
    with pytest.raises(ValueError, match="cache_leftpad.*kv_cache=True"):
        av.adapter("x", register=False, cache_leftpad=True)(lambda q, k, v, s: q)
    with pytest.raises(ValueError, match="cache_leftpad.*True or False"):
        av.adapter("x", register=False, kv_cache=True, cache_leftpad="yes")(lambda q, k, v, s: q)
    base = dict(batch=2, heads_q=2, heads_kv=1, len_q=1, len_k=6, head_dim=16, cache_lens=[8, 3], page_size=9,
                num_pages=2)
    with pytest.raises(ValueError, match="cache_leftpad.*<= cache_lens"):
        build_case(CaseRecipe(**base, cache_leftpad=[2, 4]))
    with pytest.raises(ValueError, match="len_k = max"):
        build_case(CaseRecipe(**dict(base, len_k=8), cache_leftpad=[2, 0]))
    with pytest.raises(ValueError, match="cache_leftpad.*cache_lens too"):
        build_case(CaseRecipe(batch=1, heads_q=1, heads_kv=1, len_q=1, len_k=4, head_dim=16, cache_leftpad=[1]))


def _case(paged: bool, new: int = 0):
    kw = dict(batch=2, heads_q=4, heads_kv=2, len_q=2, head_dim=16, cache_lens=[11, 6], cache_leftpad=[4, 6],
              new_len=new, garbage="nan", causal="bottom_right", return_lse=True, len_k=7 + new)
    if paged:
        kw.update(paged=True, page_size=3, num_pages=14, block_table=[[9, 2, 13, 5, 7], [0, 11, 3, 8, 1]])
    else:
        kw.update(page_size=11 + new + 1, num_pages=3, cache_batch_idx=[2, 0])
    return build_case(CaseRecipe(**kw))


@pytest.mark.parametrize("paged", [False, True])
def test_reference_reads_from_the_leftpad_and_appends_at_cache_seqlens(paged):
    case = _case(paged, new=2)
    s = case.spec
    assert key_lengths(s) == [9, 2]
    ref = reference_forward(case.q, case.k, case.v, s)
    assert torch.isfinite(ref.out).all()  # the NaN padding below cache_leftpad is never read
    # batch 0 by hand: slots 4..10, then k_new; slot t of a paged cache is page table[t // 3], offset t % 3
    where = [(s.block_table[0, t // 3].item(), t % 3) if paged else (2, t) for t in range(4, 11)]
    kb = torch.stack([case.k[p, o] for p, o in where]).permute(1, 0, 2)[None].double()
    vb = torch.stack([case.v[p, o] for p, o in where]).permute(1, 0, 2)[None].double()
    kb = torch.cat([kb, s.k_new[:1].double()], 2).repeat_interleave(2, 1)
    vb = torch.cat([vb, s.v_new[:1].double()], 2).repeat_interleave(2, 1)
    mask = torch.ones(2, 9, dtype=torch.bool).tril(7)  # bottom-right: query i sees keys j <= i + 9 - 2
    want = torch.nn.functional.scaled_dot_product_attention(case.q[:1].double(), kb, vb, attn_mask=mask)
    assert torch.allclose(ref.out[:1], want, atol=1e-12)
    k2, _ = cache_after(case.k, case.v, s)  # the append lands at cache_seqlens[b], whatever the padding
    p, o = (s.block_table[0, 11 // 3].item(), 11 % 3) if paged else (2, 11)
    assert torch.equal(k2[p, o], s.k_new[0, :, 0])


CONFTEST = '''
import torch, attnverify as av

def attend(q, k, v, scale):  # bottom-right causal over the keys given
    L, M = q.shape[2], k.shape[2]
    mask = torch.ones(L, M, dtype=torch.bool).tril(M - L)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

def decode(q, k, v, spec, honour_leftpad):
    outs = []
    pads = spec.cache_leftpad.tolist() if spec.cache_leftpad is not None else [0] * q.shape[0]
    for b, n in enumerate(spec.cache_seqlens.tolist()):
        row = int(spec.cache_batch_idx[b]) if spec.cache_batch_idx is not None else b
        if spec.k_new is not None:
            m = spec.k_new.shape[2]
            k[row, n:n + m] = spec.k_new[b].transpose(0, 1)
            v[row, n:n + m] = spec.v_new[b].transpose(0, 1)
            n += m
        start = pads[b] if honour_leftpad else 0
        stop = n if honour_leftpad else n - pads[b]
        kb, vb = k[row, start:stop].transpose(0, 1)[None], v[row, start:stop].transpose(0, 1)[None]
        outs.append(attend(q[b:b + 1], kb, vb, spec.scale))
    return torch.cat(outs)

CLAIMS = dict(dtypes=("float32",), head_dims=(16, 32, 64), causal=("bottom_right",), gqa=True, kv_cache=True,
              append=True, cache_leftpad=True, fully_masked="zeros")

@av.adapter("mine-leftpad", **CLAIMS)
def mine(q, k, v, spec):
    return decode(q, k, v, spec, True)

@av.adapter("mine-no-leftpad", **CLAIMS)
def wrong(q, k, v, spec):  # reads cache_seqlens - cache_leftpad keys from slot 0
    return decode(q, k, v, spec, False)
'''


def test_plugin_runs_kv_cache_leftpad_for_a_users_contiguous_cache(pytester):
    pytester.makeconftest(CONFTEST)
    args = ("-v", "-k", "kv_cache_leftpad or kv_cache_append", "--attn-profile=ci", "--attn-max-examples=6",
            "-p", "no:randomly")
    res = pytester.runpytest("--adapter=mine-leftpad", *args)
    assert res.ret == 0, res.stdout.str()
    res.stdout.fnmatch_lines(["*test_kv_cache_append?mine-leftpad? PASSED*", "*test_kv_cache_leftpad?mine-leftpad? PASSED*"])
    bad = pytester.runpytest("--adapter=mine-no-leftpad", *args)
    out = bad.stdout.str()
    assert bad.ret == 1 and "kv_cache_leftpad FAILED" in out and "cache_leftpad=" in out, out
