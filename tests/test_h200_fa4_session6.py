"""flash-attn4's findings of the H200 run of 2026-12-05, second session (benchmarks/fa4_serving_h200.sh; journal in
/root/out/rep_fa4): each declaration accepts the message the run wrote and rejects the same message with the
feature it is narrowed to changed. CPU only: no library is called.

- sinks_paged: NaN in a partly used page of 128 slots at D=16 reached the output: FA4's documented TMA page rule
  (declared beside F37, not strict).
- fully_masked_rows: the backward with Dv=32 < D=64 raised MLIRError (F40, not strict; also gradients_match_reference
  and outputs_fully_written).
- F37's repro measured dsink wrong with the +inf LSE: a dsinks mismatch beside it is the same finding.
"""
from __future__ import annotations

import pytest

from attnverify.adapters.registry import get

FA4 = get("flash-attn4")

SINKS_PAGED_TMA = "sinks_paged failed for flash-attn4 (profile ci)\nshrunk case: B=1 Hq=1 Hkv=1 Lq=1 D=16 float16 paged N=4 page_size=128 cache_seqlens=[1] block_table=[[3]] sinks=[0.77] garbage=nan in unused slots\n[flash-attn4] sinks_paged FAILED: B=1 Hq=1 Hkv=1 Lq=1 D=16 float16 paged N=4 page_size=128 cache_seqlens=[1] block_table=[[3]] sinks=[0.77] garbage=nan in unused slots\nA paged-KV call with sinks matches the float64 reference over each batch's gathered keys.\nout: MISMATCH\n  16 non-finite value(s) where the reference differs (NaN/Inf)\n  Mismatched elements: 16 / 16 (100.0%)\n  Greatest absolute difference: 0 at index (0, 0, 0, 0) (got nan, expected -0.12191; up to 0.00237 allowed)\n  Relative L2 error: inf (up to 0.000734 allowed)\n  Greatest error in ulps at the reference's scale: 0.0\nnote: batch(es) [0] end inside a page: the slots after their last key, in that page, hold nan\nparameters: {'sinks': {'kind': 'normal', 'level': 0.5, 'seed': 0}}\nattribution: holds with Lq=128; holds with D=32 [bug 06ad05105643]\nuntested: Lk=128 (a KV-cache case takes its key lengths from cache_lens: it has no such neighbour); float32 (flash-attn4 does not claim dtype float32)\nproperty parameters: {'sinks': {'kind': 'normal', 'level': 0.5, 'seed': 0}}\nfirst failing example: #11 after 43.18 s; 40 examples run with shrinking\nreplay: attnverify repro /root/out/rep_fa4/cases/8380c4d1548d.json"  # noqa: E501 (copied from the run's journal)

FULLY_MASKED_DV_BWD = "fully_masked_rows failed for flash-attn4 (profile ci)\nshrunk case: B=1 Hq=1 Hkv=1 Lq=10 Lk=3 D=64 Dv=32 float16 window=(2, 0)\n[flash-attn4] FAILED: B=1 Hq=1 Hkv=1 Lq=10 Lk=3 D=64 Dv=32 float16 window=(2, 0)\ndq: MISMATCH\n  backward raised MLIRError: Operation creation failed:\n  Mismatched elements: 640 / 640 (100.0%)\n  Relative L2 error: inf (up to 0.00196 allowed)\n  Greatest error in ulps at the reference's scale: inf\ndk: MISMATCH\n  backward raised MLIRError: Operation creation failed:\n  Mismatched elements: 192 / 192 (100.0%)\n  Relative L2 error: inf (up to 0.0021 allowed)\n  Greatest error in ulps at the reference's scale: inf\ndv: MISMATCH\n  backward raised MLIRError: Operation creation failed:\n  Mismatched elements: 96 / 96 (100.0%)\n  Relative L2 error: inf (up to 0.00236 allowed)\n  Greatest error in ulps at the reference's scale: inf\nnote: 7 fully-masked row(s) in this case; declared convention: zeros\nattribution: needs Dv != D; needs the backward; holds with Lq=128 [bug d7938f692e2e]\nuntested: Lq = Lk (fully_masked_rows always draws it; gradients_match_reference fails without it too: maybe another bug); no window (fully_masked_rows always draws it; gradients_match_reference fails without it too: maybe another bug); Lk=128 (fully_masked_rows always draws it; gradients_match_reference fails without it too: maybe another bug); float32 (flash-attn4 does not claim dtype float32); D=16 (flash-attn4 on SM90 picks its tiles from D alone and upstream tests only Dv < D; Dv > D is not claimed)\nfirst failing example: #3 after 29.21 s; 9 examples run with shrinking\nreplay: attnverify repro /root/out/rep_fa4/cases/a269fc2b833c.json"  # noqa: E501 (copied from the run's journal)


def test_nan_in_a_tma_page_with_sinks_is_the_documented_rule_and_only_it():
    prop = "sinks_paged"
    assert FA4.classify(prop, SINKS_PAGED_TMA)[0] == "known"
    assert "must be finite" in FA4.known_failures[prop] and prop in FA4.known_not_strict
    for other in (SINKS_PAGED_TMA.replace("page_size=128", "page_size=16"),  # no TMA page at D=16 with 16 slots
                  SINKS_PAGED_TMA.replace("hold nan", "hold 30000.0"),  # finite garbage must never leak
                  SINKS_PAGED_TMA.replace("16 non-finite value(s) where the reference differs (NaN/Inf)\n", "")
                                 .replace("got nan,", "got 0.5,")):  # a finite wrong output
        assert other != SINKS_PAGED_TMA
        assert FA4.classify(prop, other)[0] == "failed", other
    # the same rule on paged_equals_contiguous (its own message names the garbage)
    assert "must be finite" in FA4.known_failures["paged_equals_contiguous"]


@pytest.mark.parametrize("prop", ["fully_masked_rows", "gradients_match_reference", "outputs_fully_written"])
def test_the_dv_backward_compile_error_is_f40_and_only_it(prop):
    msg = FULLY_MASKED_DV_BWD.replace("fully_masked_rows", prop)
    assert FA4.classify(prop, msg)[0] == "known"
    assert "F40" in FA4.known_failures[prop] and prop in FA4.known_not_strict
    for other in (msg.replace(" Dv=32", ""),  # Dv = D: not this finding
                  msg.replace("backward raised MLIRError: Operation creation failed:",
                              "backward raised RuntimeError: CUDA error")):  # another error
        assert FA4.classify(prop, other)[0] == "failed", other


def test_f37_covers_the_sink_gradient_lost_with_the_lse():
    msg = ("sink_as_extra_key failed for flash-attn4 (profile ci)\nshrunk case: B=1 Hq=1 Hkv=1 Lq=1 Lk=1 D=16 float16\n"
           "[flash-attn4] FAILED\nlse: MISMATCH\n  1 non-finite value(s) where the reference differs (NaN/Inf)\n"
           "  Mismatched elements: 1 / 1 (100.0%)\n  Greatest absolute difference: 0 at index (0, 0, 0) (got inf, "
           "expected 90.1; up to 0.01 allowed)\ndsinks: MISMATCH\n  Relative L2 error: 1\n"
           "property parameters: {'sinks': {'kind': 'dominant', 'level': 30.0, 'seed': 1}}")
    assert FA4.classify("sink_as_extra_key", msg)[0] == "known"
    assert FA4.classify("sink_as_extra_key", msg.replace("lse: MISMATCH", "dq: MISMATCH"))[0] == "failed"
