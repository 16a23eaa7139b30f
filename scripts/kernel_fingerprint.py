"""Fingerprint the generated code of every Triton kernel attnverify ships, for sm_90, on a machine without a GPU.

A refactor of attnverify/kernels that claims "no codegen change" (a rule moved into a shared @triton.jit
helper, which Triton inlines) proves it with this: each line is one kernel of one launch configuration and the
sha256 of its TTGIR and PTX (line info and locations stripped, so moved source lines do not count). Same hashes:
the same code runs on the GPU, and the perf gate can only show noise. A differing hash says which kernel of
which configuration to look at (--dump DIR writes the PTX and TTGIR). Kernels and configurations (kfp_cases.py):
the forward (fwd.*, the plain and variant key loops), fp8 with descales (fp8.*), the backward's three kernels
(bwd.*) and split-KV decode with its LSE combine over paged and contiguous caches (decode.*).

It compiles through the project's own launchers (their arguments, tiles and specialisations) with a stand-in
Triton driver that reports an sm_90 target and never launches; ptxas is Triton's bundled one.

    env -u TRITON_INTERPRET PYTHONPATH=$PWD python scripts/kernel_fingerprint.py               # print
    env -u TRITON_INTERPRET PYTHONPATH=$PWD python scripts/kernel_fingerprint.py --against main  # exit 1: differs
    ... --json a.json;  python scripts/kernel_fingerprint.py --compare a.json b.json               # exit 1: differs

--against REF compiles the same cases (this file's) on `git archive REF` in a temporary folder, then on this
checkout, and compares. Needs Triton 3.6+ with its NVIDIA backend (the pip wheel has it); slow on a small CPU
(about 10 s a kernel; --only 'decode.*' picks cases by glob).
"""
from __future__ import annotations

import argparse
import atexit
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile


def _fake_driver():
    """The stand-in sm_90 driver that compiles and never launches: one home, benchmarks/standin_driver.py."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import standin_driver

    return standin_driver.nogpu_driver()


def _strip(text: str) -> str:
    text = re.sub(r"^\s*\.(loc|file)\b.*$", "", text, flags=re.M)
    text = re.sub(r"\s*loc\((#loc\d*|\"[^\"]*\"[^)]*)\)", "", text)
    text = re.sub(r"^#loc.*$", "", text, flags=re.M)
    text = re.sub(r"\.section\s+\.debug.*?}", "", text, flags=re.S)
    return "\n".join(x for x in text.splitlines() if x.strip())


def _constants_at_uses(ttgir: str) -> str:
    """TTGIR with each `%name = arith.constant V` written as (V) where it is used and its own line dropped: the
    same IR, but the order and numbering of the hoisted constants (which an inlined helper can shuffle, the PTX
    staying byte-identical) no longer count. Unchanged if a name is defined twice."""
    defs, body = {}, []
    for line in ttgir.splitlines():
        m = re.match(r"\s*(%[\w.$-]+) = arith\.constant (.+)$", line)
        if m and m.group(1) in defs:
            return ttgir
        if m:
            defs[m.group(1)] = m.group(2)
        else:
            body.append(line)
    use = re.compile(r"%[\w.$-]+")
    return "\n".join(use.sub(lambda x: f"({defs[x.group(0)]})" if x.group(0) in defs else x.group(0), line)
                     for line in body)


def _fmt(r: dict) -> str:
    return f"error: {r['error']}" if "error" in r else f"ttgir={r['ttgir']} ptx={r['ptx']} smem={r['smem']}"


def _line(key: str, r: dict) -> str:
    return f"{key:56s} {_fmt(r)}"


def fingerprint(patterns, dump: str = "") -> dict:
    """Compile the cases whose 'family.name' matches a pattern (all without) -> {'family.name/kernel': hashes}."""
    import kfp_cases
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_fake_driver())
    compiled = []
    run = JITFunction.run

    def warm_only(self, *a, grid, warmup, **kw):  # compile, never launch
        kernel = run(self, *a, grid=grid, warmup=True, **kw)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = warm_only
    results = {}
    try:
        for family, name, launch in kfp_cases.cases():
            case = f"{family}.{name}"
            if patterns and not any(fnmatch.fnmatchcase(case, p) for p in patterns):
                continue
            compiled.clear()
            try:
                launch()
            except Exception as e:  # a compile failure is a fingerprint too (WS fails on sm_90 with Triton 3.6-3.9)
                msg = str(e).strip().splitlines()
                results[case] = {"error": f"{type(e).__name__}: {msg[0] if msg else ''}"}
                print(_line(case, results[case]), flush=True)
                continue
            seen = {}
            for kname, kern in compiled:
                seen[kname] = seen.get(kname, 0) + 1
                key = f"{case}/{kname}" + (f"#{seen[kname]}" if seen[kname] > 1 else "")
                ttgir, ptx = _strip(kern.asm["ttgir"]), _strip(kern.asm["ptx"])
                results[key] = {"ttgir": hashlib.sha256(_constants_at_uses(ttgir).encode()).hexdigest()[:16],
                                "ptx": hashlib.sha256(ptx.encode()).hexdigest()[:16], "smem": kern.metadata.shared}
                print(_line(key, results[key]), flush=True)
                if dump:
                    os.makedirs(dump, exist_ok=True)
                    for ext, text in (("ttgir", ttgir), ("ptx", ptx)):
                        with open(os.path.join(dump, f"{key.replace('/', '.')}.{ext}"), "w") as f:
                            f.write(text)
    finally:
        JITFunction.run = run
    return results


def compare(a: dict, b: dict, out=sys.stdout) -> int:
    """Print what differs between two fingerprint files' results -> the number of differing keys."""
    if a.get("triton") != b.get("triton"):
        print(f"note: Triton {a.get('triton')} against {b.get('triton')}: hashes are only comparable within one version",
              file=out)
    ra, rb = a["results"], b["results"]
    bad = 0
    for key in sorted(set(ra) | set(rb)):
        x, y = ra.get(key), rb.get(key)
        if x == y:
            continue
        bad += 1
        if x is None or y is None:
            print(f"DIFF {key}: only in {'A' if y is None else 'B'}", file=out)
        else:
            what = [f for f in ("error", "ttgir", "ptx", "smem") if x.get(f) != y.get(f)]
            print(f"DIFF {key}: {', '.join(what)} (A {_fmt(x)} | B {_fmt(y)})", file=out)
    same = len(set(ra) & set(rb)) - sum(1 for k in set(ra) & set(rb) if ra[k] != rb[k])
    print(f"{same} identical, {bad} differing (A: {a.get('source')}, B: {b.get('source')}; Triton "
          f"{b.get('triton')})", file=out)
    return bad


def _describe(root: str) -> str:
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "attnverify/kernels"], capture_output=True,
                               text=True).stdout.strip()
        return f"{root} @ {head}{' + uncommitted kernel edits' if dirty else ''}"
    except (OSError, subprocess.CalledProcessError):
        return root


def _against(ref: str, argv_rest: list, here: str) -> dict:
    """Fingerprint `git archive ref` (this file's cases) in a child process -> its JSON."""
    with tempfile.TemporaryDirectory(prefix="kfp_ref_") as tmp:
        src = os.path.join(tmp, "src")
        os.makedirs(src)
        rev = subprocess.run(["git", "-C", here, "rev-parse", "--short", "--verify", "--quiet", f"{ref}^{{commit}}"],
                             capture_output=True, text=True).stdout.strip()
        if not rev:
            sys.exit(f"kernel_fingerprint --against {ref}: not a commit of the repository at {here}; give a branch, "
                     f"tag or commit (e.g. --against main)")
        archive = subprocess.run(["git", "-C", here, "archive", rev, "attnverify"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", src], input=archive.stdout, check=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src] + [p for p in os.environ.get("PYTHONPATH", "").split(
            os.pathsep) if p and os.path.abspath(p) != here]))
        out = os.path.join(tmp, "ref.json")
        print(f"== {ref} ({rev})", flush=True)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--json", out, "--source", f"{ref} @ {rev}",
                        *argv_rest], env=env, check=True)
        with open(out) as f:
            doc = json.load(f)
        if not doc["attnverify"].startswith(src):
            sys.exit(f"kernel_fingerprint: the {ref} side imported attnverify from {doc['attnverify']}, not {src}")
        return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma list of globs over 'family.name' (fwd.*, fp8.*, bwd.*, "
                                               "decode.*); default: all")
    ap.add_argument("--dump", default="", help="folder to write each kernel's PTX and TTGIR into (--against: "
                                               "the REF side's into DIR/against)")
    ap.add_argument("--json", default="", help="also write the results to this JSON file")
    ap.add_argument("--against", default="", metavar="REF", help="git ref to compare this checkout with; exit 1 "
                                                                 "if any kernel differs")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two --json files (no compiling); exit 1 "
                                                                   "if any kernel differs")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--source", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.compare:
        docs = []
        for path in args.compare:
            with open(path) as f:
                docs.append(json.load(f))
        return 1 if compare(*docs) else 0
    if args.list:
        import kfp_cases

        print("\n".join(f"{fam}.{name}" for fam, name, _ in kfp_cases.cases()))
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("kernel_fingerprint: unset TRITON_INTERPRET (it compiles, it does not interpret)")
    os.environ.setdefault("TRITON_DISABLE_LINE_INFO", "1")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rest = (["--only", args.only] if args.only else []) + (["--dump", os.path.join(args.dump, "against")]
                                                          if args.dump else [])
    ref = _against(args.against, rest, here) if args.against else None
    cache = tempfile.mkdtemp(prefix="kfp_cache_")
    atexit.register(shutil.rmtree, cache, True)
    os.environ["TRITON_CACHE_DIR"] = cache  # fresh: nothing reused across runs or sides
    import triton

    import attnverify

    root = os.path.dirname(os.path.dirname(os.path.abspath(attnverify.__file__)))
    if ref:
        print(f"== this checkout ({_describe(root)})", flush=True)
    doc = {"triton": triton.__version__, "source": args.source or _describe(root), "attnverify": root,
           "results": fingerprint([p for p in args.only.split(",") if p], args.dump)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
    if ref:
        return 1 if compare(ref, doc) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
