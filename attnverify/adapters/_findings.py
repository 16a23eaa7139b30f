"""`match` patterns for known findings that several adapters share (known_failures={prop: {"why", "match"}}).

Each is written against the message its property produces, so a declaration hides only that failure.
`finding` and `combine` build a declaration and join two of one property.
"""


def finding(why: str, match: str, strict: bool = True) -> dict:
    """A declared finding; `strict=False` where a run may not show it (the reason says why): a pass is then a pass,
    not a strict XPASS (docs/adapters.md, `known_failures`)."""
    return {"why": why, "match": match} if strict else {"why": why, "match": match, "strict": False}


def combine(*findings: dict) -> dict:
    """Several findings of one property: either reason, either pattern; strict unless one of them is not."""
    return finding("; ".join(f["why"] for f in findings), "|".join(f"(?:{f['match']})" for f in findings),
                   strict=all(f.get("strict", True) for f in findings))


# contract: k and v of different lengths accepted (the trial's own name in the contract property's message)
DIFFERENT_KV = "k and v of different lengths"

# a prefix: the output itself compared right (the failure is elsewhere: gradients, non-finite rows)
OUTPUT_RIGHT = r"^(?![\s\S]*\bout: MISMATCH)"

# nonfinite_inputs_propagate: a query row holding NaN comes back finite, everything else right -- the
# only poison a NaN in q, and no mismatch of the finite output
NAN_Q_ROW_SWALLOWED = (OUTPUT_RIGHT + r"[\s\S]*the NaN/Inf was swallowed[\s\S]*"
                       r"poison: \[(?:\('q', [^()]*'nan'\)(?:, )?)+\]")

# nonfinite_inputs_propagate: a key holding +inf (every query's score against it +inf) comes back finite,
# everything else right -- the only poison a +inf in k
INF_KEY_SWALLOWED = (OUTPUT_RIGHT + r"[\s\S]*the NaN/Inf was swallowed[\s\S]*"
                     r"poison: \[\('k', [^()]*'inf'\)\]")
# torch SDPA's CPU flash kernel (torch 2.13) does both (benchmarks/repro_sdpa_flash_inf_key.py for the +inf key)
CPU_FLASH_SWALLOWED = f"(?:{NAN_Q_ROW_SWALLOWED})|(?:{INF_KEY_SWALLOWED})"

# no_out_of_bounds: a varlen segment's keys/values reached another segment's rows
VARLEN_LEAK = "varlen segment leak"

# fully_masked_rows: a row with no visible key is not 0 (finite garbage, or NaN in a gradient) while the declared
# convention is zeros -- judged (no error raised), at least one fully-masked row in the case (SDPA's cuDNN, F26)
FULLY_MASKED_NOT_ZERO = (r"^(?![\s\S]*(?:\] ERROR:|the property raised))[\s\S]*\b(?:out|dq|dk|dv): MISMATCH[\s\S]*"
                         r"note: [1-9]\d* fully-masked row\(s\) in this case; declared convention: zeros")

# the output compared wrong on a float16/bfloat16 case with no non-finite value: a kernel that rounds the scores to
# the input dtype before its softmax, against attnverify's same-dtype baseline with float32 scores (F30, F34)
HALF_SCORES_OUT = r"^(?![\s\S]*non-finite)[\s\S]*shrunk case: [^\n]*\b(?:float16|bfloat16)\b[\s\S]*\bout: MISMATCH"
