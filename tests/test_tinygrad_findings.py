"""F34 (tinygrad 0.14.0 rounds the scores to float16 before its softmax) against the messages its ci profile wrote.

The two messages are copied from the run of 2026-12-04 (docs/compatibility.md F34); the declaration must take them
and refuse the same failures in float32 or with a non-finite value, so it cannot hide another tinygrad failure.
Needs no tinygrad: the declaration is data on the adapter.
"""
import pytest

from attnverify.adapters.registry import get

MESSAGES = {
    'forward_matches_reference': "\n".join([
        "forward_matches_reference failed for tinygrad (profile ci)",
        "shrunk case: B=1 Hq=1 Hkv=1 Lq=64 Lk=64 D=16 float16",
        "[tinygrad] FAILED: B=1 Hq=1 Hkv=1 Lq=64 Lk=64 D=16 float16",
        "out: MISMATCH",
        "  every element is within its bound but the norm-wise error is not",
        "  Mismatched elements: 0 / 1024 (0.0%)",
        "  Greatest absolute difference: 0.000646 at index (0, 0, 41, 0) (got -0.762207, expected -0.762854; up to 0.00487 allowed)",
        "  Relative L2 error: 0.000224 (up to 0.000202 allowed)",
        "  Greatest error in ulps at the reference's scale: 2.0",
    ]),
    'causal_alignment': "\n".join([
        "causal_alignment failed for tinygrad (profile ci)",
        "shrunk case: B=1 Hq=1 Hkv=1 Lq=63 Lk=15 D=8 float16 causal=top_left row_shift=100",
        "[tinygrad] FAILED: B=1 Hq=1 Hkv=1 Lq=63 Lk=15 D=8 float16 causal=top_left row_shift=100",
        "out: MISMATCH",
        "  Mismatched elements: 257 / 504 (51.0%)",
        "  Greatest absolute difference: 0.0249 at index (0, 0, 3, 6) (got 0.0400696, expected 0.0650115; up to 0.00248 allowed)",
        "  Relative L2 error: 0.0124 (up to 0.00055 allowed)",
        "  Greatest error in ulps at the reference's scale: 85.8",
    ]),
}


@pytest.mark.parametrize("prop", sorted(MESSAGES))
def test_f34_is_declared_for_the_measured_half_precision_failures_only(prop):
    a = get("tinygrad")
    msg = MESSAGES[prop]
    assert a.classify(prop, msg)[0] == "known"
    assert "F34" in a.classify(prop, msg)[1]
    assert a.classify(prop, msg.replace("float16", "float32"))[0] == "failed"
    assert a.classify(prop, msg.replace("out: MISMATCH", "out: MISMATCH\n  3 non-finite value(s)"))[0] == "failed"
    assert a.classify("row_shift_invariance", msg)[0] == "failed"  # declared only where measured
