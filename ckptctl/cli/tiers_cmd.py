"""``ckptctl tiers``: the tier config, resolved and checked."""
from __future__ import annotations

import sys

import typer

from ..errors import EXIT_OPERATIONAL
from .app import app
from .common import JsonOpt, QuietOpt, emit_json, human_bytes, plural, print_table, say


@app.command()
def tiers(
    ctx: typer.Context,
    no_check: bool = typer.Option(False, "--no-check",
                                  help="Only print the config; do not touch the tiers."),
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
):
    """Print the tier config resolved (secrets masked) and check every tier is writable.

    The config is --config FILE (global, anywhere on the line), else $CKPTCTL_CONFIG,
    else ./ckptctl.toml: a list of tier tables, hottest first, each with name, url and
    optional storage_options, keep, bwlimit, pack and max_chain (README, "Tiers").
    Anywhere a URL is taken, TIER: stands for a tier's root and TIER:NAME for NAME
    under it. Below the table, each tier says what it holds at most under its keep (on
    a pack tier gc and watch re-root a pack kept only as a base, so that is exact).

    Each tier is checked by writing a small .ckptctl-probe-<random> object at its root,
    reading it back and deleting it, all tiers at once, each within a bounded time
    (--timeout); a tier that fails shows its one-line reason and the command exits 3
    after checking them all.

    \b
    EXAMPLES
      ckptctl tiers
      ckptctl tiers --config /etc/ckptctl/run1.toml --json
      ckptctl tiers --no-check
      ckptctl ls warm: && ckptctl inspect cold:step-12000
    """
    from ..tiering.config import CONFIG_ENV, CONFIG_NAME
    from ..errors import UsageError
    from ..tiering.tiers import check_tiers
    from .common import current_config

    config = current_config(ctx)
    if config.path is None:
        raise UsageError(f"no tier config: pass --config FILE, set {CONFIG_ENV} or create "
                         f"./{CONFIG_NAME}")
    r = check_tiers(config, check=not no_check)
    if json:
        emit_json(r.to_dict())
    elif not quiet:
        headers = ["#", "tier", "url", "bwlimit", "keep", "pack", "storage options"]
        if r.checked:
            headers.append("check")
        rows = []
        for t in r.tiers:
            row = [str(t.order), t.name, t.url,
                   f"{human_bytes(int(t.bwlimit))}/s" if t.bwlimit else "-",
                   _words(t.keep) or "all",
                   f"yes (chain <= {t.max_chain})" if t.pack else "no",
                   _words(t.storage_options) or "-"]
            if r.checked:
                row.append("ok (writable)" if t.ok else f"FAILED: {t.reason}")
            rows.append(row)
        print_table(headers, rows, fold=(2, 6, 7))
        for t in r.tiers:
            say(f"{t.name}: {t.holds}", quiet=quiet)
        if r.checked and r.ok:
            say(f"{plural(len(r.tiers), 'tier')} from {r.config}: every one reachable and "
                "writable", quiet=quiet)
    if not r.ok:
        bad = r.failed
        print(f"ckptctl: error: {plural(len(bad), 'tier')} of {len(r.tiers)} not reachable "
              f"or not writable: {', '.join(t.name for t in bad)}", file=sys.stderr)
        raise typer.Exit(EXIT_OPERATIONAL)


def _words(d: dict | None, prefix: str = "") -> str:
    """``{"last": 2, "c": {"x": 1}}`` as ``last=2, c.x=1``."""
    out = []
    for k, v in (d or {}).items():
        if isinstance(v, dict):
            out.append(_words(v, f"{prefix}{k}."))
        else:
            shown = ",".join(map(str, v)) if isinstance(v, list) else v
            out.append(f"{prefix}{k}={shown}")
    return ", ".join(x for x in out if x)
