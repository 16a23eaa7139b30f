"""The zoo: deliberately wrong attention implementations, for `attnverify selftest`.

A verification tool must show what it catches. Each member is one realistic bug of a kind real
kernels shipped, behind an unregistered adapter that claims what a real kernel of that kind claims:

    from attnverify.zoo import ZOO, get_member
    for m in ZOO:
        print(m.name, m.kind, m.expected, "-", m.bug, "|", m.stands_for)

`ZooMember` fields: `name`, `bug` (what is wrong), `stands_for` (the real-world class of bug),
`adapter` (an `attnverify.Adapter`, not registered), `expected` (the properties expected to catch
it, tried first by selftest), `kind` ("triton": a Triton kernel, run by the Triton interpreter on a
CPU; "eager": a PyTorch forward with one bug; "autograd": a correct forward with a wrong backward),
`fast` (in `selftest --fast`, the CI subset).

Modules: `_triton_wrong` (one parametrised Triton flash forward with a BUG switch; Triton imported on
first use), `_eager` (an independent PyTorch attention with a `bug=` switch, and `BuggyGrad`),
`_precision` (the precision class: a FlashAttention-2-style kernel with one rounding in the input dtype),
`_members` (the registry), `selftest` (`attnverify selftest`), `grid` (the fixed-grid baseline).
"""
from __future__ import annotations

from typing import List

from ._fp8 import fp8_online_adapter
from ._members import ZOO, ZooMember


def get_member(name: str) -> ZooMember:
    for m in ZOO:
        if m.name == name or m.adapter.name == name:
            return m
    raise KeyError(f"unknown zoo member {name!r}; known: {', '.join(m.name for m in ZOO)}")


def fast_members() -> List[ZooMember]:
    return [m for m in ZOO if m.fast]


__all__ = ["ZOO", "ZooMember", "get_member", "fast_members", "fp8_online_adapter"]
