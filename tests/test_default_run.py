"""The README's main command on a CPU leaves out what cannot fit its 10 minutes, and says how to add it."""
from types import SimpleNamespace

from attnverify.default_run import ON_REQUEST_CPU, on_request_lines, split_default


def _a(name, min_timeout=None):
    return SimpleNamespace(name=name, min_timeout=min_timeout)


def test_cpu_default_run_lists_slow_adapters_on_request_with_their_time_and_command():
    adapters = [_a("naive"), _a("flex", 900.0), _a("keras-jax"), _a("ort-gqa"), _a("tinygrad")]
    run, on_request = split_default(adapters, gpu=False)
    assert run == ["naive", "ort-gqa"]
    assert [n for n, _ in on_request] == ["flex", "keras-jax", "tinygrad"]
    lines = on_request_lines(on_request)
    assert all("add it with: attnverify run --adapter " in line for line in lines)
    assert "2,032 s" in lines[1] and "21 min" in lines[0]


def test_gpu_default_run_takes_every_available_adapter():
    adapters = [_a("naive"), _a("flex", 900.0)] + [_a(n) for n in ON_REQUEST_CPU]
    run, on_request = split_default(adapters, gpu=True)
    assert run == [a.name for a in adapters] and on_request == []
