"""Two issue-23 capabilities audited as a stranger (docs/adapters.md, docs/guide.md and the README alone): a FlashMLA-like
absorbed-MLA decode kernel and a 192/128 prefill kernel (tests/stranger/flashmla_like.py), and a Llama 4 chunked-local
kernel with flash-attn's varlen API (tests/stranger/chunked_local.py). Their ci profiles pass; the mistakes a kernel
author makes fail them within seconds, and the diagnosis names them. Each finding of the audit fixed in attnverify has
its regression test here (it fails on the code before the fix)."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import attnverify as av
from attnverify.case import Case
from attnverify.diagnose import diagnose_result
from attnverify.properties import get_property, run_property
from attnverify.properties.driver import PropertySkipped

HERE = os.path.dirname(os.path.abspath(__file__))
STRANGER = os.path.join(HERE, "stranger")
sys.path.insert(0, STRANGER)

import chunked_local as C  # noqa: E402
import flashmla_like as F  # noqa: E402

ROOT = os.path.dirname(HERE)
FIRST = re.compile(r"first failing example: #(\d+) after ([0-9.]+) s")


def _run(prop, adapter, **kw):
    """run_property at the ci profile; a skip is a failure here (these adapters claim what the property needs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return run_property(get_property(prop), adapter, profile="ci", seed=1, database=None,
                                report_dir="reports/test", **kw)
        except PropertySkipped as e:
            pytest.fail(f"{prop} skipped {adapter.name}: {e}")


def _caught(prop, adapter):
    """(example number, seconds) of the first failure of `prop` at the ci profile, and the failure's message."""
    with pytest.raises(AssertionError) as e:
        _run(prop, adapter)
    m = FIRST.search(str(e.value))
    assert m, str(e.value)[-2000:]
    return int(m.group(1)), float(m.group(2)), str(e.value)


# ------------------------------------------------------------------------------------------ chunked local attention


@pytest.mark.parametrize("prop", ["chunked_matches_reference", "forward_matches_reference", "lse_matches_reference",
                                  "fully_masked_rows", "nonfinite_inputs_propagate"])
def test_chunked_local_holds(prop):
    run = _run(prop, C.chunked_local, max_examples=12)
    assert run.statuses.get("passed", 0) >= 5, run.statuses


CHUNK_NAMES = {  # bug -> the diagnosis' summary starts with
    "boundary_off_by_one": "chunk boundaries one key early",
    "origin_top_left": "chunks counted from the query index i",
    "origin_packed": "chunks counted from the position in the packed batch",
    "last_partial_ignored": "no chunk limit in the last, partial chunk",
}


@pytest.mark.parametrize("bug", C.BUGS)
def test_chunk_bugs_are_caught_at_once(bug):
    n, secs, msg = _caught("chunked_matches_reference", getattr(C, f"chunked_local_{bug}"))
    assert secs < 60 and n <= 5, (n, secs)
    assert "out: MISMATCH" in msg


@pytest.mark.parametrize("bug", C.BUGS)
def test_the_diagnosis_names_each_chunk_bug(bug):
    """Before: the diagnosis engine did not model attention_chunk, so every chunk bug read 'no simple explanation'
    ('the diagnosis engine does not reproduce the reference on this case (attention_chunk ...)')."""
    a = getattr(C, f"chunked_local_{bug}")
    for kw in (dict(batch=2, len_q=17, len_k=33, attention_chunk=4),
               dict(batch=1, len_q=40, len_k=50, seqlens_q=[10, 0, 30], seqlens_k=[21, 5, 24], attention_chunk=6,
                    causal="bottom_right")):
        case = av.build_case(av.CaseRecipe(dtype="float16", head_dim=16, seed=1, **kw))
        res = av.check(a, case)
        assert res.status == "failed", (bug, kw)
        d = diagnose_result(res, adapter=a)
        assert d.summary.startswith(CHUNK_NAMES[bug]), (bug, d.text())
    assert av.check(C.chunked_local, case).status == "passed"


# --------------------------------------------------------------------------------------------------------- MLA


def test_flashmla_like_runs_through_the_cli_and_says_why_the_rest_skips(tmp_path):
    """Before: every property skipped (NOTHING WAS TESTED, exit 2) after 274 s here: mla_latent_views needed
    `backward`, and the other properties spent their refusal budgets on cases with V apart from K (576 never drawn)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               ATTNVERIFY_NO_HTML="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    res = subprocess.run([sys.executable, "-m", "attnverify.cli", "run", "--adapter",
                          f"{os.path.join(STRANGER, 'flashmla_like.py')}:flashmla_like", "--profile", "ci", "--seed", "1",
                          "-n", "0", "--", "-rs"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert re.search(r"^mla_latent_views +ok ", out, re.M), out[-3000:]
    assert "PytestAssertRewriteWarning: Module already imported" not in out  # before: on every `attnverify run` (attnverify imported first)
    assert ("flashmla-like claims latent_kv (V read as the first Dv columns of K): forward_matches_reference draws K "
            "and V apart; mla_latent_views tests such a kernel") in out, out[-3000:]


@pytest.mark.parametrize("adapter", [F.flashmla_like, F.mla_prefill_like], ids=lambda a: a.name)
def test_mla_kernels_hold(adapter):
    run = _run("mla_latent_views", adapter, max_examples=8)
    assert run.statuses.get("passed", 0) >= 5, run.statuses


MLA_CAUGHT = {  # adapter attribute -> the output that fails
    "flashmla_like_v_wrong_slice": "out: MISMATCH",
    "flashmla_like_rope_dropped": "out: MISMATCH",
    "flashmla_like_lse_base2": "lse: MISMATCH",
    "flashmla_like_page_index_off_by_one": "out: MISMATCH",
    "flashmla_like_sink_ignored": "out: MISMATCH",  # mla_latent_views draws sinks where claimed (none did before)
    "mla_prefill_like_latent_grad_overwritten": "d_latent: MISMATCH",
}


@pytest.mark.parametrize("name", sorted(MLA_CAUGHT))
def test_mla_bugs_are_caught_within_seconds(name):
    """Before: the forward bugs of a forward-only kernel were never judged (mla_latent_views skipped it, 'does not
    claim backward'), and with backward the views-vs-copies comparison alone is blind to them (both calls read the
    same values): the views call is now held to the float64 reference, its LSE too."""
    n, secs, msg = _caught("mla_latent_views", getattr(F, name))
    assert secs < 60 and n <= 10, (n, secs)
    assert MLA_CAUGHT[name] in msg, msg[-2000:]


MLA_NAMES = {"v_wrong_slice": "V read from K's last 512 columns", "rope_dropped": "the scores from the first 512 columns only",
             "lse_base2": "LSE in base 2"}


@pytest.mark.parametrize("bug", sorted(MLA_NAMES))
def test_the_diagnosis_names_the_mla_bugs(bug):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 576, generator=g).bfloat16()
    lat = torch.randn(2, 1, 130, 576, generator=g).bfloat16()
    case = Case(q, lat, lat[..., :512], av.Spec(causal="bottom_right", return_lse=True))
    a = getattr(F, f"flashmla_like_{bug}")
    res = av.check(a, case)
    assert res.status == "failed"
    assert diagnose_result(res, adapter=a).summary.startswith(MLA_NAMES[bug])
    assert av.check(F.flashmla_like, case).status == "passed"


# ------------------------------------------------------------------------------- findings fixed in attnverify


def test_flashmla_keyless_rows_are_declared_not_converted():
    """Before: keyless_lse did not exist, FlashMLA's +inf LSE on a row with no attendable key was not the reference's
    -inf, and the adapter left such rows unclaimed (fully_masked unsupported: mla_latent_views kept Lq <= Lk under
    causal). Now it claims fully_masked="zeros", keyless_lse="+inf" and its kernel's LSE passes as it comes; the same
    kernel under the default claim, or one that rewrites the LSE to -inf under "+inf", fails on those rows."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 9, 576, generator=g).bfloat16()
    lat = torch.randn(1, 1, 5, 576, generator=g).bfloat16()
    case = Case(q, lat, lat[..., :512], av.Spec(causal="bottom_right", return_lse=True))  # rows 0-3 see no key
    res = av.check(F.flashmla_like, case)
    assert res.status == "passed", res.message()
    assert torch.isposinf(res.outputs["lse"][0, :, :4]).all() and (res.outputs["out"][0, :, :4] == 0).all()
    kw = {k: v for k, v in F.DECODE_CLAIMS.items() if k != "keyless_lse"}
    default = av.adapter("flashmla-like-default-keyless", register=False, **kw)(F.flashmla_like.fn)

    def rewritten(q, k, v, spec):
        o = F.flashmla_like.fn(q, k, v, spec)
        return av.Output(o.out, lse=torch.where(torch.isposinf(o.lse), torch.full_like(o.lse, float("-inf")), o.lse))

    minus = av.adapter("flashmla-like-minus-inf", register=False, **F.DECODE_CLAIMS)(rewritten)
    for a, shown in ((default, "got inf, expected -inf"), (minus, "got -inf, expected inf")):
        bad = av.check(a, case)
        assert [c.name for c in bad.failing()] == ["lse"] and shown in bad.message(), bad.message()
        n, _, msg = _caught("mla_latent_views", a)  # the property's corpus holds such a case: found at once
        assert n <= 2 and "lse: MISMATCH" in msg, msg[-1500:]


def test_flashmla_sinks_leave_the_lse_alone_as_declared():
    """FlashMLA's attn_sink scales the output by exp(lse) / (exp(lse) + exp(attn_sink)) and has "no affect on the
    returned softmax_lse". Before sink_in_lse the adapter could not say so: every LSE comparison of a sink case failed.
    Now it claims sink_in_lse=False and its kernel passes as it comes (keyless rows: out 0, LSE +inf, keyless_lse);
    under the default claim the LSE fails, and a kernel dropping the sink fails on its output."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, 9, 576, generator=g).bfloat16()
    lat = torch.randn(1, 1, 5, 576, generator=g).bfloat16()
    sinks = torch.tensor([0.7, -math.inf, 3.0])
    case = Case(q, lat, lat[..., :512], av.Spec(causal="bottom_right", return_lse=True, sinks=sinks))  # rows 0-3 keyless
    res = av.check(F.flashmla_like, case)
    assert res.status == "passed", res.message()
    kw = {k: v for k, v in F.DECODE_CLAIMS.items() if k != "sink_in_lse"}
    default = av.adapter("flashmla-like-sink-in-lse", register=False, **kw)(F.flashmla_like.fn)
    bad = av.check(default, case)
    assert [c.name for c in bad.failing()] == ["lse"], bad.message()
    ignored = av.check(F.flashmla_like_sink_ignored, case)
    assert [c.name for c in ignored.failing()] == ["out"], ignored.message()


def test_latent_kv_needs_the_mla_claims_and_says_so():
    with pytest.raises(ValueError, match=r"latent_kv=\.\.\.\).*claim dv_ne_d=True and the head dims of a pair"):
        av.adapter("lat", register=False, head_dims=(576, 512), latent_kv=True)(lambda q, k, v, s: q)
    with pytest.raises(ValueError, match="latent_kv"):
        av.adapter("lat", register=False, head_dims=(64,), dv_ne_d=True, latent_kv=True)(lambda q, k, v, s: q)
    a = av.adapter("lat", register=False, head_dims=(576, 512), dv_ne_d=True, latent_kv=True)(lambda q, k, v, s: q)
    assert "latent_kv" in a.claims.summary()
    assert get_property("mla_latent_views").why_skipped(a) is None
    assert "claims latent_kv" in get_property("lse_merge").why_skipped(a)


def test_a_claimed_head_dim_above_the_profiles_is_drawn():
    """Before: head_dims=(576, 512) drew 512 only, at every profile (576 is above the largest candidate)."""
    from attnverify.adapters.base import Claims
    from attnverify.strategies import head_dim_candidates, profile_limits

    for profile in ("ci", "thorough"):
        assert 576 in head_dim_candidates(Claims(head_dims=(576, 512)), profile_limits(profile).head_dims)
    assert head_dim_candidates(Claims(head_dims=(64, 1024)), profile_limits("ci").head_dims) == (64, 1024)


def test_the_tile_signature_prints_no_mkl_error_on_poisoned_rows(capfd):
    """Before: every failure of nonfinite_inputs_propagate printed 'Intel oneMKL ERROR: Parameter 4 was incorrect on
    entry to DGELSY' lines into the run's terminal (lstsq over NaN)."""
    from attnverify.diagnose import diagnose
    from attnverify.reference import reference_forward

    c = av.build_case(av.CaseRecipe(len_q=17, len_k=33, head_dim=16, poison=(("k", 0, 0, 32, 0, "inf"),)))
    ref = reference_forward(c.q, c.k, c.v, c.spec).out.double()
    obs = ref.clone()
    obs[0, 0, 3] += 1
    diagnose(c, {"out": obs.float()}, failing=["out"], tiles=(16, 16))
    captured = capfd.readouterr()
    assert "MKL" not in captured.out + captured.err


def test_the_cookbooks_sink_recipe_propagates_nan_and_inf(monkeypatch):
    """Found writing the stand-in kernels here the way recipe 7 computes: docs/cookbook/sink_fp8.py (shown verbatim in
    docs/adapters.md) took a row max of +Inf for 'no visible key' (isfinite) and a NaN denominator for an empty row
    (denom > 0), so a copy of it failed nonfinite_inputs_propagate at example #1 (10 rows returned finite)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "docs", "cookbook"))
    import sink_fp8

    run = _run("nonfinite_inputs_propagate", sink_fp8.sink_fp8, max_examples=10)
    assert run.statuses.get("passed", 0) >= 5, run.statuses



def test_an_mla_failure_has_its_diagnosis_in_the_report():
    """Before: an mla_latent_views case had no recipe (V is a view of K), so its evidence read 'the case cannot be
    rebuilt (... neither a recipe nor saved tensors ...): metrics only', and the report had no diagnosis."""
    from attnverify.evidence import analyse

    drawn = {"dims": [576, 512], "heads_q": 2, "batch": 1, "len_q": 3, "len_k": 70, "dtype": "bfloat16",
             "causal": "bottom_right", "seed": 4}
    a = F.flashmla_like_v_wrong_slice
    res = get_property("mla_latent_views").run_example(a, drawn)
    assert not res.passed
    info = analyse(a, "failed", res.case)
    assert info["rerun"], info["notes"]
    assert info["diagnosis"]["summary"].startswith("V read from K's last 512 columns"), info["diagnosis"]


def test_a_swallowed_nan_is_named_not_read_as_a_missing_rescale():
    """Before: the stand-in prefill kernel's nan_to_num failure of nonfinite_inputs_propagate was diagnosed 'error
    only in rows where the running max rises after the first key tile (tile 32): missing rescale'."""
    @av.adapter("swallows-nan", register=False, dtypes=("float16",), head_dims=(128,))
    def swallows(q, k, v, spec):
        s = (q.float() @ k.float().transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
        return (torch.softmax(s, -1).nan_to_num(0.0) @ v.float()).to(q.dtype)

    case = av.build_case(av.CaseRecipe(len_q=17, len_k=33, head_dim=128, dtype="float16", seed=1,
                                       poison=(("k", 0, 0, 32, 0, "inf"),)))
    res = av.check(swallows, case)
    assert res.status == "failed"
    d = diagnose_result(res, adapter=swallows)
    assert d.best is not None and d.best.key == "nonfinite_swallowed", d.text()
    assert "9 row(s) finite where the reference is NaN/Inf" in d.summary


@pytest.mark.slow
@pytest.mark.parametrize("target", ["chunked_local.py:chunked_local", "flashmla_like.py:mla_prefill_like"])
def test_the_whole_ci_profile_passes_through_the_cli(tmp_path, target):
    """Every property the claims turn on (~20-30 s each on two cores). The first runs showed the stand-ins' own
    mistake, the one recipe 7 had: a NaN/Inf input swallowed (isfinite(max), max > -inf, nan_to_num), caught by
    nonfinite_inputs_propagate at example #1."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               ATTNVERIFY_NO_HTML="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    res = subprocess.run([sys.executable, "-m", "attnverify.cli", "run", "--adapter", os.path.join(STRANGER, target),
                          "--profile", "ci", "--seed", "1", "-n", "0"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    want = "chunked_matches_reference" if "chunked" in target else "mla_latent_views"
    for prop in (want, "forward_matches_reference", "nonfinite_inputs_propagate"):
        assert re.search(rf"^{prop} +ok ", out, re.M), (prop, out[-3000:])


def test_a_swallowed_nan_message_does_not_read_out_ok():
    """Before: 'N row(s) finite where the reference is non-finite' stood above 'out: ok (rel L2 ...)' (the comparison
    skips the rows the reference makes non-finite), which read as a contradiction."""
    @av.adapter("swallows-nan-2", register=False, dtypes=("float16",), head_dims=(16, 32))
    def swallows(q, k, v, spec):
        s = (q.float() @ k.float().transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
        return (torch.softmax(s, -1).nan_to_num(0.0) @ v.float()).to(q.dtype)

    with pytest.raises(AssertionError) as e:
        _run("nonfinite_inputs_propagate", swallows, max_examples=5)
    msg = str(e.value)
    assert "the NaN/Inf was swallowed" in msg and "out, on the rows the reference keeps finite: ok" in msg, msg[-1500:]
    assert "\nout: ok" not in msg
