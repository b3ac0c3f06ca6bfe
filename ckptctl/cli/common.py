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

#: Version of every ``--json`` document (README, "JSON output"), kept with the vocabulary.
from ..catalog.vocabulary import SCHEMA_VERSION

JsonOpt = typer.Option(False, "--json", help="Machine-readable output on stdout.")
ForceOpt = typer.Option(False, "--force", help="Replace what a killed run left in DST, or "
                        "one unpinned checkpoint there (never a folder of checkpoints or "
                        "other files); its manifest and format markers are removed first.")
QuietOpt = typer.Option(False, "--quiet", "-q", help="Print nothing but errors.")


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def human_rate(r: float | None) -> str:
    """Bytes per second for people; ``unknown`` when not measured.

    >>> human_rate(3 << 20), human_rate(None)
    ('3.0 MiB/s', 'unknown')
    """
    return "unknown" if not r else f"{human_bytes(int(r))}/s"


def human_seconds(s: float | None) -> str:
    """Seconds for people, with the duration spelled out past a minute.

    >>> human_seconds(1099.3), human_seconds(None)
    ('1,099.3 s (18m19s)', 'unknown')
    """
    if s is None:
        return "unknown"
    from ..tiering.policy import format_duration

    return f"{s:,.1f} s" if s < 60 else f"{s:,.1f} s ({format_duration(s)})"


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


def emit_json(doc: dict) -> None:
    """Print one ``--json`` document on stdout, ``schema_version`` first, every place in
    it (:data:`~ckptctl.catalog.vocabulary.LOCATION_KEYS`) shown as it was given
    (:func:`shown`)."""
    doc = shown_places({"schema_version": SCHEMA_VERSION, **doc})
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")


# ------------------------------------------------------------------ places, as given

def given_places() -> list[str]:
    """The places this command was given (its URLs, paths and tiers' URLs, as
    :func:`resolve_place` saw them); empty outside a command."""
    ctx = _running_context()
    root = ctx.find_root() if ctx is not None else None
    return list(root.meta.get("ckptctl.given", ())) if root is not None else []


def _remember(ctx, url: str | None) -> None:
    """Record ``url`` as a place the running command was given (:func:`given_places`)."""
    ctx = ctx if ctx is not None else _running_context()
    root = ctx.find_root() if ctx is not None else None
    if root is not None and url:
        given = root.meta.setdefault("ckptctl.given", [])
        if url not in given:
            given.append(url)


def _as_given(given: str) -> tuple[str, str] | None:
    """(the absolute path a local place ``given`` stands for, the prefix its files are
    shown under), or None where it is shown as it is already (absolute, or remote)."""
    import os

    from ..storage import split_url

    protocol, path = split_url(given)
    if protocol != "file" or given == path or path == "/":
        return None
    prefix = given.rstrip("/") if given.strip("/") else given
    return path, "" if prefix in (".", "./") else prefix


def shown(path: str | None, places: list[str] | None = None) -> str | None:
    """``path`` (a URL or a path as the storage layer names it: absolute when local) the
    way the user gave its place: under one of ``places`` (default: the running command's,
    :func:`given_places`) given as a relative path or a ``file://`` URL, it is written
    under that place as given; anything else is returned as it is. What git and rclone
    do: a relative path stays relative, a URL stays a URL.

    >>> import os
    >>> here = os.path.abspath("run")
    >>> shown(here + "/step-20/NOTES.md", ["run/"]), shown(here, ["./run"])
    ('run/step-20/NOTES.md', './run')
    >>> shown(os.path.abspath("step-20"), ["."]), shown("/elsewhere/x", ["run"])
    ('step-20', '/elsewhere/x')
    >>> shown(here + "/s", ["file://" + here]) == "file://" + here + "/s"
    True
    """
    if not path or not path.startswith("/"):
        return path
    best = None
    for given in given_places() if places is None else places:
        pair = _as_given(given)
        if pair is None:
            continue
        full, prefix = pair
        if (path == full or path.startswith(full.rstrip("/") + "/")) and \
                (best is None or len(full) > len(best[0])):
            best = pair
    if best is None:
        return path
    full, prefix = best
    rest = path[len(full):].lstrip("/")
    return "/".join(x for x in (prefix, rest) if x) or "."


def shown_text(text: str, places: list[str] | None = None) -> str:
    """``text`` (a line for people) with each absolute path in it that lies under a place
    given as a relative path or a ``file://`` URL written as :func:`shown` writes it.

    >>> import os
    >>> shown_text(f"pinned {os.path.abspath('run/step-2')} (paper)", ["run"])
    'pinned run/step-2 (paper)'
    >>> elsewhere = [f"{os.path.abspath('run2')}: ok", f"/x{os.path.abspath('run')}/a"]
    >>> [shown_text(t, ["run"]) for t in elsewhere] == elsewhere
    True
    """
    import re

    places = given_places() if places is None else places
    for full, _ in sorted(filter(None, map(_as_given, places)), key=lambda p: -len(p[0])):
        if full in text:
            text = re.sub(r"(?<![\w/.~-])" + re.escape(full)
                          + r"(?:/[^\s:,;()\[\]'\"]*)?(?![^\s:,;()\[\]'\"])",
                          lambda m: shown(m.group(0), places), text)
    return text


def shown_places(doc, places: list[str] | None = None):
    """``doc`` (a JSON document) with the value of every location key
    (:data:`~ckptctl.catalog.vocabulary.LOCATION_KEYS`) :func:`shown` as given, at any depth.

    >>> import os
    >>> shown_places({"url": os.path.abspath("r/s"), "problems": [
    ...     {"path": os.path.abspath("r/s/x"), "message": "m"}]}, ["r"])
    {'url': 'r/s', 'problems': [{'path': 'r/s/x', 'message': 'm'}]}
    """
    from ..catalog.vocabulary import LOCATION_KEYS

    places = given_places() if places is None else places
    if not places:
        return doc
    if isinstance(doc, dict):
        return {k: shown(v, places) if k in LOCATION_KEYS and isinstance(v, str)
                else shown_places(v, places) for k, v in doc.items()}
    if isinstance(doc, list):
        return [shown_places(v, places) for v in doc]
    return doc


def plural(n: int, word: str, many: str | None = None) -> str:
    """``n`` (thousands separated) and ``word`` in the number ``n`` asks for (``many``: an
    irregular plural): ``plural(1044864, "element")`` is ``'1,044,864 elements'``."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


#: A year in durations here: 365 days (a vendor's "5 years MTBF"); the other units are
#: ``parse_duration``'s (s, m, h, d, w).
YEAR = 365 * 86400


def positive_duration(flag: str, text: str | None) -> float | None:
    """Seconds in ``text``: ``parse_duration``'s spellings (``5y``, ``2.8h``, ``1d12h``,
    ``90m``, a number of seconds), more than 0.

    >>> positive_duration("--node-mtbf", "5y") == 5 * YEAR
    True
    >>> positive_duration("--mtbf", "1y12h") == YEAR + 43200
    True
    >>> positive_duration("--mtbf", "2.8h"), positive_duration("--mtbf", None)
    (10080.0, None)
    """
    from ..errors import UsageError
    from ..tiering.policy import parse_duration

    if text is None:
        return None
    try:
        value = parse_duration(text)
    except UsageError as e:
        raise UsageError(f"{flag}: {e.message}") from None
    if value <= 0:
        raise UsageError(f"{flag} must be longer than 0, not {text!r}")
    return value


def check_size(value: str | None) -> str | None:
    """typer callback of a size flag (``--max-memory 1GiB``): a size that does not parse or
    is not positive is a usage error (exit 2) that names the flag."""
    if value is not None:
        from ..errors import UsageError
        from ..units import parse_size

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


#: Lines of a :func:`print_fitted` table fit in this many columns off a terminal.
WIDTH = 80


def print_fitted(headers: list[str], rows: list[list[str]], width: int | None = None, *,
                 min_last: int = 30) -> None:
    """Aligned columns within ``width`` (default: the terminal's, else :data:`WIDTH`), the
    last column (free text: a message) wrapped at spaces, each continuation under its
    column with the other columns blank; words are never cut (a long name runs past the
    edge). When the other columns leave it fewer than ``min_last``, each row's last cell
    goes on the lines below the row instead, indented four spaces.

    >>> print_fitted(["code", "where", "message"], [["BAD", "a.bin", "one two three"]], 24,
    ...              min_last=8)
    code  where  message
    BAD   a.bin  one two
                 three
    >>> print_fitted(["code", "where", "message"], [["BAD", "a.bin", "one two three"]], 24)
    code  where
    BAD   a.bin
        one two three
    """
    import shutil
    import textwrap

    width = width or (shutil.get_terminal_size((WIDTH, 24)).columns if is_tty() else WIDTH)
    heads = headers[:-1]
    widths = [max(len(str(x)) for x in col) for col in zip(heads, *(r[:-1] for r in rows))]
    left = sum(widths) + 2 * len(widths)
    stacked = width - left < min_last

    def line(cells: list[str]) -> str:
        return "  ".join(str(x).ljust(w) for x, w in zip(cells, widths + [0])).rstrip()

    def wrap(text: str, room: int) -> list[str]:
        return textwrap.wrap(str(text), max(room, 1), break_long_words=False,
                             break_on_hyphens=False) or [""]

    print(line(heads if stacked else headers))
    for r in rows:
        if stacked:
            print(line(r[:-1]))
            for part in wrap(r[-1], width - 4) if r[-1] else []:
                print("    " + part)
            continue
        first, *more = wrap(r[-1], width - left)
        print(line([*r[:-1], first]))
        for part in more:
            print(" " * left + part)


def say(text: str = "", *, quiet: bool = False) -> None:
    """Print a line of human output unless ``--quiet``, the places in it as the command
    was given them (:func:`shown_text`)."""
    if not quiet:
        print(shown_text(text))

#: Which storage options win, key by key (DESIGN.md, "Storage and tiers", says the same).
PRECEDENCE = ("Key by key: --src-option/--dst-option > -o > the tier's storage_options "
              "(ckptctl.toml) > the environment (AWS_*, AZURE_STORAGE_*, GOOGLE_*).")

StorageOpt = typer.Option(
    None, "--storage-option", "-o", metavar="KEY=VALUE",
    help="Storage option for every place the command touches, repeatable. S3: "
         "endpoint_url=, key=, secret=, profile=; dotted keys nest: "
         "config_kwargs.read_timeout=300 (also AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
         "AWS_SECRET_ACCESS_KEY). GCS: token=PATH|anon, project=, endpoint_url= (also "
         "GOOGLE_APPLICATION_CREDENTIALS, STORAGE_EMULATOR_HOST). Azure: account_name=, "
         "account_key=, sas_token=, endpoint=, connection_string= (also "
         "AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT_NAME/_KEY). fsspec=true: "
         "through the fsspec filesystem (s3fs, gcsfs, adlfs). " + PRECEDENCE)
SrcOpt = typer.Option(
    None, "--src-option", metavar="KEY=VALUE",
    help="Storage option for SRC only, repeatable; wins over -o, key by key (e.g. a copy "
         "between two S3 endpoints).")
DstOpt = typer.Option(
    None, "--dst-option", metavar="KEY=VALUE",
    help="Storage option for DST only, repeatable; wins over -o, key by key.")


def storage_options(pairs: list[str] | None, flag: str = "--storage-option") -> dict:
    """``KEY=VALUE`` flags as fsspec options (:func:`~ckptctl.storage.parse_storage_options`);
    a pair without ``=`` is a usage error naming ``flag``.

    >>> storage_options(["endpoint_url=http://x:9", "use_ssl=false"])
    {'endpoint_url': 'http://x:9', 'use_ssl': False}
    >>> storage_options(["endpoint_url"], "--src-option")
    Traceback (most recent call last):
    ckptctl.errors.UsageError: --src-option expects key=value, got 'endpoint_url'
    """
    from ..errors import UsageError
    from ..storage import parse_storage_options

    for pair in pairs or ():
        key, sep, _ = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag} expects key=value, got {key!r}")
    return parse_storage_options(pairs)


def current_config(ctx):
    """The tier config of this command line (the global ``--config`` read from the typer
    context ``ctx``, else ``$CKPTCTL_CONFIG``, else ``./ckptctl.toml``), read once per
    command; an empty :class:`~ckptctl.tiering.config.Config` when there is none (``ctx`` None:
    the variable and the working directory only).

    >>> current_config(None).tiers
    ()
    """
    from ..tiering.config import find_config, load_config

    ctx = ctx if ctx is not None else _running_context()
    root = ctx.find_root() if ctx is not None else None
    if root is not None and "ckptctl.tiering.config" in root.meta:
        return root.meta["ckptctl.tiering.config"]
    explicit = root.params.get("config") if root is not None else None
    cfg = load_config(find_config(explicit))
    if root is not None:
        root.meta["ckptctl.tiering.config"] = cfg
    return cfg


def _running_context():
    """The click context of the command being run (None outside one). typer 0.12+ uses
    click, later versions a vendored copy: ask the package its Context class comes from."""
    import importlib

    import typer

    try:
        core = next(c for c in typer.Context.__mro__[1:] if c.__name__ == "Context").__module__
        return importlib.import_module(core.rsplit(".", 1)[0] + ".globals") \
            .get_current_context(silent=True)
    except (StopIteration, ImportError, AttributeError):
        return None


def resolve_place(ctx, text: str | None = None, common: list[str] | None = None,
                  own: list[str] | None = None, *, own_flag: str = "--storage-option"):
    """The one way a verb turns a URL, path, ``TIER:`` or ``TIER:NAME`` and its option
    flags into a :class:`~ckptctl.tiering.config.Place` (url, storage_options, tier); ``ctx`` is
    the verb's ``typer.Context`` (it carries the global ``--config``). Called as
    ``resolve_place(text, common, own)`` it finds the running command's context itself.

    ``common`` are the ``-o`` pairs (every place of the command), ``own`` this place's
    own pairs (``--src-option``/``--dst-option``, named ``own_flag`` in errors). Key by
    key: ``own`` > ``common`` > the tier's storage_options > the environment (AWS_*,
    applied by the store for keys still unset).

    >>> p = resolve_place(None, "/data/step-1", ["endpoint_url=http://a:1", "key=k"],
    ...                   ["endpoint_url=http://b:2"], own_flag="--src-option")
    >>> p.url, p.storage_options
    ('/data/step-1', {'endpoint_url': 'http://b:2', 'key': 'k'})
    """
    from ..tiering.config import Place, merge_options, resolve, tier_reference

    if isinstance(ctx, str):  # resolve_place(text, common, own)
        ctx, text, common, own = None, ctx, text, common
    opts = merge_options(storage_options(common), storage_options(own, own_flag))
    if tier_reference(text) is None:  # a URL or path: the config is not even read
        place = Place(text, opts, None)
    else:
        place = resolve(text, config=current_config(ctx), options=opts)
    _remember(ctx, place.url)  # what the command prints is shown as given (shown())
    return place


# ------------------------------------------------------------------------ shell completion

def complete_choices(*words: str):
    """A typer ``autocompletion`` offering ``words`` (the shell keeps those that match).

    >>> complete_choices("dcp", "megatron-legacy")("m")
    ['megatron-legacy']
    """
    def complete(incomplete: str) -> list[str]:
        return [w for w in words if w.startswith(incomplete)]
    return complete


def complete_rules(incomplete: str) -> list[str]:
    """``reshard --rules``: the presets, and the ``.toml`` files and folders that match.

    >>> complete_rules("ll")
    ['llama']
    """
    import glob
    import os

    presets = [w for w in ("fsdp", "llama", "tp") if w.startswith(incomplete)]
    paths = [p + "/" if os.path.isdir(p) else p
             for p in sorted(glob.glob(glob.escape(incomplete) + "*"))]
    return presets + [p for p in paths if p.endswith((".toml", "/"))]


def place_argument(*, metavar: str, help: str):
    """A URL argument (path, s3://..., TIER:NAME): required, completed by the shell with
    the config's tier names (:func:`complete_place`).

    >>> place_argument(metavar="URL", help="One checkpoint.").metavar
    'URL'
    """
    return typer.Argument(..., metavar=metavar, help=help, autocompletion=complete_place)


def complete_place(ctx: typer.Context, incomplete: str) -> list[str]:
    """A URL argument: the config's tier names (``hot:``), under a local tier its entries
    (``hot:step-``), and with those the local paths that match; nothing (the shell's own
    file completion) when no tier matches. A config that does not load offers no tiers.

    >>> complete_place(None, "/no/such/")   # no ./ckptctl.toml here: no tiers, no offer
    []
    """
    import glob
    import os

    from ..tiering.config import tier_reference

    try:
        tiers = current_config(ctx).tiers
    except Exception:  # noqa: BLE001 - completion never fails: a bad config offers nothing
        return []
    out = [f"{t.name}:" for t in tiers if f"{t.name}:".startswith(incomplete)]
    ref = tier_reference(incomplete) if incomplete else None
    tier = next((t for t in tiers if ref and t.name == ref[0]), None)
    if tier is not None:
        base = tier.url[len("file://"):] if tier.url.startswith("file://") else tier.url
        try:
            names = [] if "://" in base else sorted(os.listdir(base))  # local tiers only
        except OSError:
            names = []
        out += [f"{tier.name}:{n}" for n in names
                if n.startswith(ref[1]) and not n.startswith(".")]
    if out:
        out += [p + "/" if os.path.isdir(p) else p
                for p in sorted(glob.glob(glob.escape(incomplete) + "*"))]
    return out
