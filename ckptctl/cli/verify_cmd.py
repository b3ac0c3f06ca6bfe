"""``ckptctl verify URL`` and ``ckptctl seal URL``: integrity for CI gates."""
from __future__ import annotations

from enum import Enum
from typing import List, Optional

import typer

from ..errors import EXIT_FINDING
from .common import (JsonOpt, QuietOpt, StorageOpt, emit_json, human_bytes, place_argument,
                     plural, print_fitted, print_table, resolve_place, say, shown)
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
                              "each; exit 1 if any has an error or cannot be read."),
    strict: bool = typer.Option(False, "--strict", help="Warnings fail too (exit 1): a file "
                                "the manifest does not list (EXTRA_FILE), a leftover temp "
                                "file (STRAY_TEMP), an unfinished upload (ORPHANED_UPLOAD). "
                                "Without it they are reported and exit 0."),
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    storage_option: Optional[List[str]] = StorageOpt,
):
    """Check a checkpoint's integrity: exit 0 OK, 1 an error, 3 unreadable.

    Warnings (EXTRA_FILE, STRAY_TEMP, ORPHANED_UPLOAD) are reported and exit 0; --strict
    makes them exit 1. Paths in the report are relative to the checkpoint.

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
      ckptctl verify --strict ckpt/step-20   # a NOTES.md beside it fails too
    """
    from ..errors import UsageError
    from ..formats.detect import several
    from ..ops import verify as do_verify
    from ..writing.distributed import Group

    place = resolve_place(ctx, url, storage_option)
    if all_:
        return _verify_all(place, level=level.value, require=require, check_finite=check_finite,
                           sample=sample, workers=workers, json=json, quiet=quiet,
                           strict=strict)
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
            given = url if url.endswith(("/", ":")) else url + "/"
            raise several(e.path, e.checkpoints, f"ckptctl verify {given} --all") from None
    r.judge(strict)
    if group.rank != 0:
        if json:
            emit_json(group.tag(r.to_dict()))
        else:
            say(f"rank {group.rank}/{group.world_size}: {plural(r.num_files_read, 'file')} "
                f"read, {human_bytes(r.bytes_read)}; rank 0 reports", quiet=quiet)
        return
    if json:
        emit_json(group.tag(r.to_dict()))
    elif not quiet:
        if r.problems:
            print_fitted(["code", "severity", "where", "message"],
                         problem_rows(r.problems, within=r.url))
        proven = f"content: {CONTENT_WORDS.get(r.content, r.content)}; " if r.content else ""
        say(f"{r.url}: {verdict(r)} ({r.level}; {r.format or 'unknown format'}, "
            f"{'sealed' if r.sealed else 'not sealed'}; {proven}{plural(r.num_files, 'file')}, "
            f"{human_bytes(r.bytes_read)} read in {r.seconds:.2f}s)", quiet=quiet)
    if not r.ok:
        raise typer.Exit(EXIT_FINDING)


def verdict(r) -> str:
    """A verify result in words: ``OK``, ``OK, 1 warning``, ``3 problems``, ``3 problems
    (2 errors, 1 warning)``, or ``1 problem (a warning, --strict)``.

    >>> from ckptctl.catalog.checks import Problem
    >>> from ckptctl.integrity.result import VerifyResult
    >>> w = Problem("EXTRA_FILE", "warning", "NOTES.md", None, "not listed in the manifest")
    >>> r = VerifyResult(True, "quick", "ck", "dcp", True, problems=[w])
    >>> verdict(r.judge()), verdict(r.judge(strict=True))
    ('OK, 1 warning', '1 problem (a warning, --strict)')
    """
    if r.ok:
        return "OK" + (f", {plural(r.num_warnings, 'warning')}" if r.num_warnings else "")
    n = plural(len(r.problems), "problem")
    if not r.num_errors:
        return f"{n} ({'a warning' if r.num_warnings == 1 else 'warnings'}, --strict)"
    if r.num_warnings:
        return f"{n} ({plural(r.num_errors, 'error')}, {plural(r.num_warnings, 'warning')})"
    return n


def _verify_all(place, *, level: str, require, check_finite: bool, sample, workers: int,
                json: bool, quiet: bool, strict: bool) -> None:
    """``verify --all``: one row per checkpoint, the problems of those that have any."""
    from ..integrity.verify import verify_all

    with byte_progress("verify", enabled=level == "full" and not (json or quiet)) as bar:
        r = verify_all(place.url, place.storage_options, level=level, require=require,
                       check_finite=check_finite, sample=sample, workers=workers, on_bytes=bar)
    r.judge(strict)
    if json:
        emit_json(r.to_dict())
    elif not quiet:
        if r.checkpoints:
            print_table(["name", "step", "format", "result"],
                        [[c.name, "-" if c.result.step is None else str(c.result.step),
                          c.result.format or "-",
                          f"not read: {_reason(c.error)}" if c.error else verdict(c.result)]
                         for c in r.checkpoints], fold=(3,))
        bad = [p for c in r.checkpoints for p in c.result.problems]
        if bad:
            say("")
            print_fitted(["code", "severity", "where", "message"],
                         problem_rows(bad, within=r.url))
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


def problem_rows(problems: list, first: int = 3, *, within: str | None = None
                 ) -> list[list[str]]:
    """Table rows of verify's problems grouped by code, in the order codes first appear:
    a code seen more than ``first`` times shows its count, ``first`` examples and a
    ``(+N more)`` row (``--json`` keeps every problem). Paths are shown relative to the
    place ``within`` (the checkpoint, or the root of ``--all``: :func:`relative_to`).

    >>> from ckptctl.catalog.checks import Problem
    >>> ps = [Problem("SIZE_MISMATCH", "error", f"ck/f{i}", None, "short") for i in range(5)]
    >>> for row in problem_rows(ps + [Problem("STRAY_TEMP", "warning", "ck/t", None, "x")],
    ...                         within="ck"):
    ...     print(row[:3])
    ['SIZE_MISMATCH (5)', 'error', 'f0']
    ['', 'error', 'f1']
    ['', 'error', 'f2']
    ['(+2 more)', '', '']
    ['STRAY_TEMP', 'warning', 't']
    """
    groups: dict[str, list] = {}
    for p in problems:
        groups.setdefault(p.code, []).append(p)
    rows = []
    for code, ps in groups.items():
        for i, p in enumerate(ps[:first]):
            rows.append([(f"{code} ({len(ps)})" if len(ps) > 1 else code) if i == 0 else "",
                         p.severity, relative_to(p.path, within)
                         + (f" [{p.entry}]" if p.entry else ""), p.message])
        if len(ps) > first:
            rows.append([f"(+{len(ps) - first} more)", "", "", ""])
    return rows


def relative_to(path: str | None, place: str | None) -> str:
    """``path`` (as the storage layer names it) shown relative to ``place`` (as given),
    the checkpoint a report's header line already names; the place itself by its last
    name; a path elsewhere (a pack's base) in full, as given (:func:`shown`).

    >>> relative_to("s3://b/run/step-2/NOTES.md", "s3://b/run/step-2")
    'NOTES.md'
    >>> relative_to("s3://b/run/step-2", "s3://b/run/step-2/"), relative_to(None, "x")
    ('step-2', '')
    >>> relative_to("s3://b/other/x", "s3://b/run")
    's3://b/other/x'
    """
    import posixpath

    if not path:
        return ""
    path, base = shown(path), (shown(place) or "").rstrip("/")
    if base and path.rstrip("/") == base:
        return posixpath.basename(base) or base
    if base and path.startswith(base + "/"):
        return path[len(base) + 1:]
    return path


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
    url: str = place_argument(metavar="URL", help="Checkpoint folder or file: path, file://, "
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
    them to it. A single-file checkpoint (train.pt, model.safetensors) gets its manifest
    beside it, FILE.ckptctl.manifest.json.

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
