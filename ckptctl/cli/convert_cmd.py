"""``ckptctl reshard`` and ``ckptctl consolidate``: layout conversion, bounded memory."""
from __future__ import annotations

from typing import List, Optional

import typer

from .common import (DstOpt, ForceOpt, JsonOpt, QuietOpt, SrcOpt, StorageOpt, check_size,
                     complete_choices, complete_rules, emit_json, human_bytes, place_argument,
                     plural, print_table, resolve_place, say)
from ..errors import UsageError
from .app import app
from .progress import byte_progress

MaxMemOpt = typer.Option("1GiB", "--max-memory", metavar="SIZE", callback=check_size,
                         help="Memory budget for tensor data (1GiB, 512MB, ...).")
WorkersOpt = typer.Option(4, "--workers", min=1, metavar="N", help="Parallel readers/writers.")
DropOpt = typer.Option(None, "--drop", metavar="NAME",
                       help="Leave out the entries NAME matches (a glob; repeatable), e.g. "
                            "an object entry the safe loader refuses (a conversion never "
                            "carries one).")


def _consolidate_targets(incomplete: str) -> list[str]:
    """Shell completion of consolidate ``--to`` (read from the op only when completing)."""
    from ..convert.consolidate import TARGETS

    return [t for t in TARGETS if t.startswith(incomplete)]

@app.command()
def reshard(
    ctx: typer.Context,
    src: str = place_argument(metavar="SRC", help="Source checkpoint, any format/place "
                              "(path, s3://..., TIER:NAME)."),
    dst: str = place_argument(metavar="DST", help="New folder for the DCP checkpoint (path, "
                              "s3://..., TIER:NAME)."),
    mesh: Optional[str] = typer.Option(None, "--mesh", metavar="DIMS",
                                       help="Target mesh in DeviceMesh order, e.g. dp=8,tp=4."),
    rules: Optional[str] = typer.Option(None, "--rules", metavar="PRESET|FILE",
                                        autocompletion=complete_rules,
                                        help="Placement rules: fsdp, llama (alias tp), or a "
                                             "TOML file of [[rule]] tables. Default: fsdp "
                                             "for a dp-only mesh, else llama (the output "
                                             "names the rules used)."),
    world_size: Optional[int] = typer.Option(None, "--world-size", metavar="N",
                                             help="Shorthand for --mesh dp=N --rules fsdp."),
    to: str = typer.Option("dcp", "--to", metavar="LAYOUT",
                           autocompletion=complete_choices("dcp", "megatron-legacy"),
                           help="dcp, or megatron-legacy (mp_rank_TT[_PPP]/model_optim_rng.pt "
                                "for --mesh tp=T[,pp=P], by Megatron's GPT rules)."),
    max_memory: str = MaxMemOpt,
    workers: int = WorkersOpt,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan, write nothing."),
    drop: Optional[List[str]] = DropOpt,
    force: bool = ForceOpt,
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    storage_option: Optional[List[str]] = StorageOpt,
    src_option: Optional[List[str]] = SrcOpt,
    dst_option: Optional[List[str]] = DstOpt,
):
    """Write SRC as a DCP checkpoint for a new mesh: rank r's DTensor shards in rank r's file.

    Rules are validated before a byte is written (a rule that does not fit a tensor exits 2);
    so are object entries: one the safe loader refuses (what seal refuses) exits 1 unless
    left out with --drop. Data first; .metadata and the manifest last.

    \b
    EXAMPLES
      ckptctl reshard ckpt/ out/ --mesh dp=2,tp=2 --rules llama --dry-run
      ckptctl reshard ckpt/ out/ --mesh dp=8,tp=4 --rules rules.toml
      ckptctl reshard s3://runs/llama/step-12000 /nvme/step-12000 --world-size 8
      ckptctl reshard ckpt/ out/ --world-size 8 --drop 'extra.*'
      ckptctl reshard s3://a/run/step-9 s3://b/run/step-9 --world-size 8 \\
          --src-option endpoint_url=http://a:9000 \\
          --dst-option endpoint_url=http://b:9000
    """
    from ..ops import reshard as do_reshard
    from ..writing.distributed import Group

    src_place = resolve_place(ctx, src, storage_option, src_option, own_flag="--src-option")
    dst_place = resolve_place(ctx, dst, storage_option, dst_option, own_flag="--dst-option")
    if to == "megatron-legacy":
        _reshard_legacy(src_place, dst_place, mesh, drop, force, json, quiet)
        return
    if to != "dcp":
        raise UsageError("--to must be dcp or megatron-legacy")
    group = Group() if dry_run else Group.from_env()
    with byte_progress("reshard", enabled=not (json or quiet or dry_run)) as cb:
        r = do_reshard(src_place.url, dst_place.url, mesh=mesh, rules=rules,
                       world_size=world_size, max_memory=max_memory, workers=workers,
                       dry_run=dry_run, force=force, storage_options=src_place.storage_options,
                       dst_storage_options=dst_place.storage_options,
                       on_bytes=cb, on_total=cb and cb.total, group=group, drop=drop)
    if json:
        emit_json(group.tag(r.to_dict()))
        return
    if group.rank != 0:
        _say_share(group, r.bytes, r.files, r.seconds, quiet)
        return
    say(f"rules: {r.rules['note']}", quiet=quiet)
    _say_dropped(r.dropped, quiet)
    if dry_run:
        rep = r.rules
        print_table(["rule", "placements", "tensors", "e.g."],
                    [[m["rule"], m["placements"], str(m["tensors"]),
                      _first(m["examples"], m["tensors"]) or "(matched nothing)"]
                     for m in rep["matched"]]
                    + [["(no rule)", "Replicate()", str(rep["replicated"]),
                        _first(rep["replicated_examples"], rep["replicated"])]],
                    title=f"rules {rep['name']}: what each matched (the first match wins); "
                          f"{plural(rep['replicated'], 'tensor')} stay replicated")
        print_table(["rank", "chunks", "read", "write", "reads from"],
                    [[str(x["rank"]), str(x["num_chunks"]), human_bytes(x["read_bytes"]),
                      human_bytes(x["write_bytes"]), ", ".join(x["read_files"][:4])
                      + (" ..." if len(x["read_files"]) > 4 else "")] for x in r.ranks],
                    title=f"plan: {r.src} -> {r.dst} at {r.mesh} ({plural(r.world_size, 'rank')})")
        say(f"or, with no copy, a job at {r.mesh} loads the source in place: dcp.load("
            f"state_dict, storage_reader=ckptctl.dcp.Reader({str(r.src)!r}))", quiet=quiet)
        return
    say(f"{r.dst}: {plural(r.world_size, 'rank')} ({r.mesh}), {plural(r.num_chunks, 'chunk')}, "
        f"{human_bytes(r.bytes)} in {plural(r.num_files, 'file')} ({r.seconds:.2f}s)", quiet=quiet)
    say(f"id {r.manifest_id}", quiet=quiet)


def _reshard_legacy(src_place, dst_place, mesh, drop, force, json, quiet) -> None:
    """reshard --to megatron-legacy: --mesh names tp (and pp) only."""
    from ..layout import parse_mesh
    from ..convert.megatron_legacy_write import reshard_legacy

    m = parse_mesh(mesh or "")
    dims = dict(zip(m.names, m.sizes))
    if not dims or set(dims) - {"tp", "pp"}:
        raise UsageError("--to megatron-legacy takes --mesh tp=T[,pp=P]")
    r = reshard_legacy(src_place.url, dst_place.url, tp=dims.get("tp", 1), pp=dims.get("pp", 1),
                       drop=drop, storage_options=src_place.storage_options,
                       dst_storage_options=dst_place.storage_options, force=force)
    if json:
        emit_json(r.to_dict())
        return
    _say_dropped(r.dropped, quiet)
    say(f"{r.dst}: Megatron legacy, TP {r.tp} x PP {r.pp}, {plural(len(r.files), 'rank file')}"
        + (f"; {r.tracker!r} written to latest_checkpointed_iteration.txt" if r.tracker else ""),
        quiet=quiet)
    say(f"id {r.manifest_id}", quiet=quiet)


def _say_share(group, nbytes: int, files: list[str], seconds: float, quiet: bool) -> None:
    """What a process other than rank 0 of a torchrun/srun run did (rank 0 commits)."""
    what = f"{human_bytes(nbytes)} in {', '.join(files)}" if files else "no file to write"
    say(f"rank {group.rank}/{group.world_size}: {what} ({seconds:.2f}s); rank 0 commits",
        quiet=quiet)


def _say_dropped(names: list[str], quiet: bool) -> None:
    """What --drop left out."""
    if names:
        say(f"left out (--drop): {', '.join(names[:8])}"
            + (f", ... ({len(names)} in all)" if len(names) > 8 else ""), quiet=quiet)


def _first(names: list[str], count: int) -> str:
    """One example name, and "..." when there are more."""
    return (names[0] + (", ..." if count > 1 else "")) if names else ""


@app.command()
def consolidate(
    ctx: typer.Context,
    src: str = place_argument(metavar="SRC", help="Source checkpoint, any format/place "
                              "(path, s3://..., TIER:NAME)."),
    dst: str = place_argument(metavar="DST", help="New folder, or one file: x.safetensors, "
                              "x.pt (.pth, .bin, .ckpt: torch.save); path, s3://..., "
                              "TIER:NAME."),
    to: Optional[str] = typer.Option(None, "--to", metavar="FORMAT",
                                     autocompletion=_consolidate_targets,
                                     help="safetensors (HF layout), torch (torch.save), dcp, "
                                          "deepspeed-universal (DeepSpeed resumes it at "
                                          "any world size), or orbax (a JAX Orbax PyTree "
                                          "checkpoint). Default: what DST's extension "
                                          "says, else safetensors; an extension --to "
                                          "disagrees with is refused."),
    only: Optional[str] = typer.Option(None, "--only", metavar="PART",
                                       help="Only these state parts: model, optim (comma list)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", metavar="DTYPE",
                                        help="Cast floating tensors: bf16, fp16, fp32."),
    strip_prefix: Optional[str] = typer.Option(None, "--strip-prefix", metavar="PREFIX",
                                               help="Drop this prefix from names (model.)."),
    unstack_layers: bool = typer.Option(
        False, "--unstack-layers",
        help="Write each layer of a stacked entry (Megatron's decoder.layers.X of shape "
             "(num_layers, ...)) as decoder.layers.<i>.X."),
    include: Optional[List[str]] = typer.Option(
        None, "--include", metavar="GLOB",
        help="--to safetensors: also carry the source folder's top-level files matching "
             "GLOB (repeatable); config, generation config and tokenizer files are carried "
             "by default."),
    max_shard_size: Optional[str] = typer.Option(
        None, "--max-shard-size", metavar="SIZE", callback=check_size,
        help="safetensors: largest file before a new shard (default 5GB; a .safetensors "
             "DST is one file of any size, and refused if this would split it)."),
    max_memory: str = MaxMemOpt,
    workers: int = WorkersOpt,
    drop: Optional[List[str]] = DropOpt,
    force: bool = ForceOpt,
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    storage_option: Optional[List[str]] = StorageOpt,
    src_option: Optional[List[str]] = SrcOpt,
    dst_option: Optional[List[str]] = DstOpt,
):
    """Write one full tensor per entry (safetensors, torch.save, DCP, a DeepSpeed
    universal checkpoint or Orbax), then seal it (a folder: its manifest goes last).

    A folder of safetensors follows the HF convention: model.safetensors, or
    model-00001-of-0000N.safetensors + model.safetensors.index.json; files are named
    after what they hold (--only optim writes optim.safetensors). When it holds the
    model, the source folder's config.json, generation_config.json and tokenizer files
    (tokenizer*.json, special_tokens_map.json, vocab/merges, *.model) come along, listed
    in the manifest like the weights.

    A DST ending in .safetensors (or .pt, .pth, .bin, .ckpt) is that one file, in the
    format its extension names: written under a temporary name, fsync'd and renamed into
    place last; no manifest and no side files (a lone file has no folder to hold them);
    --force replaces a file, never a folder. An object entry the safe loader refuses (what seal
    refuses) is never carried: it exits 1 unless left out with --drop.

    --to deepspeed-universal writes DST as DeepSpeed's universal tag folder (zero/<param>/
    fp32.pt, exp_avg.pt, exp_avg_sq.pt, step.pt; zero/optimizer_state.pt; model-states
    files for ZeRO-1/2 and ZeRO-3 engines) and then latest_universal beside it, so
    engine.load_checkpoint(PARENT) with "checkpoint": {"load_universal": true} resumes it.

    --to orbax writes DST as a single-host Orbax PyTree checkpoint (OCDBT + zarr3, with
    _METADATA, _CHECKPOINT_METADATA and commit_success.txt; a local folder, written with
    tensorstore: pip install 'ckptctl[orbax]'), which Orbax's StandardCheckpointer
    restores as nested dicts: names split at their dots, every segment a dict key; Python
    int/float objects become scalars, any other object is refused. It is written under
    Orbax's temporary name (DST + .orbax-checkpoint-tmp) and renamed into place last.

    \b
    EXAMPLES
      ckptctl consolidate ckpt/ hf/ --only model --strip-prefix model.
      ckptctl consolidate ckpt/ model.pt --only model --dtype bf16
      ckptctl consolidate ckpt/ out/model.safetensors --only model
      ckptctl consolidate s3://runs/llama/step-12000 hf/ --max-shard-size 2GB
      ckptctl consolidate hf-run/checkpoint-500 hf/ --include 'README.md'
      ckptctl consolidate warm:step-12000 cold:hf-12000 --only model
      ckptctl consolidate fsdp/step-200 ds/global_step200_universal \\
          --to deepspeed-universal
      ckptctl consolidate fsdp/step-200 jax/step-200 --to orbax --only model
    """
    from ..ops import consolidate as do_consolidate
    from ..writing.distributed import Group

    src_place = resolve_place(ctx, src, storage_option, src_option, own_flag="--src-option")
    dst_place = resolve_place(ctx, dst, storage_option, dst_option, own_flag="--dst-option")
    group = Group.from_env()
    with byte_progress("consolidate", enabled=not (json or quiet)) as cb:
        r = do_consolidate(src_place.url, dst_place.url, to=to, only=only, dtype=dtype,
                           strip_prefix=strip_prefix, max_shard_size=max_shard_size,
                           max_memory=max_memory, workers=workers, force=force,
                           storage_options=src_place.storage_options,
                           dst_storage_options=dst_place.storage_options,
                           on_bytes=cb, on_total=cb and cb.total, include=include,
                           group=group, drop=drop, unstack_layers=unstack_layers)
    if json:
        emit_json(group.tag(r.to_dict()))
        return
    if group.rank != 0:
        _say_share(group, r.bytes, r.files, r.seconds, quiet)
        return
    _say_dropped(r.dropped, quiet)
    if r.derived:
        say(f"not stored (16-bit copies of model.*, which DeepSpeed rebuilds): "
            f"{_first(r.derived, len(r.derived))} ({len(r.derived)} in all)", quiet=quiet)
    where = ", ".join(r.files) if len(r.files) <= 6 else \
        f"{len(r.files)} files ({', '.join(r.files[:3])}, ...)"
    say(f"{r.dst}: {r.to}, {plural(r.num_tensors, 'tensor')}, {plural(r.num_objects, 'object')}"
        f"; {human_bytes(r.bytes)} in {where} ({r.seconds:.2f}s)", quiet=quiet)
    if r.side_files:
        say(f"side files carried from the source: {', '.join(r.side_files)}", quiet=quiet)
    if r.manifest_id:
        say(f"id {r.manifest_id}", quiet=quiet)
