"""User adapters with unusual claim sets, written as a user would from their kernel's docstring, run through
the plugin (pytester): only passes and skips that name what is missing (issue 18), and known_failures
declarations judged strictly (a declared finding that does not reproduce is a strict XPASS)."""
import pytest

import attnverify as av
from attnverify.journal import read_journal
from attnverify.properties import PROPERTIES

FAST = ("--attn-profile=ci", "--attn-max-examples=3", "-p", "no:randomly")

USERS = '''
import torch, attnverify as av


def _attention(q, k, v, spec, causal, dtypes=(torch.float32,)):
    """Eager attention, fp32 scores and softmax; only what the adapters below claim."""
    if q.dtype not in dtypes:
        raise TypeError(f"dtype {q.dtype} is not supported")
    if k.shape[2] != v.shape[2] or q.shape[-1] != k.shape[-1] or q.shape[1] != k.shape[1]:
        raise ValueError(f"shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} are not supported")
    s = (q.float() @ k.float().transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
    lq, lk = s.shape[-2:]
    if causal:
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(0 if causal == "top_left" else lk - lq)
        s = s.masked_fill(~keep, float("-inf"))
    return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype)


@av.adapter("always-causal", dtypes=("float16", "float32"), causal=("top_left",))
def always_causal(q, k, v, spec):
    """A kernel that is always causal, j <= i (flash_attention_v2 style)."""
    return _attention(q, k, v, spec, "top_left", (torch.float16, torch.float32))


@av.adapter("decode-causal", dtypes=("float32",), causal=("bottom_right",))
def decode_causal(q, k, v, spec):
    """Causal aligned to the end of the keys (KV-cache decode / chunked prefill), nothing else."""
    return _attention(q, k, v, spec, "bottom_right")


@av.adapter("bf16-only", dtypes=("bfloat16",))
def bf16_only(q, k, v, spec):
    """bf16 inputs only."""
    return _attention(q, k, v, spec, None, (torch.bfloat16,))


@av.adapter("d48-short", head_dims=(48,), max_seqlen=32)
def d48_short(q, k, v, spec):
    """Head dim 48, sequences up to 32."""
    return _attention(q, k, v, spec, None)
'''


def test_unusual_claim_sets_give_only_passes_and_named_skips(pytester):
    pytester.makeconftest(USERS)
    res = pytester.runpytest("--adapter=always-causal,decode-causal,bf16-only,d48-short", "-rs", *FAST)
    out = res.stdout.str()
    outcomes = res.parseoutcomes()
    assert res.ret == 0 and not outcomes.get("failed") and not outcomes.get("errors"), out
    assert outcomes.get("passed", 0) + outcomes.get("skipped", 0) == 4 * len(PROPERTIES), outcomes
    skips = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
    assert sum(int(ln.split("[")[1].split("]")[0]) for ln in skips) == outcomes["skipped"], skips
    for ln in skips:  # one line that names what is missing
        assert "does not claim" in ln or "claims max_seqlen" in ln or "no CUDA device" in ln, ln
    ends = [r for r in read_journal(str(pytester.path / "reports")) if r["event"] == "test_end"]
    by = {}
    for r in ends:
        assert r["outcome"] in ("passed", "skipped"), (r["adapter"], r["property"], r["message"])
        by[(r["adapter"], r["property"])] = r
    for a in ("always-causal", "decode-causal"):  # the properties that errored for causal-only adapters run
        assert by[(a, "kv_permutation_invariance")]["outcome"] == "passed", by[(a, "kv_permutation_invariance")]
        assert by[(a, "nonfinite_inputs_propagate")]["outcome"] == "passed"
        assert by[(a, "causal_alignment")]["outcome"] == "passed"
    for a in ("bf16-only", "d48-short"):
        assert by[(a, "forward_matches_reference")]["outcome"] == "passed"
        assert (a, "causal_alignment") not in by  # skipped at collection: "<a> does not claim causal"
    assert any("d48-short does not claim backward" in ln for ln in skips)
    assert any("bf16-only does not claim causal" in ln for ln in skips)


MINE_OK = '''
import torch, attnverify as av

@av.adapter("mine", known_failures=KNOWN)
def mine(q, k, v, spec):
    s = (q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
    return torch.softmax(s, dim=-1) @ v
'''


def test_a_declared_finding_that_does_not_reproduce_is_a_strict_xpass(pytester):
    """The finding was fixed (or never was): the run fails, saying so in the terminal summary, the journal
    and the report, so the stale declaration gets removed."""
    pytester.makeconftest(MINE_OK.replace("KNOWN", '{"forward_matches_reference": "forgets the scale (issue 7)"}'))
    res = pytester.runpytest("--adapter=mine", "-k", "forward_matches_reference or inputs_unmodified", *FAST)
    out = res.stdout.str()
    assert res.ret == 1, out
    assert "XPASS(strict)" in out and "forgets the scale (issue 7)" in out
    assert "XPASS" in out.split("attnverify")[-2] + out.split("attnverify")[-1]  # the summary table's cell
    assert "remove it from known_failures" in out
    ends = {r["property"]: r for r in read_journal(str(pytester.path / "reports")) if r["event"] == "test_end"}
    assert ends["forward_matches_reference"]["outcome"] == "xpass"
    assert "did not reproduce" in ends["forward_matches_reference"]["message"]
    assert ends["inputs_unmodified"]["outcome"] == "passed"
    html = (pytester.path / "reports" / "index.html").read_text()
    assert "st-xpass" in html and "did not reproduce" in html


@pytest.mark.parametrize("known, error, words", [
    ({"forward_match_reference": "typo"}, ValueError, ["forward_match_reference", "unknown property",
                                                       "forward_matches_reference"]),
    ({"contract": {"why": "x", "mach": "k and v"}}, TypeError, ["'mach'", "known_failures['contract']", "'match'"]),
    ({"contract": {"match": "k and v"}}, TypeError, ["no 'why'", "known_failures['contract']"]),
])
def test_known_failures_are_validated_naming_the_argument_and_the_fix(known, error, words):
    with pytest.raises(error) as ei:
        av.adapter("bad-known", register=False, known_failures=known)(lambda q, k, v, spec: q)
    for w in words:
        assert w in str(ei.value), str(ei.value)


def test_the_classifier_honours_match():
    a = av.adapter("cls", register=False, known_failures={
        "contract": {"why": "k/v lengths (F8)", "match": "k and v of different lengths"},
        "forward_matches_reference": "anything (no match)"})(lambda q, k, v, spec: q)
    assert a.classify("contract", "...k and v of different lengths (k has Lk=3)...") == ("known", "k/v lengths (F8)")
    outcome, note = a.classify("contract", "Hq not a multiple of Hkv: returned numbers")
    assert outcome == "failed" and "does not match it" in note
    assert a.classify("forward_matches_reference", "out: MISMATCH")[0] == "known"
    assert a.classify("contract", None)[0] == "xpass" and a.classify("value_scaling", None) == ("passed", "")
    assert a.classify("value_scaling", "out: MISMATCH") == ("failed", "")


def test_convention_probes_stay_inside_a_causal_only_claim_set():
    """The run's convention probes (attnverify.probes, the report's 'declared vs observed' table) call the adapter
    with its claims only: an adapter claiming only top-left causal (with masks and an LSE), which raises on any
    other call as such a kernel would, is probed without one 'probe raised', and its alignment is observed."""
    import torch

    from attnverify.probes import observe

    def always_causal(q, k, v, spec):
        if spec.causal != "top_left":
            raise ValueError(f"this kernel is always causal (top-left); got causal={spec.causal!r}")
        s = (q.double() @ k.double().transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
        lq, lk = s.shape[-2:]
        keep = torch.ones(lq, lk, dtype=torch.bool).tril(0)
        if spec.attn_mask is not None:
            keep = keep & spec.attn_mask.to(torch.bool)
        s = s.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1).masked_fill(torch.isneginf(lse.unsqueeze(-1)), 0.0))
        return av.Output((p @ v.double()).to(q.dtype), lse=lse.float() if spec.return_lse else None)

    a = av.adapter("probe-always-causal", register=False, dtypes=("float32",), causal=("top_left",),
                   attn_mask=True, lse=True, fully_masked="zeros")(always_causal)
    obs = observe(a, "cpu")
    assert not [k for k, v in obs.items() if v.startswith("probe raised")], obs
    assert obs["causal"] == "top_left" and obs["lse"] == "natural log" and obs["fully_masked"] == "zeros", obs
