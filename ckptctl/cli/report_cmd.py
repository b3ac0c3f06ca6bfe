"""``ckptctl report``: a run at a glance, one self-contained HTML file (or its --json)."""
from __future__ import annotations

import os
from typing import List, Optional

import typer

from .app import app
from .common import (JsonOpt, QuietOpt, StorageOpt, check_size, emit_json, human_bytes,
                     positive_duration, resolve_place, say, shown)


@app.command()
def report(
    ctx: typer.Context,
    target: Optional[str] = typer.Argument(
        None, metavar="[ROOT|CHECKPOINT]",
        help="A folder or prefix of checkpoints, one checkpoint, or TIER: (a tier of the "
             "config). Default: every tier of the config."),
    output: Optional[str] = typer.Option(
        None, "--output", "-O", metavar="FILE",
        help="Write the HTML page here (required unless --json)."),
    against: Optional[str] = typer.Option(
        None, "--against", metavar="BASE",
        help="Compare each checkpoint with BASE (a fine-tune with its base model) instead "
             "of with the one before it."),
    only: Optional[List[str]] = typer.Option(
        None, "--only", metavar="PARTS|GLOB",
        help="What the change strip compares: state parts or globs, as for diff "
             "(default model; 'all' for every entry)."),
    pairs: int = typer.Option(10, "--pairs", min=0, metavar="N",
                              help="Compare the newest N pairs (0: none)."),
    save_seconds: Optional[float] = typer.Option(
        None, "--save-seconds", metavar="C",
        help="Seconds a save blocks training: with --mtbf, draw plan's overhead curve."),
    mtbf: Optional[str] = typer.Option(
        None, "--mtbf", metavar="DUR", help="The job's mean time between failures (2.8h)."),
    interval: Optional[str] = typer.Option(
        None, "--interval", metavar="DUR", help="The interval in use, marked on the curve."),
    max_memory: str = typer.Option("1GiB", "--max-memory", metavar="SIZE",
                                   callback=check_size,
                                   help="Memory for tensor data while comparing."),
    workers: int = typer.Option(4, "--workers", min=1, metavar="N",
                                help="Chunks compared at once."),
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    storage_option: Optional[List[str]] = StorageOpt,
):
    """Draw a run: its checkpoints by step in each tier, where one checkpoint's bytes are,
    which layers changed between checkpoints, and plan's overhead curve.

    The page is one HTML file with its charts inline (SVG): no script runs and nothing
    is fetched, so it opens from a laptop's disk or a CI artifact. The change strip
    compares each pair as `ckptctl diff LATER EARLIER` would (the same per-layer numbers
    as diff --json's layers), reading each tensor once within --max-memory. Charts need
    the report extra (pip install 'ckptctl[report]'); --json needs nothing more.

    \b
    EXAMPLES
      ckptctl report /lustre/run1 --output run1.html
      ckptctl report --config ckptctl.toml --output tiers.html \\
          --save-seconds 40 --mtbf 1d
      ckptctl report ft/step-900 --against base/ --output drift.html
      ckptctl report s3://runs/llama --json > report.json
    """
    from ..errors import UsageError
    from ..ops import report as do_report
    from .common import current_config

    if output is None and not json:
        raise UsageError("give --output FILE for the HTML page, or --json for its data")
    if (save_seconds is None) != (mtbf is None):
        raise UsageError("the overhead curve needs both --save-seconds and --mtbf")
    if save_seconds is not None and not save_seconds > 0:
        raise UsageError(f"--save-seconds must be more than 0, not {save_seconds:g}")
    plan = None
    if save_seconds is not None:
        plan = {"save_seconds": save_seconds, "mtbf_seconds": positive_duration("--mtbf", mtbf),
                "interval_seconds": positive_duration("--interval", interval)}
    config = None
    if target is None:
        config = current_config(ctx)
        if not config.tiers:
            raise UsageError("name a ROOT or CHECKPOINT, or give a tier config (--config "
                             "FILE, $CKPTCTL_CONFIG or ./ckptctl.toml)")
        url, options = None, _options(storage_option)
    else:
        place = resolve_place(ctx, target, storage_option)
        url, options = place.url, place.storage_options
    base = resolve_place(ctx, against, storage_option).url if against else None
    parts = None if only and [o.lower() for o in only] == ["all"] else (only or ["model"])
    data = do_report(url, options, output=output, config=config, against=base, only=parts,
                     pairs=pairs, max_memory=max_memory, workers=workers, plan=plan,
                     page={"show": shown, "shown_doc": _as_json})
    if json:
        emit_json(data.to_dict())
        return
    n = sum(len(t.checkpoints) for t in data.tiers)
    size = os.path.getsize(output)
    say(f"wrote {shown(output)} ({human_bytes(size)}): {n} checkpoints, "
        f"{len(data.changes)} pairs compared, in {data.seconds:.1f} s", quiet=quiet)
    for note in data.notes:
        say(f"note: {note}", quiet=quiet)


def _as_json(doc: dict) -> dict:
    """The page's JSON as ``--json`` prints it: each place as it was given."""
    from .common import SCHEMA_VERSION, shown_places

    return shown_places({"schema_version": SCHEMA_VERSION, **doc})


def _options(storage_option: Optional[List[str]]) -> dict | None:
    from .common import storage_options

    return storage_options(storage_option) if storage_option else None

