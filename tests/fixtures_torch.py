"""Pytest plugin: real checkpoints written by PyTorch and safetensors, made once and cached.

``torch_ckpts`` (session scope) returns a :class:`TorchCkpts`. The generators in
``tests/fixtures/`` run as subprocesses (DCP layouts under one ``torch.distributed.run``
launch with 4 CPU ranks) into ``tests/.cache/torch/<key>/``, where ``<key>`` hashes the generator
scripts' bytes and the torch and safetensors versions, so a second run costs nothing.
Several pytest-xdist workers may ask at once: one generates under an ``fcntl.flock`` lock,
into a temp dir renamed into place last; the others wait and reuse it.

Cached files are read-only and shared by every test: a test that modifies a checkpoint
copies it first with :func:`copy_ckpt`.
"""

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
GENERATORS = HERE / "fixtures"
CACHE = HERE / ".cache" / "torch"  # this plugin owns (and prunes) everything in it
SCRIPTS = ("write_dcp.py", "write_others.py", "reference.py")
LAYOUTS = ("fsdp", "tp", "2d", "fsdp_zstd")
STEP = 20  # the DCP dirs are <layout>/step-20
TIMEOUT_S = 600


@dataclass(frozen=True)
class TorchCkpts:
    """Paths of the cached fixtures; ``ckpts["2d"]`` is the DCP dir of a layout."""

    root: Path
    dcp: dict[str, Path]  # layout -> DCP checkpoint dir (<layout>/step-20)
    full: dict[str, Path]  # layout -> the saver's full_state_dict.pt
    reference: dict[str, Path]  # layout -> dcp_to_torch_save of the DCP dir
    hf_single: Path  # dir: model.safetensors + config.json (every dtype)
    hf_sharded: Path  # dir: 3 shards + model.safetensors.index.json + config.json
    nested_pt: Path  # file: nested torch.save
    bin: Path  # file: flat HF-style pytorch_model.bin (same tensors as hf_sharded)

    @classmethod
    def at(cls, root: Path) -> "TorchCkpts":
        d, o = root / "dcp", root / "others"
        return cls(
            root=root,
            dcp={x: d / x / f"step-{STEP}" for x in LAYOUTS},
            full={x: d / x / "full_state_dict.pt" for x in LAYOUTS},
            reference={x: d / x / "reference.pt" for x in LAYOUTS},
            hf_single=o / "hf-single",
            hf_sharded=o / "hf-sharded",
            nested_pt=o / "torchsave" / "nested.pt",
            bin=o / "torchsave" / "pytorch_model.bin",
        )

    def __getitem__(self, name: str) -> Path:
        return self.dcp[name] if name in self.dcp else getattr(self, name)


def copy_ckpt(src: Path, dst: Path) -> Path:
    """Writable copy of a fixture file or dir (mtimes kept); returns the copy's path.

    If ``dst`` is an existing directory the copy goes inside it, under ``src``'s name.
    """
    src, dst = Path(src), Path(dst)
    if dst.is_dir():
        dst = dst / src.name

    def copy(s, d):
        shutil.copy2(s, d)
        os.chmod(d, 0o644)

    if src.is_dir():
        shutil.copytree(src, dst, copy_function=copy)
    else:
        copy(src, dst)
    return dst


def cache_key() -> str:
    h = hashlib.sha256()
    for name in SCRIPTS:
        h.update(name.encode() + b"\0" + (GENERATORS / name).read_bytes())
    h.update(f"torch={version('torch')} safetensors={version('safetensors')}".encode())
    return h.hexdigest()[:16]


def _run(cmd: list, log: Path, tries: int = 2) -> None:
    """Run a generator; a torchrun launch that fails (port clash, a gloo abort at exit on
    a loaded machine) is tried once more before the session fails."""
    for attempt in range(tries):
        if _run_once(cmd, log, last=attempt == tries - 1):
            return


def _run_once(cmd: list, log: Path, *, last: bool, env: dict | None = None) -> bool:
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = f"timeout after {TIMEOUT_S}s", e.stdout or "", e.stderr or ""
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x for x in (out, err))
    with log.open("a") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n# rc={rc} {time.monotonic() - t0:.1f}s\n{out}{err}\n")
    if rc != 0 and last:
        tail = "\n".join((out + err).splitlines()[-40:])
        pytest.fail(f"fixture generator failed (rc={rc}): {' '.join(map(str, cmd))}\n{tail}", pytrace=False)
    return rc == 0


def generate(root: Path) -> None:
    """Write every fixture under ``root`` (which exists and is empty)."""
    log = root / "generate.log"
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
          GENERATORS / "write_dcp.py", "--out", root / "dcp", "--layout", ",".join(LAYOUTS),
          "--step", str(STEP)], log)
    c = TorchCkpts.at(root)
    pairs = [p for x in LAYOUTS for p in (c.dcp[x], c.reference[x])]
    _run([sys.executable, GENERATORS / "reference.py", *pairs], log)
    _run([sys.executable, GENERATORS / "write_others.py", root / "others"], log)
    for path in root.rglob("*"):
        if path.is_file():
            path.chmod(0o444)


def ensure_cache(cache: Path = CACHE, key: str | None = None, make=None) -> Path:
    """The complete cache dir for the current generators, generating it if needed.

    Other fixture plugins pass their own ``cache`` dir (which this prunes of every other
    key), ``key`` and ``make(tmp_dir)`` (default: this plugin's :func:`generate`).
    """
    key = key or cache_key()
    make = make or generate
    final = cache / key
    if final.is_dir():  # only ever appears complete (rename is last)
        return final
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if final.is_dir():  # another worker made it while we waited
            return final
        for stale in cache.iterdir():  # old keys, and temp dirs of killed runs
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=cache))
        tmp.chmod(0o755)
        try:
            make(tmp)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


@pytest.fixture(scope="session")
def torch_ckpts() -> TorchCkpts:
    return TorchCkpts.at(ensure_cache())
