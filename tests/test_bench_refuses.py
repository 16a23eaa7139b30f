"""`attnverify bench` asks the claims and `refuses` about the exact shape it times (issue 18): a kernel
whose `refuses` rejects N % 128 != 0 is timed at 128 and 256, and 200 is reported as refused."""
import json
import textwrap

from attnverify.bench import main

TUTORIAL = textwrap.dedent('''
    import torch, attnverify as av

    def _refuses(case):
        n = case.q.shape[2]
        return f"N={n}: the kernel needs N % 128 == 0" if n % 128 or case.k.shape[2] % 128 else None

    @av.adapter("tutorial128", register=False, refuses=_refuses, head_dims=(16, 64))
    def tutorial128(q, k, v, spec):
        if q.shape[2] % 128:
            raise ValueError("N % 128 != 0")  # what the kernel does with such a shape
        s = (q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
        return torch.softmax(s, dim=-1) @ v
''')


def test_bench_asks_refuses_about_the_shape_it_times(tmp_path, capsys):
    f = tmp_path / "mine.py"
    f.write_text(TUTORIAL)
    rc = main(["--adapter", f"{f}:tutorial128", "--seqlens", "128,200,256", "--head-dim", "16", "--device", "cpu",
               "--warmup", "0", "--rep", "1", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {r["n"]: r for r in json.loads((tmp_path / "out" / "bench.json").read_text())["rows"]}
    assert rows[128].get("fwd_ms", 0) > 0 and rows[256].get("fwd_ms", 0) > 0, rows
    assert "error" not in rows[128] and "error" not in rows[256]
    assert "fwd_ms" not in rows[200] and "N=200: the kernel needs N % 128 == 0" in rows[200]["skipped"], rows[200]
