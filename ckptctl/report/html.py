"""Draw a :class:`~ckptctl.report.data.ReportData` as one self-contained HTML page.

Each chart is drawn by matplotlib (the ``report`` extra) as SVG and set inline in a
``<section data-chart="NAME">``; the page has no script to run and loads nothing: it opens
the same from a laptop's disk, a CI artifact or a mail. The data it was drawn from rides
along as JSON (``<script type="application/json" id="report-data">``, never executed) for
a notebook to take.

>>> page = render(ReportData("runs/llama", ["model"]))    # doctest: +SKIP
>>> page.startswith("<!DOCTYPE html>")                     # doctest: +SKIP
True
"""
from __future__ import annotations

import html
import io
import json
import math

from ..errors import UsageError
from .data import ReportData

#: what marks a page as this command's: an existing --output without it is not replaced
GENERATOR = '<meta name="generator" content="ckptctl report">'
#: colours of checkpoint states (ls's words)
STATE_COLOURS = {"sealed": "#2b8a3e", "complete": "#74b816", "incomplete": "#f59f00",
                 "corrupt": "#e03131", "unknown": "#868e96"}
PART_COLOURS = {"model": "#1c7ed6", "optim": "#f76707", "step": "#868e96",
                "lr_scheduler": "#ae3ec9", "rng": "#495057", "dataloader": "#0ca678"}
#: layers drawn in the bytes chart at most (the largest; the rest summed in one bar)
MAX_LAYER_BARS = 40
#: the change strip writes each cell's value in it up to this many cells
MAX_LABELLED_CELLS = 120

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1180px;
       color: #212529; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 2em; }
.sub { color: #495057; margin-top: 0; } .note { color: #868e96; }
section svg { max-width: 100%; height: auto; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { padding: 2px 10px; text-align: right; border-bottom: 1px solid #dee2e6; }
td:first-child, th:first-child { text-align: left; }
"""


#: matplotlib settings while the page is drawn (a caller's own settings are left as
#: they were): text as text, and the same data gives the same page
RC = {"svg.fonttype": "none", "font.size": 9, "svg.hashsalt": "ckptctl"}


def _matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("ckptctl report draws its charts with matplotlib: "
                         "pip install 'ckptctl[report]' (or use --json)") from None
    from matplotlib.figure import Figure

    return Figure


def _style():
    """:data:`RC` for the charts drawn inside, as a context (nothing when there is no
    matplotlib: the first chart says what to install)."""
    import contextlib

    try:
        import matplotlib
    except ImportError:
        return contextlib.nullcontext()
    return matplotlib.rc_context(RC)


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _mib(n: int | None) -> float:
    return (n or 0) / 2**20


def human(n: int | None) -> str:
    """Bytes for people.

    >>> human(13483606), human(512)
    ('12.9 MiB', '512 B')
    """
    n = n or 0
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# ---------------------------------------------------------------------------- charts


def run_chart(data: ReportData) -> str | None:
    """Each tier's checkpoints on a step axis: a bar per checkpoint, its height the size,
    its colour the state; packs labelled with their ratio; gaps shaded."""
    tiers = [t for t in data.tiers if t.checkpoints]
    if not tiers:
        return None
    Figure = _matplotlib()
    fig = Figure(figsize=(11, 1.6 + 1.5 * len(tiers)))
    axes = fig.subplots(len(tiers), 1, sharex=True, squeeze=False)[:, 0]
    steps = [c["step"] for t in tiers for c in t.checkpoints if c["step"] is not None]
    width = _bar_width(steps)
    for ax, t in zip(axes, tiers):
        rows = [c for c in t.checkpoints if c["step"] is not None]
        ax.bar([c["step"] for c in rows], [_mib(c["bytes"]) for c in rows], width=width,
               color=[STATE_COLOURS.get(c["state"], "#868e96") for c in rows], gid="data-run")
        for c in rows:
            if c.get("pack_ratio"):
                ax.annotate(f"{c['pack_ratio']:.2f}x", (c["step"], _mib(c["bytes"])),
                            ha="center", va="bottom", fontsize=7)
        for a, b, _ in t.gaps:
            ax.axvspan(a, b, color="#ffe3e3", zorder=0, lw=0)
        ax.set_ylabel(f"{t.name or 'run'}\nMiB")
        ax.spines[["top", "right"]].set_visible(False)
    axes[-1].set_xlabel("step")
    handles = [_patch(c, s) for s, c in STATE_COLOURS.items()
               if any(x["state"] == s for t in tiers for x in t.checkpoints)]
    axes[0].legend(handles=handles, loc="upper left", ncols=len(handles), frameon=False,
                   bbox_to_anchor=(0, 1.25))
    return _svg(fig)


def _patch(colour: str, label: str):
    from matplotlib.patches import Patch

    return Patch(color=colour, label=label)


def _bar_width(steps: list[int]) -> float:
    s = sorted(set(steps))
    diffs = [b - a for a, b in zip(s, s[1:])]
    return 0.6 * min(diffs) if diffs else 0.6


def bytes_chart(data: ReportData) -> str | None:
    """The newest checkpoint's tensor bytes: by part and by dtype (left), by layer
    (right, the largest :data:`MAX_LAYER_BARS`), coloured by part."""
    b = data.breakdown
    if b is None or not b.layers:
        return None
    Figure = _matplotlib()
    layers = sorted(b.layers, key=lambda x: -x["bytes"])
    shown, rest = layers[:MAX_LAYER_BARS], layers[MAX_LAYER_BARS:]
    order = [x for x in b.layers if x in shown]
    fig = Figure(figsize=(11, 1.8 + 0.16 * len(order)))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2.2]})
    labels = [*(f"part {p}" for p in b.parts), *(f"dtype {d}" for d in b.dtypes)]
    values = [*b.parts.values(), *b.dtypes.values()]
    colours = [*(PART_COLOURS.get(p, "#adb5bd") for p in b.parts), *["#868e96"] * len(b.dtypes)]
    left.barh(labels[::-1], [_mib(v) for v in values[::-1]], color=colours[::-1],
              gid="data-parts")
    left.set_xlabel("MiB")
    names = [x["layer"] for x in order] + ([f"{len(rest)} more layers"] if rest else [])
    sizes = [_mib(x["bytes"]) for x in order] + ([_mib(sum(x["bytes"] for x in rest))]
                                                 if rest else [])
    cols = [PART_COLOURS.get(x["part"], "#adb5bd") for x in order] + (["#ced4da"] if rest else [])
    right.barh(names[::-1], sizes[::-1], color=cols[::-1], gid="data-layers")
    right.set_xlabel("MiB")
    right.tick_params(axis="y", labelsize=7)
    for ax in (left, right):
        ax.spines[["top", "right"]].set_visible(False)
    return _svg(fig)


def change_chart(data: ReportData) -> str | None:
    """The heat strip: one row per pair, one column per layer, the colour the layer's
    relative L2 change (log scale); a layer with NaN/Inf on one side (no finite ratio)
    is marked with a red cross; the fraction of values changed beside it."""
    if not data.changes:
        return None
    Figure = _matplotlib()
    from matplotlib.colors import LogNorm

    import numpy as np

    layers = _layer_columns(data)
    rel = np.full((len(data.changes), len(layers)), np.nan)
    frac = np.full_like(rel, np.nan)
    marks = []
    for i, c in enumerate(data.changes):
        for x in c.layers:
            j = layers.index(x["layer"])
            frac[i, j] = x["fraction_changed"]
            if x["rel_l2"] is None:
                marks.append((j, i))
            else:
                rel[i, j] = x["rel_l2"]
    fig = Figure(figsize=(11, 2.2 + 0.5 * len(data.changes)))
    top, bottom = fig.subplots(2, 1, sharex=True)
    pos = rel[np.isfinite(rel) & (rel > 0)]
    norm = LogNorm(*_decade_span(float(pos.min()), float(pos.max()))) if pos.size else None
    shown = np.where(rel > 0, rel, np.nan)  # unchanged layers stay blank
    im = top.imshow(shown, aspect="auto", cmap="viridis", norm=norm, interpolation="nearest",
                    gid="data-change")
    for j, i in marks:
        top.plot(j, i, "x", color="#e03131", ms=8, mew=2)
    if rel.size <= MAX_LABELLED_CELLS:
        for (i, j), v in np.ndenumerate(rel):
            if v > 0:
                top.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=7,
                         color="white" if norm(v) < 0.6 else "black")
    fig.colorbar(im, ax=top, label="relative L2 change")
    im2 = bottom.imshow(np.where(frac > 0, frac, np.nan), aspect="auto", cmap="Oranges",
                        vmin=0, vmax=1, interpolation="nearest", gid="data-fraction")
    fig.colorbar(im2, ax=bottom, label="fraction changed")
    labels = [_pair_label(c) for c in data.changes]
    for ax in (top, bottom):
        ax.set_yticks(range(len(labels)), labels)
    bottom.set_xticks(range(len(layers)), layers, rotation=90, fontsize=7)
    return _svg(fig)


def _decade_span(lo: float, hi: float) -> tuple[float, float]:
    """A log colour scale at least a decade wide, centred on the values.

    >>> [round(x, 4) for x in _decade_span(0.07, 0.08)]
    [0.0237, 0.2366]
    """
    lo, hi = max(lo, 1e-30), max(hi, 1e-30)
    if hi / lo >= 10:
        return lo, hi
    mid = math.sqrt(lo * hi)
    return min(lo, mid / math.sqrt(10)), max(hi, mid * math.sqrt(10))


def _layer_columns(data: ReportData) -> list[str]:
    from ..model import natural_key

    names = {x["layer"] for c in data.changes for x in c.layers}
    return sorted(names, key=natural_key)


def _pair_label(c) -> str:
    a = c.a_step if c.a_step is not None else c.a.rstrip("/").rsplit("/", 1)[-1]
    b = c.b_step if c.b_step is not None else c.b.rstrip("/").rsplit("/", 1)[-1]
    return f"{a} vs {b}"


def plan_chart(data: ReportData) -> str | None:
    """Expected overhead against the checkpoint interval, with Young's/Daly's optimum
    and the chosen interval marked."""
    p = data.plan
    if not p:
        return None
    Figure = _matplotlib()
    fig = Figure(figsize=(8, 3.4))
    ax = fig.subplots()
    ax.plot(p["intervals_seconds"], [100 * y for y in p["overheads"]], color="#1c7ed6",
            gid="data-plan")
    ax.set_xscale("log")
    for key, colour, label in (("optimal", "#2b8a3e", "Young/Daly optimum"),
                               ("chosen", "#e8590c", "chosen interval")):
        pt = p.get(key)
        if pt:
            ax.axvline(pt["interval_seconds"], color=colour, ls="--", lw=1)
            ax.plot(pt["interval_seconds"], 100 * pt["overhead"], "o", color=colour,
                    label=f"{label}: {pt['interval_seconds']:.0f} s, "
                          f"{100 * pt['overhead']:.2f}%")
    ax.set_xlabel("checkpoint interval (s)")
    ax.set_ylabel("expected overhead (%)")
    ax.legend(frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    return _svg(fig)


# ---------------------------------------------------------------------------- page


def render(data: ReportData, *, show=None, shown_doc=None) -> str:
    """The whole page: a title, then each chart that has data, each with a short table.
    ``show``: how a URL is written on the page, ``shown_doc``: how the JSON riding along
    is (the CLI: each place as the user gave it, as ``--json`` writes them)."""
    e = html.escape
    show = show or (lambda url: url)
    body = [f"<h1>ckptctl report: {e(data.target)}</h1>",
            f"<p class=sub>{_summary(data, show)}</p>"]
    sections = [("run", "The run", run_chart, _run_table),
                ("bytes", "Where the bytes are", bytes_chart, _bytes_table),
                ("change", "Change between checkpoints", change_chart, _change_table),
                ("plan", "Checkpoint interval", plan_chart, None)]
    with _style():
        drawn = [(name, title, draw(data), table) for name, title, draw, table in sections]
    for name, title, svg, table in drawn:
        if svg is None:
            continue
        body.append(f'<h2>{title}</h2>\n<section data-chart="{name}">\n{svg}\n</section>')
        if table is not None:
            body.append(table(data, show))
    for n in data.notes:
        body.append(f"<p class=note>{e(n)}</p>")
    doc = data.to_dict()
    payload = json.dumps(shown_doc(doc) if shown_doc else doc,
                         default=_jsonable).replace("</", "<\\/")
    return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>" + GENERATOR
            + f"<title>ckptctl report: {e(data.target)}</title>"
            # nothing is fetched: not even a favicon
            '<link rel="icon" href="data:,">'
            f"<style>{_STYLE}</style></head><body>\n" + "\n".join(body)
            + f'\n<script type="application/json" id="report-data">{payload}</script>'
            + "\n</body></html>\n")


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return str(v)


def _summary(data: ReportData, show) -> str:
    n = sum(len(t.checkpoints) for t in data.tiers)
    bits = []
    if data.tiers:
        bits.append(f"{n} checkpoint{'s' * (n != 1)} in {len(data.tiers)} "
                    f"place{'s' * (len(data.tiers) != 1)}")
    if data.breakdown is not None:
        bits.append(f"newest read: {html.escape(show(data.breakdown.url))}")
    if data.changes:
        what = f"against {html.escape(data.against)}" if data.against else "consecutive"
        bits.append(f"{len(data.changes)} pair{'s' * (len(data.changes) != 1)} compared "
                    f"({what}; parts: {', '.join(data.only) if data.only else 'all'})")
    return "; ".join(bits)


def _table(head: list[str], rows: list[list]) -> str:
    e = html.escape
    th = "".join(f"<th>{e(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{trs}</table>"


def _run_table(data: ReportData, show) -> str:
    rows = [[t.name or "run", c["name"], c["step"] if c["step"] is not None else "-",
             c["state"], human(c["bytes"]),
             f"{c['pack_ratio']:.2f}x" if c.get("pack_ratio") else "-", c["modified"] or "-"]
            for t in data.tiers for c in t.checkpoints]
    out = _table(["place", "checkpoint", "step", "state", "size", "pack ratio", "modified"],
                 rows)
    for t in data.tiers:
        if t.error:
            out += (f"<p class=note>{html.escape(t.name or show(t.url))}: "
                    f"{html.escape(t.error)}</p>")
        for a, b, missing in t.gaps:
            out += (f"<p class=note>{html.escape(t.name or 'run')}: {missing} save"
                    f"{'s' * (missing != 1)} missing between steps {a} and {b}</p>")
    return out


def _bytes_table(data: ReportData, show) -> str:
    b = data.breakdown
    rows = [[f"part {k}", human(v)] for k, v in b.parts.items()]
    rows += [[f"dtype {k}", human(v)] for k, v in b.dtypes.items()]
    return (f"<p>{html.escape(show(b.url))}: {human(b.bytes)} in files, {human(b.tensor_bytes)} "
            f"of tensors ({b.format}, step {b.step if b.step is not None else '?'})</p>"
            + _table(["what", "bytes"], rows))


def _change_table(data: ReportData, show) -> str:
    rows = []
    for c in data.changes:
        moved = [x for x in c.layers if x["rel_l2"] is None or x["rel_l2"] > 0]
        top = max(moved, key=lambda x: math.inf if x["rel_l2"] is None else x["rel_l2"],
                  default=None)
        rows.append([_pair_label(c), c.verdict, f"{len(moved)} of {len(c.layers)}",
                     "-" if top is None else top["layer"],
                     "-" if top is None else ("NaN/Inf" if top["rel_l2"] is None
                                              else f"{top['rel_l2']:.3g}")])
    return _table(["pair", "verdict", "layers changed", "most changed", "relative L2"], rows)


__all__ = ["bytes_chart", "change_chart", "human", "plan_chart", "render", "run_chart"]
