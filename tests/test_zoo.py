"""The zoo of wrong implementations and `attnverify selftest` (attnverify/zoo).

- every member is documented, distinct, and claims what its expected properties need;
- the engines the members are built from are correct with the bug switched off (else a catch
  would prove nothing), and each bug is live on a case made for it;
- every Triton member really runs a Triton kernel (the interpreter on a CPU);
- the fast subset is caught by the ci profile (runs in CI, so detection power cannot silently
  regress); the whole zoo is caught in the slow sweep;
- a correct control (naive, and the zoo's own engines without a bug) is not flagged by the same
  machinery, and selftest exits 1 on it.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    # the Triton members need the interpreter, switched on before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attnverify as av
from attnverify.adapters.base import adapter
from attnverify.properties import PROPERTIES, get_property
from attnverify.zoo import ZOO, ZooMember, fast_members, get_member
from attnverify.zoo import selftest
from attnverify.zoo._eager import BACKWARD_BUGS, FORWARD_BUGS, attend
from attnverify.zoo._members import EAGER, FLASH, FLASH_VARLEN, TRITON

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: the Triton zoo members cannot run")

# The issue's list, each item -> the member(s) standing for it.
ISSUE_LIST = {
    "missing rescale": ["triton-no-rescale"],
    "max from first tile only": ["triton-first-tile-max"],
    "per-tile softmax averaged": ["split-kv-equal-weights"],
    "padded tail keys scored 0": ["triton-pad-tail-zero"],
    "causal diagonal excluded": ["triton-causal-diag-excluded"],
    "wrong causal alignment for Lq != Lk": ["causal-top-left"],
    "window off by one": ["window-off-by-one"],
    "GQA mapping": ["gqa-interleaved"],
    "scale missing/doubled/ignored": ["scale-missing", "scale-twice", "scale-ignored"],
    "softcap misplaced": ["softcap-before-scale"],
    "ALiBi sign or alignment": ["alibi-sign", "alibi-top-left"],
    "fully-masked rows NaN / mean(V) / unmasked": ["fm-nan", "fm-mean-v", "fm-unmasked"],
    "exp without max subtraction": ["exp-no-max"],
    "low-precision P@V accumulation": ["pv-half-accumulate"],
    "LSE base 2": ["triton-lse-base2"],
    "batch or head cross-talk": ["batch-kv-stride"],
    "varlen boundary leak": ["varlen-leak"],
    "decode-only path wrong": ["decode-drops-last-key"],
    "head dims above 128 truncated": ["hd-trunc-128"],
    "backward dK scale": ["bwd-dk-missing-scale"],
    "dV not summed over GQA group": ["bwd-dv-gqa-last-head"],
    "backward ignoring causal=False": ["bwd-always-causal"],
    "nondeterministic dQ": ["bwd-dq-atomic-order"],
    "dropout not rescaled": ["dropout-no-rescale"],
    "input modified in place": ["inplace-q-prescale"],
    "output rows left unwritten": ["triton-unwritten-tail"],
}


# ------------------------------------------------------------------------------------------------
# the registry


def test_registry_documented_and_distinct():
    assert len(ZOO) >= 25
    names = [m.name for m in ZOO]
    assert len(set(names)) == len(names), "duplicate member names"
    assert len({m.adapter.name for m in ZOO}) == len(ZOO), "duplicate adapter names"
    assert len({m.bug for m in ZOO}) == len(ZOO), "two members describe the same bug"
    assert len({m.stands_for for m in ZOO}) == len(ZOO), "two members stand for the same real-world class"
    assert len({id(m.adapter.fn) for m in ZOO}) == len(ZOO)
    for m in ZOO:
        assert isinstance(m, ZooMember)
        assert len(m.bug) >= 20 and "\n" not in m.bug, m.name
        assert len(m.stands_for) >= 20 and "\n" not in m.stands_for, m.name
        assert not re.search(r"#\d", m.stands_for + m.bug), f"{m.name}: describe the class, no issue numbers"
        assert m.kind in ("triton", "eager", "autograd", "multi"), m.name
        assert bool(m.planted) == (m.kind == "multi") and (not m.planted or len(m.planted) >= 2), m.name
        assert m.expected, m.name
        for p in m.expected:
            prop = get_property(p)  # raises for an unknown property
            # the member claims what its expected properties need, or they could never catch it
            assert prop.skip_reason(m.adapter) is None, f"{m.name}: {prop.skip_reason(m.adapter)}"
        assert m.adapter.name == f"zoo-{m.name}"
    assert sum(m.kind == "triton" for m in ZOO) >= 5


def test_issue_list_covered():
    for item, members in ISSUE_LIST.items():
        for n in members:
            get_member(n)  # KeyError when the item has no member
    covered = {n for ms in ISSUE_LIST.values() for n in ms}
    assert covered <= {m.name for m in ZOO}


def test_fast_subset():
    fast = fast_members()
    assert 6 <= len(fast) <= 10
    assert sum(m.kind == "triton" for m in fast) >= 2
    assert {m.kind for m in fast} >= {"triton", "eager", "autograd"}


def test_members_not_registered():
    from attnverify.adapters import registry

    known = set(registry._registered) | set(registry.BUILTINS)
    for m in ZOO:
        assert m.adapter.name not in known, f"{m.name} leaked into the adapter registry"


def test_import_does_not_import_triton_or_touch_a_gpu():
    code = ("import sys; import attnverify.zoo, attnverify.zoo.selftest, attnverify.zoo.grid; "
            "assert 'triton' not in sys.modules, 'triton imported at import'; "
            "import torch; assert not torch.cuda.is_initialized()")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": ""})


# ------------------------------------------------------------------------------------------------
# the engines are correct without their bug, and each bug is live


ALL = dict(dtypes=("float32", "float16", "bfloat16"), devices=("cpu",), head_dims=lambda d: 1 <= d <= 256,
           causal=("none", "top_left", "bottom_right"), window=True, softcap=True, alibi=True, attn_mask=True,
           gqa=True, varlen=True, dropout=True, backward=True, lse=True, dv_ne_d=True, fully_masked="zeros",
           deterministic=True)


@adapter("zoo-engine-ok", register=False, **ALL)
def _engine_ok(q, k, v, spec):
    return attend(q, k, v, spec)


R = av.CaseRecipe
ENGINE_CASES = {
    "plain-gqa-f16": R(batch=2, heads_q=4, heads_kv=2, len_q=37, len_k=53, head_dim=32, dtype="float16", seed=1),
    "causal-br-bf16": R(heads_q=2, heads_kv=2, len_q=45, len_k=30, head_dim=64, dtype="bfloat16", causal="bottom_right", seed=2),
    "window-softcap": R(heads_q=2, heads_kv=1, len_q=40, len_k=40, head_dim=32, window=(3, 1), softcap=5.0, seed=3),
    "alibi-lq<lk": R(heads_q=4, heads_kv=4, len_q=9, len_k=40, head_dim=16, alibi=True, causal="bottom_right", seed=4),
    "varlen": R(heads_q=2, heads_kv=2, len_q=30, len_k=34, head_dim=16, seqlens_q=[10, 0, 20], seqlens_k=[12, 5, 17],
                causal="bottom_right", seed=5),
    "mask-rows-off": R(batch=2, heads_q=2, heads_kv=2, len_q=12, len_k=20, head_dim=16, mask="bool_random",
                       masked_rows=(0, 5), seed=6),
    "float-mask-d160": R(heads_q=2, heads_kv=2, len_q=9, len_k=17, head_dim=160, mask="float_random", seed=7),
    "shift+1000-lse": R(len_q=5, len_k=67, head_dim=16, row_shift=1000.0, return_lse=True, seed=8),
    "decode": R(heads_q=4, heads_kv=1, len_q=1, len_k=70, head_dim=64, dtype="float16", seed=9, return_lse=True),
}


@pytest.mark.parametrize("name", list(ENGINE_CASES))
def test_eager_engine_without_bug_matches_reference(name):
    case = av.build_case(ENGINE_CASES[name])
    res = av.check(_engine_ok, case, backward=True)
    assert res.passed, res.message()


# a case made for each forward bug: the member's check must fail there
BUG_CASES = {
    "gqa_interleaved": R(heads_q=4, heads_kv=2, len_q=8, len_k=8, head_dim=16),
    "batch_kv_from_batch0": R(batch=2, len_q=8, len_k=8, head_dim=16),
    "scale_missing": R(len_q=8, len_k=8, head_dim=16),
    "scale_twice": R(len_q=8, len_k=8, head_dim=16),
    "scale_ignored": R(len_q=8, len_k=8, head_dim=16, scale=0.5),
    "softcap_before_scale": R(len_q=8, len_k=8, head_dim=16, softcap=1.0),
    "alibi_sign": R(heads_q=2, heads_kv=2, len_q=8, len_k=8, head_dim=16, alibi=True),
    "alibi_top_left": R(heads_q=2, heads_kv=2, len_q=4, len_k=12, head_dim=16, alibi=True),
    "causal_top_left": R(len_q=4, len_k=12, head_dim=16, causal="bottom_right"),
    "window_off_by_one": R(len_q=12, len_k=12, head_dim=16, window=(2, 0)),
    "varlen_leak": R(len_q=8, len_k=8, head_dim=16, seqlens_q=[4, 4], seqlens_k=[4, 4]),
    "decode_drops_last_key": R(len_q=1, len_k=9, head_dim=16),
    "hd_trunc_128": R(len_q=8, len_k=8, head_dim=160),
    "fm_nan": R(len_q=8, len_k=8, head_dim=16, mask="bool_random", masked_rows=(2,)),
    "fm_mean_v": R(len_q=8, len_k=8, head_dim=16, mask="bool_random", masked_rows=(2,)),
    "fm_unmasked": R(len_q=8, len_k=8, head_dim=16, mask="bool_random", masked_rows=(2,)),
    "exp_no_max": R(len_q=4, len_k=8, head_dim=16, row_shift=1000.0),
    "split_kv_equal_weights": R(len_q=4, len_k=70, head_dim=16),
    "pv_half_accumulate": R(len_q=4, len_k=200, head_dim=16, dtype="float16", v_mean=10.0),
}


@pytest.mark.parametrize("bug", FORWARD_BUGS)
def test_each_forward_bug_is_live(bug):
    if bug == "dropout_no_rescale":
        spec = av.Spec(dropout_p=0.5, seed=3)
        q = torch.zeros(1, 1, 4, 16)
        k, v = torch.randn(1, 1, 64, 16), torch.ones(1, 1, 64, 16)
        got = attend(q, k, v, spec, bug).out
        assert not torch.allclose(got, attend(q, k, v, spec).out)
        return
    assert bug in BUG_CASES, f"no live-bug case for {bug}"

    @adapter(f"zoo-bug-{bug}".replace("_", "-"), register=False, **ALL)
    def wrong(q, k, v, spec):
        return attend(q, k, v, spec, bug)

    res = av.check(wrong, av.build_case(BUG_CASES[bug]), backward=False)
    assert not res.passed, f"{bug} is not visible on its own case"


BACKWARD_MEMBER = {"dk_missing_scale": "bwd-dk-missing-scale", "dv_gqa_last_head": "bwd-dv-gqa-last-head",
                   "bwd_always_causal": "bwd-always-causal", "dq_atomic_order": "bwd-dq-atomic-order"}


@pytest.mark.parametrize("bug", BACKWARD_BUGS)
def test_each_backward_bug_is_live(bug):
    m = get_member(BACKWARD_MEMBER[bug])
    r = R(batch=1, heads_q=4, heads_kv=2, len_q=20, len_k=40, head_dim=16, dtype="float16", seed=11)
    case = av.build_case(r)
    if bug == "dq_atomic_order":  # many key tiles, so that the order of the partial sums shows in fp16
        # (fp32 partial sums differ in the last bits; after rounding dQ to fp16 a few elements in 10^4 differ)
        big = av.build_case(dataclasses.replace(r, batch=2, len_q=128, len_k=256, head_dim=64))
        d_out = torch.randn(2, 4, 128, 64, generator=torch.Generator().manual_seed(0)).half()
        runs = []
        for _ in range(4):
            q, k, v = (t.detach().clone().requires_grad_(True) for t in (big.q, big.k, big.v))
            out = m.adapter(q, k, v, big.spec).out
            runs.append(torch.autograd.grad(out, q, d_out)[0])
        assert any(not torch.equal(runs[0], x) for x in runs[1:]), "dQ did not vary between runs"
        res = av.check(m.adapter, case, backward=True)  # the values themselves are within tolerance
        assert res.passed, res.message()
        return
    res = av.check(m.adapter, case, backward=True)
    assert not res.passed
    assert {c.name for c in res.failing()} <= {"dq", "dk", "dv"}, res.message()


# ------------------------------------------------------------------------------------------------
# Triton members really run


TRITON_CASE = R(batch=1, heads_q=2, heads_kv=1, len_q=70, len_k=75, head_dim=32, causal="top_left", return_lse=True,
                seed=12)
TRITON_BUG_CASES = {  # where the plain case above cannot show the bug
    "triton-first-tile-max": dataclasses.replace(TRITON_CASE, causal="none", late_from=64, late_boost=100.0),
    "triton-pad-tail-zero": dataclasses.replace(TRITON_CASE, causal="none"),  # causal hides the padded keys
}


@needs_triton
def test_triton_members_really_run():
    from attnverify.reference import reference_forward
    from attnverify.zoo import _triton_wrong as tw

    case = av.build_case(TRITON_CASE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ok = tw.zoo_flash_forward(case.q, case.k, case.v, case.spec, bug="none")
        kern, _ = tw._kernel()
        if not torch.cuda.is_available():
            from triton.runtime.interpreter import InterpretedFunction

            assert isinstance(kern, InterpretedFunction), "not running under the Triton interpreter"
        ref = reference_forward(case.q, case.k, case.v, case.spec)
        assert torch.allclose(ok.out.double(), ref.out, atol=1e-5, rtol=1e-4)
        assert torch.allclose(ok.lse.double(), ref.lse, atol=1e-5)
        # bf16 with a V offset: fails when fp32 -> bf16 conversions truncate (as the interpreter's do)
        bf16 = av.build_case(dataclasses.replace(TRITON_CASE, dtype="bfloat16", v_mean=10.0, len_k=200))
        res = av.check(_triton_ok(), bf16, backward=False)
        assert res.passed, res.message()
        members = [m for m in ZOO if m.kind == "triton"]
        assert len(members) >= 5
        for m in members:
            mcase = av.build_case(TRITON_BUG_CASES.get(m.name, TRITON_CASE))
            assert av.check(_triton_ok(), mcase, backward=False).passed, f"bug-free kernel fails {m.name}'s case"
            res = av.check(m.adapter, mcase, backward=False)
            assert not res.passed, f"{m.name} passed a case its bug shows on"


def _triton_ok():
    from attnverify.zoo._triton_wrong import zoo_flash_forward

    @adapter("zoo-control-triton", register=False, **TRITON)
    def ok(q, k, v, spec):
        return zoo_flash_forward(q, k, v, spec, bug="none")

    return ok


# ------------------------------------------------------------------------------------------------
# detection: the ci profile catches the fast subset (CI) and the whole zoo (slow)


def _assert_caught(m, r):
    assert r.status == "caught", (f"{m.name} was not caught by the ci profile: {r.status} {r.reason} "
                                  f"({r.total_examples} examples over {r.properties_run})")
    assert r.case, f"{m.name}: no shrunk case reported"
    assert r.diagnosis, f"{m.name}: no diagnosis reported"
    assert r.first_seconds is not None and r.first_examples


@pytest.mark.parametrize("name", [m.name for m in fast_members()])
def test_fast_subset_caught(name, tmp_path):
    m = get_member(name)
    if m.kind == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    r = selftest.run_member(m, profile="ci", seed=0, report_dir=str(tmp_path), shrink_budget_s=3.0)
    _assert_caught(m, r)
    assert r.expected, f"{m.name} was caught by {r.caught_by}, none of its expected {m.expected}"
    assert r.first_seconds < 60, f"{m.name}: first failure after {r.first_seconds:.1f}s"


@pytest.mark.slow
@pytest.mark.parametrize("name", [m.name for m in ZOO])
def test_whole_zoo_caught(name, tmp_path):
    m = get_member(name)
    if m.kind == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    r = selftest.run_member(m, profile="ci", seed=0, report_dir=str(tmp_path), shrink_budget_s=5.0)
    _assert_caught(m, r)


# ------------------------------------------------------------------------------------------------
# controls: correct implementations are not flagged by the same machinery


def _control(name, adp, expected):
    return ZooMember(name, "no bug: a correct implementation (control)", f"control {name}", adp, expected, "eager")


def test_naive_control_not_flagged(tmp_path):
    from attnverify.adapters.naive import naive

    ctl = _control("control-naive", naive, ("forward_matches_reference", "fully_masked_rows", "lse_matches_reference"))
    r = selftest.run_member(ctl, profile="ci", seed=0, report_dir=str(tmp_path), max_examples=5,
                            properties=ctl.expected)
    assert r.status == "missed", f"naive was flagged: {r.caught_by}: {r.finding} ({r.case})"
    assert r.properties_run == list(ctl.expected)


@pytest.mark.parametrize("preset", ["FLASH_VARLEN", "EAGER"])  # FLASH_VARLEN = FLASH + varlen
def test_engine_control_not_flagged(preset, tmp_path):
    claims = {"FLASH": FLASH, "FLASH_VARLEN": FLASH_VARLEN, "EAGER": EAGER}[preset]

    @adapter(f"zoo-control-{preset.lower().replace('_', '-')}", register=False, **claims)
    def ok(q, k, v, spec):
        return attend(q, k, v, spec)

    ctl = _control(ok.name, ok, ("forward_matches_reference", "gradients_match_reference"))
    r = selftest.run_member(ctl, profile="ci", seed=0, report_dir=str(tmp_path), max_examples=6,
                            properties=ctl.expected)
    assert r.status == "missed", f"the bug-free engine was flagged: {r.caught_by}: {r.finding} ({r.case})"


@needs_triton
def test_triton_control_not_flagged(tmp_path):
    ok = _triton_ok()
    ctl = _control(ok.name, ok, ("forward_matches_reference",))
    r = selftest.run_member(ctl, profile="ci", seed=0, report_dir=str(tmp_path), max_examples=3,
                            properties=ctl.expected)
    assert r.status == "missed", f"the bug-free Triton kernel was flagged: {r.finding} ({r.case})"


@pytest.mark.slow
def test_naive_control_all_properties(tmp_path):
    from attnverify.adapters.naive import naive

    ctl = _control("control-naive", naive, ("forward_matches_reference",))
    r = selftest.run_member(ctl, profile="ci", seed=0, report_dir=str(tmp_path))
    assert r.status == "missed", f"naive was flagged: {r.caught_by}: {r.finding} ({r.case})"
    assert len(r.properties_run) >= 8


# ------------------------------------------------------------------------------------------------
# the command line


def test_selftest_main_catches_and_writes_json(tmp_path, capsys):
    out = tmp_path / "st.json"
    rc = selftest.main(["--member", "fm-nan", "--json", str(out), "--report-dir", str(tmp_path / "rep"),
                        "--shrink-budget", "2"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "fm-nan" in text and "caught" in text and "diagnosis" in text
    d = json.loads(out.read_text())
    assert d["summary"]["caught"] == 1 and d["rows"][0]["caught_by"] == "fully_masked_rows"
    assert "NaN" in d["rows"][0]["diagnosis"]


def test_selftest_main_exit_1_on_a_miss(tmp_path, monkeypatch, capsys):
    from attnverify.adapters.naive import naive

    ctl = _control("control-naive", naive, ("forward_matches_reference",))
    monkeypatch.setattr(selftest, "select", lambda names=None, fast=False: [ctl])
    monkeypatch.setattr(selftest, "property_order", lambda m: [get_property("forward_matches_reference")])
    rc = selftest.main(["--max-examples", "3", "--report-dir", str(tmp_path)])
    assert rc == 1
    assert "MISSED" in capsys.readouterr().out


def test_selftest_usage_errors(capsys):
    assert selftest.main(["--member", "no-such-member"]) == 2
    assert selftest.main(["--no-such-flag"]) == 2
    assert selftest.main(["--list", "--fast"]) == 0
    assert "triton-no-rescale" in capsys.readouterr().out


def test_property_order_expected_first():
    m = get_member("gqa-interleaved")
    order = [p.name for p in selftest.property_order(m)]
    assert order[:len(m.expected)] == list(m.expected)
    assert sorted(order) == sorted(p.name for p in PROPERTIES)


# ------------------------------------------------------------------------------------------------
# the fixed-grid baseline


def test_grid_passes_a_correct_kernel_and_fails_a_wrong_one():
    from attnverify.zoo import grid

    @adapter("zoo-grid-ok", register=False, **FLASH)
    def ok(q, k, v, spec):
        return attend(q, k, v, spec)

    cfgs = list(grid.grid_configs(ok))
    assert cfgs[0].seqlen_q == 113 and cfgs[0].seqlen_k == 203
    assert len(cfgs) == len(grid.SEQLENS) * len(grid.HEAD_DIMS) * 2 * 5 * 2
    picks = [cfgs[0], next(c for c in cfgs if c.alibi and c.causal), next(c for c in cfgs if c.local),
             next(c for c in cfgs if c.seqlen_q == 239 and c.causal and c.head_dim == 32)]
    for cfg in picks:
        passed, what = grid.check_config(ok, cfg)
        assert passed, f"{cfg.describe()}: {what}"
    passed, what = grid.check_config(get_member("scale-missing").adapter, cfgs[0])
    assert not passed and "out" in what
    r = grid.run_grid(get_member("scale-twice"), budget_s=30)
    assert r.caught and r.first_index == 1


def test_a_member_that_raises_is_an_error_not_a_catch(tmp_path):
    @adapter("zoo-raises", register=False, dtypes=("float32",), devices=("cpu",))
    def raises(q, k, v, spec):
        raise RuntimeError("no kernel image for this device")

    m = _control("raises", raises, ("forward_matches_reference",))
    r = selftest.run_member(m, profile="ci", seed=0, report_dir=str(tmp_path), max_examples=2,
                            properties=m.expected)
    assert r.status == "error" and "raised" in r.reason, (r.status, r.reason)


def test_triton_imported_too_early_is_unavailable_not_caught():
    code = ("import os; os.environ.pop('TRITON_INTERPRET', None); import triton, torch; "
            "from attnverify.zoo import get_member; m = get_member('triton-no-rescale'); "
            "why = m.unavailable_reason(); "
            "assert torch.cuda.is_available() or (why and 'TRITON_INTERPRET' in why), why")
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    subprocess.run([sys.executable, "-c", code], check=True)
