"""The shape of the code (issue 19): modules of one responsibility, under 500 lines, and no private name
crossing a package line. An AST scan of attnverify/, no import of the package itself.

The allow-lists below name today's known violators, in files being split elsewhere; they may only shrink.
A test fails when a listed file no longer violates, so that its entry is removed with the fix.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "attnverify"
MAX_LINES = 500

# module (path relative to the repository) -> why it is still over MAX_LINES; empty this after the splits
TOO_LONG_ALLOWED = {
}

# (importing file, imported module, name) -> why it is still allowed; empty this after the merge
PRIVATE_IMPORTS_ALLOWED: dict = {}


def _modules(pkg: pathlib.Path = PKG):
    return sorted(p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(p: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    return p.relative_to(root).as_posix()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _target(root: pathlib.Path, mod: str, name: str):
    """(module, package) that `from mod import name` reads: a subpackage, a submodule, or a name in mod."""
    full = root / (mod + "." + name).replace(".", "/")
    if full.is_dir():
        return f"{mod}.{name}", f"{mod}.{name}"
    if full.with_suffix(".py").exists():
        return f"{mod}.{name}", mod
    if (root / mod.replace(".", "/")).is_dir():
        return mod, mod
    return mod, mod.rpartition(".")[0]


def private_imports(p: pathlib.Path, root: pathlib.Path = ROOT):
    """[(module, name)] of what this file imports from another attnverify package that is private: an
    underscore name, or any name of an underscore module. Within one package (one folder) private names
    are the package's own business."""
    tree = ast.parse(p.read_text(), filename=str(p))
    here_pkg = ".".join(p.relative_to(root).parent.parts)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here_pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            pairs = [(mod, a.name) for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Import):
            pairs = [tuple(a.name.rsplit(".", 1)) for a in node.names if "." in a.name]
        else:
            continue
        for mod, name in pairs:
            if mod.split(".")[0] != "attnverify":
                continue
            tgt, tgt_pkg = _target(root, mod, name)
            if tgt_pkg == here_pkg:
                continue
            if _private(name) or any(_private(c) for c in tgt.split(".")):
                found.append((tgt, name))
    return found


def _check_lengths(pkg: pathlib.Path, root: pathlib.Path, allowed: dict):
    over = {_rel(p, root): len(p.read_text().splitlines()) for p in _modules(pkg)}
    over = {k: n for k, n in over.items() if n > MAX_LINES}
    new = {k: n for k, n in over.items() if k not in allowed}
    assert not new, (f"modules over {MAX_LINES} lines: {new}; split them into modules of one responsibility "
                     "(put new code in a new small module)")
    fixed = sorted(set(allowed) - set(over))
    assert not fixed, f"now under {MAX_LINES} lines (or gone): remove {fixed} from TOO_LONG_ALLOWED"


def test_no_module_over_500_lines():
    _check_lengths(PKG, ROOT, TOO_LONG_ALLOWED)


def test_no_private_name_imported_across_packages():
    bad = {}
    for p in _modules():
        for mod, name in private_imports(p):
            if (_rel(p), mod, name) not in PRIVATE_IMPORTS_ALLOWED:
                bad.setdefault(_rel(p), []).append(f"{name} from {mod}")
    assert not bad, ("underscore names imported from another attnverify package (give them a public name in "
                     f"their package, or move the code): {bad}")
    stale = [k for k in PRIVATE_IMPORTS_ALLOWED if (k[1], k[2]) not in private_imports(ROOT / k[0])]
    assert not stale, f"no longer imported: remove {stale} from PRIVATE_IMPORTS_ALLOWED"


def _scan(tmp_path, rel: str, source: str):
    """private_imports of a file at attnverify/<rel> in a scratch tree shaped like the package."""
    root = tmp_path
    for f in ("check.py", "strategies/__init__.py", "strategies/_cases.py", "adapters/__init__.py",
              "adapters/_features.py", "properties/__init__.py", "properties/_props.py", "diagnose/__init__.py"):
        (root / "attnverify" / f).parent.mkdir(parents=True, exist_ok=True)
        (root / "attnverify" / f).write_text("")
    p = root / "attnverify" / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(source)
    return private_imports(p, root)


@pytest.mark.parametrize("rel,source,expected", [
    # across packages: a private name, a private module, an absolute import, a plain import
    ("zoo/_arch_probe.py", "from ..check import _unpack\n", [("attnverify.check", "_unpack")]),
    ("properties/_arch_probe.py", "from ..strategies._cases import LAST\n", [("attnverify.strategies._cases", "LAST")]),
    ("properties/_arch_probe.py", "from ..strategies import _cases\n", [("attnverify.strategies._cases", "_cases")]),
    ("_arch_probe.py", "from attnverify.adapters._features import keep_mask\n",
     [("attnverify.adapters._features", "keep_mask")]),
    ("_arch_probe.py", "import attnverify.adapters._features\n", [("attnverify.adapters._features", "_features")]),
    # allowed: within one package, public names, a public alias of a public name, dunders
    ("properties/_arch_probe.py", "from ._props import _call\nfrom .base import Property\n", []),
    ("zoo/_arch_probe.py", "from ..check import unpack_output as _unpack\nfrom .. import __version__\n", []),
    ("_arch_probe.py", "from .check import _unpack\nfrom .diagnose import diagnose\n", []),
])
def test_the_scan_itself_catches_and_allows(tmp_path, rel, source, expected):
    """The scan rejects what it must (else the architecture test could not fail) and allows the rest."""
    assert _scan(tmp_path, rel, source) == expected


def test_the_line_limit_check_would_fail_a_long_module(tmp_path):
    (tmp_path / "attnverify").mkdir()
    (tmp_path / "attnverify" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "attnverify" / "short.py").write_text("x = 1\n")
    with pytest.raises(AssertionError, match="long.py"):
        _check_lengths(tmp_path / "attnverify", tmp_path, {})
    _check_lengths(tmp_path / "attnverify", tmp_path, {"attnverify/long.py": "allowed"})
    with pytest.raises(AssertionError, match="remove"):  # an allowance that is no longer needed
        _check_lengths(tmp_path / "attnverify", tmp_path, {"attnverify/long.py": "x", "attnverify/short.py": "x"})
