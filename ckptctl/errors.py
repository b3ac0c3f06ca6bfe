"""Typed errors. Every error ckptctl raises on purpose is a :class:`CkptError`; its
``exit_code`` is what the CLI exits with (DESIGN.md, "Errors and exit codes").

>>> try:
...     raise FormatError("ckpt/.metadata", "truncated pickle")
... except CkptError as e:
...     (e.exit_code, str(e))
(3, 'ckpt/.metadata: truncated pickle')
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_FINDING = 1
EXIT_USAGE = 2
EXIT_OPERATIONAL = 3
EXIT_INTERRUPTED = 130


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
    default_code = "ERROR"

    def __init__(self, path: str | None, message: str, *, code: str | None = None):
        self.path = path
        self.message = message
        self.code = code or self.default_code
        super().__init__(f"{path}: {message}" if path else message)


class UsageError(CkptError):
    """Bad flag, bad layout spec, contradictory options (exit 2)."""

    exit_code = EXIT_USAGE
    default_code = "USAGE"

    def __init__(self, message: str, path: str | None = None):
        super().__init__(path, message)


class NotFoundError(CkptError):
    """A place, file or entry does not exist (exit 3)."""

    default_code = "MISSING_FILE"


class StorageError(CkptError):
    """I/O, permission or remote failure (exit 3)."""

    default_code = "IO_ERROR"


class FormatError(CkptError):
    """A file is not what its format says: truncated, malformed, inconsistent (exit 3)."""

    default_code = "MALFORMED_METADATA"


class UnsafeInputError(FormatError):
    """Input that tries to escape the rails: hostile pickle, path traversal,
    absurd sizes (exit 3)."""

    default_code = "UNSAFE_INPUT"


class UnsupportedFormatError(CkptError):
    """Nothing ckptctl knows matches what is at the place (exit 3)."""

    default_code = "UNSUPPORTED_FORMAT"


class Finding(CkptError):
    """An op found a problem it was asked to look for (exit 1): seal refusing an
    inconsistent checkpoint, a gc rail."""

    exit_code = EXIT_FINDING
    default_code = "FINDING"
