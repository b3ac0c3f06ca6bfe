"""The typer app and its global options. Every verb module (``*_cmd.py``) registers its
command on :data:`app`; ``cli/main.py`` imports them all and runs it."""
from __future__ import annotations

from typing import Optional

import typer

from .. import __version__
from ..errors import exit_status_text

EXIT_STATUS = exit_status_text()  # the table lives in errors.EXIT_CODES

#: ``ckptctl --help`` lists the verbs in these sections, in this order; a verb that is in
#: none is listed last, under "Other" (a new verb is never left out of the help).
SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Look", ("ls", "inspect", "latest", "report")),
    ("Convert", ("reshard", "consolidate", "pack", "unpack")),
    ("Compare and check", ("diff", "verify", "seal")),
    ("Tiers and retention", ("tiers", "promote", "gc", "rm", "pin", "unpin")),
    ("Service", ("watch", "plan", "man")),
)


def sections(names) -> list[tuple[str, list[str]]]:
    """The verbs ``names`` in :data:`SECTIONS`' order, each under its heading; the rest
    under "Other"; empty sections left out.

    >>> sections(["gc", "ls", "frob", "inspect"])
    [('Look', ['ls', 'inspect']), ('Tiers and retention', ['gc']), ('Other', ['frob'])]
    """
    names = list(names)
    placed = {n for _, verbs in SECTIONS for n in verbs}
    out = [(title, [v for v in verbs if v in names]) for title, verbs in SECTIONS]
    out.append(("Other", [n for n in names if n not in placed]))
    return [(title, verbs) for title, verbs in out if verbs]


class SectionedGroup(typer.core.TyperGroup):
    """click's plain group help with the commands in :func:`sections` (typer's
    ``rich_help_panel`` panels exist only in rich help, which ckptctl does not use)."""

    def format_commands(self, ctx, formatter) -> None:
        shown = [(n, c) for n in self.list_commands(ctx)
                 if (c := self.get_command(ctx, n)) is not None and not c.hidden]
        if not shown:
            return
        cmds = dict(shown)
        width = max(len(n) for n in cmds)
        limit = formatter.width - 6 - width
        for title, names in sections(cmds):
            with formatter.section(title):  # names padded: one column across sections
                formatter.write_dl([(n.ljust(width), cmds[n].get_short_help_str(limit))
                                    for n in names])


app = typer.Typer(
    name="ckptctl",
    cls=SectionedGroup,
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
        from ..tiering.config import find_config, load_config

        load_config(find_config(config))
    forget_dead_servers()  # one command's verdicts on servers do not leak into the next
