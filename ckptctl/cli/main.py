"""The ``ckptctl`` entry point: registers every verb on the app (``cli/app.py``) and is the
one place that turns errors into messages and exit codes (DESIGN.md). Verb modules import
the app, never this module: no import circle, and no mutable global state (``--debug``
and ``--json`` are read from the command line here and passed down)."""
from __future__ import annotations

import os
import sys
import warnings
from typing import NoReturn

import typer

from ..errors import EXIT_INTERRUPTED, EXIT_OPERATIONAL, EXIT_USAGE, CkptError, shorten
# the verb modules register their verbs on the app
from . import (convert_cmd, diff_cmd, gc_cmd, inspect_cmd, ls_cmd, man_cmd,  # noqa: F401
               pack_cmd, plan_cmd, promote_cmd, report_cmd, tiers_cmd, verify_cmd, watch_cmd)
from .app import EXIT_STATUS, app  # noqa: F401  (EXIT_STATUS: re-exported for the docs)


def _sigterm_as_interrupt():
    """SIGTERM (kill, a scheduler's preemption) takes Ctrl-C's path: writers remove what
    they wrote, exit 130. Returns the handler it replaced (None off the main thread)."""
    import signal
    import threading

    def handler(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        return signal.signal(signal.SIGTERM, handler)
    return None


def _quiet_library_logs() -> None:
    """Libraries log through the root logger; with no handler Python prints WARNING and
    above to stderr (aiohttp's "Task exception was never retrieved" after a server dies).
    ckptctl says what went wrong in its own one line; --debug shows the rest."""
    import logging

    root = logging.getLogger()
    if not any(isinstance(h, logging.NullHandler) for h in root.handlers):
        root.addHandler(logging.NullHandler())


def _hoist_timeout(args: list[str], flag: str = "--timeout") -> list[str]:
    """``--timeout S`` (and ``--config FILE``) are global but accepted anywhere on the
    line, like ``--debug``."""
    for i, a in enumerate(args):
        if a == "--":
            break
        if a.startswith(flag + "="):
            return [a] + args[:i] + args[i + 1:]
        if a == flag and i + 1 < len(args):
            return [a, args[i + 1]] + args[:i] + args[i + 2:]
    return args


def _keep_freed_memory() -> None:
    """glibc hands every freed block over 128 KiB back to the kernel (and trims the heap),
    so each chunk a pack encodes, each part promote copies, each block a hash reads costs
    fresh pages: page faults at a fraction of copy speed (FACTS.md). Keep freed blocks up
    to 32 MiB (glibc's ceiling) for reuse: pack 0.93 -> 0.66 s and unpack 0.85 -> 0.59 s
    on 231 MB, 84k -> 19k faults. A libc without ``mallopt`` is left alone."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def _no_blas_threads() -> None:
    """ckptctl multiplies no matrices, but numpy's OpenBLAS starts a thread per core when
    numpy is imported, and they spin: 4% of a consolidate's CPU samples (perf) were in
    ``blas_thread_server``. One thread, unless the user set it."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; exit with DESIGN.md's codes, never a traceback unless ``--debug``."""
    _keep_freed_memory()
    _no_blas_threads()
    # typer vendors click; its exceptions derive from typer.TyperException
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    if debug:  # accepted anywhere on the line, not only before the command
        args = ["--debug"] + [a for a in args if a != "--debug"]
    args = _hoist_timeout(_hoist_timeout(args), "--config")
    if not debug:
        _quiet_library_logs()
    previous = _sigterm_as_interrupt()
    try:
        with warnings.catch_warnings():
            if not debug:  # a library's warning (torch.load of an odd file) is not ours
                warnings.simplefilter("ignore")
            _run(args, as_json=_wants_json(args), debug=debug)
    finally:
        if previous is not None:  # an in-process caller (tests, a library user) keeps its own
            import signal

            signal.signal(signal.SIGTERM, previous)


def _wants_json(args: list[str]) -> bool:
    """``--json`` anywhere before ``--``: a failure then also prints a JSON error object."""
    return "--json" in (args[:args.index("--")] if "--" in args else args)


def _fail(as_json: bool, line: str, exit_code: int, code: str, message: str,
          path: str | None = None) -> NoReturn:
    """Exit with ``exit_code`` after ``line`` on stderr (if any) and, with ``--json``, the
    error object on stdout (README, "JSON output")."""
    if line:
        print(line, file=sys.stderr)
    if as_json:
        from .common import emit_json

        emit_json({"error": {"code": str(code), "exit_code": exit_code, "message": message,
                             "path": path}})
    sys.exit(exit_code)


#: click's type words in a usage error -> what an operator reads (issue 21: no parser
#: jargon such as "int range" or "x>=1" in a message)
_TYPE_WORDS = ((" is not a valid int range.", " is not a whole number."),
               (" is not a valid integer range.", " is not a whole number."),
               (" is not a valid int.", " is not a whole number."),
               (" is not a valid integer.", " is not a whole number."),
               (" is not a valid float range.", " is not a number."),
               (" is not a valid float.", " is not a number."),
               (" is not a valid boolean.", " is not true or false."))


def plain_usage_words(message: str) -> str:
    """A click usage message in plain words: type names and range notation spelled out.

    >>> plain_usage_words("'abc' is not a valid int range.")
    "'abc' is not a whole number."
    >>> plain_usage_words("99 is not in the range 1<=x<=22.")
    '99 is not between 1 and 22.'
    >>> plain_usage_words("0 is not in the range x>=1.")
    '0 is not 1 or more.'
    >>> plain_usage_words("5 is not in the range x<5.")
    '5 is not less than 5.'
    >>> plain_usage_words("1.5 is not in the range 0<x<=1.")
    '1.5 is not more than 0 and at most 1.'

    """
    import re

    for old, new in _TYPE_WORDS:
        message = message.replace(old, new)
    num = r"(-?[0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)"

    def both(m: re.Match) -> str:
        lo, lo_op, hi_op, hi = m.groups()
        if (lo_op, hi_op) == ("<=", "<="):
            return f"is not between {lo} and {hi}"
        return (f"is not more than {lo}" if lo_op == "<" else f"is not {lo} or more") \
            + (f" and less than {hi}" if hi_op == "<" else f" and at most {hi}")

    message = re.sub(rf"is not in the range {num}(<=?)x(<=?){num}", both, message)
    message = re.sub(rf"is not in the range x>={num}", r"is not \1 or more", message)
    message = re.sub(rf"is not in the range x>{num}", r"is not more than \1", message)
    message = re.sub(rf"is not in the range x<={num}", r"is not \1 or less", message)
    message = re.sub(rf"is not in the range x<{num}", r"is not less than \1", message)
    return message


#: the global options (``_global`` in cli/app.py) that take a value
_VALUED = ("--timeout", "--config")


def _verb_app(args: list[str]):
    """The app with only the verb ``args`` run registered. typer builds the click command
    of every registered verb on each call (30 ms of a 0.2 s command for 19 verbs); one is
    enough to run one. Top-level help, shell completion and a word that names no verb
    get the whole app (click then lists or suggests the verbs)."""
    if any(k.endswith("_COMPLETE") for k in os.environ):
        return app
    i = 0
    while i < len(args) and args[i].startswith("-"):
        if args[i] in ("-h", "--help", "--version", "--"):
            return app
        i += 2 if args[i] in _VALUED else 1
    if i >= len(args):
        return app
    from typer.main import get_command_name

    verb = [c for c in app.registered_commands
            if (c.name or get_command_name(c.callback.__name__)) == args[i]]
    if not verb:
        return app
    import copy

    one = copy.copy(app)
    one.registered_commands = verb
    return one


def _run(args: list[str], *, as_json: bool = False, debug: bool = False) -> None:
    try:
        rv = _verb_app(args)(args=args, prog_name="ckptctl", standalone_mode=False)
    except typer.Abort:
        _fail(as_json, "ckptctl: interrupted", EXIT_INTERRUPTED, "INTERRUPTED", "interrupted")
    except typer.TyperException as e:  # usage errors: bad flag, missing argument
        if isinstance(getattr(e, "message", None), str):
            e.message = plain_usage_words(e.message)
        e.show()
        code = getattr(e, "exit_code", EXIT_USAGE)
        code = EXIT_USAGE if code in (1, 2) else code
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        _fail(as_json, "", code, "USAGE", shorten(message, 400))
    except KeyboardInterrupt:
        _fail(as_json, "ckptctl: interrupted", EXIT_INTERRUPTED, "INTERRUPTED", "interrupted")
    except CkptError as e:
        if debug:
            raise
        _fail(as_json, f"ckptctl: error: {e}", e.exit_code, e.code, str(e), e.path)
    except Exception as e:  # noqa: BLE001 - a bug: one line, the traceback under --debug
        if debug:
            raise
        message = (f"internal error: {type(e).__name__}: {shorten(e, 200)}"
                   " (rerun with --debug for a traceback)")
        _fail(as_json, f"ckptctl: {message}", EXIT_OPERATIONAL, "INTERNAL", message)
    if rv == EXIT_INTERRUPTED:  # typer turns KeyboardInterrupt into Exit(130), silently
        _fail(as_json, "ckptctl: interrupted", EXIT_INTERRUPTED, "INTERRUPTED", "interrupted")
    sys.exit(rv if isinstance(rv, int) else 0)
