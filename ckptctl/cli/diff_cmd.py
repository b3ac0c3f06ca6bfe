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
        None, "--only", metavar="PART|GLOB", help="Compare only a state part (model, optim, "
        "rng, step, ...: A's names decide) or the entries whose name after --map, or A's "
        "before it, matches a glob; repeatable: model, 'layers.*', '*.exp_avg'."),
    map_: Optional[List[str]] = typer.Option(
        None, "--map", metavar="OLD=NEW", help="Rename A's names starting with OLD before "
        "matching, repeatable; first match wins ('model.=' strips 'model.')."),
    common: bool = typer.Option(False, "--common",
                                help="Compare only the entries both sides hold: those on one "
                                     "side only are counted, not a difference (exit 0 when "
                                     "every common entry is equal)."),
    stat: bool = typer.Option(False, "--stat", help="Per-part counts (same, differ, only in "
                              "A, only in B) instead of the list of differing entries."),
    limit: int = typer.Option(20, "--limit", min=0, metavar="N",
                              help="List at most N differing entries, largest change first; "
                                   "0: every one."),
    plot: bool = typer.Option(
        False, "--plot", help="After the output, a bar chart of each layer's change (as "
        "--json's layers): the bar and first figure its relative L2 change ||a-b||/||b|| (3 "
        "significant digits), then the % of its values changed; NaN/Inf or n/a, and no bar, "
        "where there is no finite ratio. Over --limit layers: the N that changed most, in "
        "layer order. Ignored with --json and --quiet."),
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

    The first line is the verdict (identical, equal or differ, with counts), then the
    count of each status and what was proven, then the differing entries: mismatches of
    dtype or shape first, then by relative L2 change, largest first; entries on one side
    only last (--limit caps the list; --stat counts per state part instead). --plot
    then draws each layer's change as a bar in the terminal.

    \b
    EXAMPLES
      ckptctl diff run/step-1000 run/step-1000-resharded
      ckptctl diff ckpt/step-20 export/ --map model.= --only model
      ckptctl diff ckpt/step-20 export/ --map model.= --common --stat
      ckptctl diff --atol 1e-6 --rtol 1e-3 --json a/ s3://runs/llama/step-12000
      ckptctl diff --cast hf-bf16/ ckpt/step-20 --map model.=  # bf16 vs fp32
      ckptctl diff run/step-1000 run/step-2000 --only model --plot
    """
    from ..convert.diff import diff as do_diff

    if plot and not (json or quiet):
        from .textplot import require_plotext

        require_plotext()  # missing: exit 3 before anything is read
    pa = resolve_place(ctx, a, storage_option, a_option, own_flag="--a-option")
    pb = resolve_place(ctx, b, storage_option, b_option, own_flag="--b-option")
    with byte_progress("diff", enabled=not (json or quiet)) as bar:
        r = do_diff(pa.url, pb.url, pa.storage_options, pb.storage_options, atol=atol,
                    rtol=rtol, only=only, maps=map_, max_memory=max_memory, workers=workers,
                    cast=cast, common=common, on_bytes=bar, on_total=bar and bar.total)
    if json:
        emit_json(r.to_dict())
    elif not quiet:
        render(r, stat=stat, limit=limit)
        if plot:
            say()
            print(layer_chart(r, limit=limit))
    if not r.equal:
        raise typer.Exit(EXIT_FINDING)


def render(r, *, stat: bool = False, limit: int = 20) -> None:
    """Human output: the verdict, the status counts, what was proven, then the per-part
    table (``stat``) or the first ``limit`` differing entries (0: all), largest change
    first."""
    say(verdict(r))
    say(summary(r))
    say(f"proven: {r.proven}; compared {human_bytes(r.bytes_compared)} of each side, "
        f"{human_bytes(r.bytes_fast_pathed)} by manifest hashes ({r.seconds:.2f}s)")
    if stat:
        print_table(["part", "same", "differ", "only in A", "only in B"], stat_rows(r))
        return
    by_name = {e.name: e for e in r.entries}
    listed = [by_name[n] for n in r.differing]  # with --common, one-sided ones only counted
    shown = listed[:limit] if limit else listed
    if shown:
        print_table(["entry", "status", "detail"], [[e.name, e.status, detail(e)] for e in shown],
                    fold=(2,))
    if len(shown) < len(listed):
        say(f"... and {len(listed) - len(shown):,} more (--limit 0 lists every one)")


def layer_chart(r, *, limit: int = 20, width: int | None = None,
                color: bool | None = None) -> str:
    """``--plot``: one bar per layer (:func:`~ckptctl.convert.diff.by_layer`, as ``--json``'s
    ``layers``), in layer order, its length the layer's relative L2 change, labelled with
    it (:func:`rel_text`) and the % of its values changed; with more than ``limit`` layers
    (0: no cap), the ``limit`` that changed most (:func:`top_layers`), and a line saying
    how many are left out.

    >>> from ckptctl.convert.diff import DiffResult, EntryDiff
    >>> rows = [EntryDiff("l.0.w", "tensor", "different", numel=4, changed=1, l2_diff=1.0,
    ...                   l2_b=4.0, rel_l2=0.25, max_abs_diff=1.0),
    ...         EntryDiff("l.1.w", "tensor", "identical", shape=[4]),
    ...         EntryDiff("l.2.w", "tensor", "different", numel=4, changed=4, l2_diff=2.0,
    ...                   l2_b=4.0, rel_l2=0.5, max_abs_diff=1.0, nonfinite_mismatch=1)]
    >>> print(layer_chart(DiffResult(False, {}, {}, 0, 0, entries=rows), width=44,
    ...                   color=False))
    per-layer change: relative L2 ||a-b||/||b|| (bar), % of values changed
                      ┌────────────────────────┐
    l.0     0.25   25%┤████████████████████████│
    l.1        0    0%┤                        │
    l.2  NaN/Inf  100%┤                        │
                      └┬───────────┬──────────┬┘
                       0         0.125     0.25
    NaN/Inf: NaN or Inf on one side only, no finite ratio (no bar)
    """
    from ..convert.diff import by_layer
    from .textplot import hbars

    layers = by_layer(r.entries)
    if not layers:
        return "per-layer change: no tensor compared on both sides, nothing to plot"
    shown = top_layers(layers, limit)
    cols = [[x.layer for x in shown], [rel_text(x) for x in shown],
            [f"{100 * x.fraction_changed:.3g}%" for x in shown]]
    if any(x.structural for x in shown):
        cols.append([f"+{x.structural} dtype/shape" if x.structural else "" for x in shown])
    widths = [max(map(len, c)) for c in cols]
    labels = ["  ".join(c.ljust(w) if i in (0, 3) else c.rjust(w)
                        for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
              for cells in zip(*cols)]
    lines = ["per-layer change: relative L2 ||a-b||/||b|| (bar), % of values changed",
             hbars(labels, [x.rel_l2 for x in shown], width=width, color=color)]
    if any(x.rel_l2 is None and x.nonfinite_mismatch for x in shown):
        lines.append("NaN/Inf: NaN or Inf on one side only, no finite ratio (no bar)")
    if any(x.rel_l2 is None and not x.nonfinite_mismatch for x in shown):
        lines.append("n/a: ||b|| = 0, or a dtype not decoded: no ratio (no bar)")
    if any(x.structural for x in shown):
        lines.append("+N dtype/shape: tensors of the layer whose dtype or shape differ "
                     "(not in its figures)")
    if len(shown) < len(layers):
        left = [x for x in layers if x not in shown]
        same = sum(not x.tensors_changed and not x.structural for x in left)
        lines.append(f"... and {plural(len(left), 'more layer')}, less changed"
                     + (f" ({same:,} of them unchanged)" if same else "")
                     + ": --limit 0 plots every one")
    return "\n".join(lines)


def rel_text(x) -> str:
    """A layer's relative L2 change as ``--plot`` labels it: 3 significant digits;
    ``NaN/Inf`` where NaN or Inf sits on one side only, ``n/a`` where there is no ratio
    otherwise (B's norm 0, a dtype not decoded).

    >>> from ckptctl.convert.diff import LayerChange
    >>> [rel_text(LayerChange("l", "model", rel_l2=v)) for v in (0.0, 0.012345, None)]
    ['0', '0.0123', 'n/a']
    >>> rel_text(LayerChange("l", "model", rel_l2=None, nonfinite_mismatch=3))
    'NaN/Inf'
    """
    if x.rel_l2 is None:
        return "NaN/Inf" if x.nonfinite_mismatch else "n/a"
    return f"{x.rel_l2:.3g}"


def top_layers(layers: list, limit: int) -> list:
    """The ``limit`` layers that changed most (0: all), in their own order: those with no
    finite ratio or a dtype/shape mismatch first, then by relative L2 change, then by the
    fraction of values changed; ties keep the earlier layer.

    >>> from ckptctl.convert.diff import LayerChange
    >>> ls = [LayerChange(f"l.{i}", "model", rel_l2=v) for i, v in enumerate([0.1, 0, None, 0.3])]
    >>> [x.layer for x in top_layers(ls, 2)], len(top_layers(ls, 0))
    (['l.2', 'l.3'], 4)
    """
    if not limit or len(layers) <= limit:
        return list(layers)
    ranked = sorted(range(len(layers)), key=lambda i: (
        not (layers[i].rel_l2 is None or layers[i].structural),
        -(layers[i].rel_l2 or 0.0), -layers[i].fraction_changed))
    return [layers[i] for i in sorted(ranked[:limit])]


def verdict(r) -> str:
    """The first line: the whole comparison in a few words.

    >>> from ckptctl.convert.diff import DiffResult, EntryDiff
    >>> rows = [EntryDiff(f"w{i}", "tensor", "identical", proof="bytes") for i in range(3)]
    >>> verdict(DiffResult(True, {}, {}, 0, 0, entries=rows, verdict="identical"))
    'identical: 3 tensors (bit for bit)'
    >>> rows += [EntryDiff("v", "tensor", "different"), EntryDiff("s", "object", "only_in_a")]
    >>> verdict(DiffResult(False, {}, {}, 0, 0, entries=rows, verdict="different"))
    'differ: 1 of 4 tensors, 1 only in A'
    >>> verdict(DiffResult(True, {}, {}, 0, 0, entries=rows[:3] + rows[4:], common=True,
    ...                    verdict="identical"))
    'identical: 3 tensors (bit for bit); 1 only in A, not compared (--common)'
    >>> verdict(DiffResult(False, {}, {}, 0, 0, entries=rows[:3] + rows[4:],
    ...                    verdict="different"))
    'differ: 1 only in A (--common compares the 3 entries both hold)'
    """
    from ..convert.diff import EQUAL, ONE_SIDED

    both = [e for e in r.entries if e.status not in ONE_SIDED]
    one = [f"{n:,} only in {s[-1].upper()}" for s in ONE_SIDED
           if (n := sum(e.status == s for e in r.entries))]
    aside = f"; {', '.join(one)}, not compared (--common)" if r.common and one else ""
    if not r.equal:
        unequal = [_of(sum(e.status not in EQUAL for e in both if e.kind == k),
                       sum(e.kind == k for e in both), k) for k in ("tensor", "object")]
        text = "differ: " + ", ".join([u for u in unequal if u] + ([] if r.common else one))
        if not any(unequal):  # only names one side lacks: say how to compare the rest
            text += (f" (--common compares the {plural(len(both), 'entry', 'entries')} both "
                     "hold)" if both else " (no name in common: --map OLD=NEW renames A's)")
        return text + aside
    kinds = [plural(n, k) for k in ("tensor", "object") if (n := sum(e.kind == k for e in both))]
    if r.verdict == "identical":
        values = any(e.proof == "values" for e in both)
        how = "tensors bit for bit, objects as values" if values else "bit for bit"
    else:
        n = sum(e.status == "equal_within_tolerance" for e in both)
        how = f"{n:,} within atol={r.atol:g}, rtol={r.rtol:g}"
    word = "identical" if r.verdict == "identical" else "equal"
    return f"{word}: {', '.join(kinds) or 'no entry'} ({how}){aside}"


def _of(n: int, total: int, kind: str) -> str:
    """``'3 of 245 tensors'``; empty when none differs."""
    return f"{n:,} of {plural(total, kind)}" if n else ""


def stat_rows(r) -> list[list[str]]:
    """``--stat``: per state part, the entries equal, differing, only in A, only in B.

    >>> from ckptctl.convert.diff import DiffResult
    >>> stat_rows(DiffResult(False, {}, {}, 0, 0, parts={"model": {"identical": 38,
    ...           "different": 1}, "optim": {"only_in_a": 135}}))
    [['model', '38', '1', '0', '0'], ['optim', '0', '0', '135', '0']]
    """
    from ..convert.diff import EQUAL

    rows = []
    for part, counts in r.parts.items():
        same = sum(counts.get(s, 0) for s in EQUAL)
        a, b = counts.get("only_in_a", 0), counts.get("only_in_b", 0)
        rows.append([part, *(f"{n:,}" for n in (same, sum(counts.values()) - same - a - b, a, b))])
    return rows


def summary(r) -> str:
    """The one-line count of a diff.

    >>> from ckptctl.convert.diff import DiffResult
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

    >>> from ckptctl.convert.diff import EntryDiff
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
