"""Pytest plugin: checkpoints written by the real third-party tools, made once and cached.

``thirdparty_ckpts`` (session scope) returns a :class:`ThirdPartyCkpts`. The generator
``tests/fixtures/write_thirdparty.py`` (transformers, accelerate, Lightning, PEFT, legacy
torch.save, DCP with strided tensors, DCP ``HuggingFaceStorageWriter`` from 2 gloo ranks; about
10 s) runs as a subprocess into ``tests/.cache/thirdparty/<key>/``, where ``<key>`` hashes the
generator's bytes and the versions of every writer package, under the same ``fcntl.flock``
lock and temp-dir-renamed-last scheme as ``fixtures_torch`` (whose helpers this reuses).

For each fixture NAME the cache holds the checkpoint, ``NAME.reference.pt`` (what the writer's
own loader returns, flat dotted names) and ``NAME.expect.json`` (entries, ``num_params``,
``num_buffers``, ...). Cached files are read-only: copy with ``fixtures_torch.copy_ckpt``
before modifying.

The writers must be the versions the dev extra of ``pyproject.toml`` pins (transformers 5.x,
say, no longer writes ``pytorch_model.bin``): when a selected test uses the fixtures and an
installed writer is outside its range, the run stops at collection with one line saying what
is needed (:func:`version_problem`), instead of erroring every test on the generator.
"""

import functools
import hashlib
import json
import re
import shutil
import sys
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest

from fixtures_torch import _run_once, ensure_cache

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "fixtures" / "write_thirdparty.py"
CACHE = HERE / ".cache" / "thirdparty"  # this plugin owns (and prunes) everything in it
PACKAGES = ("torch", "safetensors", "transformers", "accelerate", "lightning", "peft",
            "huggingface_hub", "numpy")
#: Every fixture the generator writes (its ``.expect.json`` names them).
NAMES = ("hf-safetensors", "hf-bin", "hf-sharded", "accelerate-safetensors", "accelerate-bin",
         "lightning", "peft-lora", "legacy", "dcp-strided", "dcp-hf-dist", "dcp-hf-rank0")
#: The third-party writers whose versions the generator depends on (checked against the
#: dev extra of pyproject.toml).
WRITERS = ("transformers", "accelerate", "lightning", "peft")
PYPROJECT = HERE.parent / "pyproject.toml"


@dataclass(frozen=True)
class Fixture:
    """One third-party checkpoint: ``path`` is what to point ckptctl at (a folder, or the
    one file for Lightning and legacy), ``folder`` the folder that holds it."""

    name: str
    path: Path
    folder: Path
    expect: dict
    reference_path: Path

    def reference(self) -> dict:
        """The writer's loader output: ``{entry name: tensor or plain value}`` (opaque objects
        left out)."""
        import torch

        return torch.load(self.reference_path, weights_only=False, map_location="cpu")

    @property
    def entries(self) -> dict:
        return self.expect["entries"]

    def names(self, kind: str | None = None, parts=None) -> set[str]:
        return {n for n, e in self.entries.items()
                if (kind is None or e["kind"] == kind) and (parts is None or e["part"] in parts)}


@dataclass(frozen=True)
class ThirdPartyCkpts:
    root: Path

    def __getitem__(self, name: str) -> Fixture:
        expect = json.loads((self.root / f"{name}.expect.json").read_text())
        path = self.root / expect["path"]
        return Fixture(name, path, path if path.is_dir() else path.parent, expect,
                       self.root / f"{name}.reference.pt")


@functools.lru_cache(maxsize=None)
def _generator():
    """The generator script as a module (for :func:`flatten`, the naming it defines)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("write_thirdparty", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def flatten(obj) -> dict:
    """Flatten a loaded torch.save object to dotted names, exactly as the references are."""
    return _generator().flatten(obj)


def cache_key() -> str:
    h = hashlib.sha256(SCRIPT.read_bytes())
    h.update(" ".join(f"{p}={version(p)}" for p in PACKAGES).encode())
    return h.hexdigest()[:16]


def generate(root: Path) -> None:
    log = root / "generate.log"
    for attempt in range(2):  # a second try (a gloo rank dying at exit) starts from empty
        for old in root.iterdir():
            if old != log:
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        if _run_once([sys.executable, SCRIPT, root], log, last=attempt == 1):
            break
    missing = [n for n in NAMES if not (root / f"{n}.expect.json").is_file()]
    if missing:
        pytest.fail(f"fixture generator wrote no {missing}", pytrace=False)
    for path in root.rglob("*"):
        if path.is_file():
            path.chmod(0o444)


def required_versions(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """The version ranges the dev extra of ``pyproject`` gives the :data:`WRITERS`, as
    written there (``{"transformers": ">=4.40,<5", ...}``); empty without the file."""
    import tomllib

    try:
        doc = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except OSError:
        return {}
    out = {}
    for req in doc.get("project", {}).get("optional-dependencies", {}).get("dev", []):
        m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[[^\]]*\])?\s*([^;]*)", req)
        name = m.group(1).lower().replace("_", "-") if m else ""
        if name in WRITERS and m.group(2).strip():
            out[name] = m.group(2).strip()
    return out


def installed_versions() -> dict[str, str | None]:
    """The installed version of each of the :data:`WRITERS` (None: not installed)."""
    from importlib.metadata import PackageNotFoundError

    out = {}
    for name in WRITERS:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def version_problem(installed: dict[str, str | None], required: dict[str, str]) -> str | None:
    """The one line to stop on when an installed writer is outside its required range;
    None when all are inside (a writer not installed is not a version problem: the
    fixtures skip then, as they always did).

    >>> version_problem({"transformers": "5.1.0"}, {"transformers": ">=4.40,<5"})
    "the compatibility fixtures need transformers>=4.40,<5; found 5.1.0: run `make venv` (pip install -e '.[dev]')"
    >>> version_problem({"transformers": "4.57.6", "peft": None},
    ...                 {"transformers": ">=4.40,<5", "peft": ">=0.12"}) is None
    True
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    bad = []
    for name, spec in required.items():
        have = installed.get(name)
        if have is None:
            continue
        try:
            ok = SpecifierSet(spec).contains(Version(have), prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            bad.append((name, spec, have))
    if not bad:
        return None
    need = " and ".join(f"{name}{spec}" for name, spec, _ in bad)
    found = bad[0][2] if len(bad) == 1 else " and ".join(f"{n} {h}" for n, _, h in bad)
    return (f"the compatibility fixtures need {need}; found {found}: run `make venv` "
            "(pip install -e '.[dev]')")


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: only the tests that will run
def pytest_collection_modifyitems(config, items):
    """Stop the run with one line when a selected test uses ``thirdparty_ckpts`` and a
    writer's version is outside the dev extra's range (a run without such a test, or with
    the right versions, is untouched)."""
    if not any("thirdparty_ckpts" in getattr(item, "fixturenames", ()) for item in items):
        return
    problem = version_problem(installed_versions(), required_versions())
    if problem is not None:
        raise pytest.UsageError(problem)


@pytest.fixture(scope="session")
def thirdparty_ckpts() -> ThirdPartyCkpts:
    import importlib.util

    missing = [p for p in ("transformers", "accelerate", "lightning", "peft")
               if importlib.util.find_spec(p) is None]  # not imported here: lightning is slow
    if missing:
        pytest.skip(f"the dev extra's third-party writers are not installed: {missing}")
    return ThirdPartyCkpts(ensure_cache(CACHE, cache_key(), generate))
