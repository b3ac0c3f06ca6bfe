"""``ckptctl verify URL`` and ``ckptctl seal URL``: integrity for CI gates."""
from __future__ import annotations

from enum import Enum
from typing import List, Optional

import typer

from ..errors import EXIT_FINDING
from .common import (JsonOpt, QuietOpt, StorageOpt, emit_json, human_bytes, place_argument,
                     plural, print_table, resolve_place, say)
from .app import app
from .progress import byte_progress


class Level(str, Enum):
    quick = "quick"
    structure = "structure"
    full = "full"


class HashAlgo(str, Enum):
    xxh3 = "xxh3-128"
    sha256 = "sha256"


@app.command()
def verify(
    ctx: typer.Context,
    url: str = place_argument(metavar="URL", help="Checkpoint folder or file: path, file://, "
                              "s3://..., TIER:NAME."),
    level: Level = typer.Option(Level.structure, "--level", "-l",
                                help="How deep to check; each level includes the previous."),
    require: Optional[str] = typer.Option(None, "--require", metavar="PARTS",
                                          help="Comma-separated state parts that must be present: "
                                               "model,optim,lr_scheduler,rng,step,dataloader."),
    check_finite: bool = typer.Option(False, "--check-finite",
                                      help="Count NaN/Inf per floating tensor (reads all data)."),
    sample: Optional[float] = typer.Option(None, "--sample", metavar="FRACTION",
                                           help="With --level full: check a deterministic "
                                                "fraction (0-1] of the files (default: all)."),
    workers: int = typer.Option(4, "--workers", min=1, metavar="N",
                                help="Parallel readers/hashers."),
    all_: bool = typer.Option(False, "--all", help="URL is a run's root: verify every "
                              "checkpoint under it (as `ckptctl ls` lists them), one report "
                              "each; exit 1 if any has a problem or cannot be read."),
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    storage_option: Optional[List[str]] = StorageOpt,
):
    """Check a checkpoint's integrity: exit 0 clean, 1 on any finding, 3 unreadable.

    \b
    quick      commit state, files present at their sizes, stray temp files
    structure  + metadata parses, chunks tile tensors, extents inside files,
                 closure
    full       + every data file read once: content hashes against the manifest;
                 unsealed, the CRC-32 of every DCP/torch.save zip record
                 (safetensors: decoded only)

    \b
    EXAMPLES
      ckptctl verify ckpt/step-20
      ckptctl verify --level full --require model,optim,step ckpt/ && deploy
      ckptctl verify -l full --check-finite --sample 0.1 s3://runs/step-12000
      ckptctl verify --level full cold:step-12000
      ckptctl verify --all /lustre/run1 --json
    """
    from ..errors import UsageError
    from ..formats.detect import several
    from ..ops import verify as do_verify
    from ..ops.distributed import Group

    place = resolve_place(ctx, url, storage_option)
    if all_:
        return _verify_all(place, level=level.value, require=require, check_finite=check_finite,
                           sample=sample, workers=workers, json=json, quiet=quiet)
    # under torchrun/srun the full level's files are split over the processes; rank 0
    # reports every finding and carries the exit code, the others exit 0 once they reported
    group = Group.from_env() if level == Level.full else Group()
    with byte_progress("verify", enabled=level == Level.full and not (json or quiet)) as bar:
        try:
            r = do_verify(place.url, place.storage_options, level=level.value, require=require, check_finite=check_finite,
                          sample=sample, workers=workers, on_bytes=bar, on_total=bar and bar.total,
                          group=group)
        except UsageError as e:  # a run's root: name the way to verify all it holds
            if getattr(e, "checkpoints", None) is None:
                raise
            shown = url if url.endswith(("/", ":")) else url + "/"
            raise several(e.path, e.checkpoints, f"ckptctl verify {shown} --all") from None
    if group.rank != 0:
        if json:
            emit_json(group.tag(r.to_dict()))
        else:
            say(f"rank {group.rank}/{group.world_size}: {plural(r.files_read, 'file')} read, "
                f"{human_bytes(r.bytes_read)}; rank 0 reports", quiet=quiet)
        return
    if json:
        emit_json(group.tag(r.to_dict()))
    elif not quiet:
        if r.problems:
            print_table(["code", "severity", "where", "message"], problem_rows(r.problems),
                        fold=(3,))
        state = "OK" if r.ok else plural(len(r.problems), "problem")
        proven = f"content: {CONTENT_WORDS.get(r.content, r.content)}; " if r.content else ""
        say(f"{r.url}: {state} ({r.level}; {r.format or 'unknown format'}, "
            f"{'sealed' if r.sealed else 'not sealed'}; {proven}{plural(r.files_checked, 'file')}, "
            f"{human_bytes(r.bytes_read)} read in {r.seconds:.2f}s)", quiet=quiet)
    if not r.ok:
        raise typer.Exit(EXIT_FINDING)


def _verify_all(place, *, level: str, require, check_finite: bool, sample, workers: int,
                json: bool, quiet: bool) -> None:
    """``verify --all``: one row per checkpoint, the problems of those that have any."""
    from ..ops.verify import verify_all

    with byte_progress("verify", enabled=level == "full" and not (json or quiet)) as bar:
        r = verify_all(place.url, place.storage_options, level=level, require=require,
                       check_finite=check_finite, sample=sample, workers=workers, on_bytes=bar)
    if json:
        emit_json(r.to_dict())
    elif not quiet:
        if r.checkpoints:
            print_table(["name", "step", "format", "result"],
                        [[c.name, "-" if c.result.step is None else str(c.result.step),
                          c.result.format or "-",
                          "OK" if c.result.ok else f"not read: {_reason(c.error)}" if c.error
                          else plural(len(c.result.problems), "problem")]
                         for c in r.checkpoints], fold=(3,))
        bad = [p for c in r.checkpoints for p in c.result.problems]
        if bad:
            say("")
            print_table(["code", "severity", "where", "message"], problem_rows(bad), fold=(3,))
        n_ok = sum(c.result.ok for c in r.checkpoints)
        unread = sum(c.error is not None for c in r.checkpoints)
        parts = [f"{n_ok} OK"] + ([f"{len(r.checkpoints) - n_ok - unread} with problems"]
                                  if len(r.checkpoints) - n_ok - unread else []) \
            + ([f"{unread} not read"] if unread else [])
        say(f"{r.url}: {plural(len(r.checkpoints), 'checkpoint')}"
            + (f": {', '.join(parts)}" if r.checkpoints else "")
            + f" ({r.level}; {human_bytes(r.bytes_read)} read in {r.seconds:.2f}s)", quiet=quiet)
    if not r.ok:
        raise typer.Exit(EXIT_FINDING)


def _reason(error: dict) -> str:
    """An error's message without the path the row already names."""
    msg, path = error["message"], error["path"]
    return msg[len(path) + 2:] if path and msg.startswith(f"{path}: ") else msg


def problem_rows(problems: list, first: int = 3) -> list[list[str]]:
    """Table rows of verify's problems grouped by code, in the order codes first appear:
    a code seen more than ``first`` times shows its count, ``first`` examples and a
    ``(+N more)`` row (``--json`` keeps every problem).

    >>> from ckptctl.ops.verify import Problem
    >>> ps = [Problem("SIZE_MISMATCH", "error", f"f{i}", None, "short") for i in range(5)]
    >>> for row in problem_rows(ps + [Problem("STRAY_TEMP", "warning", "t", None, "x")]):
    ...     print(row[:3])
    ['SIZE_MISMATCH (5)', 'error', 'f0']
    ['', 'error', 'f1']
    ['', 'error', 'f2']
    ['', '', '(+2 more)']
    ['STRAY_TEMP', 'warning', 't']
    """
    groups: dict[str, list] = {}
    for p in problems:
        groups.setdefault(p.code, []).append(p)
    rows = []
    for code, ps in groups.items():
        for i, p in enumerate(ps[:first]):
            rows.append([(f"{code} ({len(ps)})" if len(ps) > 1 else code) if i == 0 else "",
                         p.severity, (p.path or "") + (f" [{p.entry}]" if p.entry else ""),
                         p.message])
        if len(ps) > first:
            rows.append(["", "", f"(+{len(ps) - first} more)", ""])
    return rows


#: What a full verify proved, in words.
CONTENT_WORDS = {
    "hashes": "hashes (every file against the manifest)",
    "crc": "crc (every zip record against its CRC-32)",
    "decoded-only": "decoded-only (the format carries no checksum; seal it to get hashes)",
    "crc+decoded-only": "crc where the format has it, decoded-only elsewhere",
}


@app.command()
def seal(
    ctx: typer.Context,
    url: str = place_argument(metavar="URL", help="Checkpoint folder: path, file://, "
                              "s3://..., TIER:NAME."),
    hash: Optional[HashAlgo] = typer.Option(None, "--hash", help="Content hash of each file "
                                            "(default xxh3-128; --update keeps the "
                                            "manifest's)."),
    step: Optional[int] = typer.Option(None, "--step", metavar="N",
                                       help="Step to record (default: the "
                                       "checkpoint's step entry, else its name)."),
    tag: Optional[List[str]] = typer.Option(None, "--tag", metavar="TAG",
                                            help="Tag to record, repeatable. A sealed "
                                                 "checkpoint gets the tags it lacks; the "
                                                 "tags of sealers running at once all end "
                                                 "up in its manifest."),
    update: bool = typer.Option(False, "--update",
                                help="Reseal a sealed checkpoint after files were added on "
                                     "purpose: every listed file must still match its hash; "
                                     "the new files are hashed and the manifest replaced "
                                     "atomically (step and tags kept unless given)."),
    workers: int = typer.Option(4, "--workers", min=1, metavar="N", help="Parallel hashers."),
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    storage_option: Optional[List[str]] = StorageOpt,
):
    """Write the hash manifest (the commit marker) of a checkpoint, last and atomically.

    Refuses (exit 1) a checkpoint that is incomplete or inconsistent. Sealing a sealed
    checkpoint verifies it against its manifest instead (and adds the --tag tags it
    lacks), and names the files the manifest does not list (EXTRA_FILE); --update adds
    them to it.

    \b
    EXAMPLES
      ckptctl seal ckpt/step-20 --tag release
      ckptctl seal s3://runs/llama/step-12000 --hash sha256 --step 12000
      cp tokenizer.json ckpt/step-20/ && ckptctl seal --update ckpt/step-20
    """
    from ..ops import seal as do_seal

    place = resolve_place(ctx, url, storage_option)
    with byte_progress("seal", enabled=not (json or quiet)) as bar:
        r = do_seal(place.url, place.storage_options, hash=hash and hash.value, step=step,
                    tags=tag or [], workers=workers, on_bytes=bar, on_total=bar and bar.total,
                    update=update)
    if json:
        emit_json(r.to_dict())
        return
    what = {"sealed": "sealed", "updated": "resealed (manifest updated)",
            "tagged": "already sealed; verified against its manifest, tags added"}.get(
        r.action, "already sealed; verified against its manifest")
    extra = [p for p in r.problems if p.code == "EXTRA_FILE"]
    for p in r.problems:
        say(f"{p.severity}: {p.code}: {p.path or ''}: {p.message}", quiet=quiet)
    if extra:
        say(f"{plural(len(extra), 'file')} not in the manifest: seal --update adds "
            f"{'it' if len(extra) == 1 else 'them'} (after checking the listed files)", quiet=quiet)
    say(f"{r.url}: {what}: {plural(r.num_files, 'file')}, {human_bytes(r.bytes)}, {r.hash}, "
        f"step {r.step if r.step is not None else '-'} ({r.seconds:.2f}s)", quiet=quiet)
    if r.tags:
        say(f"tags {', '.join(r.tags)}", quiet=quiet)
    say(f"id {r.manifest_id}", quiet=quiet)
