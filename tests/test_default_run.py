"""The README's main command on a CPU leaves out what cannot fit its 10 minutes, and says how to add it."""
import pytest

import attnverify as av
from attnverify.adapters.registry import BUILTINS, get
from attnverify.default_run import on_request_lines, split_default


def _a(name, min_timeout=None, on_request_cpu=None):
    """An adapter as a built-in module declares it: a compile time (min_timeout) or a measured CPU time."""
    return av.adapter(name, register=False, min_timeout=min_timeout, on_request_cpu=on_request_cpu)(lambda q, k, v, s: q)


def test_cpu_default_run_lists_slow_adapters_on_request_with_their_time_and_command():
    adapters = [_a("naive"), _a("flex", 900.0), _a("slow-client", on_request_cpu="ci profile 2,032 s on a 2-core CPU"),
                _a("ort-gqa"), _a("compiles", 60.0)]
    run, on_request = split_default(adapters, gpu=False)
    assert run == ["naive", "ort-gqa"]
    assert [n for n, _ in on_request] == ["flex", "slow-client", "compiles"]
    lines = on_request_lines(on_request)
    assert all("add it with: attnverify run --adapter " in line for line in lines)
    assert "21 min" in lines[0] and "2,032 s" in lines[1] and "minutes per shape cold" in lines[2]


def test_gpu_default_run_takes_every_available_adapter():
    adapters = [_a("naive"), _a("flex", 900.0), _a("slow-client", on_request_cpu="ci profile 229 s")]
    run, on_request = split_default(adapters, gpu=True)
    assert run == [a.name for a in adapters] and on_request == []


def test_the_measured_cpu_clients_declare_their_time():
    """The built-ins measured too slow for the default CPU run (docs/compatibility.md) say so themselves."""
    declared = {}
    for n in BUILTINS:
        try:
            declared[n] = get(n).on_request_cpu
        except Exception:  # noqa: BLE001 - an optional module that does not load declares nothing here
            continue
    slow = {n for n, why in declared.items() if why}
    assert slow == {"onnx-attention", "ort-mha", "hf-sdpa", "hf-eager", "keras-torch", "keras-jax", "tinygrad"} & set(declared)
    assert "2,032 s" in declared["keras-jax"] and "ort-gqa" not in slow  # ort-gqa (58 s) stays in the default run


def test_on_request_cpu_is_a_reason():
    with pytest.raises(ValueError, match="on_request_cpu"):
        _a("bad", on_request_cpu="  ")
