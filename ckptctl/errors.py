"""Typed errors. Every error ckptctl raises on purpose is a :class:`CkptError`; its
``exit_code`` is what the CLI exits with (DESIGN.md, "Errors and exit codes").

>>> try:
...     raise FormatError("ckpt/.metadata", "truncated pickle")
... except CkptError as e:
...     (e.exit_code, str(e))
(3, 'ckpt/.metadata: truncated pickle')
"""
from __future__ import annotations

from enum import Enum

EXIT_OK = 0
EXIT_FINDING = 1
EXIT_USAGE = 2
EXIT_OPERATIONAL = 3
EXIT_INTERRUPTED = 130

#: The exit-code table, written once: the CLI's EXIT STATUS help and the man page use it.
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "success (verify: nothing wrong; diff: no difference)"),
    (EXIT_FINDING, "a finding (verify: a problem; diff: a difference; seal: refused)"),
    (EXIT_USAGE, "usage error"),
    (EXIT_OPERATIONAL, "operational error (not found, I/O, unreadable or unsupported input)"),
    (EXIT_INTERRUPTED, "interrupted"),
)


def exit_status_text() -> str:
    """The exit-code table as the CLI's help shows it (click keeps a ``\\b`` block as is).

    >>> print(exit_status_text().splitlines()[3])
      1  a finding (verify: a problem; diff: a difference; seal: refused)
    """
    rows = [f"  {code:<2} {meaning}" for code, meaning in EXIT_CODES]
    return "\n".join(["\b", "EXIT STATUS", *rows])


class ProblemCode(str, Enum):
    """The closed vocabulary of problem codes: every ``code`` a :class:`CkptError` carries
    and every problem ``verify`` reports is a member. A member equals its string, prints as
    it, and carries a one-line ``doc``; ``verify`` is False for codes only errors carry.

    >>> gap = ProblemCode("CHUNK_GAP")
    >>> gap == "CHUNK_GAP", f"{gap}", gap.verify, ProblemCode.USAGE.verify
    (True, 'CHUNK_GAP', True, False)
    >>> ProblemCode.CHUNK_GAP.doc
    'chunks leave part of a tensor uncovered'
    """

    def __new__(cls, value: str, doc: str, verify: bool = True):
        obj = str.__new__(cls, value)
        obj._value_ = value
        obj.doc = doc
        obj.verify = verify
        return obj

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    # reported by verify
    NOT_COMMITTED = ("NOT_COMMITTED", "no manifest and no format commit marker (DCP .metadata): "
                     "a write never finished")
    MISSING_FILE = ("MISSING_FILE", "a file the manifest or metadata names is not there")
    MISSING_BASE = ("MISSING_BASE", "a delta pack's base chain is not all there and committed: "
                    "it cannot be restored")
    SIZE_MISMATCH = ("SIZE_MISMATCH", "a file's size differs from the manifest, or is too short "
                     "for its extents")
    EXTRA_FILE = ("EXTRA_FILE", "a file is present that the manifest does not list")
    STRAY_TEMP = ("STRAY_TEMP", "a writer's temporary file is left over (.metadata.tmp, "
                  "*.partial, ...)")
    ORPHANED_UPLOAD = ("ORPHANED_UPLOAD", "an unfinished S3 multipart upload lies under the "
                       "checkpoint's prefix")
    MALFORMED_METADATA = ("MALFORMED_METADATA", "metadata does not parse or is inconsistent")
    UNSAFE_INPUT = ("UNSAFE_INPUT", "metadata tries to run code or asks for absurd sizes")
    PATH_ESCAPE = ("PATH_ESCAPE", "a path in the metadata leaves the checkpoint root")
    CHUNK_GAP = ("CHUNK_GAP", "chunks leave part of a tensor uncovered")
    CHUNK_OVERLAP = ("CHUNK_OVERLAP", "chunks cover part of a tensor twice")
    OUT_OF_BOUNDS = ("OUT_OF_BOUNDS", "a chunk lies outside its tensor, or its bytes outside "
                     "its file")
    DTYPE_SIZE_MISMATCH = ("DTYPE_SIZE_MISMATCH", "stored bytes differ from dtype x number of "
                           "elements")
    MALFORMED_CHUNK = ("MALFORMED_CHUNK", "a chunk's bytes do not decode (DCP zip, zstd stream)")
    INDEX_MISMATCH = ("INDEX_MISMATCH", "the HF index and the shard files disagree")
    MISSING_STATE = ("MISSING_STATE", "a required part of the training state is absent "
                     "(--require)")
    HASH_MISMATCH = ("HASH_MISMATCH", "a file's content hash differs from the manifest")
    MANIFEST_MISMATCH = ("MANIFEST_MISMATCH", "the manifest describes another checkpoint than "
                         "the files hold")
    NON_FINITE = ("NON_FINITE", "a tensor holds NaN or Inf values (--check-finite)")
    IO_ERROR = ("IO_ERROR", "a file could not be read")
    CRC_MISMATCH = ("CRC_MISMATCH", "a zip record's CRC-32 (DCP chunk, torch.save file) differs "
                    "from the one its writer recorded")
    # carried by errors only
    ERROR = ("ERROR", "an error of no more specific kind", False)
    USAGE = ("USAGE", "a bad flag, layout spec or contradictory options (exit 2)", False)
    FINDING = ("FINDING", "an op found a problem it was asked to look for (exit 1)", False)
    FOREIGN_FILES = ("FOREIGN_FILES", "a checkpoint folder holds files that are not the "
                     "checkpoint's: they stop its removal (exit 1)", False)
    HAS_DEPENDANTS = ("HAS_DEPENDANTS", "a kept delta pack needs this checkpoint as its base: "
                      "it is not removed (exit 1)", False)
    UNSUPPORTED_FORMAT = ("UNSUPPORTED_FORMAT", "nothing ckptctl knows matches what is at the "
                          "place", False)
    ALREADY_EXISTS = ("ALREADY_EXISTS", "an exclusive write found its target already there",
                      False)
    REMOTE_TIMEOUT = ("REMOTE_TIMEOUT", "a remote (S3) request took longer than --timeout",
                      False)
    REMOTE_UNREACHABLE = ("REMOTE_UNREACHABLE", "the remote (S3) server cannot be reached",
                          False)
    MISSING_DEPENDENCY = ("MISSING_DEPENDENCY", "an optional library the verb or input needs "
                          "is not installed (pip install 'ckptctl[torch]')", False)


def shorten(text: str, limit: int = 120) -> str:
    """``text`` cut to at most ``limit`` characters at a word boundary, with an ellipsis;
    only its first line is kept. Messages are never cut mid-word.

    >>> shorten("unpickling stack underflow while reading data.pkl", 30)
    'unpickling stack underflow...'
    >>> shorten("unpickling stack underflow", 16)
    'unpickling stack...'
    >>> shorten("short", 30), shorten("", 30)
    ('short', '')
    """
    lines = str(text).strip().splitlines()
    line = lines[0].strip() if lines else ""
    if len(line) <= limit:
        return line
    cut = line[:limit]
    if line[limit] != " " and " " in cut.rstrip():  # drop the word the limit falls in
        cut = cut[:cut.rstrip().rfind(" ")]
    return cut.rstrip(" ,;:([{") + "..."


class CkptError(Exception):
    """Base class: a one-line, user-facing message and an exit code.

    ``code`` is the stable problem code ``verify`` reports when it meets this error
    (``MALFORMED_METADATA``, ``PATH_ESCAPE``...); each class has a default.
    """

    exit_code = EXIT_OPERATIONAL
    default_code: str = ProblemCode.ERROR

    def __init__(self, path: str | None, message: str, *, code: str | None = None):
        self.path = path
        self.message = message
        self.code = code or self.default_code
        super().__init__(f"{path}: {message}" if path else message)

    def __reduce__(self):
        """Pickled whole, whatever a subclass's ``__init__`` takes: torch's DCP gathers
        each rank's error to the others as a pickle.

        >>> import pickle
        >>> e = pickle.loads(pickle.dumps(UsageError("bad flag", "x")))
        >>> type(e).__name__, e.path, e.message, e.code == "USAGE", str(e)
        ('UsageError', 'x', 'bad flag', True, 'x: bad flag')
        """
        return _rebuilt, (type(self), self.args, dict(self.__dict__))


def _rebuilt(cls: type, args: tuple, state: dict) -> "CkptError":
    e = cls.__new__(cls)
    Exception.__init__(e, *args)
    e.__dict__.update(state)
    return e


class UsageError(CkptError):
    """Bad flag, bad layout spec, contradictory options (exit 2)."""

    exit_code = EXIT_USAGE
    default_code: str = ProblemCode.USAGE

    def __init__(self, message: str, path: str | None = None):
        super().__init__(path, message)


class NotFoundError(CkptError):
    """A place, file or entry does not exist (exit 3)."""

    default_code: str = ProblemCode.MISSING_FILE


class StorageError(CkptError):
    """I/O, permission or remote failure (exit 3)."""

    default_code: str = ProblemCode.IO_ERROR


class FormatError(CkptError):
    """A file is not what its format says: truncated, malformed, inconsistent (exit 3)."""

    default_code: str = ProblemCode.MALFORMED_METADATA


class UnsafeInputError(FormatError):
    """Input that tries to escape the rails: hostile pickle, path traversal,
    absurd sizes (exit 3)."""

    default_code: str = ProblemCode.UNSAFE_INPUT


class UnsupportedFormatError(CkptError):
    """Nothing ckptctl knows matches what is at the place (exit 3)."""

    default_code: str = ProblemCode.UNSUPPORTED_FORMAT


def layout_refused(where: str | None, what: str, framework: str) -> UnsupportedFormatError:
    """A framework's layout that its reader does not read exactly, refused by name (exit
    3); ``framework`` tells verify and ls this refusal from "nothing recognised".

    >>> str(layout_refused("run/t", "DeepSpeed MoE", "DeepSpeed"))
    'run/t: not a layout ckptctl reads: DeepSpeed MoE'
    """
    e = UnsupportedFormatError(where, f"not a layout ckptctl reads: {what}")
    e.framework = framework
    return e


class Finding(CkptError):
    """An op found a problem it was asked to look for (exit 1): seal refusing an
    inconsistent checkpoint, a gc rail."""

    exit_code = EXIT_FINDING
    default_code: str = ProblemCode.FINDING
