"""What ``verify`` reports of one checkpoint: :class:`VerifyResult`, the verdict with every
:class:`~ckptctl.catalog.checks.Problem` found and what was read, filled level by level
(:mod:`ckptctl.catalog.checks`, :mod:`ckptctl.integrity.structure`,
:mod:`ckptctl.integrity.full`) and finished by :func:`~ckptctl.integrity.verify.verify`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..catalog.checks import Problem


@dataclass
class VerifyResult:
    """What verify found and what it read. ``ok`` is the verdict the exit status carries
    (:meth:`judge`): no problem of severity ``error``, and with ``strict`` no warning
    either (EXTRA_FILE, STRAY_TEMP, ORPHANED_UPLOAD: a README beside a checkpoint does not
    fail a CI gate unless it asks). Counts are ``num_*`` as in every verb (README, "JSON
    vocabulary"); ``files_checked``, ``files_read`` and ``tensors_checked`` are the older
    names of three of them, still read and set.

    >>> r = VerifyResult(True, "quick", "ck", "dcp", True,
    ...                  problems=[Problem("EXTRA_FILE", "warning", "ck/NOTES.md", None, "x")])
    >>> r.judge().ok, r.judge(strict=True).ok, r.num_warnings, r.num_errors
    (True, False, 1, 0)
    """

    ok: bool
    level: str
    url: str
    format: str | None
    sealed: bool
    step: int | None = None
    problems: list[Problem] = field(default_factory=list)
    #: the checkpoint's files, as every verb counts them (ops/vocabulary.counted_files)
    num_files: int = 0
    bytes_read: int = 0
    num_tensors_checked: int = 0
    seconds: float = 0.0
    hash: str | None = None
    non_finite: dict[str, dict] = field(default_factory=dict)
    #: what the full level proved about the bytes: "hashes" (manifest), "integrity.json"
    #: (Megatron's SHA-256 manifest), "crc" (every zip record's CRC-32), "decoded-only" (no
    #: checksum in the format), or "crc+decoded-only"
    content: str | None = None
    #: files whose content the full level read (``--sample``: its share)
    num_files_read: int = 0
    #: warnings fail too (``verify --strict``)
    strict: bool = False

    @property
    def num_errors(self) -> int:
        return sum(p.severity == "error" for p in self.problems)

    @property
    def num_warnings(self) -> int:
        return sum(p.severity != "error" for p in self.problems)

    def judge(self, strict: bool | None = None) -> "VerifyResult":
        """Set ``ok`` from the problems (and ``strict``, when given); returns self."""
        if strict is not None:
            self.strict = strict
        self.ok = not self.num_errors and not (self.strict and self.num_warnings)
        return self

    files_checked = property(lambda self: self.num_files,
                             lambda self, n: setattr(self, "num_files", n))
    files_read = property(lambda self: self.num_files_read,
                          lambda self, n: setattr(self, "num_files_read", n))
    tensors_checked = property(lambda self: self.num_tensors_checked,
                               lambda self, n: setattr(self, "num_tensors_checked", n))

    def to_dict(self) -> dict:
        """The ``--json`` document, with ``num_errors`` and ``num_warnings``."""
        doc = asdict(self)
        doc.update(num_errors=self.num_errors, num_warnings=self.num_warnings)
        return doc

