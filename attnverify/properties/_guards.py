"""Guards and poisoning for the contract properties: poisoned allocations, guarded buffers whose
surroundings hold NaN and huge values, structural checks of a result, and the helpers they share."""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
import os
from typing import Callable, List, Optional, Tuple

import torch

from ..adapters.base import Adapter
from ..case import Case
from ..check import bitwise_equal, unpack_output
from ..spec import Output
from .base import ExampleResult
from ..devices import cuda_present

# ------------------------------------------------------------------------------------------ helpers


def _cuda_reason(adapter) -> Optional[str]:
    """Why a CUDA-only property cannot run for this adapter here (None: it can)."""
    if not cuda_present():  # does not initialise a context
        return "no CUDA device here (this property needs a GPU)"
    if "cuda" not in adapter.claims.devices:
        return f"{adapter.name} does not claim device cuda"
    return None


def _skipped(why: str, case: Optional[Case] = None) -> ExampleResult:
    return ExampleResult(True, message=why, status="skipped", case=None if case is None else case.to_dict())


def _proxy(adapter: Adapter, fn: Callable) -> Adapter:
    """The same adapter (name, claims, refusals), called through `fn(q, k, v, spec)`."""
    return Adapter(name=adapter.name, fn=fn, claims=adapter.claims, description=adapter.description,
                   availability=adapter.availability, refuses=adapter.refuses)


def _rewrap(result, out):
    """Put `out` back into the adapter's return value (tensor, Output or tuple)."""
    if isinstance(result, Output):
        return Output(out, lse=result.lse, dropout_mask=result.dropout_mask)
    if isinstance(result, (tuple, list)) and len(result) in (2, 3):
        return type(result)([out, *result[1:]])
    return out


class _OnBackward(torch.autograd.Function):
    """Identity in forward; in backward, `hook(grad)` returns the gradient the adapter's backward sees."""

    @staticmethod
    def forward(ctx, x, hook):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.hook(g), None


def _on_backward(out, hook):
    if isinstance(out, torch.Tensor) and torch.is_grad_enabled() and out.requires_grad:
        return _OnBackward.apply(out, hook)
    return out


def _digest(t: torch.Tensor) -> str:
    """Content + geometry hash of a tensor (bitwise: NaN payloads and -0.0 count)."""
    x = t.detach()
    h = hashlib.sha1(f"{tuple(x.shape)}|{x.stride()}|{x.storage_offset()}|{x.dtype}".encode())
    if x.numel():
        c = x.contiguous().cpu()
        if c.dtype == torch.bool:
            c = c.to(torch.uint8)
        h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _storage_span(t: torch.Tensor) -> Tuple[int, int]:
    """[first, last] byte addresses a strided tensor can touch."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    es = t.element_size()
    lo = t.data_ptr() + es * sum(min(0, s * (n - 1)) for s, n in zip(t.stride(), t.shape))
    hi = t.data_ptr() + es * (sum(max(0, s * (n - 1)) for s, n in zip(t.stride(), t.shape)) + 1)
    return lo, hi


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = _storage_span(a), _storage_span(b)
    return a0 < b1 and b0 < a1


def _accepts_out(adapter: Adapter) -> bool:
    """Does the adapter's function take an `out=` buffer (an optional extension of the adapter API)?"""
    try:
        return "out" in inspect.signature(adapter.fn).parameters
    except (TypeError, ValueError):
        return False


# ------------------------------------------------------------------------------------ poisoning memory


class Poisoner:
    """Fill and free buffers so that the allocator hands poisoned (all-ones bytes: NaN in every float
    type, -1 in integers) memory to the next allocations.

    CUDA: the caching allocator reuses a freed block of the same size (best fit, same stream) and
    splits big cached blocks, so blocks of the exact output sizes plus one large block are poisoned.
    CPU: glibc reuses freed chunks of the same size; above the mmap threshold a first free only raises
    the threshold, so every size is poisoned twice. Best effort on the CPU: measured, a 16 KiB block comes
    back poisoned, a 4 MiB one does not (glibc trims the freed top of the heap, fresh pages are zero), and
    a freed neighbour with stale data can merge first; what is not poisoned is caught by the reference
    comparison (zeros or stale values), only without the "unwritten" diagnosis.
    """

    def __init__(self, device, nbytes: List[int], big_factor: int = 4, big_cap: int = 1 << 30):
        self.device = torch.device(device)
        self.sizes = sorted({int(n) for n in nbytes if n > 0}, reverse=True)
        self.big = min(big_cap, big_factor * sum(self.sizes)) if self.device.type == "cuda" else 0
        self.calls = 0

    def __call__(self, grad=None):
        """Poison; returns `grad` unchanged (so it can sit in a backward hook)."""
        self.calls += 1
        rounds = 2 if self.device.type == "cpu" else 1
        for _r in range(rounds):
            held = []
            for n in self.sizes:
                for _i in range(2):
                    held.append(torch.full((n,), 255, dtype=torch.uint8, device=self.device))
            if self.big:
                try:
                    held.append(torch.full((self.big,), 255, dtype=torch.uint8, device=self.device))
                except RuntimeError:  # out of memory: the exact sizes are what matter most
                    pass
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the fills must land before the blocks are reused
            del held
        return grad


def _output_nbytes(case: Case) -> List[int]:
    b, hq, lq, _ = case.q.shape
    dv = case.v.shape[-1]
    es = case.q.element_size()
    return [b * hq * lq * dv * es, b * hq * lq * 4, case.q.numel() * es, case.k.numel() * es, case.v.numel() * es,
            b * hq * lq * dv * 4]


# ----------------------------------------------------------------------------------- guarded buffers


def _huge(dtype: torch.dtype) -> float:
    try:
        return float(torch.finfo(dtype).max) / 4
    except TypeError:
        return 1e30


def _sentinel_fill(flat: torch.Tensor) -> None:
    """NaN, +huge, -huge repeating: a read that is multiplied by 0 shows as NaN, one that is masked
    after the fact shows as a dominant score or value."""
    n = flat.numel()
    idx = torch.arange(n, device=flat.device) % 3
    h = _huge(flat.dtype)
    vals = torch.tensor([math.nan, h, -h], dtype=torch.float64, device=flat.device).to(flat.dtype)
    flat.copy_(vals[idx])


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class Guards:
    """Views into larger buffers whose surroundings hold sentinels; `verify()` lists what changed there.

    mode "padded": each (b, h) slab has `pad_l` rows before and `pad_r` rows after (reading one tile
    past the end hits them) and the head dim is padded to the next power of two plus 8; the last dim
    stays unit-stride. mode "flat": the tensor is contiguous, with sentinel runs before and after it in
    the same storage. Both start at a non-zero storage offset that keeps 16-byte alignment (`lead`
    elements). mode "unaligned" is "flat" one element in: a valid tensor whose data pointer is not
    16-byte aligned, which an adapter must use or refuse with an error, never fault on (PyTorch's CUDA
    flash kernel faulted with a misaligned address, docs/compatibility.md F9).
    """

    def __init__(self, mode: str = "padded", pad_rows: int = 128, lead: int = 64):
        if mode not in ("padded", "flat", "unaligned"):
            raise ValueError(f"Guards(mode={mode!r}): use 'padded', 'flat' or 'unaligned'")
        self.mode = mode
        self.pad_rows = int(pad_rows)
        self.lead = 1 if mode == "unaligned" else int(lead)  # unaligned: "flat" one element in, not 16-byte aligned
        self.items: List[Tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def wrap(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A guarded copy of `t` (same values and shape; no autograd)."""
        t = t.detach()
        if self.mode == "padded" and t.dim() == 4:
            b, h, l, d = t.shape
            pl, pr = 3, self.pad_rows
            dp = _pow2(d) + 8
            n = b * h * (pl + l + pr) * dp
            flat = torch.empty(self.lead + n + self.lead, dtype=t.dtype, device=t.device)
            _sentinel_fill(flat)
            view = flat[self.lead:self.lead + n].view(b, h, pl + l + pr, dp)[:, :, pl:pl + l, :d]
        else:
            n = t.numel()
            tail = self.lead + self.pad_rows * (t.shape[-1] if t.dim() else 1)
            flat = torch.empty(self.lead + n + tail, dtype=t.dtype, device=t.device)
            _sentinel_fill(flat)
            view = flat[self.lead:self.lead + n].view(t.shape)
        view.copy_(t)
        region = torch.zeros(flat.numel(), dtype=torch.bool, device=t.device)
        if view.numel():
            region.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(True)
        self.items.append((name, flat, region, flat[~region].clone(), view))
        return view

    def verify(self) -> List[str]:
        bad = []
        for name, flat, region, before, _view in self.items:
            now = flat[~region]
            if not bitwise_equal(before, now):
                n = int((torch.nan_to_num(before, nan=1.5) != torch.nan_to_num(now, nan=1.5)).sum()
                        + (torch.isnan(before) != torch.isnan(now)).sum())
                bad.append(f"out-of-bounds write: {n} element(s) of the memory around {name} changed "
                           f"(the call wrote outside the tensor it was given)")
        return bad


class _ToGuarded(torch.autograd.Function):
    """Forward: the input's values in a guarded view (the adapter reads from there, and saves it for
    backward). Backward: the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x, guards, name):
        return guards.wrap(name, x)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def _guarded(x: torch.Tensor, guards: Guards, name: str) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _ToGuarded.apply(x, guards, name)
    return guards.wrap(name, x)


# ------------------------------------------------------------------------------ structural checks


def structure_problems(adapter: Adapter, case: Case, result, q=None, k=None, v=None) -> List[str]:
    """Shape, dtype, device, layout of every output; no self-overlap; no aliasing of the inputs."""
    q = case.q if q is None else q
    k = case.k if k is None else k
    v = case.v if v is None else v
    b, hq, lq, _ = q.shape
    lk, dv = k.shape[2], v.shape[-1]
    out, lse, keep = unpack_output(result)
    probs: List[str] = []

    def tensor_checks(name, t, shape, dtype, allow_dtypes=None):
        if not isinstance(t, torch.Tensor):
            probs.append(f"{name} is a {type(t).__name__}, not a tensor")
            return
        if tuple(t.shape) != tuple(shape):
            probs.append(f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}")
        ok = (dtype,) if allow_dtypes is None else tuple(allow_dtypes)
        if t.dtype not in ok:
            probs.append(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected "
                         f"{' or '.join(str(x).replace('torch.', '') for x in ok)}")
        if t.device != q.device:
            probs.append(f"{name} is on {t.device}; the inputs are on {q.device}")
        if t.layout != torch.strided:
            probs.append(f"{name} has layout {t.layout}; expected torch.strided")
        elif t.numel() > 1 and torch._debug_has_internal_overlap(t) == 1:
            probs.append(f"{name} has overlapping memory (strides {t.stride()}): its elements are not "
                         f"separately written")
        if t.layout == torch.strided:
            for iname, it in (("q", q), ("k", k), ("v", v)):
                if isinstance(it, torch.Tensor) and _shares_memory(t, it):
                    probs.append(f"{name} shares memory with the input {iname} (an output must not alias an input)")

    tensor_checks("out", out, (b, hq, lq, dv), q.dtype)
    if case.spec.return_lse and adapter.claims.lse:
        if lse is None:
            probs.append("lse was asked for (spec.return_lse) and is claimed, but not returned")
        else:
            # float32 (SPEC); a float64 call may keep float64
            tensor_checks("lse", lse, (b, hq, lq), torch.float32,
                          (torch.float32, torch.float64) if q.dtype == torch.float64 else None)
    if keep is not None:
        tensor_checks("dropout_mask", keep, (b, hq, lq, lk), torch.bool)
    return probs


def _with_problems(res: ExampleResult, problems: List[str], header: str, severity: float = 10.0) -> ExampleResult:
    if not problems:
        return res
    msg = "\n".join([header] + problems)
    res.message = msg + ("\n" + res.message if res.message else "")
    res.passed = False
    res.status = "failed" if res.status in ("passed", "skipped", "") else res.status
    res.severity = max(res.severity if res.severity == res.severity else 1e30, severity)
    return res


def _in_guards(case: Case, mode: str) -> Case:
    """The case with q, k, v in (unchecked) guards of `mode`: what the adapter would be handed."""
    probe = Guards(mode, pad_rows=1)
    return dataclasses.replace(case, q=probe.wrap("q", case.q), k=probe.wrap("k", case.k), v=probe.wrap("v", case.v))


def _refused(adapter, case: Case, note: str) -> ExampleResult:
    """A passing example where the adapter (declared or at run time) refused the inputs with an error."""
    return ExampleResult(True, "", severity=0.0, case=case.to_dict(),
                         records=[{"adapter": adapter.name, "status": "passed", "comparisons": [], "note": note}])


def _sync_faults(device) -> bool:
    """Whether synchronising the device raises (an asynchronous fault of the call just made)."""
    if getattr(device, "type", "cpu") != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - whatever synchronising raises, the call left the device broken
        return True
    return False


def _from_check(res, case) -> ExampleResult:
    return ExampleResult(passed=res.passed, message="" if res.passed else res.message(), severity=res.severity(),
                         records=[res.to_dict()], case=case.to_dict(), status=res.status, seconds=res.seconds)


def _unwritten_rows(out: Optional[torch.Tensor], ref_out: torch.Tensor, ref_lse=None, fully_masked="zeros") -> int:
    """Rows that hold NaN where the reference is finite: the poison shows through (rows with no visible
    key are left out unless the adapter declares zeros for them)."""
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(ref_out.shape):
        return 0
    o = out.detach().double().cpu()
    r = ref_out.detach().cpu()
    bad = (torch.isnan(o) & torch.isfinite(r)).any(-1)
    if fully_masked != "zeros" and isinstance(ref_lse, torch.Tensor):
        bad &= ~torch.isneginf(ref_lse.detach().cpu())
    return int(bad.sum())


def _interpreted_triton(adapter) -> bool:
    """A Triton kernel running under the interpreter (the bundled `triton` adapter without a GPU, or an
    adapter whose function lives in a module named after triton)."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    mod = str(getattr(adapter.fn, "__module__", "") or "")
    return "triton" in adapter.name.lower() or "triton" in mod.lower()
