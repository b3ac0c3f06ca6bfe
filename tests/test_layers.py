"""The house (README, "Design in one page"): the import contracts under
``[tool.importlinter]`` in pyproject.toml (imports point down the layers, lazy imports
included; no modules in a circle; typer, rich and click in the command line only), checked
by import-linter, and the sizes of its pieces measured from the source: no package over 30%
of the lines, no class over 350 lines, no function body over 100.

No module imports another's private (``_name``) functions: what two modules share is public.
A new top-level module or package fails here until pyproject.toml gives it a layer.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "ckptctl"
LINT = Path(sys.executable).with_name("lint-imports")
MAX_SHARE, MAX_CLASS, MAX_BODY = 0.30, 350, 100


def lint(root: Path) -> subprocess.CompletedProcess:
    """import-linter's verdict on the ckptctl package under ``root`` (the contracts of
    ``root/pyproject.toml``), with no cache written into the tree."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache", "--config", str(root / "pyproject.toml")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def broken(r: subprocess.CompletedProcess) -> str:
    """The part of import-linter's report that lists the broken contracts."""
    return r.stdout.split("Broken contracts")[-1] if "Broken contracts" in r.stdout else ""


def test_the_import_contracts_hold():
    r = lint(PKG.parent)
    assert r.returncode == 0 and "Contracts: 3 kept, 0 broken." in r.stdout, r.stdout + r.stderr


def every_module_has_a_layer() -> list[str]:
    """Top-level modules and packages of ckptctl that the layers contract does not name."""
    import tomllib

    conf = tomllib.loads((PKG.parent / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in conf["contracts"] if c["type"] == "layers")["layers"]
    named = {n.strip() for layer in layers for n in layer.replace(":", "|").split("|")}
    here = {p.stem if p.suffix else p.name for p in PKG.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    return sorted(here - named)


def test_every_module_and_package_has_a_layer():
    assert not every_module_has_a_layer()


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(PKG, tmp_path / "ckptctl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PKG.parent / "pyproject.toml", tmp_path)
    return tmp_path / "ckptctl"


@pytest.mark.parametrize("module, line, contract", [
    ("model.py", "\n\ndef _late():\n    from .cli import app\n", "imports point down"),
    ("convert/reshard.py", "from ..packs import pack\n", "imports point down"),
    ("catalog/ls.py", "from ..integrity.verify import verify\n", "imports point down"),
    ("formats/dcp.py", "import rich\n", "only the command line imports"),
    ("catalog/vocabulary.py", "\n\ndef _late():\n    from .ls import ls\n", "in a circle"),
    ("catalog/ls.py", "from .closure import parse_parts\n", None),
])
def test_a_new_wrong_import_breaks_a_contract(tmp_path, module, line, contract):
    target = _copy(tmp_path) / module
    target.write_text(target.read_text() + line)
    r = lint(tmp_path)
    if contract is None:  # down, inside a package: allowed
        assert r.returncode == 0, r.stdout
    else:
        assert r.returncode == 1 and contract in broken(r), r.stdout


def python_files() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def lines_of(p: Path) -> int:
    return len(p.read_text(encoding="utf-8").splitlines())


def test_no_package_holds_over_30_percent_of_the_lines():
    total = sum(lines_of(p) for p in python_files())
    per: dict[str, int] = {}
    for p in python_files():
        rel = p.relative_to(PKG)
        if len(rel.parts) > 1:
            per[rel.parts[0]] = per.get(rel.parts[0], 0) + lines_of(p)
    big = {k: f"{v / total:.0%}" for k, v in per.items() if v > MAX_SHARE * total}
    assert len(per) >= 8 and not big, big


def oversized(source: str, where: str = "") -> list[str]:
    """Classes over :data:`MAX_CLASS` lines and function bodies over :data:`MAX_BODY`
    lines, counted from the first statement after the docstring to the end of the last.

    >>> oversized("def f():\\n    '''doc'''\\n" + "    x = 1\\n" * 101, "m.py")
    ['m.py:1 function f: 101 lines']
    >>> oversized("def f():\\n    '''doc'''\\n" + "    x = 1\\n" * 100)
    []
    """
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        body = node.body
        if len(body) > 1 and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value,
                                                                           str):
            body = body[1:]
        n = body[-1].end_lineno - body[0].lineno + 1
        kind, limit = ("class", MAX_CLASS) if isinstance(node, ast.ClassDef) else \
            ("function", MAX_BODY)
        if n > limit:
            out.append(f"{where}:{node.lineno} {kind} {node.name}: {n} lines")
    return out


def test_no_class_over_350_lines_no_function_body_over_100():
    bad = [x for p in python_files()
           for x in oversized(p.read_text(encoding="utf-8"), str(p.relative_to(PKG.parent)))]
    assert not bad, "\n".join(bad)


def test_every_package_says_what_lives_there_and_what_it_may_import():
    for init in sorted(PKG.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        assert "import" in doc.lower() and len(doc) > 80, (init, doc)


def private_imports(source: str) -> list[str]:
    """``from <a ckptctl module> import _name``: a private name used across modules.

    >>> private_imports("from .reshard import _execute, parse_size\\nfrom .. import __version__")
    ['_execute (line 1)']
    """
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(
                "ckptctl")):
            out += [f"{a.name} (line {node.lineno})" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_private_imports_across_modules():
    bad = [f"{p.relative_to(PKG.parent)}: {x}" for p in sorted(PKG.rglob("*.py"))
           for x in private_imports(p.read_text(encoding="utf-8"))]
    assert not bad, "\n".join(bad)


def test_docs_generator_is_outside_the_package():
    assert not (PKG / "cli" / "docs.py").exists()
    assert (PKG.parent / "tests" / "docsgen.py").exists()


def test_cli_registers_verbs_without_an_import_circle_or_global_state():
    """(issue 8, item 12) verb modules import the app from cli/app.py, never cli/main.py
    (which imports them); no module-level mutable context object carries options."""
    import ast
    from pathlib import Path

    import ckptctl.cli

    cli_dir = Path(ckptctl.cli.__file__).parent
    for f in sorted(cli_dir.glob("*_cmd.py")):
        tree = ast.parse(f.read_text())
        froms = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
        assert "main" not in froms and "app" in froms, (f.name, froms)
    import ckptctl.cli.common as common

    assert not hasattr(common, "CTX") and not hasattr(common, "Context")
