"""The typer app and its global options. Every verb module (``*_cmd.py``) registers its
command on :data:`app`; ``cli/main.py`` imports them all and runs it."""
from __future__ import annotations

from typing import Optional

import typer

from .. import __version__
from ..errors import exit_status_text

EXIT_STATUS = exit_status_text()  # the table lives in errors.EXIT_CODES

app = typer.Typer(
    name="ckptctl",
    help="git + rclone + restic for training checkpoints: inspect, seal and verify; "
         "reshard and consolidate; diff, pack and unpack; promote between tiers, gc, "
         "latest; watch and plan the tiering.\n\n"
         + EXIT_STATUS,
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    # click's plain help: it keeps the \b blocks (tables, examples) intact and wraps to
    # the terminal (80 columns reads well), it is what README.md and the man page show,
    # and --help imports no rich
    rich_markup_mode=None,
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
    config: Optional[str] = typer.Option(
        None, "--config", metavar="FILE",
        help="Tier config (TOML, see `ckptctl tiers`): TIER: and TIER:NAME then stand for "
             "a URL anywhere one is taken. Default: $CKPTCTL_CONFIG, else ./ckptctl.toml "
             "if there is one."),
):
    from ..storage.failures import forget_dead_servers
    from ..storage.filesystems import set_timeout

    del debug  # read from argv by main(), before parsing: it must hold on every error path
    set_timeout(timeout)  # UsageError (exit 2) unless > 0
    if config:  # checked now (exit 2), even when no TIER: is used
        from ..config import find_config, load_config

        load_config(find_config(config))
    forget_dead_servers()  # one command's verdicts on servers do not leak into the next
