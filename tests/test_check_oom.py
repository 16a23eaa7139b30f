"""A device out of memory during the backward is an error (the machine's limit), as in the forward, not a wrong
answer: on a GPU shared by 19 judging processes (H100, 2026-12-05) the thorough run reported backward OOMs as
"MISMATCH ... backward raised OutOfMemoryError" failures and shrank them like bugs."""
from __future__ import annotations

import pytest
import torch

import attnverify as av
from attnverify.adapters.registry import get
from attnverify.case import CaseRecipe, build_case



class _Raise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, exc):
        ctx.exc = exc
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ctx.exc


def _backward_raising(exc):
    naive = get("naive")

    @av.adapter("bwd-raises", register=False, dtypes=("float32",), backward=True)
    def a(q, k, v, spec):
        return _Raise.apply(naive(q, k, v, spec).out, exc)

    return a


@pytest.mark.parametrize("exc", [
    getattr(torch, "OutOfMemoryError", RuntimeError)("CUDA out of memory. Tried to allocate 1.94 GiB"),
    RuntimeError("Triton Error [CUDA]: out of memory"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
], ids=["torch", "triton", "cublas"])
def test_a_backward_out_of_memory_is_an_error_not_a_wrong_answer(exc):
    r = av.check(_backward_raising(exc), build_case(CaseRecipe(len_q=5, len_k=7, head_dim=16, dtype="float32")))
    assert r.status == "error" and r.error.startswith("backward: ") and str(exc) in r.error


def test_any_other_backward_exception_is_still_a_failure():
    r = av.check(_backward_raising(ValueError("unsupported head dim")),
                 build_case(CaseRecipe(len_q=5, len_k=7, head_dim=16, dtype="float32")))
    assert r.status == "failed"
    assert any("backward raised ValueError" in p for c in r.comparisons for p in c.problems)


def test_a_wrong_forward_still_fails_when_the_backward_runs_out_of_memory():
    naive = get("naive")

    @av.adapter("half-off-then-oom", register=False, dtypes=("float32",), backward=True)
    def a(q, k, v, spec):
        return _Raise.apply(naive(q, k, v, spec).out * 0.5, RuntimeError("CUDA error: out of memory"))

    r = av.check(a, build_case(CaseRecipe(len_q=5, len_k=7, head_dim=16, dtype="float32")))
    assert r.status == "failed" and any(c.name == "out" and not c.passed for c in r.comparisons)
    assert any("ran out of device memory" in n for n in r.notes)


def test_the_judges_own_exception_in_the_backward_is_raised_not_blamed_on_the_adapter(monkeypatch):
    import attnverify.check as check_mod

    def broken(*args, **kwargs):
        raise KeyError("a bug of the judge")

    monkeypatch.setattr(check_mod, "upstream", broken)
    with pytest.raises(KeyError, match="a bug of the judge"):
        av.check(get("naive"), build_case(CaseRecipe(len_q=5, len_k=7, head_dim=16, dtype="float32")))
