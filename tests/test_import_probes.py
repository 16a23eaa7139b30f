"""Nothing asks the machine at import (issue 19): importing any attnverify module probes no GPU, spawns no
process, looks up no installed package and changes no environment variable. Claims and known findings that
depend on the machine are computed on first use (attnverify/adapters/deferred.py) and are still right then.

Each check runs in a fresh interpreter whose probes raise while the modules are imported: the GPU probe
attnverify.devices.cuda_present, torch.cuda's queries, importlib.util.find_spec and subprocess.run/Popen.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

import attnverify as av

ROOT = pathlib.Path(__file__).resolve().parent.parent

_SCRIPT = r'''
import importlib, json, os, pathlib, subprocess, sys, traceback
import torch
import attnverify.devices as devices

root, extra, after = pathlib.Path(sys.argv[1]), sys.argv[2].split(",") if sys.argv[2] else [], sys.argv[3]
state = {"cuda": None}  # None: probing now is an error (we are importing)
asked = []

def _record(what):
    asked.append(what + ": " + "".join(traceback.format_stack(limit=4)[:-2]).strip().splitlines()[-1].strip())
    raise RuntimeError(what + " asked at import")

def cuda_present():
    if state["cuda"] is None:
        _record("attnverify.devices.cuda_present")
    return state["cuda"]

devices.cuda_present = cuda_present
real = {n: getattr(torch.cuda, n) for n in ("is_available", "device_count", "get_device_capability",
                                            "get_device_properties", "init", "current_device")}
for n in real:
    setattr(torch.cuda, n, lambda *a, n=n, **k: _record("torch.cuda." + n))
import importlib.util as iu
real_find_spec, real_run, real_popen = iu.find_spec, subprocess.run, subprocess.Popen
iu.find_spec = lambda *a, **k: _record("importlib.util.find_spec(%r)" % (a[:1],))
subprocess.run = lambda *a, **k: _record("subprocess.run")
subprocess.Popen = lambda *a, **k: _record("subprocess.Popen")
env_before = dict(os.environ)

modules = sorted(".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
                 for p in (root / "attnverify").rglob("*.py") if "__pycache__" not in p.parts)
failed = {}
for name in modules + extra:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"
env_changed = sorted(k for k in set(env_before) | set(os.environ) if env_before.get(k) != os.environ.get(k))

from attnverify.adapters.deferred import DeferredAdapter
from attnverify.adapters.registry import resolve
from attnverify.zoo import get_member
names = ["triton", "flex", "jax", "sdpa", "sdpa-flash", "sdpa-efficient"]
adapters = {n: resolve([n])[0] for n in names}
adapters["zoo-triton-no-rescale"] = get_member("zoo-triton-no-rescale").adapter
resolved_early = sorted(n for n, a in adapters.items() if not isinstance(a, DeferredAdapter) or a.resolved)

# now the machine may be asked: restore the probes, and say there is a GPU (with JAX's CUDA plugin) or not
iu.find_spec, subprocess.run, subprocess.Popen = real_find_spec, real_run, real_popen
for n, f in real.items():
    setattr(torch.cuda, n, f)
state["cuda"] = after == "cuda"
if after == "cuda":
    iu.find_spec = lambda name, *a: object() if name in ("jax", "jax_cuda12_plugin") else real_find_spec(name, *a)
claims = {}
for n, a in adapters.items():
    c = a.claims
    claims[n] = {"devices": list(c.devices), "dtypes": list(c.dtypes), "max_seqlen": c.max_seqlen,
                 "backward": c.backward, "lse": c.lse, "known": sorted(a.known_failures),
                 "min_timeout": a.min_timeout}
print("RESULT" + json.dumps({"modules": len(modules), "failed": failed, "asked": asked, "env_changed": env_changed,
                             "resolved_early": resolved_early, "claims": claims}))
'''


def _run(tmp_path, after: str, extra=(), path=None):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([str(path)] if path else []) + [env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", _SCRIPT, str(ROOT), ",".join(extra), after], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT"):])


def test_importing_every_module_asks_the_machine_nothing_and_claims_follow_a_cpu(tmp_path):
    r = _run(tmp_path, "cpu")
    assert r["modules"] > 100  # the whole package was imported, not an empty list
    assert r["failed"] == {} and r["asked"] == [], (r["failed"], r["asked"])
    assert r["env_changed"] == []  # no TRITON_INTERPRET, no XLA_PYTHON_CLIENT_PREALLOCATE at import
    assert r["resolved_early"] == []  # every machine-dependent adapter is deferred and nothing resolved it
    c = r["claims"]
    assert c["triton"]["devices"] == ["cpu"] and c["triton"]["max_seqlen"] == 4096
    assert c["zoo-triton-no-rescale"]["devices"] == ["cpu"]
    # flex on the CPU: no backward, no LSE; its CPU findings (F2 swallowed NaN) and the cold-compile timeout
    assert c["flex"]["devices"] == ["cpu"] and not c["flex"]["backward"] and not c["flex"]["lse"]
    assert "nonfinite_inputs_propagate" in c["flex"]["known"] and c["flex"]["min_timeout"] == 900.0
    # jax on the CPU: XLA, no fp16 (XLA:CPU rejects its precision under jit)
    assert c["jax"]["devices"] == ["cpu"] and c["jax"]["dtypes"] == ["bfloat16", "float32"] and c["jax"]["lse"]
    assert c["sdpa"]["devices"] == ["cpu"] and c["sdpa-efficient"]["devices"] == ["cpu"]


def test_claims_follow_a_gpu_when_asked(tmp_path):
    c = _run(tmp_path, "cuda")["claims"]
    assert c["triton"]["devices"] == ["cuda"] and c["triton"]["max_seqlen"] == 16384
    assert c["zoo-triton-no-rescale"]["devices"] == ["cuda"]
    assert c["flex"]["devices"] == ["cuda"] and c["flex"]["backward"] and c["flex"]["lse"]
    assert "nonfinite_inputs_propagate" not in c["flex"]["known"] and c["flex"]["min_timeout"] == 300.0
    # jax with its CUDA plugin: the cuDNN implementation, fp16/bf16, no LSE
    assert c["jax"]["devices"] == ["cuda"] and c["jax"]["dtypes"] == ["float16", "bfloat16"] and not c["jax"]["lse"]
    assert c["sdpa"]["max_seqlen"] == 16384 and c["sdpa-efficient"]["dtypes"] == ["float16", "bfloat16", "float32"]


_PLANTS = {
    "planted_cuda": "from attnverify.devices import cuda_present\nCUDA = cuda_present()\n",
    "planted_torch": "import torch\nGPU = torch.cuda.is_available()\n",
    "planted_spec": "import importlib.util\nHAS = importlib.util.find_spec('jax') is not None\n",
    "planted_claims": "from attnverify.adapters.registry import resolve\nTRITON_DEVICES = resolve(['triton'])[0].claims.devices\n",
    "planted_env": "import os\nos.environ['TRITON_INTERPRET'] = '1'\n",
}


def test_the_check_catches_a_module_that_probes_at_import(tmp_path):
    """Planted modules that ask the machine while they are imported (through attnverify's probe, torch.cuda, a
    package lookup, a built-in's claims) or change the environment are reported: the checks above can fail."""
    for name, source in _PLANTS.items():
        (tmp_path / f"{name}.py").write_text(source)
    r = _run(tmp_path, "cpu", extra=list(_PLANTS), path=tmp_path)
    assert sorted(r["failed"]) == ["planted_claims", "planted_cuda", "planted_spec", "planted_torch"], r["failed"]
    assert all("asked at import" in why for why in r["failed"].values())
    assert len(r["asked"]) == 4 and r["env_changed"] == ["TRITON_INTERPRET"]


def test_deferred_claims_are_computed_once_on_first_use_and_validated():
    """`@av.adapter(..., deferred_claims=fn)` as a user writes it: fn is not called at decoration, is called once,
    and its keywords (claims, known_failures, min_timeout) are merged over the static ones and validated."""
    calls = []

    def machine():
        calls.append(1)
        return dict(devices=("cpu",), dtypes=("float16", "float32"), min_timeout=60,
                    known_failures={"determinism": {"why": "atomics on this machine", "match": "bitwise"}})

    @av.adapter("deferred-user", register=False, deferred_claims=machine, gqa=True, dtypes=("float32",))
    def mine(q, k, v, spec):
        return q

    assert calls == [] and not mine.resolved
    assert mine.claims.dtypes == ("float16", "float32") and mine.claims.gqa  # deferred wins, static kept
    assert mine.min_timeout == 60.0 and mine.known_patterns == {"determinism": "bitwise"}
    assert mine.classify("determinism", "not bitwise identical")[0] == "known"
    assert mine.classify("determinism", "something else")[0] == "failed"
    _ = mine.claims, mine.known_failures
    assert calls == [1]

    with pytest.raises(TypeError, match="deferred_claims"):
        av.adapter("bad", register=False, deferred_claims={"devices": ("cpu",)})(lambda q, k, v, s: q)
    bad = av.adapter("bad-kw", register=False, deferred_claims=lambda: {"devise": ("cpu",)})(lambda q, k, v, s: q)
    with pytest.raises(TypeError, match=r"'bad-kw'.*unknown keyword.*devise"):
        bad.claims
    bad = av.adapter("bad-dev", register=False, deferred_claims=lambda: {"devices": ("tpu",)})(lambda q, k, v, s: q)
    with pytest.raises(ValueError, match=r"'bad-dev', devices=.*tpu"):
        bad.claims
    bad = av.adapter("bad-ret", register=False, deferred_claims=lambda: None)(lambda q, k, v, s: q)
    with pytest.raises(TypeError, match="return a dict"):
        bad.claims
