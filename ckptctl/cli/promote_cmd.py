"""``ckptctl promote SRC DST``: copy a checkpoint between places, verified and committed last."""
from __future__ import annotations

import sys
from typing import List, Optional

import typer

from .app import app
from .common import (DstOpt, JsonOpt, QuietOpt, SrcOpt, StorageOpt, check_size, emit_json,
                     human_bytes, place_argument, plural, resolve_place, say)
from .pack_cmd import SealSourceOpt
from .progress import byte_progress


@app.command()
def promote(
    ctx: typer.Context,
    src: str = place_argument(metavar="SRC", help="Checkpoint (folder or file) to copy "
                              "(path, s3://..., TIER:NAME)."),
    dst: str = place_argument(metavar="DST", help="Where it goes (path, s3://..., TIER:NAME; "
                              "TIER: puts it under the tier by SRC's name). A file SRC: "
                              "DST ending in its name is the file, else the folder for it."),
    bwlimit: Optional[str] = typer.Option(
        None, "--bwlimit", metavar="RATE",
        help="Most bytes per second sent, all workers together (200MiB/s, 1.5GB/s, off). "
             "Default: DST tier's bwlimit, else none."),
    workers: int = typer.Option(4, "--workers", min=1, metavar="N",
                                help="Files or parts sent at once."),
    part_size: str = typer.Option("32MiB", "--part-size", metavar="SIZE", callback=check_size,
                                  help="Size of the parts of a large file (at least 5MiB)."),
    delete_source: bool = typer.Option(
        False, "--delete-source", help="Remove SRC once DST is committed and checked "
        "(its manifest and .metadata first)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what a run would send (after "
                                 "a crash: what is left to send), write nothing."),
    pack: Optional[bool] = typer.Option(
        None, "--pack/--unpack", help="Store DST as a compressed delta pack (--pack) or as a "
        "plain checkpoint (--unpack: restores a pack). Default: DST tier's `pack` setting, "
        "else SRC's form (a delta pack is restored: its base is not at DST)."),
    base: str = typer.Option("auto", "--base", metavar="auto|URL|none",
                             help="--pack: delta-encode against this checkpoint; auto: the "
                                  "newest committed one already beside DST (a delta pack SRC "
                                  "whose base DST reaches is copied as it is); none: a full "
                                  "pack, with no base."),
    seal_source: Optional[bool] = SealSourceOpt,
    pack_level: int = typer.Option(3, "--pack-level", min=1, max=22, metavar="N",
                                   help="--pack: zstd level (1 fast ... 19 small), as pack "
                                        "--level."),
    old_level: Optional[int] = typer.Option(None, "--level", min=1, max=22, hidden=True,
                                            help="Deprecated spelling of --pack-level."),
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    storage_option: Optional[List[str]] = StorageOpt,
    src_option: Optional[List[str]] = SrcOpt,
    dst_option: Optional[List[str]] = DstOpt,
):
    """Copy checkpoint SRC to DST: hashed while copying, data first, manifest last.

    An unsealed but complete SRC is hashed first, and sealed where it takes the write (a
    read-only SRC is left untouched); an incomplete one is refused (exit 1). A delta pack
    never lands where its base is not: to a plain place it is restored, to a pack place it
    is copied only if DST reaches its base, else packed again. --delete-source keeps a
    SRC the copy still needs, and one rm would keep (a user's file in it, the base of a
    pack): the copy stays committed, exit 1.
    Files go in parallel, large ones in parallel parts, under one --bwlimit. Each file is
    published at DST only once its bytes match SRC's manifest, and DST is committed (POSIX:
    a hidden folder renamed into place; S3: the manifest as the last object) only after a
    size check of every file there. Rerun after a crash to resume: finished files and
    parts of S3 multipart uploads are not sent again.

    \b
    EXAMPLES
      ckptctl promote /nvme/run1/step-2000 /lustre/run1/step-2000
      ckptctl promote hot:step-2000 cold: --bwlimit 200MiB/s --delete-source
      ckptctl promote /lustre/run1/step-2000 s3://ckpt/run1/step-2000 --dry-run
      ckptctl promote s3://a/run/step-9 s3://b/run/step-9 \\
          --src-option endpoint_url=http://a:9000 \\
          --dst-option endpoint_url=http://b:9000
    """
    from ..writing.distributed import Group
    from ..tiering.promote import promote as do_promote
    from ..units import parse_size

    if old_level is not None:  # promote --level was renamed (issue 21): verify's is a depth
        print("ckptctl: warning: promote --level is now --pack-level", file=sys.stderr)
        pack_level = old_level
    s = resolve_place(ctx, src, storage_option, src_option, own_flag="--src-option")
    d = resolve_place(ctx, dst, storage_option, dst_option, own_flag="--dst-option")
    dst_url = d.url
    if d.tier is not None and dst.rstrip().endswith(":"):  # TIER: -> under it, by SRC's name
        dst_url = d.url.rstrip("/") + "/" + s.url.rstrip("/").rsplit("/", 1)[-1]
    rate = bwlimit if bwlimit is not None else (d.tier.bwlimit if d.tier else None)
    if pack is None and d.tier is not None:
        pack = d.tier.pack
    base_url = None if base == "none" else base
    if base_url not in (None, "auto"):
        base_url = resolve_place(ctx, base_url, storage_option, dst_option,
                                 own_flag="--dst-option").url
    # under torchrun/srun the data files are split over the processes; a dry run runs
    # whole in each, a --pack/--unpack conversion on rank 0 alone (it does not split yet)
    group = Group() if dry_run else Group.from_env()
    if pack is not None and group.active:
        if (note := group.rank_0_alone("promote --pack/--unpack")) is not None:
            if json:
                emit_json(group.tag({"note": note}))
            else:
                say(note, quiet=quiet)
            return
        group = Group()
    with byte_progress("promote", enabled=not (json or quiet or dry_run)) as bar:
        r = do_promote(s.url, dst_url, s.storage_options, d.storage_options, bwlimit=rate,
                       workers=workers, part_size=parse_size(part_size),
                       delete_source=delete_source, dry_run=dry_run, pack=pack,
                       base=base_url, level=pack_level, on_bytes=bar,
                       on_total=bar and bar.total, group=group, seal_source=seal_source,
                       max_chain=d.tier.max_chain if d.tier is not None else 8)
    if json:
        emit_json(group.tag(r.to_dict()))
        return
    if group.rank != 0:
        say(f"rank {group.rank}/{group.world_size}: sent {plural(r.files_sent, 'file')}, "
            f"{human_bytes(r.bytes_sent)} ({r.seconds:.2f}s); rank 0 commits", quiet=quiet)
        return
    if r.action == "dry-run":
        seal_note = "" if r.manifest_id else " (SRC is not sealed: a run hashes it first)"
        say(f"{r.dst}: would send {plural(len(r.to_send), 'file')}, "
            f"{human_bytes(r.bytes_to_send)} of {human_bytes(r.bytes)}"
            + (f"; {plural(r.files_skipped, 'file')} already there" if r.files_skipped else "")
            + seal_note, quiet=quiet)
        for rel in r.to_send:
            say(f"  {rel}", quiet=quiet)
        return
    if r.action in ("packed", "unpacked"):
        p = r.pack or {}
        how = (f"packed {p.get('ratio', 0):.2f}x" + (f" against {p['base_url']} (chain depth "
               f"{p['depth']})" if p.get("base") else ", full")) if r.action == "packed" \
            else "unpacked"
        say(f"{r.dst}: {plural(r.num_files, 'file')}, {human_bytes(r.bytes)}; {how}; wrote "
            f"{human_bytes(r.bytes_sent)} ({r.seconds:.2f}s)"
            + (f"; {p['full_reason']}" if p.get("full_reason") else "")
            + (", SRC left unsealed" if r.source_unsealed else "")
            + ("; source removed" if r.deleted_source else ""), quiet=quiet)
        say(f"id {r.manifest_id}", quiet=quiet)
        return
    if r.action == "up-to-date":
        say(f"{r.dst}: already committed with the same content (id {r.manifest_id})"
            + ("; source removed" if r.deleted_source else ""), quiet=quiet)
        return
    resumed = (f", {plural(r.files_skipped, 'file')} and {plural(r.parts_resumed, 'part')} "
               "already there" if r.files_skipped or r.parts_resumed else "")
    say(f"{r.dst}: {plural(r.num_files, 'file')}, {human_bytes(r.bytes)}; sent "
        f"{human_bytes(r.bytes_sent)} at {human_bytes(int(r.rate))}/s{resumed} "
        f"({r.seconds:.2f}s)" + (", sealed SRC first" if r.sealed_source else "")
        + (", SRC left unsealed (its manifest is at DST only)" if r.source_unsealed else "")
        + (f"; delta pack, its base {r.pack['base_url']} reached from DST"
           if r.pack and r.pack.get("carried") else "")
        + ("; server-side copy" if r.server_copy else "")
        + ("; source removed" if r.deleted_source else ""), quiet=quiet)
    say(f"id {r.manifest_id}", quiet=quiet)
