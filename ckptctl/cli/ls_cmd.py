"""``ckptctl ls ROOT``: the checkpoints a place holds."""
from __future__ import annotations

import datetime as dt
import sys
from typing import List, Optional

import typer

from .common import (JsonOpt, QuietOpt, StorageOpt, emit_json, human_bytes, place_argument,
                     print_table, resolve_place, shown)
from .app import app


@app.command()
def ls(
    ctx: typer.Context,
    root: str = place_argument(metavar="ROOT", help="Folder or prefix holding checkpoints, "
                               "or TIER: (a tier of the config)."),
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    storage_option: Optional[List[str]] = StorageOpt,
):
    """List every checkpoint under ROOT with step, format, state, size and time, by step.

    \b
    EXAMPLES
      ckptctl ls /lustre/run1
      ckptctl ls s3://runs/llama -o endpoint_url=http://minio:9000 --json
      ckptctl ls warm:                       # a tier of ckptctl.toml
    """
    from ..ops import ls as do_ls

    place = resolve_place(ctx, root, storage_option)
    r = do_ls(place.url, place.storage_options, check="auto")  # remote: from the listing
    if json:
        emit_json(r.to_dict())
        return
    for p in r.pointers:  # a resume that reads it would fail: say so even with --quiet
        if not p["present"]:
            what = f"names {p['names']}, which is not here" if p["names"] else \
                f"refused: {p['refused']}" if p.get("refused") else "names no checkpoint folder"
            print(f"ckptctl: warning: {p['file']} {what}", file=sys.stderr)
    if quiet:
        return
    rows = []
    for c in r.checkpoints:
        when = dt.datetime.fromtimestamp(c.modified).strftime("%Y-%m-%d %H:%M") if c.modified else "-"
        state = f"{c.state}, pinned" if c.pinned else c.state
        rows.append([c.name, "-" if c.step is None else str(c.step), c.format or "-", state,
                     human_bytes(c.bytes), when])
    if not rows:
        print(f"no checkpoints under {shown(r.root)}")
        return
    print_table(["name", "step", "format", "state", "size", "modified"], rows)
    for p in r.pointers:
        if p["present"]:
            print(f"{p['file']} names {p['names']}")
