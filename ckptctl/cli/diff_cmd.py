"""``ckptctl diff A B``: compare two checkpoints entry by entry, across formats and layouts."""
from __future__ import annotations

from typing import List, Optional

import typer

from ..errors import EXIT_FINDING
from .app import app
from .common import (JsonOpt, QuietOpt, StorageOpt, check_size, emit_json, human_bytes,
                     place_argument, plural, print_table, resolve_place, say)
from .progress import byte_progress

#: Status words as the summary line says them.
WORDS = {"identical": "identical", "equal_within_tolerance": "within tolerance",
         "different": "different", "dtype_mismatch": "dtype mismatch",
         "shape_mismatch": "shape mismatch", "kind_mismatch": "tensor/object mismatch",
         "only_in_a": "only in A", "only_in_b": "only in B"}


@app.command()
def diff(
    ctx: typer.Context,
    a: str = place_argument(metavar="A", help="Checkpoint folder or file (path, s3://..., "
                            "TIER:NAME), any format."),
    b: str = place_argument(metavar="B", help="Checkpoint to compare with, any format; the "
                            "reference for --rtol and the relative L2 change."),
    atol: float = typer.Option(0.0, "--atol", metavar="X",
                               help="Absolute tolerance: |a-b| <= atol + rtol*|b| is equal."),
    rtol: float = typer.Option(0.0, "--rtol", metavar="Y", help="Relative tolerance (of B)."),
    cast: bool = typer.Option(False, "--cast",
                              help="Compare a tensor stored in another dtype on each side (an "
                                   "export cast to bf16 against its fp32 source) as values: "
                                   "within --atol/--rtol, or with neither, within one unit in "
                                   "the last place of the narrower type (bf16: rtol 2^-7)."),
    only: Optional[List[str]] = typer.Option(
        None, "--only", metavar="GLOB", help="Compare only entries whose name (after --map) "
        "matches, repeatable: 'model.*', '*.exp_avg'."),
    map_: Optional[List[str]] = typer.Option(
        None, "--map", metavar="OLD=NEW", help="Rename A's names starting with OLD before "
        "matching, repeatable; first match wins ('model.=' strips 'model.')."),
    max_memory: str = typer.Option("1GiB", "--max-memory", metavar="SIZE", callback=check_size,
                                   help="Memory budget for tensor data (1GiB, 512MB, ...)."),
    workers: int = typer.Option(4, "--workers", min=1, metavar="N",
                                help="Chunks compared at once."),
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    storage_option: Optional[List[str]] = StorageOpt,
    a_option: Optional[List[str]] = typer.Option(
        None, "--a-option", metavar="KEY=VALUE",
        help="Storage option for A only, repeatable; wins over -o, key by key."),
    b_option: Optional[List[str]] = typer.Option(
        None, "--b-option", metavar="KEY=VALUE",
        help="Storage option for B only, repeatable; wins over -o, key by key."),
):
    """Compare checkpoints A and B entry by entry: exit 0 equal, 1 on any difference.

    Entries are matched by name through the logical model, so a DCP checkpoint, its
    reshard and its consolidated safetensors compare identical. Each entry is identical
    (bytes equal: proven by both manifests' content hashes without reading, or read and
    compared), equal within tolerance (numpy isclose; NaN equals NaN only at the same
    positions), different (max |a-b|, relative L2 change ||a-b||/||b||, fraction of
    elements changed), a dtype or shape mismatch, or only in A or B. Objects compare as
    plain values when both decode safely, else by their payload bytes. Tensors stream in
    blocks within --max-memory; only blocks whose bytes differ are decoded.

    \b
    EXAMPLES
      ckptctl diff run/step-1000 run/step-1000-resharded
      ckptctl diff ckpt/step-20 export/ --map model.= --only 'layers.*'
      ckptctl diff --atol 1e-6 --rtol 1e-3 --json a/ s3://runs/llama/step-12000
      ckptctl diff --cast hf-bf16/ ckpt/step-20 --map model.=  # bf16 vs fp32
    """
    from ..ops.diff import diff as do_diff

    pa = resolve_place(ctx, a, storage_option, a_option, own_flag="--a-option")
    pb = resolve_place(ctx, b, storage_option, b_option, own_flag="--b-option")
    with byte_progress("diff", enabled=not (json or quiet)) as bar:
        r = do_diff(pa.url, pb.url, pa.storage_options, pb.storage_options, atol=atol,
                    rtol=rtol, only=only, maps=map_, max_memory=max_memory, workers=workers,
                    cast=cast, on_bytes=bar, on_total=bar and bar.total)
    if json:
        emit_json(r.to_dict())
    elif not quiet:
        rows = [[e.name, e.status, detail(e)] for e in r.entries if e.status not in
                ("identical", "equal_within_tolerance")]
        if rows:
            print_table(["entry", "status", "detail"], rows, fold=(2,))
        say(summary(r))
        say(f"proven: {r.proven}; compared {human_bytes(r.bytes_compared)} of each side, "
            f"{human_bytes(r.bytes_fast_pathed)} by manifest hashes ({r.seconds:.2f}s)")
    if not r.equal:
        raise typer.Exit(EXIT_FINDING)


def summary(r) -> str:
    """The one-line count of a diff.

    >>> from ckptctl.ops.diff import DiffResult
    >>> r = DiffResult(False, {}, {}, 0, 0, counts={"identical": 312, "different": 2,
    ...                "only_in_a": 1}, bytes_identical=3 << 29)
    >>> summary(r)
    'identical: 312 entries (1.5 GiB), different: 2, only in A: 1'
    """
    n = r.counts.get("identical", 0)
    parts = [f"identical: {plural(n, 'entry', 'entries')} ({human_bytes(r.bytes_identical)})"]
    parts += [f"{WORDS[s]}: {c:,}" for s, c in r.counts.items() if s != "identical" and c]
    return ", ".join(parts)


def detail(e) -> str:
    """What differs about one entry, in a few words.

    >>> from ckptctl.ops.diff import EntryDiff
    >>> detail(EntryDiff("w", "tensor", "different", max_abs_diff=0.5, rel_l2=0.01,
    ...                  fraction_changed=0.25))
    'max |a-b| 0.5, rel L2 0.01, 25% changed'
    >>> detail(EntryDiff("w", "tensor", "shape_mismatch", shape=[4, 2], shape_b=[2, 4]))
    'A [4, 2], B [2, 4]'
    """
    if e.status == "dtype_mismatch":
        return f"A {e.dtype}, B {e.dtype_b}"
    if e.status == "shape_mismatch":
        return f"A {e.shape}, B {e.shape_b}"
    if e.status in ("only_in_a", "only_in_b"):
        what = f"{e.dtype} {e.shape}" if e.kind == "tensor" else "object"
        return what + (f" (A: {e.name_a})" if e.name_a and e.name_a != e.name else "")
    words = []
    if e.max_abs_diff is not None:
        rel = "n/a (||b|| = 0)" if e.rel_l2 is None else f"{e.rel_l2:.3g}"
        words.append(f"max |a-b| {e.max_abs_diff:.3g}, rel L2 {rel}, "
                     f"{100 * e.fraction_changed:.3g}% changed"
                     + (f" ({plural(e.outside_tolerance, 'element')} outside tolerance)"
                        if e.outside_tolerance != e.changed else ""))
    if e.note:
        words.append(e.note)
    return "; ".join(words)
