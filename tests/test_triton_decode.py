"""The bundled Triton kernel's serving path (kernels/decode.py, combine.py, serving.py): split-KV decode over
paged and contiguous KV caches, against the float64 reference; the `triton` adapter's serving claims; and a
user's file adapter wrapping `attnverify.kernels.paged_decode` with only what its docstring says.

On a CPU the kernels run under the Triton interpreter (set here before triton is imported); shapes are small.
"""
from __future__ import annotations

import os
import sys
import textwrap

import importlib.util

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the bundled kernel cannot run", allow_module_level=True)
if not _CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1: the kernel cannot run here", allow_module_level=True)

import attnverify as av  # noqa: E402
from attnverify.case import CaseRecipe, build_case  # noqa: E402
from attnverify.kernels import paged_decode  # noqa: E402
from attnverify.properties import get_property  # noqa: E402
from attnverify.properties.driver import run_property  # noqa: E402
from attnverify.properties.serving import cache_problems  # noqa: E402
from attnverify.reference import reference_forward  # noqa: E402
from attnverify.reference.paged import cache_after  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
DEV = "cuda" if _CUDA else "cpu"
NEW = ("paged_equals_contiguous", "kv_cache_append", "split_invariance", "lse_merge", "batch_invariance",
       "kv_cache_leftpad")


def _recipe(**kw):
    d = dict(batch=3, heads_q=4, heads_kv=2, len_q=1, len_k=90, head_dim=32, cache_lens=[90, 0, 41], paged=True,
             page_size=7, num_pages=60, block_table=[list(range(59, 46, -1)), list(range(13)), list(range(20, 33))],
             garbage="nan", dtype="float16", device=DEV, return_lse=True)
    d.update(kw)
    return CaseRecipe(**d)


CASES = {
    "paged-nan-garbage-empty-seq": _recipe(),
    "paged-page1-huge-splits3": _recipe(page_size=1, num_pages=300, garbage="huge", num_splits=3,
                                        block_table=[list(range(299, 209, -1)), list(range(90)), list(range(100, 190))]),
    "append-lq4-causal-gqa4": _recipe(heads_q=8, len_q=4, len_k=94, new_len=4, causal="bottom_right", num_splits=2,
                                      cache_lens=[90, 0, 41], garbage="mixed", block_table=[
                                          list(range(59, 45, -1)), list(range(14)), list(range(20, 34))]),
    "contiguous-batch-idx-bf16-window-softcap-alibi": CaseRecipe(
        batch=3, heads_q=4, heads_kv=1, len_q=2, len_k=70, head_dim=24, head_dim_v=40, cache_lens=[66, 3, 70],
        page_size=73, num_pages=4, cache_batch_idx=[2, 0, 3], garbage="nan", dtype="bfloat16", device=DEV,
        causal="top_left", window=(16, 0), softcap=5.0, alibi=True, return_lse=True, num_splits=4, scale=0.5),
    "float32-gqa16-splits8": _recipe(heads_q=16, heads_kv=1, dtype="float32", num_splits=8, head_dim=16),
    # float32 at D > 128 takes 16 x 16 tiles (decode_tiles): 24 query rows per kv head span two row tiles
    "float32-d160-gqa8-lq3-splits2": _recipe(heads_q=8, heads_kv=1, len_q=3, len_k=93, new_len=3, dtype="float32",
                                             causal="bottom_right", num_splits=2, head_dim=160, cache_lens=[90, 0, 41],
                                             block_table=[list(range(59, 45, -1)), list(range(14)),
                                                          list(range(20, 34))]),
    "paged-leftpad-append-causal-splits3": _recipe(
        len_q=2, len_k=80, new_len=2, causal="bottom_right", num_splits=3, cache_lens=[88, 9, 41],
        cache_leftpad=[10, 9, 0], garbage="nan"),
    "contiguous-leftpad-window-alibi": CaseRecipe(
        batch=2, heads_q=4, heads_kv=2, len_q=3, len_k=43, head_dim=32, cache_lens=[45, 40], cache_leftpad=[5, 17],
        new_len=3, page_size=50, num_pages=3, cache_batch_idx=[2, 0], garbage="mixed", dtype="float16", device=DEV,
        causal="bottom_right", window=(8, 0), alibi=True, return_lse=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_paged_decode_matches_the_reference_and_appends_in_place(name):
    case = build_case(CASES[name])
    s = case.spec
    ref = reference_forward(case.q, case.k, case.v, s)
    k_exp, v_exp = cache_after(case.k, case.v, s)
    out, lse = paged_decode(case.q, case.k, case.v, s.cache_seqlens, block_table=s.block_table,
                            cache_batch_idx=s.cache_batch_idx, k_new=s.k_new, v_new=s.v_new, num_splits=s.num_splits,
                            scale=s.scale, causal=s.causal, window=s.window, softcap=s.softcap,
                            alibi_slopes=s.alibi_slopes, cache_leftpad=s.cache_leftpad)
    lens = s.cache_seqlens.tolist()
    pads = [0] * len(lens) if s.cache_leftpad is None else s.cache_leftpad.tolist()
    for b in range(case.q.shape[0]):
        if lens[b] - pads[b] + (0 if s.k_new is None else s.k_new.shape[2]) == 0:  # no key: output 0, LSE -inf
            assert (out[b] == 0).all() and torch.isneginf(lse[b]).all()
            continue
        tol = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2.5e-2}[case.dtype]
        err = (out[b].double().cpu() - ref.out[b].cpu()).abs().max().item()
        assert err <= tol, f"{name}: batch {b} output off by {err}"
        assert torch.allclose(lse[b].double().cpu(), ref.lse[b].cpu(), atol=1e-4, rtol=1e-4), name
    if s.k_new is not None:
        assert not cache_problems(case, k_exp, v_exp)  # the append wrote where it belongs, nothing else
    else:
        assert torch.equal(torch.nan_to_num(case.k, nan=7.0), torch.nan_to_num(k_exp, nan=7.0))


def test_decode_tiles_shrink_for_float32_at_large_head_dims():
    """float32 tiles live in registers (CUDA-core dots): what spills is local memory every launch reserves for the
    whole GPU, and on filled GPUs those launches failed ("out of memory": D = 160 on the H200, D = 72-111 on a shared
    H100); half types keep 64 x 64. tests/test_kernel_spills.py compiles them and reads ptxas's spill count."""
    from attnverify.kernels.serving import decode_tiles

    assert decode_tiles(torch.float16, 256, 8) == (16, 64, 2)
    assert decode_tiles(torch.bfloat16, 256, 100) == (64, 64, 2)
    assert decode_tiles(torch.float32, 32, 100) == (64, 64, 2)
    assert decode_tiles(torch.float32, 64, 100) == (16, 64, 2)
    assert decode_tiles(torch.float32, 128, 100) == (16, 16, 1)
    assert decode_tiles(torch.float32, 256, 100) == (16, 16, 1)


def test_paged_decode_launches_the_tiles_decode_tiles_chose(monkeypatch):
    """The launch takes decode_tiles' choice (the table above is what the kernel gets), a block_n given wins."""
    from attnverify.kernels import serving

    seen = []

    class Stop(Exception):
        pass

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((grid, kw["BLOCK_M"], kw["BLOCK_N"], kw["num_stages"]))
                raise Stop
            return launch

    monkeypatch.setattr(serving.decode, "_decode_partial", Spy())
    monkeypatch.setattr(serving, "decode_tiles", lambda dtype, bd, rows: (16, 32, 3))
    monkeypatch.setattr(serving, "interpreting", lambda: False)
    case = build_case(CASES["float32-d160-gqa8-lq3-splits2"])
    s = case.spec
    for kw in ({}, {"block_n": 16}):
        with pytest.raises(Stop):
            paged_decode(case.q, case.k, case.v, s.cache_seqlens, block_table=s.block_table, k_new=s.k_new,
                         v_new=s.v_new, num_splits=s.num_splits, causal=s.causal, **kw)
    assert [x[1:] for x in seen] == [(16, 32, 3), (16, 16, 3)]


def test_paged_decode_is_split_and_batch_invariant_bitwise():
    """Each request splits by its own length: num_splits=None (the kernel's choice) and explicit values give a
    request the same bits alone and in a batch; splits agree with one pass within fp16 rounding."""
    case = build_case(_recipe(num_splits=None))
    s = case.spec
    full = {n: paged_decode(case.q, case.k, case.v, s.cache_seqlens, block_table=s.block_table, num_splits=n)
            for n in (None, 1, 3)}
    for n, (out, lse) in full.items():
        alone = paged_decode(case.q[2:3], case.k, case.v, s.cache_seqlens[2:3], block_table=s.block_table[2:3],
                             num_splits=n)
        assert torch.equal(alone[0], out[2:3]) and torch.equal(alone[1], lse[2:3]), n
    assert (full[3][0].float() - full[1][0].float()).abs().max() < 2e-3


@pytest.mark.parametrize("kw, match", [
    (dict(cache_seqlens=[5, 5]), "cache_seqlens.*1 rows"),
    (dict(cache_seqlens=[200]), "cache_seqlens.*needs 200 slots"),
    (dict(block_table=[[0, 99]]), "block_table.*outside the pool"),
    (dict(num_splits=0), "num_splits"),
    (dict(causal="bottom-right"), "causal"),
    (dict(k_new=torch.zeros(1, 2, 1, 16)), "k_new and v_new together"),
    (dict(block_table=[[0, 1]], cache_batch_idx=[0]), "cache_batch_idx"),
    (dict(cache_leftpad=[10]), "cache_leftpad.*start slot"),
    (dict(cache_leftpad=[[1]]), "cache_leftpad.*1 dim"),
])
def test_paged_decode_rejects_bad_input_by_name(kw, match):
    q, k = torch.zeros(1, 2, 1, 16, device=DEV), torch.zeros(4, 8, 2, 16, device=DEV)
    args = dict(cache_seqlens=[9], block_table=[[2, 3]])
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        paged_decode(q, k, k.clone(), **args)


def test_triton_adapter_serves_num_splits_on_a_plain_call():
    """A plain call with num_splits runs the split kernel over a strided view of k and v (no copy): it matches
    the reference; with gradients it is left to the FlashAttention-2 kernels."""
    from attnverify.adapters.triton_adapter import triton

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 3, 32, generator=g).half().to(DEV) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    spec = av.Spec(num_splits=3, causal="bottom_right", return_lse=True)
    res = triton(q, k, v, spec)
    ref = reference_forward(q, k, v, spec.replace(num_splits=None))
    assert (res.out.double().cpu() - ref.out.cpu()).abs().max() < 3e-3
    assert torch.allclose(res.lse.double().cpu(), ref.lse.cpu(), atol=1e-4)
    qg = q.clone().requires_grad_()
    out = triton(qg, k, v, spec).out
    out.float().sum().backward()  # the decode path has no backward: this went through flash_attention
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


# ------------------------------------------------------------------------------ a stranger's file adapter

USER_ADAPTER = '''
"""My decode kernel: attnverify's bundled paged_decode, with the claims its docstring makes (a subset)."""
import torch
import attnverify as av
from attnverify.kernels import paged_decode


@av.adapter("my-decode", dtypes=("float16",), devices=("{dev}",), head_dims=(16, 64), causal=("none", "bottom_right"),
            gqa=True, lse=True, paged=True, page_sizes=(5, 16), num_splits=(1, 2, 7))
def my_decode(q, k, v, spec):
    if spec.cache_seqlens is None:  # a plain call: one cache row per batch, (B, Lk, Hkv, D) views
        lens = torch.full((q.shape[0],), k.shape[2], dtype=torch.int32, device=q.device)
        k, v, table = k.transpose(1, 2), v.transpose(1, 2), None
    else:
        lens, table = spec.cache_seqlens{minus}, spec.block_table
    out, lse = paged_decode(q, k, v, lens, block_table=table, num_splits=spec.num_splits, scale=spec.scale,
                            causal=spec.causal)
    return av.Output(out, lse=lse if spec.return_lse else None)
'''


def test_plugin_runs_the_serving_properties_for_a_file_adapter_around_paged_decode(pytester):
    """A user's file adapter claiming paged (page sizes 5 and 16), num_splits (1, 2, 7), no kv_cache, no append:
    the four properties it claims pass through the plugin, kv_cache_append skips naming the claim."""
    pytester.makepyfile(my_decode=USER_ADAPTER.format(dev=DEV, minus=""))
    res = pytester.runpytest("--adapter=my_decode.py:my_decode", "-v", "-rs", "-k", " or ".join(NEW),
                             "--attn-profile=ci", "--attn-max-examples=4", "-p", "no:randomly", "-p", "no:xdist")
    out = res.stdout.str()
    assert res.ret == 0, out
    res.stdout.fnmatch_lines(["*test_paged_equals_contiguous?my-decode? PASSED*",
                              "*test_split_invariance?my-decode? PASSED*", "*test_lse_merge?my-decode? PASSED*",
                              "*test_batch_invariance?my-decode? PASSED*", "*my-decode does not claim append*"])


def test_the_same_file_adapter_reading_one_key_short_fails(tmp_path):
    """The wrapper passing cache_seqlens - 1 (the last key never read): paged_equals_contiguous fails."""
    from attnverify.adapters.registry import load_target

    path = tmp_path / "my_decode_short.py"
    path.write_text(textwrap.dedent(USER_ADAPTER.format(dev=DEV, minus=".clamp(min=1) - 1")))
    bad = load_target(f"{path}:my_decode")
    with pytest.raises(AssertionError, match="paged_equals_contiguous"):
        run_property(get_property("paged_equals_contiguous"), bad, profile="ci", seed=0, database=None,
                     max_examples=6, report_dir=str(tmp_path / "reports"))


@pytest.mark.slow
@pytest.mark.parametrize("prop", NEW)
def test_triton_adapter_holds_the_serving_properties_ci(prop, tmp_path):
    from attnverify.adapters.triton_adapter import triton

    run = run_property(get_property(prop), triton, profile="ci", seed=0, database=None, report_dir=str(tmp_path))
    assert run.statuses.get("passed", 0) >= 5


def test_partial_lse_is_natural_log_and_combine_weights_by_it():
    """Two disjoint halves of one cache merged by hand with their returned LSEs give the whole call: the LSE
    is natural-log and includes the scale (what lse_merge checks through the adapter)."""
    case = build_case(_recipe(batch=1, cache_lens=[90], block_table=[list(range(59, 46, -1))], garbage="none",
                              scale=0.3))
    s = case.spec
    whole = paged_decode(case.q, case.k, case.v, s.cache_seqlens, block_table=s.block_table, scale=0.3, num_splits=2)
    first = paged_decode(case.q, case.k, case.v, torch.tensor([35], dtype=torch.int32), block_table=s.block_table,
                         scale=0.3)
    tail_table = s.block_table[:, 5:]  # keys 35 .. 89: pages 5.. of the row (page size 7)
    rest = paged_decode(case.q, case.k, case.v, torch.tensor([55], dtype=torch.int32), block_table=tail_table,
                        scale=0.3)
    lse = torch.logaddexp(first[1], rest[1])
    merged = torch.exp(first[1] - lse)[..., None] * first[0].float() + torch.exp(rest[1] - lse)[..., None] * rest[0].float()
    assert torch.allclose(whole[1], lse, atol=1e-5) and (whole[0].float() - merged).abs().max() < 2e-3


@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_sinks_join_the_denominator_once(splits):
    """Sinks (one logit per query head over a zero value): in the one-pass kernel and in the combine alike; a
    sequence with no key gets output 0 and LSE = its sink. Without the sinks the answer is measurably different."""
    case = build_case(_recipe(dtype="float16", num_splits=splits))
    s = case.spec
    sinks = torch.tensor([1.5, -0.5, 3.0, 0.0], device=DEV)
    ref = reference_forward(case.q, case.k, case.v, s.replace(sinks=sinks))
    out, lse = paged_decode(case.q, case.k, case.v, s.cache_seqlens, block_table=s.block_table, num_splits=splits,
                            sinks=sinks)
    assert (out.double().cpu() - ref.out.cpu()).abs().max() < 3e-3
    assert torch.allclose(lse.double().cpu(), ref.lse.cpu(), atol=1e-4)
    assert torch.equal(out[1].float().cpu(), torch.zeros_like(out[1].float().cpu()))
    assert torch.allclose(lse[1].cpu(), sinks.cpu()[:, None].expand(4, 1))
    plain, _ = paged_decode(case.q, case.k, case.v, s.cache_seqlens, block_table=s.block_table, num_splits=splits)
    assert (plain.double().cpu() - ref.out.cpu()).abs().max() > 1e-2


def test_paged_decode_reads_a_bhsd_pool_through_its_strides():
    """A pool stored (N, Hkv, S, D) is passed as a (N, S, Hkv, D) view: the same answer as the contiguous pool,
    bitwise (the kernel reads through the strides it is given)."""
    case = build_case(_recipe(num_splits=2))
    s = case.spec
    bhsd_k, bhsd_v = case.k.transpose(1, 2).contiguous(), case.v.transpose(1, 2).contiguous()
    a = paged_decode(case.q, case.k, case.v, s.cache_seqlens, block_table=s.block_table, num_splits=2)
    b = paged_decode(case.q, bhsd_k.transpose(1, 2), bhsd_v.transpose(1, 2), s.cache_seqlens,
                     block_table=s.block_table, num_splits=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    wrong = paged_decode(case.q, bhsd_k.view(case.k.shape), bhsd_v.view(case.v.shape), s.cache_seqlens,
                         block_table=s.block_table, num_splits=2)  # the same bytes read as the other layout
    assert not torch.equal(torch.nan_to_num(wrong[0], nan=9.0), a[0])


def test_paged_decode_reads_the_lengths_back_once(monkeypatch):
    """Validation is one device read-back (a sync on a GPU) for all length checks, none without it."""
    from attnverify.kernels import combine, decode

    class Stub:
        def __getitem__(self, grid):
            return lambda *a, **k: None

    monkeypatch.setattr(decode, "_decode_partial", Stub())
    monkeypatch.setattr(combine, "_combine", Stub())
    count = [0]
    for name in ("tolist", "item", "__bool__", "__int__"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _o=orig, **k: (count.__setitem__(0, count[0] + 1), _o(t, *a, **k))[1])
    case = build_case(CASES["paged-leftpad-append-causal-splits3"])
    s = case.spec
    for validate, want in ((True, 1), (False, 0)):
        count[0] = 0
        paged_decode(case.q, case.k.clone(), case.v.clone(), s.cache_seqlens, block_table=s.block_table, k_new=s.k_new,
                     v_new=s.v_new, num_splits=3, cache_leftpad=s.cache_leftpad, validate_lengths=validate)
        assert count[0] == want, (validate, count[0])
