"""Standalone: jax.dlpack.from_dlpack accepts a GPU buffer that is not 16-byte aligned, and the jitted
jax.nn.dot_product_attention given it fails later with INTERNAL "Address of buffer N must be a multiple
of 10" (F20, docs/compatibility.md).

    python benchmarks/repro_jax_unaligned.py      # a CUDA GPU, torch and jax[cuda]

A view that starts a few bytes into a torch buffer (one batch element of a bool mask, a slice of a packed
buffer) is a valid DLPack tensor. The import should copy it or refuse it; running fails instead.
Prints one JSON line per (input made misaligned, implementation); a copy made on the torch side is the
control.
"""
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import torch  # noqa: E402

B, T, S, N, H = 1, 4, 4, 2, 16


def shifted(shape, dtype, offset, fill):
    """A contiguous view starting `offset` elements into a fresh buffer."""
    n = 1
    for x in shape:
        n *= x
    buf = fill(offset + n, dtype)
    return buf[offset:].view(shape)


def main():
    print(json.dumps(dict(jax=jax.__version__, torch=torch.__version__, gpu=torch.cuda.get_device_name())), flush=True)
    rnd = lambda n, dt: torch.randn(n, device="cuda", dtype=dt)  # noqa: E731
    ones = lambda n, dt: torch.ones(n, device="cuda", dtype=dt)  # noqa: E731
    for impl in ("cudnn", "xla"):
        for what, offset in (("none", 0), ("mask", 1), ("q", 1), ("q_copied", 1)):
            q = shifted((B, T, N, H), torch.float16, offset if what.startswith("q") else 0, rnd)
            if what == "q_copied":
                q = q.clone()
            k, v = (rnd(B * S * N * H, torch.float16).view(B, S, N, H) for _ in range(2))
            mask = shifted((B, N, T, S), torch.bool, offset if what == "mask" else 0, ones)
            row = dict(impl=impl, misaligned=what, q_ptr_mod16=q.data_ptr() % 16, mask_ptr_mod16=mask.data_ptr() % 16)
            try:
                jq, jk, jv, jm = (jax.dlpack.from_dlpack(t) for t in (q, k, v, mask))
                row["imported_zero_copy"] = jq.unsafe_buffer_pointer() == q.data_ptr() and jm.unsafe_buffer_pointer() == mask.data_ptr()
                f = jax.jit(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m, implementation=impl))
                out = torch.from_dlpack(f(jq, jk, jv, jm))
                ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)))
                row["ok_max_err"] = float((out.float().transpose(1, 2) - ref).abs().max())
            except Exception as e:  # the finding: a clean error long after the import
                row["raised"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
