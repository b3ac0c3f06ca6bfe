"""What every command shares: global options, JSON output, human sizes, TTY-only rich.

>>> human_bytes(1536), human_bytes(3 * 2**30)
('1.5 KiB', '3.0 GiB')
>>> plural(1, "tensor"), plural(2, "file"), plural(0, "entry", "entries")
('1 tensor', '2 files', '0 entries')
"""
from __future__ import annotations

import json
import sys

import typer


JsonOpt = typer.Option(False, "--json", help="Machine-readable output on stdout.")
QuietOpt = typer.Option(False, "--quiet", "-q", help="Print nothing but errors.")


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def human_count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def is_tty() -> bool:
    return sys.stdout.isatty()


def console():
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False)


#: Version of every ``--json`` document (README, "JSON output"); bump on a breaking change.
SCHEMA_VERSION = 1


def emit_json(doc: dict) -> None:
    """Print one ``--json`` document on stdout, ``schema_version`` first."""
    doc = {"schema_version": SCHEMA_VERSION, **doc}
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")


def plural(n: int, word: str, many: str | None = None) -> str:
    """``n`` (thousands separated) and ``word`` in the number ``n`` asks for (``many``: an
    irregular plural): ``plural(1044864, "element")`` is ``'1,044,864 elements'``."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def check_size(value: str | None) -> str | None:
    """typer callback of a size flag (``--max-memory 1GiB``): a size that does not parse or
    is not positive is a usage error (exit 2) that names the flag."""
    if value is not None:
        from ..errors import UsageError
        from ..ops.reshard import parse_size

        try:
            parse_size(value)
        except UsageError as e:
            raise typer.BadParameter(e.message) from None
    return value


def print_table(headers: list[str], rows: list[list[str]], title: str | None = None, *,
                fold: tuple[int, ...] = ()) -> None:
    """A rich table on a TTY; plain tab-free aligned columns otherwise (never wrapped).

    On a TTY only the ``fold`` columns (free text: messages, values) wrap, at spaces or
    inside a long word; names and numbers keep their width, the table growing past the
    terminal's width rather than break a name mid-word.
    """
    if is_tty():
        from rich.table import Table
        from rich.text import Text

        t = Table(title=title, show_edge=False, pad_edge=False)
        for i, h in enumerate(headers):
            t.add_column(h, no_wrap=i not in fold, overflow="fold")
        for r in rows:  # Text: a name such as "[model.w]" is not rich markup
            t.add_row(*(Text(str(x)) for x in r))
        out = console()
        natural = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
        need = sum(min(w, 30) if i in fold else w for i, w in enumerate(natural)) \
            + 3 * (len(headers) - 1)
        out.width = max(out.width, need)
        out.print(t)
        return
    if title:
        print(title)
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    for r in [headers, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip())


def say(text: str = "", *, quiet: bool = False) -> None:
    """Print a line of human output unless ``--quiet``."""
    if not quiet:
        print(text)

StorageOpt = typer.Option(
    None, "--storage-option", "-o", metavar="KEY=VALUE",
    help="fsspec storage option, repeatable (endpoint_url=..., key=..., secret=...). "
         "S3 also reads AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY.")


def storage_options(pairs: list[str] | None) -> dict:
    from ..storage import parse_storage_options

    return parse_storage_options(pairs)
