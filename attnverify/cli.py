"""`attnverify`: run the suite, list adapters, replay a saved case, render the report.

    attnverify run [--adapter NAME ...] [--profile P] [--seed N] [-n N] [-- PYTEST ARGS]
    attnverify run --ray [ADDRESS] [--ray-shards N] ...   # one Ray task per shard, one merged report
    attnverify adapters
    attnverify repro FILE            # reports/cases/<id>.json, or a results.jsonl: its dangling case
    attnverify report DIR            # or: attnverify report RUN1 RUN2 ... --out MERGED

Exit status: 0 all held, 1 a property failed, 2 usage error or nothing tested (an adapter unavailable
here or every property skipped; `run --allow-untested` accepts that), 3 internal error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import List, Optional
from .devices import cuda_present

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_STOPPED = 130  # stopped by Ctrl-C or SIGTERM (pytest's "interrupted"), as a shell reports a Ctrl-C


class CliUsageError(Exception):
    pass


# --------------------------------------------------------------------------------------------- run


def _gpu_present() -> bool:
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # ask NVML: this process may fork judges
    try:

        return bool(cuda_present())
    except Exception:
        return False


def default_adapters(out=sys.stdout, *, gpu: Optional[bool] = None) -> List[str]:
    """Every built-in adapter this machine can run (without a GPU: but those that compile every shape,
    listed as on request with the command that adds them); prints the others with the reason."""
    from .adapters.registry import BUILTINS, get
    from .default_run import on_request_lines, split_default

    names = []
    for n in BUILTINS:
        try:
            a = get(n)
            why = a.unavailable_reason()
        except Exception as e:  # noqa: BLE001 - a missing optional module is "unavailable", never fatal
            why = f"failed to load: {type(e).__name__}: {e}"
        if why is None:
            names.append(n)
        else:
            print(f"attnverify run: skipping {n}: {why}", file=out)
    names, on_request = split_default([get(n) for n in names], _gpu_present() if gpu is None else gpu)
    for line in on_request_lines(on_request):
        print(line, file=out)
    return names


def pytest_args_for_run(ns, extra: List[str], *, gpu: Optional[bool] = None, out=sys.stdout) -> List[str]:
    adapters = []
    for a in ns.adapter or []:
        adapters += [x.strip() for x in a.split(",") if x.strip()]
    if not adapters and not os.environ.get("ATTNVERIFY_ADAPTER"):
        adapters = default_adapters(out, gpu=gpu)
        if not adapters:
            raise CliUsageError("no built-in adapter is available on this machine; name one with --adapter")
    profile = ns.profile
    if profile is None and not os.environ.get("ATTNVERIFY_PROFILE"):
        profile = "dev" if (_gpu_present() if gpu is None else gpu) else "ci"
    args: List[str] = []
    # named as the installed entry point is: pytest registers it once, from a source tree or an install
    args += ["-p", "attnverify.plugin", "--attn-only", "-p", "no:cacheprovider", "-rfE"]
    # run imports attnverify before pytest starts, so pytest's assertion rewriting warned on every run that it could
    # not rewrite attnverify (noise: attnverify's own messages need no rewriting); -W's message is literal
    args += ["-W", "ignore:Module already imported so cannot be rewritten; attnverify:pytest.PytestAssertRewriteWarning"]
    if adapters:
        args += [f"--adapter={','.join(adapters)}"]
    for flag, val in (("--attn-profile", profile), ("--attn-report", ns.report), ("--attn-seed", ns.seed),
                      ("--attn-device", ns.device), ("--attn-max-examples", ns.max_examples),
                      ("--attn-isolate", ns.isolate), ("--attn-timeout", ns.timeout),
                      ("--attn-max-bugs", getattr(ns, "max_bugs", None)),
                      ("--attn-shard", getattr(ns, "shard", None)), ("--attn-db", getattr(ns, "db", None))):
        if val is not None:
            args.append(f"{flag}={val}")
    if getattr(ns, "allow_untested", False):
        args.append("--attn-allow-untested")
    budget = getattr(ns, "prewarm_budget", None)
    if getattr(ns, "prewarm", False) or budget is not None:  # a budget asks for the pre-warm
        args.append("--attn-prewarm")
    if budget is not None:
        args.append(f"--attn-prewarm-budget={budget:.15g}")
    if ns.numprocesses is not None:
        args += ["-n", str(ns.numprocesses)]
    if ns.keyword:
        args += ["-k", ns.keyword]
    args += ["-q"] if ns.quiet else ["-v"]  # -v: one progress line per (property, adapter)
    return args + list(extra)


# options users reach for that `run` spells differently; anything else unknown goes on to pytest
RUN_OPTION_SPELLINGS = {
    "--out": "--report", "--output": "--report", "--output-dir": "--report", "--reports": "--report",
    "--report-dir": "--report", "--adapters": "--adapter", "--examples": "--max-examples",
    "--max_examples": "--max-examples", "--workers": "-n", "--jobs": "-n", "--dev": "--profile dev",
    "--ci": "--profile ci", "--thorough": "--profile thorough", "--gpu": "--device cuda",
    "--cuda": "--device cuda", "--cpu": "--device cpu",
}


def run_option_misspellings(unknown: List[str]) -> Optional[str]:
    """A usage error naming the fix for an option `run` spells differently, else None (pytest's turn)."""
    for arg in unknown:
        name = arg.split("=", 1)[0]
        if name in RUN_OPTION_SPELLINGS:
            return (f"unknown option {name}: did you mean {RUN_OPTION_SPELLINGS[name]}? "
                    "(`attnverify run --help` lists run's options; anything after `--` goes to pytest as written)")
    return None


def cmd_run(ns, extra: List[str]) -> int:
    import pytest

    args = pytest_args_for_run(ns, extra)
    print("attnverify run: pytest " + " ".join(args), flush=True)
    before = os.environ.get("ATTNVERIFY_NO_HTML")
    if ns.no_html:  # the plugin renders reports/index.html at the end of the session unless told not to
        os.environ["ATTNVERIFY_NO_HTML"] = "1"
    from .lifeline import SigtermStopsRun

    try:
        with SigtermStopsRun():  # SIGTERM stops the run as Ctrl-C does: what was judged is journaled and rendered
            code = int(pytest.main(args))
    finally:  # called in-process (tests, notebooks): a later session in this process renders again
        if before is None:
            os.environ.pop("ATTNVERIFY_NO_HTML", None)
        else:
            os.environ["ATTNVERIFY_NO_HTML"] = before
    return {0: EXIT_OK, 1: EXIT_FAILED, 2: EXIT_STOPPED, 4: EXIT_USAGE, 5: EXIT_USAGE}.get(code, EXIT_INTERNAL)


# ---------------------------------------------------------------------------------------- adapters


def cmd_adapters(ns) -> int:
    from .adapters.registry import all_adapters

    _import_conftest(ns.conftest)
    rows = []
    for a in all_adapters():
        why = a.unavailable_reason()
        rows.append((a.name, "available" if why is None else f"unavailable: {why}", a.claims.summary()))
    if ns.json:
        print(json.dumps([{"name": n, "status": s, "claims": c} for n, s, c in rows], indent=1))
        return EXIT_OK
    w0 = max([len("adapter")] + [len(r[0]) for r in rows])
    w1 = min(60, max([len("status")] + [len(r[1]) for r in rows]))
    print(f"{'adapter'.ljust(w0)}  {'status'.ljust(w1)}  claims")
    for n, s, c in rows:
        print(f"{n.ljust(w0)}  {(s if len(s) <= w1 else s[:w1 - 3] + '...').ljust(w1)}  {c}")
    return EXIT_OK


def _import_conftest(path: Optional[str]) -> None:
    """Import a conftest.py (default: ./conftest.py) so the adapters it registers are known.

    Its folder goes on sys.path first (as pytest does); an import error is reported, not swallowed,
    since the adapters it would have registered are then missing."""
    explicit = path is not None
    path = path or ("conftest.py" if os.path.exists("conftest.py") else None)
    if not path:
        return
    if not os.path.exists(path):
        raise CliUsageError(f"--conftest {path!r}: no such file; give the path of the conftest.py that registers your adapters")
    from .adapters.registry import import_file

    try:
        import_file(path)
    except Exception as e:
        if explicit:
            raise CliUsageError(f"--conftest {path!r} failed to import: {type(e).__name__}: {e}") from e
        print(f"attnverify: warning: ./conftest.py failed to import ({type(e).__name__}: {e}); "
              "adapters it registers are unavailable", file=sys.stderr)


# ------------------------------------------------------------------------------------------- repro


class _CheckCase:
    """A stand-in property for a saved case without a property: check(adapter, case)."""

    name = "check"

    def __init__(self, path: str, device: Optional[str]):
        self.path, self.device = path, device

    def run_example(self, adapter, drawn):
        from .case import load_case
        from .check import check
        from .properties.base import ExampleResult

        case = load_case(self.path, device=self.device)
        res = check(adapter, case)
        return ExampleResult(res.passed, message=res.message(), severity=res.severity(), records=[res.to_dict()],
                             case=case.to_dict(), status=res.status)


def _find_adapter(d: dict, override: Optional[str]):
    from .adapters.registry import UnknownAdapterError, get, load_target as _load_target

    name = override or d.get("adapter")
    if not name:
        raise CliUsageError("the case names no adapter; give one with --adapter")
    try:
        return get(name)
    except UnknownAdapterError:
        origin = d.get("adapter_origin") or {}
        f = origin.get("file")
        if f and os.path.exists(f):
            try:  # the object the run took (a file adapter need not register itself: register=False)
                found = _load_target(f"{f}:{origin.get('attr') or '__name__'}")
                if found.name == name:
                    return found
            except UnknownAdapterError:
                pass
            return get(name)
        raise


def _load_repro_target(path: str) -> dict:
    from .journal import JOURNAL_NAME, dangling_cases, last_run

    if os.path.isdir(path):
        path = os.path.join(path, JOURNAL_NAME)
    if not os.path.exists(path):
        raise CliUsageError(f"{path}: no such file")
    if path.endswith(".jsonl"):
        recs = last_run(path)
        dang = dangling_cases(recs)
        if not dang:
            fails = [r for r in recs if r.get("event") == "test_end" and r.get("case_file")]
            if fails:
                raise CliUsageError(f"{path}: the last run finished every case; replay a saved case instead: "
                                    + ", ".join(f["case_file"] for f in fails))
            raise CliUsageError(f"{path}: no case was left running in the last run (nothing crashed it)")
        rec = dang[-1]
        print(f"replaying the example that was running when run {rec.get('run_id')} died", flush=True)
        return {"adapter": rec.get("adapter"), "property": rec.get("property"), "drawn": rec.get("drawn"), "_file": path}
    with open(path) as f:
        try:
            d = json.load(f)
        except ValueError as e:
            raise CliUsageError(f"{path}: not a saved case ({e})") from None
    d["_file"] = path
    return d


def cmd_repro(ns) -> int:
    from .isolation import make_runner

    path = ns.file
    if str(path).endswith(".evidence.json"):  # the stored evidence of a failure: replay the case beside it
        path = str(path)[: -len(".evidence.json")] + ".json"
    d = _load_repro_target(path)
    _import_conftest(ns.conftest)
    adapter = _find_adapter(d, ns.adapter)
    prop, drawn = None, d.get("drawn")
    if d.get("property") and drawn is not None:
        try:
            from .properties import get_property

            prop = get_property(d["property"])
        except (ImportError, KeyError):
            prop = None
    if prop is None:
        if not (d.get("recipe") or d.get("tensors")):
            raise CliUsageError(f"{d['_file']}: property {d.get('property')!r} is unknown here and the file holds no case")
        prop, drawn = _CheckCase(d["_file"], ns.device), None
    elif ns.device and isinstance(drawn, dict) and isinstance(drawn.get("recipe"), dict):
        drawn = {**drawn, "recipe": {**drawn["recipe"], "device": ns.device}}
    print(f"replaying {getattr(prop, 'name', prop)} for {adapter.name}"
          + (f" (recorded: {d['status']})" if d.get("status") else ""), flush=True)
    if d.get("describe"):
        print(f"case: {d['describe']}")
    runner = make_runner(ns.isolate, ns.timeout)
    try:
        res = runner(prop, adapter, drawn)
    finally:
        runner.close()
    print(res.message or "")
    for rec in res.records or []:
        for c in rec.get("comparisons", []):
            ok = "ok" if c.get("passed") else "MISMATCH"
            print(f"  {c.get('name', '?'):6s} {ok:8s} rel L2 {_f(c.get('rel_l2'))} (tol {_f(c.get('tol_norm'))})  "
                  f"max abs {_f(c.get('max_abs'))}  mismatched {c.get('mismatched')}/{c.get('numel')}")
    if res.status == "skipped":  # nothing was judged: not a pass (the message above says why)
        print(f"NOT RUN: {getattr(prop, 'name', prop)} was skipped for {adapter.name} on this case")
        return EXIT_FAILED
    if res.passed:
        print(f"HELD: {getattr(prop, 'name', prop)} holds for {adapter.name} on this case now")
        return EXIT_OK
    print(f"STILL FAILS ({res.status})")
    return EXIT_FAILED


def _f(x) -> str:
    try:
        return f"{float(x):.3g}"
    except (TypeError, ValueError):
        return str(x)


# ------------------------------------------------------------------------------------------ report


def _render(report_dir: str) -> int:
    from .reports import render

    try:
        out = render(report_dir)
    except Exception as e:  # noqa: BLE001 -- the journal is safe on disk; say why the HTML is missing
        print(f"attnverify report: rendering failed: {type(e).__name__}: {e}; the results are in "
              f"{os.path.join(report_dir, 'results.jsonl')}", file=sys.stderr)
        return EXIT_INTERNAL
    print(f"report: {out or os.path.join(report_dir, 'index.html')}")
    return EXIT_OK


def cmd_report(ns) -> int:
    """Render from the report folder only (nothing is run, no adapter is needed); several folders merge
    into --out first."""
    dirs = list(ns.dir or ["reports"])
    for d in dirs:
        if not os.path.isdir(d):
            raise CliUsageError(f"report DIR: {d!r} is no folder; give the report folder of a run (default: reports)")
    if len(dirs) > 1 and not ns.out:
        raise CliUsageError(f"report: {len(dirs)} folders given; name the merged report's folder with --out MERGED")
    if not ns.out:
        return _render(dirs[0])
    from .reports.merge import MergeError, merge

    try:
        out = merge(dirs, ns.out)
    except MergeError as e:
        raise CliUsageError(str(e)) from None
    return _render(out)


# -------------------------------------------------------------------------------------------- main


def _prewarm_budget(text: str) -> float:
    from .prewarm import parse_budget  # light: the standard library only

    try:
        return parse_budget(text, "--prewarm-budget")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    from .prewarm import DEFAULT_BUDGET_S, PROGRESS_EVERY_S  # light: the standard library only

    p = argparse.ArgumentParser(prog="attnverify", description="correctness and fuzz testing for attention implementations")
    sub = p.add_subparsers(dest="cmd", metavar="{run,adapters,repro,report,selftest,bench}")
    r = sub.add_parser("run", help="run the property suite (pytest underneath); extra args after -- go to pytest")
    r.add_argument("--adapter", action="append", help="adapter name, import path or `all`; repeat or comma list "
                   "(default: every available built-in adapter)")
    r.add_argument("--profile", "--attn-profile", dest="profile", choices=("ci", "dev", "thorough"),
                   help="default: ci on a CPU-only machine, dev with a GPU")
    r.add_argument("--report", "--attn-report", dest="report")
    r.add_argument("--seed", "--attn-seed", dest="seed", type=int)
    r.add_argument("--device", "--attn-device", dest="device", choices=("auto", "cpu", "cuda"))
    r.add_argument("--max-examples", "--attn-max-examples", dest="max_examples", type=int)
    r.add_argument("--isolate", "--attn-isolate", dest="isolate", choices=("auto", "subprocess", "none"))
    r.add_argument("--timeout", "--attn-timeout", dest="timeout", type=float)
    r.add_argument("--max-bugs", "--attn-max-bugs", dest="max_bugs", type=int,
                   help="distinct bugs to look for per property (default: the profile's, 1 in ci, 3 in dev)")
    r.add_argument("--shard", "--attn-shard", dest="shard", metavar="K/N",
                   help="run shard K of N: a stable slice of the (adapter, property) pairs (attnverify.shards)")
    r.add_argument("--db", "--attn-db", dest="db", metavar="URL",
                   help="shared example database: redis://HOST:PORT/N or github:OWNER/REPO[/ARTIFACT]")
    r.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="run the shards as Ray tasks and merge their reports (attnverify.ray_run); no ADDRESS: a "
                   "local Ray instance; auto or ray://HOST:PORT: a cluster")
    r.add_argument("--ray-shards", type=int, metavar="N", help="with --ray: shards (default: the cluster's GPUs, else CPUs)")
    r.add_argument("--ray-retries", type=int, default=3, metavar="R",
                   help="with --ray: retries of a shard whose worker or node was lost (default 3)")
    r.add_argument("--prewarm", "--attn-prewarm", dest="prewarm", action="store_true",
                   help="compile what the run will launch first, in parallel on every core (adapters with a JIT: "
                        f"the bundled triton on a GPU); the same verdicts; a progress line every {PROGRESS_EVERY_S:g} s")
    r.add_argument("--prewarm-budget", "--attn-prewarm-budget", dest="prewarm_budget", type=_prewarm_budget,
                   metavar="SECONDS", help=f"the pre-warm's time at most (default {DEFAULT_BUDGET_S:g}, or a quarter "
                   "of pytest's --session-timeout if less; implies --prewarm): when it ends, the run starts and "
                   "compiles the rest itself (the first examples of every property are warmed first)")
    r.add_argument("-n", "--numprocesses", dest="numprocesses", help="pytest-xdist workers (auto, N)")
    r.add_argument("-k", dest="keyword", help="pytest -k expression over test ids")
    r.add_argument("-q", "--quiet", action="store_true")
    r.add_argument("--no-html", action="store_true", help="do not render reports/index.html afterwards")
    r.add_argument("--allow-untested", "--attn-allow-untested", dest="allow_untested", action="store_true",
                   help="exit 0 although an adapter tested nothing (unavailable here, or every property skipped)")
    a = sub.add_parser("adapters", help="table of known adapters: available or why not, and their claims")
    a.add_argument("--json", action="store_true")
    a.add_argument("--conftest", help="import this file first (default ./conftest.py) for its adapters")
    x = sub.add_parser("repro", help="replay a saved failing case (or a journal's crashed case)")
    x.add_argument("file")
    x.add_argument("--adapter", help="replay against this adapter instead of the recorded one")
    x.add_argument("--device", choices=("cpu", "cuda"))
    x.add_argument("--isolate", choices=("auto", "subprocess", "none"), default="auto")
    x.add_argument("--timeout", type=float, default=60.0)
    x.add_argument("--conftest", help="import this file first (default ./conftest.py) for its adapters")
    rp = sub.add_parser("report", help="render the HTML report from a report folder (several: merged into --out)")
    rp.add_argument("dir", nargs="*", help="report folder(s) of runs (default: reports)")
    rp.add_argument("--out", help="merge the folders given into this new folder and render it there")
    # their own parsers live with their code (attnverify/zoo/selftest.py, attnverify/bench.py)
    sub.add_parser("selftest", add_help=False, help="run the suite against the zoo of wrong implementations")
    sub.add_parser("bench", add_help=False, help="speed and peak memory of adapters side by side")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = build_parser()
    try:
        ns, unknown = parser.parse_known_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    if ns.cmd is None:
        parser.print_help()
        return EXIT_USAGE
    if ns.cmd in ("selftest", "bench"):
        rest = argv[argv.index(ns.cmd) + 1:] + extra
        try:
            if ns.cmd == "selftest":
                from .zoo.selftest import main as sub_main
            else:
                from .bench import main as sub_main
        except ImportError as e:
            print(f"attnverify {ns.cmd}: not available in this installation ({e})", file=sys.stderr)
            return EXIT_INTERNAL
        try:
            return int(sub_main(rest) or 0)
        except SystemExit as e:
            return int(e.code or 0)
    if unknown and ns.cmd != "run":
        parser.print_usage(sys.stderr)
        print(f"attnverify {ns.cmd}: unrecognized arguments: {' '.join(unknown)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if ns.cmd == "run" and run_option_misspellings(unknown):
            raise CliUsageError(run_option_misspellings(unknown))
        if ns.cmd == "run" and ns.ray is not None:
            from .ray_run import RayUnavailable, cmd_run_ray

            try:
                return cmd_run_ray(ns, unknown + extra)
            except RayUnavailable as e:
                raise CliUsageError(str(e)) from None
        if ns.cmd == "run":
            if ns.ray_shards is not None:
                raise CliUsageError("--ray-shards without --ray: give --ray [ADDRESS] too (or --shard K/N for one shard)")
            return cmd_run(ns, unknown + extra)
        if ns.cmd == "adapters":
            return cmd_adapters(ns)
        if ns.cmd == "repro":
            return cmd_repro(ns)
        if ns.cmd == "report":
            return cmd_report(ns)
        return EXIT_USAGE
    except CliUsageError as e:
        print(f"attnverify {ns.cmd}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # noqa: BLE001
        from .adapters.registry import UnknownAdapterError

        if isinstance(e, UnknownAdapterError):
            print(f"attnverify {ns.cmd}: {e}", file=sys.stderr)
            return EXIT_USAGE
        traceback.print_exc()
        print(f"attnverify {ns.cmd}: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
