"""Diagnosis of a failed check: which alternative semantics explain what the adapter returned.

    from attnverify.diagnose import diagnose, diagnose_result
    d = diagnose_result(check_result)          # a CheckResult from av.check (kept tensors)
    d = diagnose(case, {"out": out, "lse": lse}, declared_fully_masked="zeros", tiles=(64, 64))
    print(d.summary)                           # "scale missing (1.0 used instead of 0.125)" / "no simple explanation"

Method: the case is recomputed in float64 under each alternative semantics (the other causal
alignment, diagonal excluded, window bound off by one, scale missing/doubled/default, softcap before
scale, GQA interleaved, fully-masked rows as NaN/mean(V)/unmasked, LSE base 2, dropout not rescaled,
a batch or head reading another's K/V, padded tail keys counted, last key tile skipped, the online
softmax without its rescale, an fp8 descale ignored, sinks ignored or in the numerator). A case whose
features the engine does not model (KV cache, chunked attention: its default semantics do not reproduce
the reference) is explained by nothing, with a note. An alternative *explains* the output when the adapter's output is within
a few tolerances of it, much closer than to the reference, and NaN/Inf sit in the same places.
When none does, error signatures are measured (concentrated in the last key tile, only where the
running max jumps, growing with the number of keys summed, confined to some heads or to fully-masked
rows). When nothing fits the summary says "no simple explanation".

Pure functions of tensors and records: no pytest, no adapter calls, no I/O.

Modules: records (Explanation, Signature, Diagnosis), engine (the float64 engine with knobs: Variant,
alternative_forward), alternatives (which Variants to try), fit (residuals), ranking (`diagnose`),
signatures (error patterns, key_error_profile).
"""
from __future__ import annotations

from .alternatives import TILE_CANDIDATES
from .engine import ONLINE_UPDATES, Variant, alternative_forward, online_update
from .ranking import MAX_ELEMENTS, diagnose
from .records import NO_EXPLANATION, Diagnosis, Explanation, Signature
from .signatures import key_error_profile

__all__ = [
    "diagnose", "diagnose_result", "Diagnosis", "Explanation", "Signature", "NO_EXPLANATION", "Variant",
    "alternative_forward", "key_error_profile", "online_update", "ONLINE_UPDATES", "TILE_CANDIDATES", "MAX_ELEMENTS",
]


def diagnose_result(result, *, adapter=None, dropout_mask=None) -> Diagnosis:
    """Diagnose a failed `CheckResult` (made with keep_tensors=True, the default)."""
    if result.status == "error":
        return Diagnosis(NO_EXPLANATION, notes=["the adapter raised; nothing to diagnose numerically"])
    if not result.outputs:
        return Diagnosis(NO_EXPLANATION, notes=["the check kept no tensors (keep_tensors=False)"])
    failing = [c.name for c in result.comparisons if not c.passed]
    tol = {c.name: c.tol_norm for c in result.comparisons}
    claims = getattr(adapter, "claims", None)
    fm = claims.fully_masked if claims is not None else "zeros"
    tiles = claims.tiles if claims is not None else None
    keep = dropout_mask if dropout_mask is not None else result.outputs.get("dropout_mask")
    observed = dict(result.outputs)
    if claims is not None and "lse" in observed:  # the adapter's declared LSE conventions, back in the contract's
        from ..lse_conventions import observed_lse

        observed["lse"] = observed_lse(claims, result.case.spec, observed["lse"])
    d = diagnose(result.case, observed, failing=failing, declared_fully_masked=fm, tiles=tiles,
                 tol_norm=tol, dropout_mask=keep)
    from ..precision_diagnosis import with_precision  # issue 20: name precision where semantics explain nothing

    return with_precision(d, result)
