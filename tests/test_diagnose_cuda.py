"""The diagnosis of a failure on a GPU: the reference runs on the case's device, the observed outputs and the
alternatives are float64 on the CPU; the diagnosis must name the same semantics as for the same case on the
CPU (on the H200, 2026-12-05, every forward failure's evidence on cuda fell back to "metrics only": 'Expected
all tensors to be on the same device, but found at least two devices, cuda:0 and cpu')."""
from __future__ import annotations

import pytest
import torch

from attnverify.case import CaseRecipe, build_case
from attnverify.diagnose import Variant, alternative_forward, diagnose

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the case lives there")


@pytest.mark.parametrize("recipe, variant", [
    (dict(), Variant(scale=0.5)),  # a softmax scale other than the spec's
    (dict(causal="bottom_right", len_q=9, len_k=17), Variant(causal="top_left")),
    (dict(sinks={"kind": "normal", "level": 2.0, "seed": 1}, heads_q=2, heads_kv=2), Variant(sink="ignored")),
], ids=["scale", "causal-alignment", "sink-ignored"])
def test_a_cuda_case_is_diagnosed_like_its_cpu_copy(recipe, variant):
    base = dict(batch=1, heads_q=2, heads_kv=1, len_q=8, len_k=16, head_dim=16, dtype="float32", seed=3, return_lse=True)
    names = []
    for device in ("cpu", "cuda"):
        case = build_case(CaseRecipe(**{**base, **recipe, "device": device}))
        out, lse = alternative_forward(case.q, case.k, case.v, case.spec, variant)  # float64 on the CPU
        obs = {"out": out.to(device, torch.float32), "lse": lse.to(device, torch.float32)}
        d = diagnose(case, obs, failing=["out", "lse"])
        best = next((e for e in d.explanations if e.fits), None)
        assert best is not None, f"{device}: nothing named:\n{d.text()}"
        names.append(best.key)
    assert names[0] == names[1], names
