"""Standalone: PyTorch's paged flex attention lets NaN in the unused slots of a partly used page reach the output
(docs/compatibility.md F38; attnverify's flex-paged adapter declares it for paged_equals_contiguous and
kv_cache_append).

    python benchmarks/repro_flex_paged_nan.py          # on a CUDA GPU (compiled flex_attention); < 1 minute
    python benchmarks/repro_flex_paged_nan.py --cpu    # the same on the CPU with eager flex_attention

Needs torch >= 2.6 only (torch.nn.attention.experimental._paged_attention.PagedAttention, private and experimental).
Without CUDA (and without --cpu) it prints why and exits 0.

One sequence of `length` keys on page 3 of a 4-page pool of 128 slots, q of one row, D=16 fp32; every slot the
sequence does not use holds `garbage`: NaN, or a finite 3e4. PagedAttention's own bookkeeping (reserve,
convert_logical_block_mask, get_score_mod) masks the logical positions past the length, as its docs say. Printed per
(length, garbage): the output's NaN count and its largest error against float64 attention over the sequence's keys.
From the H200 run of 2026-12-05 (torch 2.11, compiled, attnverify's shrunk case: length 1, page 128): NaN garbage ->
every output element NaN; expected with finite garbage: no NaN and the right answer. Length 128 (the page full, NaN
only in pages the sequence does not use) is the control: the compiled kernel skips the blocks the block mask
excludes, so it should not leak there (this script's own numbers: not yet run on the H200). --cpu uses eager
flex_attention, which is unfused: it computes every slot of the pool, so there NaN leaks from unused pages too
(length 128 included), which a compiled kernel, skipping the blocks the mask excludes, should not do.
The kernel loads whole key blocks (BLOCK_N = the page size) and masks their scores, but
multiplies the masked slots' values by P = 0, and 0 * NaN = NaN. PyTorch documents nothing about the contents of
unused or freed slots (_paged_attention.py, flex_attention's docstring).
"""
import json
import math
import sys

import torch


def emit(**kw):
    print(json.dumps(kw), flush=True)


def main(dev: str) -> None:
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    attend = torch.compile(flex_attention, dynamic=False) if dev == "cuda" else flex_attention
    n_pages, page, hkv, d, page_of_seq = 4, 128, 1, 16, 3
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, d, generator=g).to(dev)
    keys = torch.randn(page, d, generator=g, dtype=torch.float64)
    vals = torch.randn(page, d, generator=g, dtype=torch.float64)
    emit(torch=torch.__version__, device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
         compiled=dev == "cuda")
    pa = PagedAttention(n_pages, page, 1, device=dev)
    pa.empty_pages = [page_of_seq]  # reserve takes the list's last entries: the sequence lives on page 3
    pa.reserve(torch.tensor(0, device=dev), torch.tensor(page, device=dev))
    lens = torch.zeros(1, dtype=torch.int64, device=dev)  # one tensor, refilled: the mods' closures stay the same
    score_mod = pa.get_score_mod(None, lens)

    def visible(b, h, qi, ki):
        return ki < lens[b]

    for length in (1, 100, 128):  # 128: the page fully used, NaN only in pages the sequence does not use
        lens.fill_(length)
        block_mask = pa.convert_logical_block_mask(
            create_block_mask(visible, 1, None, 1, page, device=dev, BLOCK_SIZE=(128, page)), kv_len=lens)
        for garbage in (math.nan, 3e4):
            kc = torch.full((1, hkv, n_pages * page, d), garbage, dtype=torch.float32)
            vc = kc.clone()
            at = page_of_seq * page
            kc[0, 0, at:at + length], vc[0, 0, at:at + length] = keys[:length].float(), vals[:length].float()
            out = attend(q, kc.to(dev), vc.to(dev), block_mask=block_mask, score_mod=score_mod, scale=d ** -0.5)
            s = (q.double().cpu()[0, 0] @ keys[:length].T) * d ** -0.5
            ref = torch.softmax(s, -1) @ vals[:length]
            o = out.double().cpu()[0, 0]
            finite = torch.isfinite(o)
            emit(length=length, page_size=page, garbage=str(garbage), partly_used_page=length % page != 0,
                 out_nan=int(o.isnan().sum()), out_elements=o.numel(),
                 max_abs_err=float((o - ref)[finite].abs().max()) if finite.any() else None)


if __name__ == "__main__":
    if "--cpu" in sys.argv[1:]:
        main("cpu")
    elif not torch.cuda.is_available():
        print("repro_flex_paged_nan: no CUDA device here (pass --cpu for the CPU, eager flex_attention); nothing run")
    else:
        main("cuda")
