"""`match` patterns for known findings that several adapters share (known_failures={prop: {"why", "match"}}).

Each is written against the message its property produces, so a declaration hides only that failure.
"""

# contract: k and v of different lengths accepted (the trial's own name in the contract property's message)
DIFFERENT_KV = "k and v of different lengths"

# a prefix: the output itself compared right (the failure is elsewhere: gradients, non-finite rows)
OUTPUT_RIGHT = r"^(?![\s\S]*\bout: MISMATCH)"

# nonfinite_inputs_propagate: a query row holding NaN comes back finite, everything else right -- the
# only poison a NaN in q, and no mismatch of the finite output
NAN_Q_ROW_SWALLOWED = (OUTPUT_RIGHT + r"[\s\S]*the NaN/Inf was swallowed[\s\S]*"
                       r"poison: \[(?:\('q', [^()]*'nan'\)(?:, )?)+\]")

# no_out_of_bounds: a varlen segment's keys/values reached another segment's rows
VARLEN_LEAK = "varlen segment leak"
