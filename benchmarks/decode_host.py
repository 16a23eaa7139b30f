"""Host cost of one `paged_decode` call, measurable without a GPU: kernel launches, tensor allocations, device
read-backs (syncs on a GPU) and the Python microseconds around the launches, with the kernels stubbed out.

    PYTHONPATH=$PWD python benchmarks/decode_host.py [--calls 2000]

The two Triton kernels are replaced by a stub that records each launch and its argument count, so the time is
everything paged_decode does on the host besides Triton's own launch path (binding and specialising the
arguments, then the driver call: that part is measured on the GPU, benchmarks/decode_bench.py). Allocations and
read-backs as the calls of Tensor.tolist / item / __bool__ / __int__ made inside paged_decode (each one a
device-to-host sync on a GPU); allocations with torch's dispatcher (TorchDispatchMode: aten.empty*, new_empty*,
zeros, full). CPU tensors; the counts are the same on a GPU. The time is the best of --repeats rounds.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ALLOC = ("empty", "new_empty", "empty_strided", "empty_like", "zeros", "full", "new_zeros")
READ_BACKS = ("tolist", "item", "__bool__", "__int__")


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.alloc = self.sync = self.ops = 0
        self.saved = {}

    def __enter__(self):
        for name in READ_BACKS:
            orig = self.saved[name] = getattr(torch.Tensor, name)

            def counted(t, *a, _orig=orig, **kw):
                self.sync += 1
                return _orig(t, *a, **kw)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, orig in self.saved.items():
            setattr(torch.Tensor, name, orig)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.alloc += func.overloadpacket.__name__ in ALLOC
        return func(*args, **(kwargs or {}))


class Stub:
    def __init__(self):
        self.launches, self.args = 0, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches += 1
            self.args.append(len(args) + len(kw))
        return launch


def cases():
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, d, lk, page = 4, 32, 8, 128, 1024, 16
    q = torch.randn(b, hq, 1, d, generator=g, dtype=torch.float16)
    pool = torch.randn(b * lk // page, page, hkv, d, generator=g, dtype=torch.float16)
    cont = torch.randn(b, lk, hkv, d, generator=g, dtype=torch.float16)
    table = torch.randperm(b * lk // page, generator=g).view(b, -1).to(torch.int32)
    lens = torch.full((b,), lk, dtype=torch.int32)
    yield "contiguous, num_splits=1", (q, cont, cont, lens), dict(num_splits=1)
    yield "contiguous, num_splits=4", (q, cont, cont, lens), dict(num_splits=4)
    yield "paged p16, num_splits=1", (q, pool, pool, lens), dict(block_table=table, num_splits=1)
    yield "paged p16, num_splits=4", (q, pool, pool, lens), dict(block_table=table, num_splits=4)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--module", default="attnverify.kernels.serving", help="the module whose paged_decode is measured")
    a = p.parse_args(argv)
    import importlib

    from attnverify.kernels import combine, decode

    serving = importlib.import_module(a.module)

    rows = []
    for name, args, kw in cases():
        for validate in (True, False):
            stubs = Stub(), Stub()
            saved = decode._decode_partial, combine._combine
            decode._decode_partial, combine._combine = stubs
            try:
                with Count() as c:
                    serving.paged_decode(*args, validate_lengths=validate, **kw)
                us = float("inf")
                for _ in range(a.repeats):
                    t = time.perf_counter()
                    for _ in range(a.calls):
                        serving.paged_decode(*args, validate_lengths=validate, **kw)
                    us = min(us, (time.perf_counter() - t) / a.calls * 1e6)
            finally:
                decode._decode_partial, combine._combine = saved
            launches = sum(s.launches for s in stubs) // (a.calls * a.repeats + 1)
            nargs = "+".join(str(s.args[0]) for s in stubs if s.args)
            rows.append((name, validate, launches, nargs, c.alloc, c.sync, c.ops, us))
    print("| call | validate_lengths | launches | kernel args | allocations | read-backs (syncs) | aten ops | host us "
          "(kernels stubbed) |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| {} | {} | {} | {} | {} | {} | {} | {:.1f} |".format(*r))


if __name__ == "__main__":
    main()
