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
"""

import functools
import hashlib
import json
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


@pytest.fixture(scope="session")
def thirdparty_ckpts() -> ThirdPartyCkpts:
    import importlib.util

    missing = [p for p in ("transformers", "accelerate", "lightning", "peft")
               if importlib.util.find_spec(p) is None]  # not imported here: lightning is slow
    if missing:
        pytest.skip(f"the dev extra's third-party writers are not installed: {missing}")
    return ThirdPartyCkpts(ensure_cache(CACHE, cache_key(), generate))
