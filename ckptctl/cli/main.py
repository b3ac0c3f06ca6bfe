"""The ``ckptctl`` entry point: the app, global options and the one place that turns
errors into messages and exit codes (DESIGN.md)."""
from __future__ import annotations

import sys

import typer

from .. import __version__
from ..errors import EXIT_INTERRUPTED, EXIT_OPERATIONAL, EXIT_USAGE, CkptError
from .common import CTX

EXIT_STATUS = """\b
EXIT STATUS
  0  success (verify: nothing wrong)
  1  a finding (verify found a problem, seal refused an inconsistent checkpoint)
  2  usage error
  3  operational error (not found, I/O, unreadable or unsupported input)
  130 interrupted"""

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
):
    CTX.debug = debug


from . import convert_cmd, inspect_cmd, ls_cmd, verify_cmd  # noqa: E402,F401  (registers)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; exit with DESIGN.md's codes, never a traceback unless ``--debug``."""
    # typer vendors click; its exceptions derive from typer.TyperException
    args = list(sys.argv[1:] if argv is None else argv)
    CTX.debug = "--debug" in args
    if CTX.debug:  # accepted anywhere on the line, not only before the command
        args = ["--debug"] + [a for a in args if a != "--debug"]
    try:
        rv = app(args=args, prog_name="ckptctl", standalone_mode=False)
    except typer.Abort:
        print("ckptctl: interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except typer.TyperException as e:  # usage errors: bad flag, missing argument
        e.show()
        code = getattr(e, "exit_code", EXIT_USAGE)
        sys.exit(EXIT_USAGE if code in (1, 2) else code)
    except KeyboardInterrupt:
        print("ckptctl: interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except CkptError as e:
        if CTX.debug:
            raise
        print(f"ckptctl: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 - a bug: one line, the traceback under --debug
        if CTX.debug:
            raise
        print(f"ckptctl: internal error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
              " (rerun with --debug for a traceback)", file=sys.stderr)
        sys.exit(EXIT_OPERATIONAL)
    sys.exit(rv if isinstance(rv, int) else 0)

