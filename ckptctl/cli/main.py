"""The ``ckptctl`` entry point: the app, global options and the one place that turns
errors into messages and exit codes (DESIGN.md)."""
from __future__ import annotations

import sys
import warnings
from typing import NoReturn

import typer

from .. import __version__
from ..errors import (EXIT_INTERRUPTED, EXIT_OPERATIONAL, EXIT_USAGE, CkptError,
                      exit_status_text, shorten)
from .common import CTX

EXIT_STATUS = exit_status_text()  # the table lives in errors.EXIT_CODES

app = typer.Typer(
    name="ckptctl",
    help="git + rclone + restic for training checkpoints: inspect, seal and verify, "
         "reshard and consolidate.\n\n"
         + EXIT_STATUS,
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool):
    if value:
        print(f"ckptctl {__version__}")
        raise typer.Exit()


@app.callback()
def _global(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
    timeout: float = typer.Option(
        60.0, "--timeout", metavar="SECONDS", envvar="CKPTCTL_TIMEOUT",
        help="Most seconds one remote (S3) request may take, retries included; a dead or "
             "silent server then stops the command with exit 3."),
):
    from ..storage.store import forget_dead_servers, set_timeout

    CTX.debug = debug
    set_timeout(timeout)  # UsageError (exit 2) unless > 0
    forget_dead_servers()  # one command's verdicts on servers do not leak into the next
    CTX.timeout = timeout


from . import convert_cmd, inspect_cmd, ls_cmd, verify_cmd  # noqa: E402,F401  (registers)


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


def _hoist_timeout(args: list[str]) -> list[str]:
    """``--timeout S`` is global but accepted anywhere on the line, like ``--debug``."""
    for i, a in enumerate(args):
        if a == "--":
            break
        if a.startswith("--timeout="):
            return [a] + args[:i] + args[i + 1:]
        if a == "--timeout" and i + 1 < len(args):
            return [a, args[i + 1]] + args[:i] + args[i + 2:]
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; exit with DESIGN.md's codes, never a traceback unless ``--debug``."""
    # typer vendors click; its exceptions derive from typer.TyperException
    args = list(sys.argv[1:] if argv is None else argv)
    CTX.debug = "--debug" in args
    if CTX.debug:  # accepted anywhere on the line, not only before the command
        args = ["--debug"] + [a for a in args if a != "--debug"]
    args = _hoist_timeout(args)
    if not CTX.debug:
        _quiet_library_logs()
    previous = _sigterm_as_interrupt()
    try:
        with warnings.catch_warnings():
            if not CTX.debug:  # a library's warning (torch.load of an odd file) is not ours
                warnings.simplefilter("ignore")
            _run(args, as_json=_wants_json(args))
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


def _run(args: list[str], *, as_json: bool = False) -> None:
    try:
        rv = app(args=args, prog_name="ckptctl", standalone_mode=False)
    except typer.Abort:
        _fail(as_json, "ckptctl: interrupted", EXIT_INTERRUPTED, "INTERRUPTED", "interrupted")
    except typer.TyperException as e:  # usage errors: bad flag, missing argument
        e.show()
        code = getattr(e, "exit_code", EXIT_USAGE)
        code = EXIT_USAGE if code in (1, 2) else code
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        _fail(as_json, "", code, "USAGE", shorten(message, 400))
    except KeyboardInterrupt:
        _fail(as_json, "ckptctl: interrupted", EXIT_INTERRUPTED, "INTERRUPTED", "interrupted")
    except CkptError as e:
        if CTX.debug:
            raise
        _fail(as_json, f"ckptctl: error: {e}", e.exit_code, e.code, str(e), e.path)
    except Exception as e:  # noqa: BLE001 - a bug: one line, the traceback under --debug
        if CTX.debug:
            raise
        message = (f"internal error: {type(e).__name__}: {shorten(e, 200)}"
                   " (rerun with --debug for a traceback)")
        _fail(as_json, f"ckptctl: {message}", EXIT_OPERATIONAL, "INTERNAL", message)
    if rv == EXIT_INTERRUPTED:  # typer turns KeyboardInterrupt into Exit(130), silently
        _fail(as_json, "ckptctl: interrupted", EXIT_INTERRUPTED, "INTERRUPTED", "interrupted")
    sys.exit(rv if isinstance(rv, int) else 0)
