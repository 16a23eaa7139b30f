"""Which calibration failures are an adapter's declared known findings (semantics), not a bound too tight.

A calibration (benchmarks/calibrate_tolerances.py) judges correct kernels case by case with `check`; a library
that misbehaves on a documented feature (cuDNN's fully-masked rows, F26; its NaN dQ under scores far below 0,
F10) fails there for a reason its adapter already declares, narrowed with `match`, for the properties that judge
the same thing. Such a failure is counted apart ("known") and its ratios are kept out of the tolerance
statistics: it says nothing about how tight a bound may be. A failure no declaration covers stays a false
positive.

    python benchmarks/calibration_findings.py RESULTS.json [--sdpa-cuda]    (re-classify a finished run's failures)

--sdpa-cuda applies the SDPA backends' CUDA declarations (attnverify/adapters/_sdpa_cuda_findings.py) off the
GPU, where the adapters declare only their CPU findings: for a run made on a GPU and read elsewhere.
"""
from __future__ import annotations

import json
import re
import sys
from collections import Counter
from typing import Callable, Optional

# the properties whose judgement the calibration's `check` repeats: a finding declared for one of them covers
# the same failure seen in a calibration case
CAL_PROPERTIES = ("forward_matches_reference", "lse_matches_reference", "gradients_match_reference",
                  "fully_masked_rows", "causal_alignment")
_SDPA_BACKEND = {"sdpa-cudnn": "cudnn", "sdpa-flash": "flash", "sdpa-efficient": "efficient", "sdpa": "default"}


def declared(known_finding: Callable[[str, str], Optional[str]], describe: str, message: str) -> Optional[str]:
    """'property: why' of the first declaration that covers this failure, else None. `known_finding` is
    Adapter.known_finding (property, message) -> why; the message is laid out as a property's failure is
    (`shrunk case: <case>` first), which the declarations' patterns are written against."""
    text = f"shrunk case: {describe}\n{message}"
    for prop in CAL_PROPERTIES:
        why = known_finding(prop, text)
        if why:
            return f"{prop}: {why}"
    return None


def table_matcher(findings: dict) -> Callable[[str, str], Optional[str]]:
    """Adapter.known_finding over a {property: {"why", "match"}} table."""
    def known(prop, text):
        d = findings.get(prop)
        if d and (not d.get("match") or re.search(d["match"], text)):
            return d["why"]
        return None
    return known


def reclassify(path: str, sdpa_cuda: bool = False) -> Counter:
    """Mark each failure of the run at `path` with the declaration that covers it ("known"); rewrite the file."""
    from attnverify.adapters import registry

    d = json.load(open(path))
    tally: Counter = Counter()
    for f in d.get("failures", []):
        name = f["adapter"]
        if sdpa_cuda and name in _SDPA_BACKEND:
            from attnverify.adapters._sdpa_cuda_findings import CUDA_FINDINGS
            match = table_matcher(CUDA_FINDINGS.get(_SDPA_BACKEND[name], {}))
        else:
            match = registry.get(name).known_finding
        f["known"] = declared(match, f["case"], f["message"]) if f["status"] == "failed" else None
        tally[(f"{name}/{f['dtype']}", "known" if f["known"] else "unexplained")] += 1
    json.dump(d, open(path, "w"), indent=1)
    return tally


def main(argv):
    paths = [a for a in argv if not a.startswith("--")]
    if not paths:
        raise SystemExit(__doc__)
    for p in paths:
        for (key, kind), n in sorted(reclassify(p, "--sdpa-cuda" in argv).items()):
            print(f"{p}: {key}: {n} {kind}")


if __name__ == "__main__":
    main(sys.argv[1:])
