"""``ckptctl pack`` and ``ckptctl unpack``: lossless compressed (delta) packs."""
from __future__ import annotations

import os
from typing import List, Optional

import typer

from .app import app
from .common import (DstOpt, ForceOpt, JsonOpt, QuietOpt, SrcOpt, StorageOpt, emit_json,
                     human_bytes, place_argument, plural, resolve_place, say)
from .progress import byte_progress

BaseOpt = typer.Option(None, "--base", metavar="BASE",
                       help="A sealed earlier checkpoint (or pack) of the same run: unchanged "
                            "tensors are stored as references, changed ones as XOR deltas.")
WorkersOpt = typer.Option(None, "--workers", min=1, metavar="N",
                          help="Encoding/decoding threads (default: every core).")
SealSourceOpt = typer.Option(
    None, "--seal-source/--no-seal-source",
    help="An unsealed SRC is hashed first; --seal-source also writes its manifest into it "
         "(failing if it cannot), --no-seal-source never writes into it. Default: seal it "
         "when it takes the write, else (read-only) leave it as it is; DST gets the "
         "manifest either way.")


@app.command()
def pack(
    ctx: typer.Context,
    src: str = place_argument(metavar="SRC", help="Checkpoint (folder or file) to pack, any "
                              "format/place (path, s3://..., TIER:NAME)."),
    dst: str = place_argument(metavar="DST", help="New folder for the pack."),
    base: Optional[str] = BaseOpt,
    level: int = typer.Option(3, "--level", min=1, max=22, metavar="N",
                              help="zstd level (1 fast ... 19 small)."),
    workers: Optional[int] = WorkersOpt,
    max_chain: int = typer.Option(8, "--max-chain", min=0, max=64, metavar="N",
                                  help="Longest chain of delta packs: when BASE is already N "
                                       "deep, a full pack is written instead (0: never delta)."),
    seal_source: Optional[bool] = SealSourceOpt,
    force: bool = ForceOpt,
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    storage_option: Optional[List[str]] = StorageOpt,
    src_option: Optional[List[str]] = SrcOpt,
    dst_option: Optional[List[str]] = DstOpt,
):
    """Store SRC as a lossless pack: tensor bytes compressed plane by plane, the rest with
    zstd, optionally against a BASE checkpoint; every chunk carries its own checksum.

    A pack reads like the checkpoint it holds (inspect, verify, ls, diff, consolidate,
    reshard take it as a source); `unpack` restores every file byte for byte. An
    unsealed but complete SRC is hashed first and sealed where it takes the write (a
    read-only SRC is left untouched). A delta pack records where its base was
    (relative to the pack) and the base's id: readers find it there, or take --base.

    \b
    EXAMPLES
      ckptctl pack ckpt/step-1000 packs/step-1000
      ckptctl pack ckpt/step-2000 packs/step-2000 --base packs/step-1000
      ckptctl pack /nvme/step-12000 s3://cold/run1/step-12000 \\
          --base s3://cold/run1/step-11000
      ckptctl pack ckpt/step-3000 packs/step-3000 --base ckpt/step-2000 --json
    """
    from ..writing.distributed import Group
    from ..packs.pack import pack as do_pack

    group = Group.from_env()  # under torchrun/srun: each process its share of data files
    src_place = resolve_place(ctx, src, storage_option, src_option, own_flag="--src-option")
    dst_place = resolve_place(ctx, dst, storage_option, dst_option, own_flag="--dst-option")
    base_place = resolve_place(ctx, base, storage_option, src_option,
                               own_flag="--src-option") if base else None
    with byte_progress("pack", enabled=not (json or quiet)) as cb:
        r = do_pack(src_place.url, dst_place.url, base=base_place and base_place.url,
                    level=level, workers=workers or os.cpu_count(), max_chain=max_chain,
                    force=force, storage_options=src_place.storage_options,
                    dst_storage_options=dst_place.storage_options,
                    base_storage_options=base_place and base_place.storage_options,
                    on_bytes=cb, on_total=cb and cb.total, group=group,
                    seal_source=seal_source)
    if json:
        emit_json(group.tag(r.to_dict()))
        return
    if group.rank != 0:
        say(f"rank {group.rank}/{group.world_size}: {human_bytes(r.bytes_out)} in "
            f"{plural(r.data_files, 'data file')} ({r.seconds:.2f}s); rank 0 commits",
            quiet=quiet)
        return
    if r.full_reason:
        say(f"note: {r.full_reason}", quiet=quiet)
    if r.source_unsealed:
        say("note: SRC is not sealed and was left so; its manifest is in the pack only",
            quiet=quiet)
    modes = ", ".join(f"{n} {m}" for m, n in r.chunks.items())
    say(f"{r.dst}: {human_bytes(r.bytes_in)} -> {human_bytes(r.bytes_out)} (ratio "
        f"{r.ratio:.2f}), {plural(sum(r.chunks.values()), 'chunk')} ({modes}), "
        f"{r.seconds:.2f}s, {r.rate / 1e6:.0f} MB/s", quiet=quiet)
    if r.base:
        say(f"base {r.base} (chain depth {r.depth}); {r.base_segments} of "
            f"{plural(r.tensor_segments, 'tensor segment')} stored against it", quiet=quiet)
    say(f"packs {r.source_id}", quiet=quiet)


@app.command()
def unpack(
    ctx: typer.Context,
    pack_: str = place_argument(metavar="PACK", help="A pack folder (path, s3://..., "
                                "TIER:NAME)."),
    dst: str = place_argument(metavar="DST", help="New folder for the checkpoint (a pack "
                              "of one file: that file, or the folder it goes into)."),
    base: Optional[str] = typer.Option(None, "--base", metavar="BASE",
                                       help="Where the base of a delta pack is, when not "
                                            "where the pack recorded it (its id is checked)."),
    workers: Optional[int] = WorkersOpt,
    force: bool = ForceOpt,
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    storage_option: Optional[List[str]] = StorageOpt,
    src_option: Optional[List[str]] = SrcOpt,
    dst_option: Optional[List[str]] = DstOpt,
):
    """Restore the checkpoint a pack holds, byte for byte, with the source's manifest.

    Every file is checked against the source's hash while it is written, the manifest
    last; a corrupt chunk stops the run naming it and leaves nothing at DST.

    \b
    EXAMPLES
      ckptctl unpack packs/step-2000 ckpt/step-2000
      ckptctl unpack s3://cold/run1/step-12000 /nvme/step-12000 --json
      ckptctl unpack packs/step-2000 out/ --base /archive/step-1000
    """
    from ..packs.unpack import unpack as do_unpack

    src_place = resolve_place(ctx, pack_, storage_option, src_option, own_flag="--src-option")
    dst_place = resolve_place(ctx, dst, storage_option, dst_option, own_flag="--dst-option")
    base_place = resolve_place(ctx, base, storage_option, src_option,
                               own_flag="--src-option") if base else None
    with byte_progress("unpack", enabled=not (json or quiet)) as cb:
        r = do_unpack(src_place.url, dst_place.url, base=base_place and base_place.url,
                      workers=workers or os.cpu_count(), force=force,
                      storage_options=src_place.storage_options,
                      dst_storage_options=dst_place.storage_options,
                      base_storage_options=base_place and base_place.storage_options,
                      on_bytes=cb, on_total=cb and cb.total)
    if json:
        emit_json(r.to_dict())
        return
    say(f"{r.dst}: {plural(r.num_files, 'file')}, {human_bytes(r.bytes)} restored "
        f"({r.seconds:.2f}s, {r.rate / 1e6:.0f} MB/s)", quiet=quiet)
    say(f"id {r.manifest_id}", quiet=quiet)
