"""One closed vocabulary: every problem code the code base uses is a documented member of
:class:`ckptctl.errors.ProblemCode`, and the exit-code table is written once
(:data:`ckptctl.errors.EXIT_CODES`) and shown by ``--help`` and the man page.

Codes are collected from the source with ``ast``, wherever a code is named: ``code=``
arguments, ``default_code``, verify's ``add("CODE", ...)``, the storage layer's
``bad(..., "CODE")`` and every comparison against ``.code``.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckptctl import errors, ops
from ckptctl.errors import EXIT_CODES, CkptError, ProblemCode, UsageError
from ckptctl.integrity.verify import PROBLEM_CODES

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ckptctl"
CODE = re.compile(r"^[A-Z][A-Z0-9]*(_[A-Z0-9]+)*$")
#: Calls whose all-caps string arguments are problem codes.
CODE_CALLS = {"add", "bad"}


def _strings(node: ast.AST) -> list[str]:
    """All-caps string constants in ``node`` (an expression naming codes), plus
    ``ProblemCode.X`` attributes."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and CODE.match(n.value):
            out.append(n.value)
        elif (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
              and n.value.id == "ProblemCode"):
            out.append(n.attr)
    return out


def _is_code_attr(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "code"


def codes_in(source: str) -> list[tuple[str, int]]:
    """(code, line) for every problem code ``source`` names.

    >>> codes_in('raise FormatError(p, "bad", code="CHUNK_GAP" if x else "OOPS")\\n'
    ...          'if e.code in _NO: pass\\n_NO = ("REMOTE_TIMEOUT",)\\nself.add("NON_FINITE", m)')
    [('CHUNK_GAP', 1), ('OOPS', 1), ('REMOTE_TIMEOUT', 3), ('NON_FINITE', 4)]
    """
    tree = ast.parse(source)
    consts: dict[str, ast.AST] = {}
    for n in tree.body:
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            consts[n.targets[0].id] = n.value
    found: list[tuple[str, int]] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.keyword) and n.arg in ("code", "code_"):
            found += [(c, n.value.lineno) for c in _strings(n.value)]
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, ast.Name) and t.id == "default_code" for t in targets):
                found += [(c, n.lineno) for c in _strings(n.value)]
        elif isinstance(n, ast.Call):
            name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            if name in CODE_CALLS:
                found += [(c, n.lineno) for a in n.args if isinstance(a, ast.Constant)
                          for c in _strings(a)]
        elif isinstance(n, ast.Compare) and any(map(_is_code_attr, [n.left, *n.comparators])):
            for side in [n.left, *n.comparators]:
                if isinstance(side, ast.Name) and side.id in consts:
                    value = consts[side.id]
                    found += [(c, value.lineno) for c in _strings(value)]
                elif not _is_code_attr(side):
                    found += [(c, n.lineno) for c in _strings(side)]
    return sorted(set(found), key=lambda x: (x[1], x[0]))


def all_codes() -> dict[str, list[str]]:
    """code -> where it is used (``path:line``), over the whole package."""
    out: dict[str, list[str]] = {}
    for p in sorted(PKG.rglob("*.py")):
        for code, line in codes_in(p.read_text(encoding="utf-8")):
            out.setdefault(code, []).append(f"{p.relative_to(ROOT)}:{line}")
    return out


# ------------------------------------------------------------------------ problem codes

def test_every_code_used_is_a_member():
    used = all_codes()
    # the collector really sees each kind of use
    assert {"CHUNK_GAP", "MALFORMED_CHUNK", "REMOTE_TIMEOUT", "ALREADY_EXISTS", "NON_FINITE",
            "UNSUPPORTED_FORMAT", "PATH_ESCAPE"} <= set(used)
    members = {c.value for c in ProblemCode}
    unknown = {c: where for c, where in used.items() if c not in members}
    assert not unknown, f"codes used but not in errors.ProblemCode: {unknown}"


def test_every_member_is_used():
    used = set(all_codes())
    assert {c.value for c in ProblemCode} - used == set()


def test_members_are_documented_strings():
    for c in ProblemCode:
        assert c.value == c.name and c == c.name and str(c) == c.name and f"{c}" == c.name
        assert c.doc.strip() and "\n" not in c.doc and len(c.doc) < 120, c
    assert ProblemCode("CHUNK_GAP") is ProblemCode.CHUNK_GAP
    with pytest.raises(ValueError):
        ProblemCode("NO_SUCH_CODE")


def test_problem_codes_dict_is_derived_and_kept():
    assert ops.PROBLEM_CODES is PROBLEM_CODES
    assert PROBLEM_CODES == {c.value: c.doc for c in ProblemCode if c.verify}
    assert all(type(k) is str for k in PROBLEM_CODES)
    assert "CRC_MISMATCH" in PROBLEM_CODES and "USAGE" not in PROBLEM_CODES


def test_error_classes_default_to_members():
    classes = [CkptError, *_subclasses(CkptError)]
    assert len(classes) >= 8
    for cls in classes:
        assert cls.default_code in ProblemCode.__members__, cls
        assert cls.exit_code in dict(EXIT_CODES), cls


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_codes_serialize_as_plain_strings():
    import json

    e = errors.FormatError("x", "y")
    assert json.dumps({"code": e.code}) == '{"code": "MALFORMED_METADATA"}'
    assert f"{e.code}: {e}" == "MALFORMED_METADATA: x: y"


def test_readme_lists_every_verify_code():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [c for c in PROBLEM_CODES if f"`{c}`" not in text]
    assert not missing, f"README.md does not list {missing}"


def test_man_page_documents_every_code():
    man = (ROOT / "man" / "ckptctl.1").read_text(encoding="utf-8")
    diag = man.split("\n.SH DIAGNOSTICS\n")[1].split("\n.SH ")[0]
    for c in ProblemCode:
        assert f"\\fB{c.value}\\fR" in diag, c


# ------------------------------------------------------------------------ exit codes

def test_exit_table_is_written_once_and_shown_everywhere():
    from ckptctl.cli.main import EXIT_STATUS

    assert EXIT_STATUS == errors.exit_status_text()
    assert [c for c, _ in EXIT_CODES] == [0, 1, 2, 3, 130]
    man = (ROOT / "man" / "ckptctl.1").read_text(encoding="utf-8")
    section = man.split("\n.SH EXIT STATUS\n")[1].split("\n.SH ")[0]
    for code, meaning in EXIT_CODES:
        assert f"  {code:<2} {meaning}" in EXIT_STATUS
        assert f".TP\n\\fB{code}\\fR\n" in section
    r = subprocess.run([sys.executable, "-m", "ckptctl", "--help"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env={"COLUMNS": "200", "PATH": ""})
    assert r.returncode == 0, r.stderr
    for code, meaning in EXIT_CODES:
        assert re.search(rf"^\s*{code}\s+{re.escape(meaning[:30])}", r.stdout, re.M), code


# ------------------------------------------------------------------------ seal of a file

def _one_file(tmp_path: Path) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(path))
    return path


def test_a_single_file_copied_under_another_name_is_a_usage_error(tmp_path):
    path = _one_file(tmp_path)
    dst = tmp_path / "out" / "other.safetensors"
    with pytest.raises(UsageError) as e:
        ops.promote(str(path), str(dst))
    assert e.value.exit_code == 2 and e.value.code == "USAGE"
    assert str(e.value).startswith(f"{dst}: a single-file checkpoint keeps its name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # not sealed


def test_a_single_file_copied_under_another_name_exits_2(tmp_path):
    path = _one_file(tmp_path)
    dst = tmp_path / "out" / "other.safetensors"
    r = subprocess.run([sys.executable, "-m", "ckptctl", "promote", str(path), str(dst)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.strip().splitlines() == [
        f"ckptctl: error: {dst}: a single-file checkpoint keeps its name (its manifest names "
        f"model.safetensors): name {tmp_path / 'out'}/model.safetensors, or the folder "
        f"{tmp_path / 'out'}/"]
