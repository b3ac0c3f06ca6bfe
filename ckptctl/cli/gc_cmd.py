"""``ckptctl gc ROOT``, ``latest ROOT``, ``rm URL``, ``pin URL``, ``unpin URL``: retention
and run management."""
from __future__ import annotations

import datetime as dt
import sys
from typing import List, Optional

import typer

from ..errors import EXIT_FINDING
from .common import (JsonOpt, QuietOpt, StorageOpt, emit_json, human_bytes, place_argument,
                     plural, print_table, resolve_place, say, shown)
from .app import app

GRACE_HELP = ("An incomplete or corrupt checkpoint untouched for less than this is kept "
              "(it may be being written), and so is an unfinished S3 multipart upload "
              "started less long ago. Default: 24h.")


def _duration(positive: bool):
    """typer callback of a duration flag: one that does not parse (or is 0 where a positive
    one is needed) is a usage error naming the flag."""
    def check(value: str | None) -> str | None:
        if value is not None:
            from ..errors import UsageError
            from ..tiering.policy import parse_duration

            try:
                seconds = parse_duration(value)
            except UsageError as e:
                raise typer.BadParameter(e.message) from None
            if positive and seconds <= 0:
                raise typer.BadParameter(f"must be longer than 0, not {value!r}")
        return value
    return check


def _policy(place, keep_last, keep_every, keep_within, keep_hourly, keep_daily, keep_tag):
    """The policy from the --keep-* flags; with none, a tier's ``keep`` table (a tier
    without one keeps everything: nothing to do, refused like an empty policy)."""
    from ..errors import UsageError
    from ..tiering.policy import Policy, parse_duration

    flags = dict(last=keep_last, every=keep_every, hourly=keep_hourly, daily=keep_daily,
                 within=None if keep_within is None else parse_duration(keep_within),
                 tags=tuple(keep_tag or ()))
    policy = Policy(**flags)
    if policy.is_empty and place.tier is not None and place.tier.keep:
        return Policy.from_dict(place.tier.keep, where=f"tier {place.tier.name}")
    if policy.is_empty:
        tier = (f" (tier {place.tier.name} has no keep table: it keeps everything)"
                if place.tier is not None else " (gc never removes everything)")
        raise UsageError("empty policy: give at least one of --keep-last, --keep-every, "
                         "--keep-within, --keep-hourly, --keep-daily, --keep-tag" + tier)
    return policy


@app.command()
def gc(
    root: str = place_argument(metavar="ROOT", help="Folder or prefix holding checkpoints, "
                               "or a TIER: of ckptctl.toml."),
    keep_last: Optional[int] = typer.Option(None, "--keep-last", min=1, metavar="N",
                                            help="Keep the N newest committed checkpoints."),
    keep_every: Optional[int] = typer.Option(None, "--keep-every", min=1, metavar="STEPS",
                                             help="Keep one checkpoint per STEPS steps (the "
                                                  "lowest step of each block: the multiples "
                                                  "of STEPS where they exist)."),
    keep_within: Optional[str] = typer.Option(None, "--keep-within", metavar="DUR",
                                              callback=_duration(True),
                                              help="Keep every checkpoint made within DUR "
                                                   "(30d, 12h, 1d12h) of the newest one."),
    keep_hourly: Optional[int] = typer.Option(None, "--keep-hourly", min=1, metavar="N",
                                              help="Keep the newest checkpoint of each of "
                                                   "the last N hours that have one (UTC)."),
    keep_daily: Optional[int] = typer.Option(None, "--keep-daily", min=1, metavar="N",
                                             help="Keep the newest checkpoint of each of the "
                                                  "last N days that have one (UTC)."),
    keep_tag: Optional[List[str]] = typer.Option(None, "--keep-tag", metavar="TAG",
                                                 help="Keep every checkpoint sealed with TAG "
                                                      "(seal --tag); repeatable."),
    incomplete_grace: Optional[str] = typer.Option(None, "--incomplete-grace", metavar="DUR",
                                                   callback=_duration(False),
                                                   help=GRACE_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", "-n",
                                 help="Print what a real run would remove, keep and "
                                      "re-root, and why, and what ROOT then holds at most; "
                                      "change nothing."),
    reroot: Optional[bool] = typer.Option(None, "--reroot/--no-reroot",
                                          help="Re-root a pack kept for its own sake whose "
                                               "base is kept only for it, so the base can go "
                                               "(the count is exact). Default: on for a TIER: "
                                               "with pack = true, else off."),
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    storage_option: Optional[List[str]] = StorageOpt,
):
    """Remove the checkpoints a retention policy does not keep, saying why each stays.

    Rules add up: a checkpoint is kept when any --keep-* rule keeps it. Whatever they say,
    gc never removes the newest committed (sealed or complete) checkpoint, a pinned one
    (ckptctl pin), the base of a kept pack, or an incomplete one younger than
    --incomplete-grace; a corrupt one goes only once a newer committed one exists.
    Each removal deletes the commit markers (manifest, DCP .metadata,
    HF index) first, so a crash mid-way leaves something incomplete, never something valid.
    With a TIER: and no --keep-* flag, the tier's keep table is the policy.

    A delta pack keeps its base, so a pack tier could hold far more than its keep says.
    With --reroot (the default on a pack tier), a pack kept for its own sake whose base
    is kept only for it is first written again, against an older checkpoint kept for
    its own sake or as a full pack (never past the tier's max_chain), and put in place
    of the old one, keeping its checkpoint id; its bases then go. Crash-safe: the new
    pack is committed beside the old one first, and a rerun finishes an interrupted
    re-root.

    \b
    EXAMPLES
      ckptctl gc /lustre/run1 --keep-last 3 --keep-every 5000 --dry-run
      ckptctl gc s3://runs/llama --keep-within 30d --keep-tag release --json
      ckptctl gc warm:                     # the keep table of tier "warm"
      ckptctl gc cold: --dry-run           # a pack tier: which packs re-root
    """
    from ..tiering.config import DEFAULT_MAX_CHAIN
    from ..tiering.gc import gc as do_gc
    from ..catalog.ownership import foreign_list
    from ..tiering.policy import DEFAULT_GRACE, parse_duration

    place = resolve_place(root, storage_option)
    policy = _policy(place, keep_last, keep_every, keep_within, keep_hourly, keep_daily,
                     keep_tag)
    tier = place.tier
    r = do_gc(place.url, policy, place.storage_options, dry_run=dry_run,
              grace=parse_duration(incomplete_grace or DEFAULT_GRACE),
              reroot=reroot if reroot is not None else bool(tier and tier.pack),
              max_chain=tier.max_chain if tier is not None else DEFAULT_MAX_CHAIN)
    if json:
        emit_json(r.to_dict())
    elif not quiet:
        _report(r, dry_run)
    failed = [x for x in r.reroots if x.action == "failed"]
    for x in failed:
        print(f"ckptctl: could not re-root {x.name} ({x.reason}); it keeps its bases",
              file=sys.stderr)
    if r.blocked:  # the policy asked for a removal gc would not do: a finding
        for name, files in r.blocked.items():
            print(f"ckptctl: kept {name}: it holds files that are not the checkpoint's "
                  f"({foreign_list(files)}); move them away to let gc remove it",
                  file=sys.stderr)
        raise typer.Exit(EXIT_FINDING)
    if failed:  # the count is not exact: a finding
        raise typer.Exit(EXIT_FINDING)


def _reroot_line(x) -> str:
    """One re-root in words: what the pack is made against after, and what that frees."""
    interrupted = {"would finish": "would finish", "would discard": "would clear the "
                   "leftovers of", "finished": "finished", "discarded": "cleared the "
                   "leftovers of", "busy": "left alone (another process is on it)"}
    if x.action in interrupted:
        return f"{interrupted[x.action]} an interrupted re-root of {x.name}"
    how = f"against {x.base} (chain depth {x.depth})" if x.base else "as a full pack"
    verb = {"would re-root": "would re-root", "re-rooted": "re-rooted",
            "failed": "failed to re-root"}.get(x.action, x.action)
    frees = f"; frees {', '.join(x.frees)}" if x.frees else ""
    return f"{verb} {x.name} {how} (its base {', '.join(x.was)} is kept only for it){frees}"


def _report(r, dry_run: bool) -> None:
    if not r.checkpoints:
        say(f"no checkpoints under {r.root}")
    else:
        rows = []
        for c in r.checkpoints:
            what = c.action if not (dry_run and c.action == "remove") else "would remove"
            why = ", ".join(c.reasons) or (
                "-" if c.state in ("sealed", "complete") else f"({c.state}, older than grace)")
            rows.append([c.name, "-" if c.step is None else str(c.step), c.state, what, why])
        print_table(["name", "step", "state", "action", "why kept"], rows, fold=(4,))
    for u in r.uploads:
        when = dt.datetime.fromtimestamp(u.initiated).strftime("%Y-%m-%d %H:%M") \
            if u.initiated else "?"
        verb = {"abort": "would abort" if dry_run else "aborted", "keep": "kept (young)"}
        say(f"upload {u.url} ({u.upload_id[:16]}, started {when}): {verb[u.action]}")
    for x in r.reroots:
        say(_reroot_line(x))
    done = "to remove" if dry_run else "removed"
    say(f"{r.policy}: {plural(len(r.decision.keep), 'checkpoint')} kept, "
        f"{len(r.removed)} {done} ({human_bytes(r.bytes_freed)})")
    if dry_run and r.holds:
        say(f"{r.root} {r.holds}")


@app.command()
def latest(
    root: str = place_argument(metavar="ROOT", help="Folder or prefix holding checkpoints, "
                               "or a TIER: of ckptctl.toml."),
    verified: bool = typer.Option(False, "--verified",
                                  help="The newest that passes verify --level full (content "
                                       "hashes or CRCs), walking back past any that fail."),
    json: bool = JsonOpt,
    storage_option: Optional[List[str]] = StorageOpt,
):
    """Print the URL of the newest committed (sealed or complete) checkpoint, by step.

    Prints the URL alone, for scripts; exit 1 (and a line on stderr) when there is none
    (with --json, the document then has "url": null and the candidates it rejected).
    Two committed at one step: the one modified last is taken (then the last by name),
    with a note on stderr saying so ("tie" in --json).

    \b
    EXAMPLES
      torchrun train.py --resume "$(ckptctl latest /ckpt/run1)"
      ckptctl latest --verified s3://runs/llama -o endpoint_url=http://minio:9000
    """
    from ..errors import Finding
    from ..tiering.latest import latest as do_latest

    place = resolve_place(root, storage_option)
    r = do_latest(place.url, place.storage_options, verified=verified)
    if r.url is None:
        why = ("none passed verify --level full: " + ", ".join(
            f"{x['url']} ({x['code']})" for x in r.rejected)) if r.rejected else \
            "no committed checkpoint"
        if json:  # "there is none" is latest's answer (exit 1): its document, not an error
            emit_json(r.to_dict())
            print(f"ckptctl: {r.root}: {why}", file=sys.stderr)
            raise typer.Exit(EXIT_FINDING)
        raise Finding(r.root, why)
    for x in r.rejected:  # stderr: $(ckptctl latest --verified ...) still gets the URL alone
        print(f"ckptctl: skipped {x['url']}: {x['code']}: {x['message']}", file=sys.stderr)
    for p in r.disagrees:  # a resume through the framework would take another one
        what = f"names {p['names']}" if p["names"] else "names no checkpoint folder"
        print(f"ckptctl: warning: {p['file']} {what}, not this newest one (the framework's "
              "own resume reads it)", file=sys.stderr)
    if r.tie:  # two committed at one step: say which was taken, and why
        print(f"ckptctl: note: {r.tie_note()}", file=sys.stderr)
    if json:
        emit_json(r.to_dict())
    else:
        print(shown(r.url))


@app.command()
def rm(
    url: str = place_argument(metavar="URL", help="One checkpoint: path, s3://..., "
                              "TIER:NAME."),
    force: bool = typer.Option(False, "--force", "-f", help="Remove it even if pinned."),
    orphan_dependants: bool = typer.Option(False, "--orphan-dependants",
                                           help="Remove it even though delta packs are "
                                                "made against it (they can then no longer "
                                                "be restored)."),
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    storage_option: Optional[List[str]] = StorageOpt,
):
    """Delete one checkpoint safely: commit markers first, then data.

    Refused (exit 1): a pinned checkpoint (unless --force), the base of delta packs that
    still need it (unless --orphan-dependants; the refusal names them), and a folder that
    holds files which are not the checkpoint's (they are named; move them away first).

    \b
    EXAMPLES
      ckptctl rm /lustre/run1/step-1000
      ckptctl rm s3://runs/llama/step-500 --force     # even though pinned
    """
    from ..tiering.rm import remove

    place = resolve_place(url, storage_option)
    r = remove(place.url, place.storage_options, force=force,
               orphan_dependants=orphan_dependants)
    if json:
        emit_json(r.to_dict())
        return
    say(f"removed {r.url} ({plural(r.num_files, 'file')}, {human_bytes(r.bytes)})"
        + (" (was pinned)" if r.was_pinned else ""), quiet=quiet)


@app.command()
def pin(
    url: str = place_argument(metavar="URL", help="One checkpoint (folder or file): path, "
                              "s3://..., TIER:NAME."),
    reason: str = typer.Option("", "--reason", "-m", metavar="WHY",
                               help="Why it must stay (shown by rm)."),
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    storage_option: Optional[List[str]] = StorageOpt,
):
    """Pin a checkpoint: gc keeps it and rm refuses it until unpin.

    The pin is a small file, .ckptctl-pinned, in the checkpoint's folder (beside a
    single-file checkpoint: FILE.ckptctl-pinned): it belongs to that place (promote does
    not copy it) and is not part of the checkpoint's content.

    \b
    EXAMPLES
      ckptctl pin /lustre/run1/step-12000 --reason "paper results"
    """
    from ..tiering.pins import pin as do_pin

    place = resolve_place(url, storage_option)
    r = do_pin(place.url, reason, place.storage_options)
    if json:
        emit_json(r.to_dict())
        return
    say(f"pinned {r.url}" + (f" ({r.reason})" if r.reason else "")
        + ("" if r.changed else " (already pinned)"), quiet=quiet)


@app.command()
def unpin(
    url: str = place_argument(metavar="URL", help="One checkpoint (folder or file): path, "
                              "s3://..., TIER:NAME."),
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    storage_option: Optional[List[str]] = StorageOpt,
):
    """Remove a checkpoint's pin (not pinned: nothing to do, exit 0).

    \b
    EXAMPLES
      ckptctl unpin /lustre/run1/step-12000
    """
    from ..tiering.pins import unpin as do_unpin

    place = resolve_place(url, storage_option)
    r = do_unpin(place.url, place.storage_options)
    if json:
        emit_json(r.to_dict())
        return
    say(f"unpinned {r.url}" if r.changed else f"{r.url} was not pinned", quiet=quiet)

