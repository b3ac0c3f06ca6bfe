"""Imports point down the layers (DESIGN.md, "Layers"), parsed with ``ast``, lazy imports
inside functions included:

    cli -> ops -> formats -> storage -> leaves (model, errors, layout, boxes, parts, ...)

A module imports its own layer or a lower one, never a higher one; leaves import only
leaves, without a circle. Only ``ckptctl/cli`` imports typer, rich or click. No module
imports another's private (``_name``) functions: what two modules share is public. A new
top-level module fails here until it is given a layer below.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "ckptctl"

#: Layer of each subpackage and top-level module; higher may import lower, not the reverse.
LAYERS = {"cli": 4, "__main__": 4, "dcp": 4, "callbacks": 4, "ops": 3, "config": 3,
          "formats": 2, "storage": 1}
#: Pure modules beside the model: they import only each other (and the standard library
#: and numpy), so every layer may use them.
LEAVES = {"", "model", "errors", "layout", "boxes", "parts", "_deps", "bulk", "units"}
UI_LIBRARIES = {"typer", "rich", "click"}


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports_of(source: str, module: str, package: bool) -> list[tuple[str, int]]:
    """(absolute module, line) for every import in ``source``; ``from X import y`` counts
    as ``X.y`` when that names a module of ckptctl, else as ``X``.

    >>> imports_of("from ..errors import UsageError\\nimport typer\\n", "ckptctl.ops.seal", False)
    [('ckptctl.errors', 1), ('typer', 2)]
    >>> imports_of("from . import dcp\\n", "ckptctl.formats", True)
    [('ckptctl.formats.dcp', 1)]
    """
    out = []
    here = module.split(".") if package else module.split(".")[:-1]
    tree = ast.parse(source)
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                   for n in ast.walk(node)}  # annotations only: never imported at run time
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub if _exists(sub) else target, node.lineno))
    return sorted(set(out), key=lambda x: (x[1], x[0]))


def _exists(module: str) -> bool:
    if not module.startswith("ckptctl"):
        return False
    rel = Path(*module.split(".")[1:])
    return (PKG / rel).with_suffix(".py").exists() or (PKG / rel / "__init__.py").exists()


def layer_of(module: str) -> int | None:
    """0 for leaves, LAYERS[...] otherwise; None for a module given no layer."""
    head = module.split(".")[1] if "." in module else ""
    if head in LEAVES and module.count(".") <= 1:
        return 0
    return LAYERS.get(head)


def graph() -> dict[str, list[tuple[str, int]]]:
    """ckptctl module -> its imports (absolute names, with lines)."""
    return {module_name(p): imports_of(p.read_text(encoding="utf-8"), module_name(p),
                                       is_package(p))
            for p in sorted(PKG.rglob("*.py"))}


def violations(g: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Every import in ``g`` that points up a layer, sideways between layers' packages or
    to a UI library outside cli, plus modules without a layer and circles among leaves.

    >>> for v in violations({"ckptctl.layout": [("ckptctl.ops.closure", 175)],
    ...                      "ckptctl.ops.diff": [("ckptctl.layout", 3), ("rich.table", 9)]}):
    ...     print(v)
    ckptctl.layout:175 imports ckptctl.ops.closure (layer 3 above 0)
    ckptctl.ops.diff:9 imports rich.table (UI library outside ckptctl/cli)
    """
    bad = []
    leaf_edges: dict[str, set[str]] = {}
    for mod, imps in g.items():
        mine = layer_of(mod)
        if mine is None:
            bad.append(f"{mod}: no layer (add it to LAYERS or LEAVES in tests/test_layers.py)")
            continue
        for target, line in imps:
            top = target.split(".")[0]
            if top in UI_LIBRARIES and mine != LAYERS["cli"]:
                bad.append(f"{mod}:{line} imports {target} (UI library outside ckptctl/cli)")
            if top != "ckptctl":
                continue
            theirs = layer_of(target)
            if theirs is None:
                bad.append(f"{mod}:{line} imports {target}, which has no layer")
            elif theirs > mine:
                bad.append(f"{mod}:{line} imports {target} (layer {theirs} above {mine})")
            elif theirs == 0 and mine == 0 and target != mod:
                leaf_edges.setdefault(mod, set()).add(target)
    bad += [f"import circle among leaves: {' -> '.join(c)}" for c in _cycles(leaf_edges)]
    return bad


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    out, state = [], {}

    def visit(n, path):
        state[n] = 1
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                out.append(path[path.index(m):] + [m] if m in path else [n, m])
            elif m not in state:
                visit(m, path + [m])
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n, [n])
    return out


def test_the_graph_is_real():
    g = graph()
    assert len(g) > 30 and "ckptctl.ops.planner" in g and "ckptctl.cli.main" in g
    assert "ckptctl.ops.planner" in {t for t, _ in g["ckptctl.ops.copier"]}
    assert "ckptctl.parts" in {t for t, _ in g["ckptctl.layout"]}
    assert any(t.startswith("typer") for t, _ in g["ckptctl.cli.main"])


def test_imports_point_down_the_layers():
    bad = violations(graph())
    assert not bad, "\n".join(bad)


def circles(g: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Pairs of modules that import each other (lazy imports included): one of them
    belongs below the other, or what both need belongs in a third module.

    >>> circles({"ckptctl.a": [("ckptctl.b", 3)], "ckptctl.b": [("ckptctl.a", 9)]})
    ['ckptctl.a:3 <-> ckptctl.b:9']
    """
    lines = {(m, t): line for m, imps in g.items() for t, line in imps}
    return sorted(f"{a}:{lines[a, b]} <-> {b}:{lines[b, a]}" for a, b in lines
                  if a < b and (b, a) in lines)


def test_no_two_modules_import_each_other():
    bad = circles(graph())
    assert not bad, "\n".join(bad)


def test_only_cli_imports_typer_or_rich():
    g = graph()
    bad = [f"{mod}:{line} imports {t}" for mod, imps in g.items()
           if not mod.startswith(("ckptctl.cli", "ckptctl.__main__"))
           for t, line in imps if t.split(".")[0] in UI_LIBRARIES]
    assert not bad, "\n".join(bad)


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


def test_layout_is_a_leaf():
    imps = {t for t, _ in graph()["ckptctl.layout"] if t.startswith("ckptctl")}
    assert imps and all(layer_of(t) == 0 for t in imps), imps


@pytest.mark.parametrize("g, expect", [
    ({"ckptctl.storage.store": [("ckptctl.formats.dcp", 1)]}, "layer 2 above 1"),
    ({"ckptctl.formats.dcp": [("ckptctl.cli.common", 1)]}, "layer 4 above 2"),
    ({"ckptctl.model": [("ckptctl.storage", 1)]}, "layer 1 above 0"),
    ({"ckptctl.newthing": []}, "no layer"),
    ({"ckptctl.model": [("ckptctl.errors", 1)], "ckptctl.errors": [("ckptctl.model", 2)]},
     "import circle among leaves"),
    ({"ckptctl.ops.x": [("typer", 1)]}, "UI library outside ckptctl/cli"),
])
def test_violations_are_caught(g, expect):
    assert any(expect in v for v in violations(g)), violations(g)


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
