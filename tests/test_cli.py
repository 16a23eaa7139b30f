"""The `attnverify` command line: run, adapters, repro, report, exit codes."""
import argparse
import json
import sys


from attnverify import cli

MINE_OK = """
import torch, attnverify as av

@av.adapter("mine")
def mine(q, k, v, spec):
    s = (q @ k.transpose(-1, -2)) * spec.resolved_scale(q.shape[-1])
    return torch.softmax(s, dim=-1) @ v
"""


def test_adapters_table_lists_builtins_with_availability(capsys):
    assert cli.main(["adapters"]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out.splitlines()[1:] if ln.strip()}
    assert "available" in lines["naive"] and "dtypes=" in lines["naive"]
    assert "available" in lines["sdpa-math"]
    assert cli.main(["adapters", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in rows} >= {"naive", "sdpa", "sdpa-math"}
    assert all(r["status"] == "available" or r["status"].startswith("unavailable: ") for r in rows)


def _ns(**kw):
    base = dict(adapter=None, profile=None, report=None, seed=None, device=None, max_examples=None, isolate=None,
                timeout=None, numprocesses=None, keyword=None, quiet=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_run_defaults_every_available_builtin_ci_on_cpu_dev_on_gpu(monkeypatch):
    monkeypatch.delenv("ATTNVERIFY_ADAPTER", raising=False)
    monkeypatch.delenv("ATTNVERIFY_PROFILE", raising=False)
    args = cli.pytest_args_for_run(_ns(), [], gpu=False)
    adapter_arg = next(a for a in args if a.startswith("--adapter="))
    names = adapter_arg.split("=", 1)[1].split(",")
    assert "naive" in names and "sdpa-math" in names and "sdpa-efficient" not in names  # no CUDA here
    assert "--attn-profile=ci" in args and "--attn-only" in args and "-v" in args
    assert "--attn-profile=dev" in cli.pytest_args_for_run(_ns(), [], gpu=True)
    args = cli.pytest_args_for_run(_ns(adapter=["mine,x"], seed=3, numprocesses="2", profile="thorough"), ["-x"])
    assert "--adapter=mine,x" in args and "--attn-seed=3" in args and args[-1] == "-x"
    assert "--attn-profile=thorough" in args and args[args.index("-n") + 1] == "2"


def test_run_is_pytest_underneath_and_runs_only_the_suite(pytester):
    pytester.makeconftest(MINE_OK)
    pytester.makepyfile(test_own="def test_own_fails():\n    assert False\n")
    res = pytester.run(sys.executable, "-m", "attnverify.cli", "run", "--adapter", "mine", "--max-examples", "2",
                       "-k", "forward_matches_reference or inputs_unmodified", "--no-html", "--", "-p", "no:randomly")
    out = res.stdout.str()
    assert res.ret == 0, out + res.stderr.str()
    assert "test_forward_matches_reference[mine] PASSED" in out and "test_inputs_unmodified[mine] PASSED" in out
    assert "test_own_fails" not in out  # the repo's own tests are not part of `attnverify run`
    assert "--attn-profile=ci" in out  # no GPU here


def test_run_exit_codes(pytester, monkeypatch):
    pytester.makeconftest(MINE_OK.replace("* spec.resolved_scale(q.shape[-1])", ""))  # wrong: no scale
    monkeypatch.chdir(pytester.path)
    common = ["--max-examples", "2", "-q", "--no-html", "-k", "forward_matches_reference"]
    assert cli.main(["run", "--adapter", "mine", *common]) == 1
    assert cli.main(["run", "--adapter", "nope", *common]) == 2
    assert cli.main(["run", "--adapter", "mine", *common[:-2], "-k", "no_such_property"]) == 2  # nothing to run


def test_repro_report_and_usage_errors(tmp_path, capsys):
    assert cli.main(["repro", str(tmp_path / "missing.json")]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli.main(["repro", str(bad)]) == 2
    assert cli.main(["repro", str(tmp_path)]) == 2  # a folder without a journal
    assert cli.main(["report", str(tmp_path / "nowhere")]) == 2
    # selftest and bench hand their arguments to their own parsers: a bad option is a usage error
    assert cli.main(["selftest", "--no-such-option"]) == 2 and cli.main(["bench", "--no-such-option"]) == 2
    assert cli.main([]) == 2
    assert cli.main(["adapters", "--bogus"]) == 2
    capsys.readouterr()


def _naive_case_file(tmp_path) -> str:
    """A saved case (no property) that names the naive adapter: what `attnverify repro` replays through check()."""
    from attnverify.case import CaseRecipe, build_case

    path = str(tmp_path / "c.json")
    build_case(CaseRecipe(len_q=5, len_k=6, head_dim=16, seed=2)).save(path)
    d = json.load(open(path))
    d["adapter"] = "naive"
    json.dump(d, open(path, "w"))
    return path


def test_repro_of_a_case_file_without_property_uses_check(tmp_path, capsys):
    path = _naive_case_file(tmp_path)
    assert cli.main(["repro", path]) == 0
    out = capsys.readouterr().out
    assert "HELD" in out and "out" in out


def test_run_names_the_fix_for_an_option_it_spells_differently(capsys, monkeypatch):
    # `--out` reached pytest and came back as a bare "unrecognized arguments"; now the usage error names
    # run's spelling, and pytest is never started (monkeypatched to fail loudly if it is)
    monkeypatch.setattr(cli, "cmd_run", lambda ns, extra: (_ for _ in ()).throw(AssertionError("ran pytest")))
    assert cli.main(["run", "--adapter", "naive", "--out", "r"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "--out" in err and "did you mean --report" in err
    assert cli.main(["run", "--examples=5"]) == cli.EXIT_USAGE
    assert "did you mean --max-examples" in capsys.readouterr().err
    # an option pytest knows still goes through to it, and so does anything after `--`
    calls = []
    monkeypatch.setattr(cli, "cmd_run", lambda ns, extra: calls.append(extra) or 0)
    assert cli.main(["run", "--adapter", "naive", "-x", "--", "--out", "r"]) == 0
    assert calls == [["-x", "--out", "r"]]


def test_repro_that_judged_nothing_is_not_run_not_held(tmp_path, capsys, monkeypatch):
    """A replay whose property skipped (nothing judged: the adapter refuses the drawn case, a claim is gone) must
    not print HELD or exit 0: it prints NOT RUN and exits 1."""
    import types

    import attnverify.isolation as isolation

    path = _naive_case_file(tmp_path)
    skipped = types.SimpleNamespace(status="skipped", passed=True, records=[], message="skipped: refused by the adapter")

    class Runner:  # what make_runner hands back: called once per replay, then closed
        def __call__(self, prop, adapter, drawn):
            return skipped

        def close(self):
            pass

    monkeypatch.setattr(isolation, "make_runner", lambda *a: Runner())
    assert cli.main(["repro", path]) == cli.EXIT_FAILED
    out = capsys.readouterr().out
    assert "NOT RUN" in out and "HELD" not in out and "refused by the adapter" in out


def test_python_dash_m_runs_the_command_where_its_script_is_not_on_path(tmp_path):
    """A checkout used through PYTHONPATH (the H200 machine: no install, no `attnverify` on PATH) runs it as a module,
    with the command's exit codes: 0 for a listing, 2 for a usage error."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(cli.__file__)))}
    ok = subprocess.run([sys.executable, "-m", "attnverify", "adapters"], capture_output=True, text=True, env=env,
                        cwd=tmp_path, timeout=240)
    assert ok.returncode == 0 and "naive" in ok.stdout, ok.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-m", "attnverify", "run", "--profile", "nightly"], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=240)
    assert bad.returncode == 2 and "--profile" in bad.stderr, bad.stderr[-2000:]
