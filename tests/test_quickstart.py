"""README's quick start, followed by a stranger in a fresh kernel repository (a temporary folder).

The repository holds only what the quick start says to write (tests/conftest.py, verbatim from the
README's `<!-- quickstart: ... -->` blocks) next to the user's own kernel: `mykernels.py`, a flash-style
BSHD kernel in plain torch written here, once with a planted bug (the causal mask aligned top-left
although the claims promise bottom-right) and once fixed. The README's command then runs there, as is:
it fails on the bug and passes on the fix; with the adapter's claim narrowed to CUDA on a machine
without one it fails with the "nothing was tested" message.

attnverify itself comes from this checkout (the environment the tests run in; installing it is
checked by tests/test_docs.py's install-block test); the kernel is made importable with PYTHONPATH, which
is what `pip install -e .` gives a kernel repo.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from test_docs import ROOT, _commands, _env, parse_blocks

README = ROOT / "README.md"
CUDA = torch.cuda.is_available()

KERNEL = '''"""mykernels: flash-style attention in plain torch (q (B, Sq, H, D), k/v (B, Sk, Hkv, D) -> (B, Sq, H, D))."""
import torch


def flash_attn_func(q, k, v, causal=False, softmax_scale=None):
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"flash_attn_func: fp16 or bf16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, sq, h, d = q.shape
    if d not in (32, 64, 128) or k.shape[-1] != d or v.shape[-1] != d or h % k.shape[2]:
        raise ValueError(f"flash_attn_func: head dims 32, 64, 128 and Hq divisible by Hkv, got {q.shape}, {k.shape}")
    sk, hkv = k.shape[1], k.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    qh = q.transpose(1, 2).float()
    kh = k.transpose(1, 2).float().repeat_interleave(h // hkv, dim=1)
    vh = v.transpose(1, 2).float().repeat_interleave(h // hkv, dim=1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    if causal:
        visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(DIAGONAL)
        s = s.masked_fill(~visible, float("-inf"))
        dead = ~visible.any(dim=-1, keepdim=True)  # rows that see no key give 0
        p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    else:
        p = torch.softmax(s, dim=-1)
    return (p @ vh).to(q.dtype).transpose(1, 2)
'''
BUGGY = KERNEL.replace("DIAGONAL", "0")  # top-left: query i sees keys j <= i, whatever Lk - Lq is
FIXED = KERNEL.replace("DIAGONAL", "sk - sq")  # bottom-right, as flash-attn >= 2.1


def quickstart():
    """({path: text} to write, [commands to run]) from the README's quick start."""
    blocks = [b for b in parse_blocks(README) if "quickstart" in b.markers]
    files = {b.markers["quickstart"]: b.code + "\n" for b in blocks if b.markers["quickstart"] != "run"}
    runs = [c for b in blocks if b.markers["quickstart"] == "run" for c in _commands(b.code)]
    assert files and runs, "README.md lost its quick start blocks (<!-- quickstart: tests/conftest.py --> / run)"
    return files, runs


def make_repo(root: Path, kernel: str, edit=None) -> Path:
    files, _ = quickstart()
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(edit(text) if edit else text)
    (root / "mykernels.py").write_text(kernel)
    return root


def run_quickstart(repo: Path, **env):
    _, runs = quickstart()
    (cmd,) = runs
    assert cmd == "pytest --adapter=mine --attn-only --attn-profile=ci", cmd
    e = _env(PYTHONPATH=os.pathsep.join([str(repo), str(ROOT)]), **env)  # the kernel importable, as pip install -e .
    r = subprocess.run(["bash", "-c", cmd], cwd=repo, env=e, capture_output=True, text=True, timeout=900)
    return r.returncode, r.stdout + r.stderr


def test_the_quick_start_adapter_transposes_bhsd_to_bshd():
    files, _ = quickstart()
    conftest = files["tests/conftest.py"]
    assert "q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)" in conftest and "out.transpose(1, 2)" in conftest


def test_quick_start_fails_on_a_planted_bug_and_passes_when_fixed(tmp_path):
    repo = make_repo(tmp_path / "buggy", BUGGY)
    rc, out = run_quickstart(repo)
    assert rc == 1, out[-5000:]
    assert "FAILED attnverify::test_causal_alignment[mine]" in out, out[-5000:]
    assert "causal_alignment[mine]: attnverify repro reports/cases/" in out
    assert (repo / "reports" / "index.html").is_file()  # rendered by the plugin: no second command
    fixed = make_repo(tmp_path / "fixed", FIXED)
    rc, out = run_quickstart(fixed)
    assert rc == 0, out[-5000:]
    assert " passed" in out and "failed" not in out.splitlines()[-1], out[-3000:]
    assert "test_gradients_match_reference[mine] PASSED" in out or "gradients_match_reference     ok" in out


@pytest.mark.skipif(CUDA, reason="this machine has a CUDA GPU: a CUDA-only adapter is tested here, not refused")
def test_quick_start_with_a_cuda_only_claim_on_a_cpu_says_nothing_was_tested(tmp_path):
    def cuda_only(text):
        assert 'devices=("cpu", "cuda"),' in text
        return text.replace('devices=("cpu", "cuda"),', 'devices=("cuda",),')

    repo = make_repo(tmp_path / "gpu-only", FIXED, edit=cuda_only)
    rc, out = run_quickstart(repo)
    assert rc == 5, out[-5000:]
    assert "NOTHING WAS TESTED for adapter mine" in out
    assert "TRITON_INTERPRET=1" in out and "--attn-allow-untested" in out
