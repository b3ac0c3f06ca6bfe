"""``ckptctl inspect URL``: what is in a checkpoint (metadata only, no tensor data)."""
from __future__ import annotations

from typing import List, Optional

import typer

from .common import (JsonOpt, QuietOpt, StorageOpt, emit_json, human_bytes, human_count,
                     place_argument, plural, print_table, resolve_place, say)
from .app import app


@app.command()
def inspect(
    ctx: typer.Context,
    url: str = place_argument(metavar="URL", help="Checkpoint folder or file: path, file://, "
                              "s3://..., TIER:NAME."),
    json: bool = JsonOpt,
    tensors: bool = typer.Option(False, "--tensors", help="List every tensor."),
    tree: bool = typer.Option(False, "--tree", help="Group tensors by module prefix."),
    filter: Optional[str] = typer.Option(None, "--filter", metavar="GLOB",
                                         help="Only entries whose name matches GLOB."),
    show_objects: bool = typer.Option(False, "--show-objects",
                                      help="List non-tensor entries, with values when plain data."),
    allow_incomplete: bool = typer.Option(False, "--allow-incomplete",
                                          help="Read a folder a ckptctl writer or remover "
                                               "holds (.ckptctl-writing), for salvage."),
    quiet: bool = QuietOpt,
    storage_option: Optional[List[str]] = StorageOpt,
):
    """Show format, step, sizes, dtypes, layout and state closure of a checkpoint.

    Reads metadata only: on S3 a DCP checkpoint costs a listing and one or two GETs.

    \b
    EXAMPLES
      ckptctl inspect ckpt/step-20
      ckptctl inspect ckpt/step-20 --tree --filter 'model.layers.0.*'
      ckptctl inspect hf/model.safetensors --tensors
      ckptctl inspect s3://runs/llama/step-12000 --json
      ckptctl inspect cold:step-12000        # NAME under a tier of ckptctl.toml
    """
    from ..errors import shorten
    from ..ops import inspect as do_inspect

    place = resolve_place(ctx, url, storage_option)
    r = do_inspect(place.url, place.storage_options, filter=filter,
                   show_objects=show_objects, tree=tree, allow_incomplete=allow_incomplete)
    if json:
        doc = r.to_dict()
        if not tree:
            doc.pop("tree")
        emit_json(doc)
        return
    if quiet:
        return
    step = f"step {r.step} (from {r.step_source})" if r.step is not None else "step unknown"
    say(f"{r.url}", quiet=quiet)
    origin = f" ({r.origin})" if r.origin else ""
    say(f"  format   {r.format}{origin}, {step}, {'sealed' if r.sealed else 'not sealed'}",
        quiet=quiet)
    if r.manifest_id:
        say(f"  id       {r.manifest_id}", quiet=quiet)
    if r.pack:
        pk = r.pack
        say(f"  pack     ratio {pk['ratio']:.2f} (holds {human_bytes(pk['source_bytes'])}), "
            + (f"base {pk['base']} (chain depth {pk['depth']})" if pk["base"] else "no base"),
            quiet=quiet)
    say(f"  size     {human_bytes(r.bytes)} in {plural(r.num_files, 'file')}; "
        f"{plural(r.num_tensors, 'tensor')} ({human_bytes(r.tensor_bytes)}), "
        f"{plural(r.num_objects, 'object')}", quiet=quiet)
    say(f"  params   {human_count(r.num_params)} ({r.num_params:,}) in the model part"
        + (f"; buffers {human_count(r.num_buffers)} ({plural(r.num_buffers, 'element')})"
           if r.num_buffers else ""), quiet=quiet)
    say("  dtypes   " + ", ".join(f"{d} {plural(v['tensors'], 'tensor')} {human_bytes(v['bytes'])}"
                                  for d, v in r.dtypes.items()), quiet=quiet)
    lay = r.layout
    dims = ", ".join(f"{k}: {v}" for k, v in lay["dims"].items()) or "none"
    say(f"  layout   {plural(lay['world_size'], 'data file')}, "
        f"{plural(lay['sharded_tensors'], 'tensor')} sharded "
        f"({dims}), {lay['replicated_tensors']} stored whole"
        + (f", mesh guess {lay['mesh_guess']}" if lay["mesh_guess"] else ""), quiet=quiet)
    say("  closure  " + "  ".join(f"{k} {'yes' if v else 'NO'}" for k, v in r.closure.items()), quiet=quiet)
    for note in r.notes:
        say(f"  note     {note}", quiet=quiet)
    if r.ranks:
        say("  ranks    " + "; ".join(
            (f"tp{v['mp_rank']}/dp{v['rank']}: " if "mp_rank" in v else f"{v['rank']}: ")
            + " + ".join(f"{g['elements']:,}" for g in v["groups"])
            + " elements" for v in r.ranks[:4]) + ("; ..." if len(r.ranks) > 4 else "")
            + " (each rank's flat partitions; --json: where each parameter sits)", quiet=quiet)
    if tree:
        say("", quiet=quiet)
        print_table(["module", "tensors", "params", "bytes"],
                    [[("  " * n.prefix.count(".")) + n.prefix.rsplit(".", 1)[-1], str(n.num_tensors),
                      human_count(n.num_params), human_bytes(n.bytes)] for n in r.tree])
    if tensors:
        say("", quiet=quiet)
        print_table(["name", "dtype", "shape", "chunks", "bytes"],
                    [[t.name, t.dtype, "x".join(map(str, t.shape)) or "()", str(t.num_chunks),
                      human_bytes(t.bytes)] for t in r.tensors])
    if show_objects:
        say("", quiet=quiet)
        print_table(["name", "part", "type", "value"],
                    [[o.name, o.part, o.type or "-", "-" if o.value is None else shorten(repr(o.value), 60)]
                     for o in r.objects])
