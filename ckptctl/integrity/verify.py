"""``verify``: integrity checks for CI gates, at three levels, each including the one before.

* ``quick``: commit state (manifest, or the format's own marker), every file present at
  its recorded size, stray temp files and orphaned multipart uploads
  (:class:`~ckptctl.catalog.checks.QuickCheck`: what ``ls`` calls a checkpoint's state);
* ``structure``: metadata parses; chunks tile each tensor exactly; every byte extent lies
  inside its file; dtype x elements = bytes; DCP chunk zips are well-formed; HF index and
  files agree; state closure against ``require``
  (:class:`~ckptctl.integrity.structure.StructureCheck`);
* ``full``: each data file read once: its content hash against the manifest, or, unsealed,
  the CRC-32 of every zip record (DCP chunks, torch.save files; ``content`` says which was
  proven, ``decoded-only`` where the format carries no checksum); NaN/Inf counts from the
  same bytes (``check_finite``); a deterministic sample of files (``sample``)
  (:class:`~ckptctl.integrity.full.FullCheck`).

This module holds the verb: :func:`verify` runs the levels up to the one asked for,
:func:`check_and_hash` the checks a seal stands on, :func:`verify_all` every checkpoint
under a root. Problem codes are stable (see :data:`PROBLEM_CODES`); ``ok`` is False on any
problem. Another framework's layout is refused by name (exit 3), a run's root given as one
checkpoint is a usage error (exit 2).

>>> r = verify("ckpt/", level="quick")                      # doctest: +SKIP
>>> r.ok, [p.code for p in r.problems]                      # doctest: +SKIP
(False, ['MISSING_FILE'])
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..catalog.vocabulary import counted_files
from ..errors import CkptError, ProblemCode, StorageError, UsageError
from ..model import Checkpoint
from ..storage import normalize_algo
from .full import FullCheck
from .result import VerifyResult

LEVELS = ("quick", "structure", "full")

#: Every problem code verify reports, with what it means (compatibility view of
#: :class:`~ckptctl.errors.ProblemCode`, the whole vocabulary).
PROBLEM_CODES: dict[str, str] = {c.value: c.doc for c in ProblemCode if c.verify}


class _Checker(FullCheck):
    """The levels' checks (:class:`~ckptctl.integrity.full.FullCheck`) run up to
    ``level``, into the :class:`~ckptctl.integrity.result.VerifyResult` verify returns."""

    def run(self) -> VerifyResult:
        """Run the levels up to ``level`` (the structure and full ones only on a checkpoint
        that opened; a seal refused on its structure reads no data) and return the result."""
        t0 = time.monotonic()
        self.quick()
        r = self.result
        r.format, r.sealed, r.step = self.format, self.sealed, self.step
        fatal = self.ck is None
        if not fatal and self.level in ("structure", "full"):
            self.store.cache_small_files(self.files)  # reading chunks: whole small files
            self.structure()
        if self.level == "full" and self.group is not None and self.group.active:
            from ..writing.distributed import full_shared

            full_shared(self.group, self, run=not fatal)  # rank 0 gets every finding
        elif not fatal and self.level == "full" and not (
                self.seal_algo and any(p.severity == "error" for p in self.problems)):
            self.full()  # (a seal refused on its structure reads no data)
        r.num_files = len(counted_files(self.files, self.manifest, store=self.store))
        r.problems = self.problems
        r.judge()
        r.bytes_read = (self.store.stats.bytes_read if self.store is not None else 0) \
            + getattr(self, "_other_bytes", 0)  # the other processes' (writing.distributed)
        r.seconds = round(time.monotonic() - t0, 3)
        return r


def _check_args(level: str, sample: float | None) -> None:
    """The usage errors of verify's level and sample (exit 2), before anything is read."""
    if level not in LEVELS:
        raise UsageError(f"unknown level {level!r} (choose from {', '.join(LEVELS)})")
    if sample is not None and not 0 < sample <= 1:
        raise UsageError("--sample takes a fraction in (0, 1]")
    if sample is not None and level != "full":  # only the full level reads file contents
        raise UsageError(f"--sample needs --level full (it picks the files whose contents "
                         f"are read; --level {level} reads none)")


def verify(url: str, storage_options: dict | None = None, *, level: str = "structure",
           require: str | list[str] | None = None, check_finite: bool = False,
           sample: float | None = None, workers: int = 4,
           on_bytes: Callable[[int], None] | None = None, located: tuple | None = None,
           checkpoint: Checkpoint | None = None, uploads: bool = True,
           on_total: Callable[[int], None] | None = None, group=None,
           bases: dict | None = None) -> VerifyResult:
    """Check the checkpoint at ``url``; problems are collected, not raised. ``bases``: a
    dict one caller shares across many verifies (``ls`` of a root of delta packs), so
    each base chain is checked once, not once per pack above it.

    Raises only when the place cannot be read at all (exit 3): not found, unreachable.
    A caller that has already listed or opened the checkpoint passes it on, so nothing is
    listed or read twice: ``located`` (what :func:`~ckptctl.formats.detect.locate`
    returned), ``checkpoint`` (opened from that listing with ``strict=False``).
    ``uploads=False`` skips the look for orphaned S3 multipart uploads (one more listing;
    they are only ever warnings). ``on_bytes(n)``: n more bytes read (full level);
    ``on_total(n)``: called once before the reads with the bytes they come to.
    ``group``: a :class:`~ckptctl.writing.distributed.Group` (``Group.from_env()`` under
    torchrun/srun): the full level's files are split over the processes and rank 0's
    result holds every finding (``bytes_read``: all processes together).
    """
    _check_args(level, sample)
    c = _Checker(url, storage_options, level=level, require=require,
                 check_finite=check_finite, sample=sample, workers=workers, on_bytes=on_bytes,
                 located=located, checkpoint=checkpoint, uploads=uploads, on_total=on_total,
                 group=group, bases=bases)
    return c.run()


def check_and_hash(url: str, storage_options: dict | None = None, *, algo: str,
                   names: list[str], workers: int = 4,
                   on_bytes: Callable[[int], None] | None = None,
                   on_total: Callable[[int], None] | None = None,
                   located: tuple | None = None, checkpoint: Checkpoint | None = None
                   ) -> tuple[VerifyResult, dict[str, tuple[str, int]]]:
    """What a seal stands on: the checks of ``verify --level full`` of an unsealed
    checkpoint (structure, every zip record's CRC-32, Megatron's ``integrity.json``, zstd
    chunks decoded) on the files ``names``, in the same read that hashes each of them with
    ``algo``. Returns the result and each file's (digest, bytes read); the data is not
    read at all when the structure is already wrong. A sealed checkpoint (``seal
    --update``) has its new files checked as unsealed ones.

    >>> r, digests = check_and_hash("ckpt/", algo="xxh3-128",  # doctest: +SKIP
    ...                             names=["__0_0.distcp"])
    >>> r.ok, digests["__0_0.distcp"][1]                       # doctest: +SKIP
    (True, 4194304)
    """
    c = _Checker(url, storage_options, level="full", workers=workers, on_bytes=on_bytes,
                 located=located, checkpoint=checkpoint, uploads=False, on_total=on_total)
    c.seal_algo, c.seal_names = normalize_algo(algo), list(names)
    return c.run(), c.digests


@dataclass
class CheckpointVerify:
    """One checkpoint of a ``verify ROOT --all``: its name under ROOT (as ``ls`` shows
    it), verify's result, and ``error`` ({code, exit_code, message, path}) when verify
    could not read it at all (another framework's layout...): then ``result.ok`` is
    False and it has no problems of its own."""

    name: str
    result: VerifyResult
    error: dict | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, **self.result.to_dict(), "error": self.error}


@dataclass
class VerifyAllResult:
    """``verify ROOT --all``: every checkpoint ``ls`` finds under ROOT, in its order;
    ``ok`` when each one is (an empty root is ok)."""

    ok: bool
    level: str
    url: str
    checkpoints: list[CheckpointVerify] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0
    strict: bool = False

    def judge(self, strict: bool) -> "VerifyAllResult":
        """Each checkpoint's verdict with warnings failing (``strict``) or not
        (:meth:`VerifyResult.judge`; one that could not be read stays not ok); returns
        self."""
        self.strict = strict
        for c in self.checkpoints:
            if c.error is None:
                c.result.judge(strict)
            else:
                c.result.strict = strict
        self.ok = all(c.result.ok for c in self.checkpoints)
        return self

    def to_dict(self) -> dict:
        return {"ok": self.ok, "level": self.level, "url": self.url, "strict": self.strict,
                "num_checkpoints": len(self.checkpoints),
                "num_ok": sum(c.result.ok for c in self.checkpoints),
                "checkpoints": [c.to_dict() for c in self.checkpoints],
                "bytes_read": self.bytes_read, "seconds": self.seconds}


def verify_all(root: str, storage_options: dict | None = None, *, level: str = "structure",
               require: str | list[str] | None = None, check_finite: bool = False,
               sample: float | None = None, workers: int = 4,
               on_bytes: Callable[[int], None] | None = None) -> VerifyAllResult:
    """Verify each checkpoint under ``root`` as ``ls`` groups them (one listing of the
    root, then :func:`verify` of each at ``level``), like ``restic check`` of a
    repository. A checkpoint verify cannot read (another framework's layout, a file of
    no format ckptctl knows) is reported with its error, not ok; an I/O failure stops
    the run (exit 3): it says nothing about the checkpoints.

    >>> r = verify_all("runs/llama", level="quick")              # doctest: +SKIP
    >>> r.ok, [(c.name, c.result.ok) for c in r.checkpoints]     # doctest: +SKIP
    (False, [('step-100', True), ('step-200', False)])
    """
    from .._deps import MissingDependencyError
    from ..catalog.ls import ls

    _check_args(level, sample)
    t0 = time.monotonic()
    rows = ls(root, storage_options, check="listing").checkpoints
    out = VerifyAllResult(True, level, root.rstrip("/") if len(root) > 1 else root)
    for row in rows:
        try:
            r = verify(row.url, storage_options, level=level, require=require,
                       check_finite=check_finite, sample=sample, workers=workers,
                       on_bytes=on_bytes, located=row.located)
            out.checkpoints.append(CheckpointVerify(row.name, r))
        except (StorageError, MissingDependencyError):
            raise
        except CkptError as e:
            out.checkpoints.append(CheckpointVerify(
                row.name, VerifyResult(False, level, row.url, row.format, False, row.step),
                {"code": str(e.code), "exit_code": e.exit_code, "message": str(e),
                 "path": e.path}))
    out.ok = all(c.result.ok for c in out.checkpoints)
    out.bytes_read = sum(c.result.bytes_read for c in out.checkpoints)
    out.seconds = round(time.monotonic() - t0, 3)
    return out
