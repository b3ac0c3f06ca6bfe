"""Pytest plugin: real Megatron-core checkpoints written by megatron-core itself, megatron's
own view of them, and legacy (``--ckpt-format torch``) checkpoints, made once and cached.

``megatron_ckpts`` (session scope) returns a :class:`MegatronCkpts`. Generation (about 95 s
on 2 cores) runs ``tests/fixtures/write_megatron.py save`` under ``torch.distributed.run``
with 2 gloo CPU ranks once per layout (``tp2``: TP=2; ``pp2``: PP=2; a tiny ``GPTModel``
trained two fake steps, ``torch_dist`` checkpoints at iterations 10 and 20 in Megatron's run
layout, with ``load_plain_tensors`` / ``load_common_state_dict`` oracles), then
``write_megatron.py reload`` loads each run's ``iter_0000020`` with megatron's
``dist_checkpointing.load`` at other grids (:data:`RELOADS`: TP=1 on 1 rank, and the other
2-rank layout), then ``tests/fixtures/write_megatron_legacy.py`` (plain torch, no megatron)
writes the legacy per-rank ``model_optim_rng.pt`` runs. Everything goes into
``tests/.cache/megatron/<key>/`` (``<key>`` hashes both scripts and the torch and
megatron-core versions) under the ``fcntl.flock`` / temp-dir-renamed-last scheme of
``fixtures_torch`` (whose helpers this reuses): ``dist/`` (the ``write_megatron`` output dir:
``tp2/`` and ``pp2/`` runs, their oracles, ``tp2.manifest.json`` and ``pp2.manifest.json``),
``legacy/`` (the ``write_megatron_legacy`` output dir, with ``manifest.json``),
``generate.log``.

``.dist(name)`` (``.dist_names()``: ``tp2``, ``pp2``) gives a :class:`DistRun`: ``run``
(holds ``latest_checkpointed_iteration.txt`` = ``20``, ``iter_0000010/``,
``iter_0000020/``), ``iter_dir(it)``, ``plain(it)`` / ``load_plain(it)`` (megatron's
``load_plain_tensors``: common state + every full tensor by checkpoint key),
``common(it)`` / ``load_common(it)``, ``live(it)`` / ``load_live(it)`` (each rank's own
local tensors and optimizer state when saving), ``sharded_keys(it)`` (each rank's
ShardedTensor metadata), ``reloads`` (``"tp1pp1"`` etc. -> file, ``load_reload(grid)``) and
``entry`` (its manifest: ``tp``, ``pp``, ``dp``, ``world``, ``padded_vocab_size``,
``tracker``, ``megatron_core``, ``torch``, ``iterations`` -> {``dir``, ``files`` (names in
the checkpoint folder), ``metadata_json``, ``integrity_json`` (False: 0.16.1 writes none),
``content_metadata``, ``plain_keys``, ``plain_shapes``, ``common_keys``, and the oracle file
names}). See ``write_megatron.py``'s docstring for every file and what megatron refused on CPU.

``.legacy(name)`` (``.legacy_names()``: ``legacy-tp2pp2``, ``legacy-tp4``) gives a
:class:`LegacyRun`: ``run``, ``full`` / ``load_full()`` (the full tensors the shards were
cut from), ``files`` and ``entry`` (``tp``, ``pp``, ``layers``, ``spec`` (``te`` /
``local`` names), ``release``, ``iterations``, ``optimizer``, ``padded_vocab_size``,
``tracker``, ``names`` (per ``"<tp>_<pp>"`` rank, its model keys)); the split rules are in
``write_megatron_legacy.py``'s docstring.

Cached files are read-only: copy with ``fixtures_torch.copy_ckpt`` before modifying. Tests
using the fixture are skipped (one line) when megatron-core is not installed.
"""

import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import pytest

from fixtures_torch import _run_once, ensure_cache

HERE = Path(__file__).resolve().parent
GENERATORS = HERE / "fixtures"
WRITER = GENERATORS / "write_megatron.py"
LEGACY_WRITER = GENERATORS / "write_megatron_legacy.py"
CACHE = HERE / ".cache" / "megatron"  # this plugin owns (and prunes) everything in it
PACKAGES = ("torch", "megatron-core")
LAYOUTS = ("tp2", "pp2")  # write_megatron.py save --layout (2 ranks each)
ITERATIONS = (10, 20)
RELOADED = 20  # the iteration every RELOADS entry loads
#: layout -> ((tp, pp) grids its iter_0000020 is loaded back at, world = tp * pp)
RELOADS = {"tp2": ((1, 1), (1, 2)), "pp2": ((1, 1), (2, 1))}
#: the newest megatron-core, unpacked beside the venv's 0.16.1 by the Makefile (its wheel is
#: for Python 3.12 only): its runs (common_state byte entry, integrity.json) go to dist-<v>/
NEXT_VERSION = "0.19.2"
NEXT = Path(sys.prefix) / f"megatron-core-{NEXT_VERSION}"
NEXT_LAYOUTS = ("tp2",)


def next_env() -> dict:
    """The environment that runs the writer under :data:`NEXT` (first on PYTHONPATH)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(NEXT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}


def _iter(it: int) -> str:
    return f"iter_{it:07d}"


@dataclass(frozen=True)
class DistRun:
    """One ``torch_dist`` run (two iterations) and its oracles (all paths absolute)."""

    name: str
    entry: dict  # its <name>.manifest.json
    root: Path  # the write_megatron output dir (dist/)
    run: Path  # the run root: latest_checkpointed_iteration.txt, iter_0000010/, iter_0000020/
    reloads: dict = field(default_factory=dict)  # "tp<T>pp<P>" -> reload file (iteration 20)

    @property
    def tp(self) -> int:
        return self.entry["tp"]

    @property
    def pp(self) -> int:
        return self.entry["pp"]

    @property
    def world(self) -> int:
        return self.entry["world"]

    def iteration(self, it: int = 20) -> dict:
        return self.entry["iterations"][str(it)]

    def iter_dir(self, it: int = 20) -> Path:
        return self.root / self.iteration(it)["dir"]

    def plain(self, it: int = 20) -> Path:
        return self.root / self.iteration(it)["plain"]

    def common(self, it: int = 20) -> Path:
        return self.root / self.iteration(it)["common"]

    def live(self, it: int = 20) -> Path:
        return self.root / self.iteration(it)["live"]

    def sharded_keys(self, it: int = 20) -> dict:
        return json.loads((self.root / self.iteration(it)["sharded_keys"]).read_text())

    # The oracles pickle argparse.Namespace (the saved args) and numpy rng state: full unpickler.
    def load_plain(self, it: int = 20) -> dict:
        return _load(self.plain(it))

    def load_common(self, it: int = 20) -> dict:
        return _load(self.common(it))

    def load_live(self, it: int = 20) -> dict:
        return _load(self.live(it))

    def load_reload(self, grid: str) -> dict:
        return _load(self.reloads[grid])


@dataclass(frozen=True)
class LegacyRun:
    """One legacy (per TP/PP rank ``model_optim_rng.pt``) run and its truth."""

    name: str
    entry: dict
    root: Path  # the write_megatron_legacy output dir (legacy/)
    run: Path
    full: Path

    @property
    def tp(self) -> int:
        return self.entry["tp"]

    @property
    def pp(self) -> int:
        return self.entry["pp"]

    @property
    def files(self) -> list[Path]:
        return [self.root / f for f in self.entry["files"]]

    def load_full(self) -> dict:
        return _load(self.full)


def _load(path: Path):
    import torch

    return torch.load(path, weights_only=False, map_location="cpu")


@dataclass(frozen=True)
class MegatronCkpts:
    root: Path

    @property
    def dist_root(self) -> Path:
        return self.root / "dist"

    @property
    def legacy_root(self) -> Path:
        return self.root / "legacy"

    def dist_names(self) -> list[str]:
        return list(LAYOUTS)

    def dist(self, name: str, release: str | None = None) -> DistRun:
        """Run ``name`` as megatron-core 0.16.1 wrote it, or ``release`` (``NEXT_VERSION``:
        no reloads) where the Makefile unpacked it (else the test is skipped)."""
        if release is not None:
            root = self.root / f"dist-{release}"
            if not root.is_dir():
                pytest.skip(f"megatron-core {release} is not unpacked at {NEXT} (make venv)")
            entry = json.loads((root / f"{name}.manifest.json").read_text())
            return DistRun(name=name, entry=entry, root=root, run=root / entry["run"])
        entry = json.loads((self.dist_root / f"{name}.manifest.json").read_text())
        reloads = {f"tp{t}pp{p}": self.dist_root / reload_name(name, t, p)
                   for t, p in RELOADS[name]}
        return DistRun(name=name, entry=entry, root=self.dist_root,
                       run=self.dist_root / entry["run"], reloads=reloads)

    def legacy_manifest(self) -> dict:
        return json.loads((self.legacy_root / "manifest.json").read_text())

    def legacy_names(self) -> list[str]:
        return list(self.legacy_manifest()["variants"])

    def legacy(self, name: str) -> LegacyRun:
        entry = self.legacy_manifest()["variants"][name]
        return LegacyRun(name=name, entry=entry, root=self.legacy_root,
                         run=self.legacy_root / entry["run"],
                         full=self.legacy_root / entry["full"])


def reload_name(layout: str, tp: int, pp: int) -> str:
    return f"{layout}.{_iter(RELOADED)}.reload-tp{tp}pp{pp}.pt"


def cache_key() -> str:
    h = hashlib.sha256()
    for script in (WRITER, LEGACY_WRITER):
        h.update(script.name.encode() + b"\0" + script.read_bytes())
    h.update(" ".join(f"{p}={version(p)}" for p in PACKAGES).encode())
    h.update(f"next={NEXT_VERSION if NEXT.is_dir() else None}".encode())
    return h.hexdigest()[:16]


def _torchrun(world: int, script: Path, *args) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={world}", script, *args]


def _run_twice(cmd: list, log: Path, clean, env: dict | None = None) -> None:
    """Run a generator launch, once more after ``clean()`` if it fails (a port clash or a gloo
    rank dying at exit on a loaded machine); the second failure fails the session."""
    for attempt in range(2):
        clean()
        if _run_once(cmd, log, last=attempt == 1, env=env):
            return


def _remove(*paths: Path):
    def clean():
        import shutil

        for p in paths:
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    return clean


def generate(root: Path) -> None:
    log = root / "generate.log"
    dist = root / "dist"
    dist.mkdir()
    for name in LAYOUTS:
        outputs = [dist / name, dist / f"{name}.manifest.json"] + [
            dist / f"{name}.{_iter(it)}.{kind}" for it in ITERATIONS
            for kind in ("plain.pt", "common.pt", "live.pt", "sharded_keys.json")]
        _run_twice(_torchrun(2, WRITER, "save", "--out", dist, "--layout", name), log,
                   _remove(*outputs))
    for name in LAYOUTS:
        for tp, pp in RELOADS[name]:
            out = dist / reload_name(name, tp, pp)
            _run_twice(_torchrun(tp * pp, WRITER, "reload", "--ckpt",
                                 dist / name / _iter(RELOADED), "--tp", str(tp), "--pp",
                                 str(pp), "--out", out), log, _remove(out))
    if NEXT.is_dir():
        nxt = root / f"dist-{NEXT_VERSION}"
        nxt.mkdir()
        for name in NEXT_LAYOUTS:
            outputs = [nxt / name, nxt / f"{name}.manifest.json"] + [
                nxt / f"{name}.{_iter(it)}.{kind}" for it in ITERATIONS
                for kind in ("plain.pt", "common.pt", "live.pt", "sharded_keys.json")]
            _run_twice(_torchrun(2, WRITER, "save", "--out", nxt, "--layout", name), log,
                       _remove(*outputs), env=next_env())
    legacy = root / "legacy"
    _run_twice([sys.executable, LEGACY_WRITER, "--out", legacy], log, _remove(legacy))
    for path in root.rglob("*"):
        if path.is_file():
            path.chmod(0o444)


def _have_megatron() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


@pytest.fixture(scope="session")
def megatron_ckpts() -> MegatronCkpts:
    if not _have_megatron():
        pytest.skip("the Megatron fixtures need megatron-core (pip install megatron-core==0.16.1)")
    return MegatronCkpts(ensure_cache(CACHE, cache_key(), generate))
