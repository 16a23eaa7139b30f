"""flash-attn4's serving calls (attnverify/adapters/flash_attn4_serving.py): KV caches paged and contiguous,
num_splits and learnable sinks, with claims read from FlashAttention-4 4.0.0b36's source.

On the CPU: the translation as functions (block_table / cache_seqlens -> page_table / seqused_k, contiguous
caches and cache_batch_idx, num_splits per GPU generation, the refusals), and the adapter's glue through the
serving and sink properties against a plain-torch stand-in with FA4's signatures and argument checks; each
glue check is shown to fail on a wrong translation. The documented TMA-page NaN finding is classified as
declared on a real failure message, and only there.

On an H200 with flash-attn-4 installed (marked gpu; skipped elsewhere, saying why): the same properties on
the real library at the ci profile (benchmarks/fa4_serving_h200.sh runs them there).
"""
from __future__ import annotations

import dataclasses
import math
import sys
import types
import warnings

import pytest
import torch

from _fa4_mask import fa4_keep, fa4_paged_head_dim_check
from _judged import judged_on_the_real_library
from attnverify.adapters import flash_attn4, flash_attn4_serving as fs
from attnverify.adapters.base import Adapter
from attnverify.adapters.registry import get
from attnverify.case import CaseRecipe, build_case
from attnverify.properties import get_property
from attnverify.properties.driver import run_property
from attnverify.spec import Spec
from attnverify.strategies import page_size_choices

INF = math.inf
SERVING = ("paged_equals_contiguous", "batch_invariance", "lse_merge", "sinks_match_reference", "sink_as_extra_key",
           "sink_limits", "sinks_paged")


# ------------------------------------------------------------------------------------------ the translation


def test_paged_args_are_fa4s_int32_contiguous_tensors_with_the_same_entries():
    table = torch.tensor([[5, 2, 9, 0], [7, 1, 3, 3]], dtype=torch.int64).t().contiguous().t()  # int64, strided
    lens = torch.tensor([17, 30], dtype=torch.int64)
    spec = Spec(cache_seqlens=lens, block_table=table, page_size=8)
    got = fs.paged_args(spec, "cpu")
    assert set(got) == {"page_table", "seqused_k"}
    pt, used = got["page_table"], got["seqused_k"]
    assert pt.dtype == torch.int32 and pt.stride(-1) == 1 and pt.shape == (2, 4)  # FA4's three asserts
    assert used.dtype == torch.int32 and used.is_contiguous() and used.shape == (2,)
    assert pt.tolist() == table.tolist() and used.tolist() == [17, 30]  # entries, not a transposed table


def test_contiguous_caches_pass_the_batch_rows_as_they_are_and_gather_cache_batch_idx():
    k = torch.arange(4 * 6 * 2 * 8, dtype=torch.float32).view(4, 6, 2, 8)
    v = -k
    lens = torch.tensor([3, 6, 1, 2], dtype=torch.int32)
    kc, vc, used = fs.contiguous_caches(k, v, Spec(cache_seqlens=lens), batch=4)
    assert kc.data_ptr() == k.data_ptr() and vc.data_ptr() == v.data_ptr()  # rows are the batch: no copy
    assert used.dtype == torch.int32 and used.tolist() == [3, 6, 1, 2]
    idx = torch.tensor([2, 0], dtype=torch.int32)
    kc, vc, _ = fs.contiguous_caches(k, v, Spec(cache_seqlens=lens[:2], cache_batch_idx=idx), batch=2)
    assert torch.equal(kc, k[[2, 0]]) and torch.equal(vc, v[[2, 0]])
    kc, _, _ = fs.contiguous_caches(k, v, Spec(cache_seqlens=lens[:3]), batch=3)  # more rows than the batch
    assert torch.equal(kc, k[:3])


def test_num_splits_per_generation():
    assert fs.num_splits_arg(Spec()) == 1  # None -> FA4's default 1, never 0 (its heuristic may split)
    assert fs.num_splits_arg(Spec(num_splits=1)) == 1
    with pytest.raises(NotImplementedError, match="SplitKV not supported on SM 9.0"):
        fs.num_splits_arg(Spec(num_splits=2), (9, 0))
    assert fs.num_splits_arg(Spec(num_splits=4), (10, 0)) == 4  # SM100 splits (is_split_kv + combine)
    with pytest.raises(NotImplementedError):
        fs.num_splits_arg(Spec(num_splits=300), (10, 0))  # the combine asserts num_splits <= 256
    with pytest.raises(NotImplementedError):
        fs.num_splits_arg(Spec(num_splits=2), (12, 0))  # "SM120 forward only supports num_splits=1"
    lim = {cap: fs.generation_limits(cap) for cap in ((9, 0), (10, 0), (8, 0))}
    assert [(x["qv"], x["fp8"], x["paged"]) for x in lim.values()] == [(False, False, True), (True, True, True),
                                                                       (False, False, False)]
    with pytest.raises(ValueError, match="capability"):
        fs.generation_limits((7, 5))


def test_sm90_key_tile_is_tile_size_fwd_sm90s():
    # (D, Dv, causal, local) -> n_block_size, transcribed from interface.py _tile_size_fwd_sm90
    table = {(64, 64, False, False): 128, (96, 96, False, False): 144, (96, 96, True, False): 128,
             (80, 80, False, True): 128, (128, 128, False, True): 128, (192, 128, False, False): 128,
             (192, 192, False, False): 112, (160, 128, True, True): 96, (256, 256, False, False): 80,
             (256, 256, True, True): 64}
    assert {key: fs.sm90_tile_n(*key) for key in table} == table


def test_what_fa4_lacks_is_refused_and_not_claimed():
    q = torch.zeros(1, 2, 1, 16)
    k = torch.zeros(3, 8, 2, 16)
    base = Spec(cache_seqlens=torch.tensor([4], dtype=torch.int32))
    new = torch.zeros(1, 2, 1, 16)
    assert "append" in fs.refuse_cache_call(q, k, k, base.replace(k_new=new, v_new=new))
    assert "left padding" in fs.refuse_cache_call(q, k, k, base.replace(cache_leftpad=torch.tensor([1], dtype=torch.int32)))
    assert "forward only" in fs.refuse_cache_call(q.clone().requires_grad_(True), k, k, base)
    assert fs.refuse_cache_call(q, k, k, base) is None
    c = get("flash-attn4").claims
    assert (c.kv_cache, c.paged, c.sinks, c.num_splits) == (True, True, True, (1,))
    assert not (c.append or c.cache_leftpad or c.descales or c.attention_chunk)
    assert page_size_choices(c) == [1, 3, 5, 7, 13, 16, 64, 128, 256]  # every drawn size: no page-size assert on SM90


# ------------------------------------------------------------------- a stand-in with FA4's signatures


def _attend(q, k, v, scale, keep, softcap, sink):
    """One sequence, BSHD (Lq, Hq, D) x (Lk, Hkv, D): out (Lq, Hq, Dv) and natural-log LSE (Hq, Lq); the sink one
    more column of score sink_h and a zero value row (softmax.py apply_learnable_sink). Masked columns get P = 0
    and are still multiplied by their values (0 * NaN = NaN, as a kernel's P @ V)."""
    hq, hkv, lq = q.shape[1], k.shape[1], q.shape[0]
    g = hq // hkv
    qf, kf, vf = q.float(), k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep, -INF)
    sk = torch.full((hq,), -INF) if sink is None else sink.float()
    full = torch.cat([s, sk.view(hq, 1, 1).expand(hq, lq, 1)], dim=-1)
    m = full.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(full - m)
    den = e.sum(-1, keepdim=True)
    ok = den > 0
    p = e[..., :-1] / torch.where(ok, den, torch.ones_like(den))
    out = torch.einsum("hqk,khd->qhd", p, vf)
    lse = torch.where(ok, m + torch.log(torch.where(ok, den, torch.ones_like(den))), torch.full_like(m, -INF))
    return out.to(q.dtype), lse.squeeze(-1)


def _fake_fa4(tma_page=None):
    """flash_attn / flash_attn.cute with FA4 4.0.0b36's public signatures and the argument checks the adapter's
    translation must satisfy (interface.py _flash_attn_fwd). `tma_page`: a page size whose pages are read whole,
    rows past seqused_k included (the TMA path FA4 documents), to produce the documented NaN."""
    pkg = types.ModuleType("flash_attn")
    pkg.__path__ = []
    cute = types.ModuleType("flash_attn.cute")
    calls = []

    def common(q, learnable_sink, num_splits, softmax_scale):
        assert num_splits == 1, "SplitKV not supported on SM 9.0"
        if learnable_sink is not None:
            assert learnable_sink.shape == (q.shape[-2],)
            assert learnable_sink.dtype in (torch.float16, torch.bfloat16, torch.float32)
        return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])

    def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                        window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                        deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                        aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False,
                        gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
        assert qv is None and q.dim() == 4 and q.shape[0] == k.shape[0]
        scale = common(q, learnable_sink, num_splits, softmax_scale)
        calls.append(dict(kind="dense", sink=learnable_sink is not None))
        lq, lk = q.shape[1], k.shape[1]
        outs, lses = zip(*[_attend(q[b], k[b], v[b], scale, fa4_keep(lq, lk, causal, *window_size), softcap,
                                   learnable_sink) for b in range(q.shape[0])])
        return torch.stack(outs), torch.stack(lses) if return_lse else None

    def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                               gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                               window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1,
                               pack_gqa=None, deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
                               block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
                               scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
                               gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
        assert qv is None
        scale = common(q, learnable_sink, num_splits, softmax_scale)
        for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
            assert t is None or (t.dtype == torch.int32 and t.stride(0) == 1), "must be int32 / contiguous"
        if cu_seqlens_q is not None:  # packed documents (the adapter's varlen path)
            assert q.dim() == 3 and page_table is None
            cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
            calls.append(dict(kind="varlen", sink=learnable_sink is not None))
            out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
            lse = torch.full((q.shape[1], q.shape[0]), -INF)
            for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
                o, l_ = _attend(q[q0:q1], k[k0:k1], v[k0:k1], scale, fa4_keep(q1 - q0, k1 - k0, causal, *window_size),
                                softcap, learnable_sink)
                out[q0:q1], lse[:, q0:q1] = o, l_
            return out, lse if return_lse else None
        b, lq = q.shape[0], q.shape[1]
        assert q.dim() == 4 and seqused_k is not None and seqused_k.shape == (b,)
        if page_table is not None:
            assert cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"
            assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1 and page_table.shape[0] == b
            assert k.dim() == 4 and k.shape[:3] == v.shape[:3] and k.shape[2] == v.shape[2]  # (pages, size, Hkv, D)
            size = k.shape[1]
            fa4_paged_head_dim_check(q.shape[-1], v.shape[-1], size, causal, *window_size)  # flash_fwd_sm90.py:66
            calls.append(dict(kind="paged", sink=learnable_sink is not None, page_size=size))
        else:
            assert k.shape[0] == b, "k: (batch, seqlen_k, nheads_k, hdim)"
            calls.append(dict(kind="batched", sink=learnable_sink is not None))
        outs, lses = [], []
        for i in range(b):
            n = int(seqused_k[i])
            if page_table is not None:
                rows = -(-n // size) * size if size == tma_page else n  # TMA: whole pages
                t = torch.arange(rows)
                pages = page_table[i].long()[t // size]
                kb, vb = k[pages, t % size], v[pages, t % size]
            else:
                rows, kb, vb = n, k[i, :n], v[i, :n]
            keep = torch.zeros(lq, rows, dtype=torch.bool)
            keep[:, :n] = fa4_keep(lq, n, causal, *window_size)
            o, l_ = _attend(q[i], kb, vb, scale, keep, softcap, learnable_sink)
            outs.append(o)
            lses.append(l_)
        return torch.stack(outs), torch.stack(lses) if return_lse else None

    cute.flash_attn_func, cute.flash_attn_varlen_func, cute.calls = flash_attn_func, flash_attn_varlen_func, calls
    pkg.cute = cute
    return pkg, cute


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """Installs the stand-in (tma_page None); returns a function that reinstalls it with other options."""
    def install(**kw):
        pkg, cute = _fake_fa4(**kw)
        monkeypatch.setitem(sys.modules, "flash_attn", pkg)
        monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
        return cute

    for var in ("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
        monkeypatch.setenv(var, "x")  # monkeypatch then removes what the adapter sets
        monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(tmp_path))
    install()
    return install


def _cpu(a) -> Adapter:
    """flash-attn4's function, refusals and claims, on the CPU with float32 added (for the stand-in)."""
    return Adapter(name="flash-attn4-glue", fn=a.fn, refuses=a.refuses,
                   claims=dataclasses.replace(a.claims, devices=("cpu",), dtypes=a.claims.dtypes + ("float32",)))


def _run(prop, adapter, tmp_path, n=3):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_property(get_property(prop), adapter, profile="ci", seed=0, database=None, max_examples=n,
                            report_dir=str(tmp_path / prop))


@pytest.mark.parametrize("prop", SERVING)
def test_glue_holds_the_serving_and_sink_properties(prop, fake, tmp_path):
    """Through the stand-in (FA4's checks on every argument), each serving and sink property passes, judging at
    least one example; paged calls reach flash_attn_varlen_func's page_table, sinks its learnable_sink."""
    cute = sys.modules["flash_attn.cute"]
    run = _run(prop, _cpu(flash_attn4.flash_attn4), tmp_path)
    assert run.statuses.get("passed", 0) >= 1, run.statuses
    kinds = {c["kind"] for c in cute.calls}
    if prop in ("paged_equals_contiguous", "sinks_paged"):
        assert "paged" in kinds
    if prop.startswith("sink"):
        assert any(c["sink"] for c in cute.calls)


def _recipe(**kw):
    d = dict(batch=3, heads_q=4, heads_kv=2, len_q=2, len_k=150, head_dim=32, cache_lens=[150, 17, 41], paged=True,
             page_size=7, num_pages=90, block_table=[list(range(89, 67, -1)), list(range(22)), list(range(30, 52))],
             garbage="nan", dtype="float32", device="cpu", return_lse=True, causal="bottom_right")
    d.update(kw)
    return CaseRecipe(**d)


def _judge(prop, adapter, case, params=None):
    p = get_property(prop)
    return p.judge(adapter, case, params if params is not None else p.default_params())


def test_a_wrong_translation_fails_the_glue(fake, monkeypatch):
    """Each translation step matters: seqused_k one short, the cache_batch_idx ignored, the sinks dropped, and
    (FA4 splitting nothing on SM90) the check of num_splits."""
    a = _cpu(flash_attn4.flash_attn4)
    paged = build_case(_recipe())
    assert _judge("paged_equals_contiguous", a, paged).passed
    right = fs.paged_args
    monkeypatch.setattr(fs, "paged_args", lambda spec, dev: {**right(spec, dev),
                                                             "seqused_k": right(spec, dev)["seqused_k"] - 1})
    assert not _judge("paged_equals_contiguous", a, paged).passed
    monkeypatch.setattr(fs, "paged_args", right)

    contiguous = build_case(CaseRecipe(batch=3, heads_q=2, heads_kv=1, len_q=1, len_k=40, head_dim=16,
                                       cache_lens=[40, 9, 23], page_size=43, num_pages=4, cache_batch_idx=[3, 0, 2],
                                       garbage="huge", dtype="float32", device="cpu", return_lse=True))
    assert _judge("batch_invariance", a, contiguous).passed
    monkeypatch.setattr(fs, "contiguous_caches", lambda k, v, spec, batch: (k[:batch], v[:batch], torch.as_tensor(
        spec.cache_seqlens).to(torch.int32)))
    assert not _judge("batch_invariance", a, contiguous).passed
    monkeypatch.undo()
    fake()

    plain = build_case(CaseRecipe(batch=2, heads_q=4, heads_kv=2, len_q=9, len_k=20, head_dim=32, dtype="float32",
                                  device="cpu", causal="bottom_right", return_lse=True, seed=3))
    assert _judge("sinks_match_reference", a, plain).passed
    assert _judge("sinks_paged", a, paged).passed
    monkeypatch.setattr(flash_attn4, "sink_arg", lambda spec, dev: None)
    assert not _judge("sinks_match_reference", a, plain).passed
    assert not _judge("sinks_paged", a, paged).passed


def test_the_lse_carries_fa4s_gradient_so_the_sinks_get_their_dlse_term(fake):
    """FA4's returned LSE takes a gradient; the adapter must not detach it, or dsink loses sum_i P_sink,i dLSE_i.
    The sink's gradient through the adapter equals autograd through the stand-in's own formula."""
    case = build_case(CaseRecipe(batch=1, heads_q=2, heads_kv=1, len_q=5, len_k=7, head_dim=16, dtype="float32",
                                 device="cpu", causal="bottom_right", return_lse=True, seed=1))
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)
    res = flash_attn4.flash_attn4(case.q, case.k, case.v, case.spec.replace(sinks=sinks))
    assert res.lse.requires_grad
    (g_lse,) = torch.autograd.grad(res.lse.sum(), sinks)
    assert g_lse.abs().min() > 1e-3  # exp(sink - LSE) summed over rows: never 0 with a finite sink


def test_the_documented_tma_page_nan_is_the_declared_finding_and_only_it(fake):
    """FA4 documents that a page of one key tile (TMA) is read whole, so NaN past seqused_k in a sequence's last
    page reaches the output. The stand-in does that at page size 128: the failure is classified as flash-attn4's
    declared finding; the same leak at page size 7 (no TMA on SM90) is a new failure."""
    fa4 = get("flash-attn4")
    a = _cpu(flash_attn4.flash_attn4)
    for size, expect in ((128, "known"), (7, "failed")):
        fake(tma_page=size)
        n = 4 * -(-200 // size)
        case = build_case(_recipe(page_size=size, num_pages=n, block_table=_table(size, n)))
        res = _judge("paged_equals_contiguous", a, case)
        assert not res.passed and "garbage reached the output" in res.message
        assert fa4.classify("paged_equals_contiguous", res.message)[0] == expect, res.message[:2000]
    fake(tma_page=128)
    finite = build_case(_recipe(page_size=128, num_pages=8, garbage="huge", block_table=_table(128, 8)))
    assert _judge("paged_equals_contiguous", a, finite).passed  # finite garbage: 0 x 3e4 = 0, nothing leaks


def _table(size, n):
    """Disjoint scrambled rows for cache_lens [150, 17, 41] with `size`-slot pages over a pool of n pages."""
    need = [-(-x // size) for x in (150, 17, 41)]
    width = max(need)
    pages = list(range(n - 1, -1, -1))
    rows, at = [], 0
    for m in need:
        row = pages[at:at + m]
        at += m
        rows.append(row + [pages[-1]] * (width - m))
    return rows


def test_paged_calls_at_an_irregular_head_dim_are_refused_not_raised(fake, monkeypatch):
    """FA4's SM90 forward asserts 'Paged KV does not support irregular head dim' (flash_fwd_sm90.py line 66: a D or
    Dv not a multiple of 16 with pages not loaded by TMA, page_size != the key tile), as the stand-in does. The
    adapter refuses those cases (never drawn) and those calls (NotImplementedError), and only those: D=40 with a
    page of one key tile (128: TMA), D=48, and plain calls at D=40 go through."""
    fa4 = get("flash-attn4")
    a = _cpu(flash_attn4.flash_attn4)
    for d, dv, size, causal, refused in ((40, 40, 1, "none", True), (40, 40, 7, "bottom_right", True),
                                         (40, 40, 128, "none", False), (48, 48, 7, "none", False),
                                         (64, 40, 7, "none", True), (88, 88, 128, "none", True),
                                         (88, 88, 128, "bottom_right", False), (24, 24, 128, "bottom_right", False)):
        n = 4 * -(-200 // size)
        case = build_case(_recipe(head_dim=d, head_dim_v=dv, page_size=size, num_pages=n, block_table=_table(size, n),
                                  garbage="huge", causal=causal, dtype="float16"))
        why = fa4.refuses(case)
        assert (why is not None and "irregular head dim" in why) == refused, (d, dv, size, causal, why)
        case = build_case(_recipe(head_dim=d, head_dim_v=dv, page_size=size, num_pages=n, block_table=_table(size, n),
                                  garbage="huge", causal=causal))  # float32 for the CPU stand-in
        if refused:
            with pytest.raises(NotImplementedError, match="irregular head dim"):
                a(case.q, case.k, case.v, case.spec)
            # the stand-in holds FA4's assert: without the adapter's refusal the call raises as the H200 run did
            monkeypatch.setattr(fs, "irregular_head_dim", lambda *args: None)
            with pytest.raises(AssertionError, match="Paged KV does not support irregular head dim"):
                a(case.q, case.k, case.v, case.spec)
            monkeypatch.undo()
            fake()
        else:
            assert _judge("paged_equals_contiguous", a, case).passed, (d, dv, size, causal)
    plain = build_case(CaseRecipe(batch=1, heads_q=2, heads_kv=2, len_q=3, len_k=9, head_dim=40, dtype="float16"))
    assert fa4.refuses(plain) is None


def test_paged_properties_run_at_irregular_head_dims_without_raising(fake, tmp_path):
    """The run of 2026-12-05 shrank three properties to the assert at D=40; with the refusal, the same properties
    through the stand-in (which raises as FA4 does) pass, never drawing a refused case."""
    a = _cpu(flash_attn4.flash_attn4)
    a = Adapter(name=a.name, fn=a.fn, refuses=a.refuses,
                claims=dataclasses.replace(a.claims, head_dims=lambda d: d in (40, 24)))
    for prop in ("paged_equals_contiguous", "batch_invariance"):
        run = _run(prop, a, tmp_path, n=4)
        assert run.statuses.get("passed", 0) >= 1, run.statuses


# ------------------------------------------------------------------------------------------ on an H200

@pytest.mark.gpu
@pytest.mark.parametrize("prop", SERVING)
def test_flash_attn4_serving_properties_on_the_gpu(prop, tmp_path):
    """The real library (SM90) at the ci profile: each property passes, or fails only with a declared finding."""
    judged_on_the_real_library(get("flash-attn4"), prop, tmp_path / prop)


def test_f18_is_declared_on_the_sink_property_too_and_only_f18():
    """The sink property judges dQ/dK/dV, so the backward's F18 (measured on the H200, D in 8, 16, 40, ...) may show
    there: declared with F18's match, not strict (only an affected head dim shows it); an unaffected head dim, a
    wrong output or a wrong dsinks stays a new failure."""
    a = get("flash-attn4")
    assert "sinks_match_reference" in a.known_not_strict and "F18" in a.known_failures["sinks_match_reference"]
    msg = ("sinks_match_reference failed for flash-attn4 (profile ci)\nshrunk case: B=1 Hq=2 Hkv=1 Lq=65 Lk=65 D=16 "
           "float16\n[flash-attn4] sinks_match_reference FAILED\ndq: MISMATCH\n  rel L2 0.9")
    assert a.classify("sinks_match_reference", msg)[0] == "known"
    for other in (msg.replace("D=16 ", "D=64 "), msg.replace("dq: MISMATCH", "out: MISMATCH\ndq: MISMATCH"),
                  msg.replace("dq: MISMATCH", "dsinks: MISMATCH")):
        assert a.classify("sinks_match_reference", other)[0] == "failed", other
    assert a.classify("sinks_match_reference", None)[0] == "passed"  # not strict: a pass is a pass


def test_the_gqa_backward_refusal_reads_the_heads_of_a_cache_right():
    """Dv != D with GQA is refused for the SM90 backward's assert; a cache call (k (N, S, Hkv, D), forward only)
    is not refused for it, and its heads are not read from the slot dimension."""
    a = get("flash-attn4")
    plain = build_case(CaseRecipe(batch=1, heads_q=4, heads_kv=2, len_q=3, len_k=8, head_dim=64, head_dim_v=32,
                                  dtype="float16"))
    assert "GQA backward" in a.refuses(plain)
    for hkv, slots in ((2, 4), (2, 9), (4, 4)):
        case = build_case(_recipe(heads_kv=hkv, head_dim=64, head_dim_v=32, dtype="float16", page_size=slots,
                                  num_pages=150, block_table=_table(slots, 150)))
        assert a.refuses(case) is None, (hkv, slots)
    wide = build_case(_recipe(head_dim=32, head_dim_v=64, dtype="float16"))
    assert "Dv > D" in a.refuses(wide)
