"""Pytest plugin: real Orbax (JAX) checkpoints written by orbax-checkpoint itself, and orbax's
own view of each of them, made once and cached.

``orbax_ckpts`` (session scope) returns an :class:`OrbaxCkpts`. Generation (about 8 s on 2
cores) runs ``tests/fixtures/write_orbax.py --out DIR`` once, with ``JAX_PLATFORMS=cpu`` (two
host CPU devices, so some arrays are sharded: one zarr chunk per shard), into
``tests/.cache/orbax/<key>/`` (``<key>`` hashes the script and the installed jax, jaxlib,
orbax-checkpoint, optax, tensorstore, numpy and ml_dtypes versions) under the
``fcntl.flock`` / temp-dir-renamed-last scheme of ``fixtures_torch`` (whose helpers this
reuses): ``out/`` (the writer's output dir) and ``generate.log``.

Paths (absolute): ``.manager`` (a CheckpointManager root: ``10/``, ``20/``, each with
``_CHECKPOINT_METADATA``, ``commit_success.txt`` and the item ``default/``), ``.standard``
(``StandardCheckpointer().save``: OCDBT + zarr v2, orbax-checkpoint 0.12.8's default),
``.zarr3`` (``PyTreeCheckpointHandler(use_zarr3=True)``: OCDBT + zarr v3), ``.plain``
(``use_ocdbt=False``: one zarr2 folder per array on disk) and ``.inflight`` (a manager root
with step ``10/`` complete and the leftovers of two interrupted saves,
``20.orbax-checkpoint-tmp/`` (item finalised, step not) and
``30.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp/`` (item not finalised: no OCDBT
merge)). All hold the same state pytree (steps 10 / 20 of one tiny Adam run); see
``write_orbax.py``'s docstring for the tree, its dtypes and its shardings.

Checkpoints by name (:meth:`OrbaxCkpts.names`: ``manager-10``, ``manager-20``, ``standard``,
``zarr3``, ``plain``, ``inflight-10``, ``inflight-20``): ``.item(name)`` (the folder holding
``_METADATA``), ``.step_dir(name)``, ``.entry(name)`` (its manifest entry: ``use_ocdbt``,
``use_zarr3``, ``arrays`` (the dotted names)), ``.oracle(name)`` (``{dotted.path: numpy
array}``: what orbax's own restore on CPU returns, bfloat16 arrays as ml_dtypes bfloat16) and
``.oracle_meta(name)`` (per path: ``dtype``, ``shape``, ``stored_as``, ``type``).

Cached files are read-only: copy with ``fixtures_torch.copy_ckpt`` before modifying. Tests
using the fixture are skipped (one line) when jax, orbax-checkpoint, optax or tensorstore is
not installed. This module imports none of them (ckptctl never does; the pytest process
stays free of them too); ``.oracle`` needs ``ml_dtypes`` only for bfloat16 arrays.
"""

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from functools import cached_property
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

from fixtures_torch import _run_once, ensure_cache

HERE = Path(__file__).resolve().parent
GENERATORS = HERE / "fixtures"
WRITER = GENERATORS / "write_orbax.py"
CACHE = HERE / ".cache" / "orbax"  # this plugin owns (and prunes) everything in it
#: the writer's packages (all needed to generate) and the rest of its versions in the key
NEEDED = ("jax", "jaxlib", "orbax-checkpoint", "optax", "tensorstore")
PACKAGES = NEEDED + ("numpy", "ml_dtypes")
NAMES = ("manager-10", "manager-20", "standard", "zarr3", "plain", "inflight-10",
         "inflight-20")
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's temporary folders: <final name> + this


@dataclass(frozen=True)
class OrbaxCkpts:
    root: Path  # the cache dir; the checkpoints are under out/

    @property
    def out(self) -> Path:
        return self.root / "out"

    @cached_property
    def manifest(self) -> dict:
        return json.loads((self.out / "manifest.json").read_text())

    @property
    def manager(self) -> Path:
        return self.out / "manager"

    @property
    def standard(self) -> Path:
        return self.out / "standard"

    @property
    def zarr3(self) -> Path:
        return self.out / "zarr3"

    @property
    def plain(self) -> Path:
        return self.out / "plain"

    @property
    def inflight(self) -> Path:
        return self.out / "inflight"

    def names(self) -> list[str]:
        return list(self.manifest["checkpoints"])

    def entry(self, name: str) -> dict:
        return self.manifest["checkpoints"][name]

    def item(self, name: str) -> Path:
        """The item folder (``_METADATA``, ``manifest.ocdbt`` ...) of checkpoint ``name``."""
        return self.out / self.entry(name)["item"]

    def step_dir(self, name: str) -> Path:
        """Its step folder (``_CHECKPOINT_METADATA``, ``commit_success.txt``); the item
        folder itself for ``standard``, ``zarr3`` and ``plain``."""
        return self.out / self.entry(name)["step_dir"]

    def oracle_meta(self, name: str) -> dict:
        """Per dotted path: ``dtype``, ``shape``, ``stored_as`` (the npz dtype), ``type``."""
        return json.loads((self.out / self.entry(name)["oracle_meta"]).read_text())["arrays"]

    def oracle(self, name: str) -> dict:
        """``{dotted.path: numpy array}``: orbax's own restore of checkpoint ``name``."""
        import numpy as np

        meta = self.oracle_meta(name)
        with np.load(self.out / self.entry(name)["oracle"]) as z:
            arrays = {k: z[k] for k in z.files}
        for k, m in meta.items():
            if m["dtype"] != m["stored_as"]:
                import ml_dtypes

                arrays[k] = arrays[k].view(getattr(ml_dtypes, m["dtype"]))
        return arrays


def missing() -> list[str]:
    out = []
    for p in NEEDED:
        try:
            version(p)
        except PackageNotFoundError:
            out.append(p)
    return out


def cache_key() -> str:
    h = hashlib.sha256()
    h.update(WRITER.name.encode() + b"\0" + WRITER.read_bytes())
    h.update(" ".join(f"{p}={version(p)}" for p in PACKAGES).encode())
    return h.hexdigest()[:16]


def generate(root: Path) -> None:
    log = root / "generate.log"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    _run_once([sys.executable, WRITER, "--out", root / "out"], log, last=True, env=env)
    for path in root.rglob("*"):
        if path.is_file():
            path.chmod(0o444)


@pytest.fixture(scope="session")
def orbax_ckpts() -> OrbaxCkpts:
    if lacking := missing():
        pytest.skip(f"the Orbax fixtures need {', '.join(lacking)} (pip install jax==0.10.2 "
                    "orbax-checkpoint==0.12.8 optax==0.2.8 tensorstore==0.1.86)")
    return OrbaxCkpts(ensure_cache(CACHE, cache_key(), generate))


def safetensors_entries(path) -> dict:
    """{name: (safetensors dtype code, shape, raw bytes)} of a safetensors file: what the
    Orbax tests compare with an oracle, bit for bit."""
    import struct

    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n:]
    return {k: (v["dtype"], tuple(v["shape"]), data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items()}
