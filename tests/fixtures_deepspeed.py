"""Pytest plugin: real DeepSpeed checkpoints written by DeepSpeed itself, and DeepSpeed's own
view of them, made once and cached.

``deepspeed_ckpts`` (session scope) returns a :class:`DeepSpeedCkpts`; ``.variant(name,
world=2)`` gives one variant's paths (:class:`Variant`). Generation (about 2 minutes on 2
cores) runs ``tests/fixtures/write_deepspeed.py`` under ``torch.distributed.run`` with 2 and
then 3 gloo CPU ranks (every ZeRO-1/2/3 fp32/bf16/fp16 variant, their zero_to_fp32 and
``load_checkpoint`` oracles, ds_to_universal of ``z2-fp32`` and ``z3-fp32``), then
``tests/fixtures/resume_deepspeed.py`` loads each universal checkpoint at the OTHER world size
(2 -> 3 and 3 -> 2) with DeepSpeed's universal loader, and ``tests/fixtures/
write_deepspeed_tp.py`` writes the tensor-parallel (AutoTP) variants with 4 and then 2 ranks
(about 40 s more). Everything goes into ``tests/.cache/deepspeed/<key>/`` (``<key>`` hashes
the three scripts and the torch, deepspeed and safetensors versions) under the
``fcntl.flock`` / temp-dir-renamed-last scheme of ``fixtures_torch`` (whose helpers this
reuses): ``w2/`` and ``w3/`` (one ``write_deepspeed`` output dir each, with its
``manifest.json``), ``tp-w4/`` and ``tp-w2/`` (one ``write_deepspeed_tp`` output dir each),
``generate.log``.

Tensor-parallel variants: ``.tp(name, world=4)`` gives a :class:`TpVariant` (``.tp_names(
world)``, ``.tp_manifest(world)``): at world 4 ``tp2-z1-fp32``, ``tp2-z2-bf16``,
``tp2-z3-fp32`` (TP2 x DP2) and ``tp4-z2-fp32`` (TP4 x DP1); at world 2 ``tp2-z2-fp32``
(TP2 x DP1). Its ``full[t]`` / ``load_full(t)`` is DeepSpeed's ``load_checkpoint`` view of TP
rank ``t`` (local shards, full over DP), ``universal_tag`` the ds_to_universal join (full
logical tensors); the manifest entry has ``tp``, ``dp``, ``logical_params``, ``split``
(column / row / replicated), ``split_dim``, ``shard_shapes`` (per TP rank), ``tag_files``,
``rank_layout`` (see the writer's docstring for every file and what DeepSpeed refused).

Cached files are read-only: copy with ``fixtures_torch.copy_ckpt`` before modifying. Tests
using the fixture are skipped (one line) when deepspeed is not installed.
"""

import hashlib
import importlib.util
import json
import shutil
import sys
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import pytest

from fixtures_torch import _run_once, ensure_cache

HERE = Path(__file__).resolve().parent
GENERATORS = HERE / "fixtures"
WRITER = GENERATORS / "write_deepspeed.py"
RESUMER = GENERATORS / "resume_deepspeed.py"
TP_WRITER = GENERATORS / "write_deepspeed_tp.py"
CACHE = HERE / ".cache" / "deepspeed"  # this plugin owns (and prunes) everything in it
PACKAGES = ("torch", "deepspeed", "safetensors")
WORLDS = (2, 3)
TP_WORLDS = (4, 2)  # write_deepspeed_tp launches (output dirs tp-w4/, tp-w2/)
#: (variant, stage) whose universal checkpoint is resumed at the other world size
RESUMED = (("z2-fp32", 2), ("z3-fp32", 3))


@dataclass(frozen=True)
class Variant:
    """One DeepSpeed checkpoint and its oracles (all paths absolute)."""

    name: str
    world: int
    entry: dict  # its manifest.json entry (stage, dtype, tags, params, frozen, tied, ...)
    root: Path  # the write_deepspeed output dir it lives in (w2/ or w3/)
    save_dir: Path  # what save_checkpoint was given: holds `latest` and the tag folders
    tag_dir: Path  # the latest tag's folder
    full: Path  # .full.pt: DeepSpeed's view after load_checkpoint
    zero_to_fp32: Path | None  # .zero_to_fp32.safetensors (None: zero_to_fp32 refuses it)
    universal: Path | None  # ds_to_universal output root (holds latest_universal)
    universal_tag: Path | None  # ... and its tag folder
    resumed: dict = field(default_factory=dict)  # world -> resume_deepspeed.py output of universal

    @property
    def stage(self) -> int:
        return self.entry["stage"]

    @property
    def dtype(self) -> str:
        return self.entry["dtype"]

    @property
    def tags(self) -> list[str]:
        return self.entry["tags"]

    def load_full(self) -> dict:
        import torch

        return torch.load(self.full, weights_only=False, map_location="cpu")

    def load_zero_to_fp32(self) -> dict:
        from safetensors.torch import load_file

        return load_file(str(self.zero_to_fp32))


@dataclass(frozen=True)
class TpVariant:
    """One tensor-parallel (AutoTP) DeepSpeed checkpoint and its oracles (paths absolute)."""

    name: str
    world: int
    entry: dict  # its manifest.json entry (tp, dp, logical_params, split, shard_shapes, ...)
    root: Path  # the write_deepspeed_tp output dir it lives in (tp-w4/ or tp-w2/)
    save_dir: Path  # what save_checkpoint was given: holds `latest` and the tag folder
    tag_dir: Path  # the latest tag's folder
    full: dict  # TP rank -> .full.tp<T>.pt: DeepSpeed's view of that TP rank after loading
    universal: Path  # ds_to_universal output root (holds latest_universal)
    universal_tag: Path  # ... and its tag folder (zero/<param>/*.pt: full logical tensors)

    @property
    def stage(self) -> int:
        return self.entry["stage"]

    @property
    def dtype(self) -> str:
        return self.entry["dtype"]

    @property
    def tags(self) -> list[str]:
        return self.entry["tags"]

    @property
    def tp(self) -> int:
        return self.entry["tp"]

    @property
    def dp(self) -> int:
        return self.entry["dp"]

    def load_full(self, tp_rank: int) -> dict:
        import torch

        return torch.load(self.full[tp_rank], weights_only=False, map_location="cpu")


@dataclass(frozen=True)
class DeepSpeedCkpts:
    root: Path

    def manifest(self, world: int = 2) -> dict:
        return json.loads((self.root / f"w{world}" / "manifest.json").read_text())

    def names(self, world: int = 2) -> list[str]:
        return list(self.manifest(world)["variants"])

    def variant(self, name: str, world: int = 2) -> Variant:
        root = self.root / f"w{world}"
        entry = self.manifest(world)["variants"][name]
        o = entry["oracles"]
        resumed = {w: root / f"{name}.universal.resumed-w{w}.pt" for w in WORLDS if w != world
                   and (root / f"{name}.universal.resumed-w{w}.pt").is_file()}
        return Variant(
            name=name, world=world, entry=entry, root=root,
            save_dir=root / entry["save_dir"], tag_dir=root / entry["tag_dir"],
            full=root / o["full"],
            zero_to_fp32=root / o["zero_to_fp32"] if "zero_to_fp32" in o else None,
            universal=root / o["universal"] if "universal" in o else None,
            universal_tag=root / o["universal_tag"] if "universal_tag" in o else None,
            resumed=resumed)

    def __getitem__(self, name: str) -> Variant:
        return self.variant(name)

    def tp_manifest(self, world: int = 4) -> dict:
        return json.loads((self.root / f"tp-w{world}" / "manifest.json").read_text())

    def tp_names(self, world: int = 4) -> list[str]:
        return list(self.tp_manifest(world)["variants"])

    def tp(self, name: str, world: int = 4) -> TpVariant:
        root = self.root / f"tp-w{world}"
        entry = self.tp_manifest(world)["variants"][name]
        o = entry["oracles"]
        return TpVariant(
            name=name, world=world, entry=entry, root=root,
            save_dir=root / entry["save_dir"], tag_dir=root / entry["tag_dir"],
            full={int(t): root / f for t, f in o["full"].items()},
            universal=root / o["universal"], universal_tag=root / o["universal_tag"])


def cache_key() -> str:
    h = hashlib.sha256()
    for script in (WRITER, RESUMER, TP_WRITER):
        h.update(script.name.encode() + b"\0" + script.read_bytes())
    h.update(" ".join(f"{p}={version(p)}" for p in PACKAGES).encode())
    return h.hexdigest()[:16]


def _torchrun(world: int, script: Path, *args) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={world}", script, *args]


def _run_fresh(cmd: list, log: Path, out: Path) -> None:
    """Run a generator launch, once more from an empty ``out`` if it fails (a port clash or a
    gloo rank dying at exit on a loaded machine); the second failure fails the session."""
    for attempt in range(2):
        if out.is_dir():
            shutil.rmtree(out)
        elif out.exists():
            out.unlink()
        if _run_once(cmd, log, last=attempt == 1):
            return


def generate(root: Path) -> None:
    log = root / "generate.log"
    for world in WORLDS:
        _run_fresh(_torchrun(world, WRITER, "--out", root / f"w{world}"), log, root / f"w{world}")
    for world in WORLDS:
        for name, stage in RESUMED:
            for to in WORLDS:
                if to == world:
                    continue
                src = root / f"w{world}" / f"{name}.universal"
                out = root / f"w{world}" / f"{name}.universal.resumed-w{to}.pt"
                _run_fresh(_torchrun(to, RESUMER, "--load", src, "--universal", "--stage",
                                     str(stage), "--world-check", str(to), "--out", out), log, out)
    for world in TP_WORLDS:
        out = root / f"tp-w{world}"
        _run_fresh(_torchrun(world, TP_WRITER, "--out", out), log, out)
    for path in root.rglob("*"):
        if path.is_file():
            path.chmod(0o444)


@pytest.fixture(scope="session")
def deepspeed_ckpts() -> DeepSpeedCkpts:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("the DeepSpeed fixtures need deepspeed (pip install deepspeed)")
    return DeepSpeedCkpts(ensure_cache(CACHE, cache_key(), generate))
