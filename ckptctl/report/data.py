"""What ``ckptctl report`` shows, gathered from the verbs that compute it.

* **the run**: ``ls`` of a root, or of each tier of a ``ckptctl.toml``: every checkpoint
  with its step, state, size, time and (a pack) its ratio; gaps in the step sequence;
* **the bytes of one checkpoint** (the newest readable one, or the one named): by part,
  by layer (:func:`~ckptctl.convert.diff.layer_of`) and by dtype, from ``inspect``;
* **change**: ``diff``'s per-layer change (:func:`~ckptctl.convert.diff.by_layer`) between
  consecutive checkpoints, each pair compared as ``ckptctl diff LATER EARLIER`` (the
  earlier is the reference: relative L2 change over its norm), or each one against
  ``against`` (``ckptctl diff CHECKPOINT BASE``): the same numbers ``diff --json`` gives
  as ``layers``. Each pair reads each tensor once, within ``max_memory``;
* **plan**: the expected overhead against the checkpoint interval
  (:func:`~ckptctl.tiering.plan.overhead_curve`), when a save time and an MTBF are given.

>>> r = collect("runs/llama", only=["model"])            # doctest: +SKIP
>>> [c["step"] for c in r.tiers[0].checkpoints], len(r.changes)   # doctest: +SKIP
([100, 200, 300], 2)
"""
from __future__ import annotations

import posixpath
import time
from dataclasses import asdict, dataclass, field

from ..errors import CkptError, UsageError

#: states whose checkpoints can be read for bytes and change
READABLE = ("sealed", "complete")
#: consecutive pairs compared by default (the newest ones)
PAIRS = 10


@dataclass
class TierRun:
    """The checkpoints of one place: ``name`` is the tier's (None for a plain root).
    ``checkpoints``: ``ls --json`` rows, with ``pack_ratio`` for packs. ``gaps``: each
    ``[step, next_step, missing]`` where steps are missing at the run's save interval (the
    smallest step difference). ``error``: why the place could not be listed."""

    name: str | None
    url: str
    checkpoints: list[dict] = field(default_factory=list)
    gaps: list[list[int]] = field(default_factory=list)
    error: str | None = None


@dataclass
class Breakdown:
    """Where the bytes of one checkpoint are: tensor bytes by part, by layer (in natural
    order; ``params``: elements) and by dtype."""

    url: str
    step: int | None
    format: str
    bytes: int
    tensor_bytes: int
    parts: dict[str, int] = field(default_factory=dict)
    layers: list[dict] = field(default_factory=list)
    dtypes: dict[str, int] = field(default_factory=dict)


@dataclass
class Change:
    """One pair: ``a`` compared with ``b`` (the reference), as ``ckptctl diff A B``;
    ``layers``: diff's per-layer change (``LayerChange`` as dicts)."""

    a: str
    b: str
    a_step: int | None
    b_step: int | None
    verdict: str
    layers: list[dict] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class ReportData:
    """Everything the report draws; ``to_dict()`` is ``report --json``."""

    target: str
    only: list[str] | None
    tiers: list[TierRun] = field(default_factory=list)
    #: the bytes of the newest readable checkpoint (or of the one named)
    breakdown: Breakdown | None = None
    changes: list[Change] = field(default_factory=list)
    against: str | None = None
    plan: dict | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def step_gaps(steps: list[int]) -> list[list[int]]:
    """Where a run skips saves: ``[step, next, missing]`` for each pair of consecutive
    steps further apart than the smallest difference (the save interval).

    >>> step_gaps([100, 200, 300, 600, 700])
    [[300, 600, 2]]
    >>> step_gaps([10]), step_gaps([5, 7, 9])
    ([], [])
    """
    s = sorted(set(steps))
    diffs = [b - a for a, b in zip(s, s[1:])]
    if not diffs:
        return []
    every = min(diffs)
    return [[a, b, (b - a) // every - 1] for a, b in zip(s, s[1:])
            if b - a > every and (b - a) // every > 1]


def tier_run(url: str, name: str | None = None, storage_options: dict | None = None, *,
             listed=None) -> TierRun:
    """``ls`` of one place (``listed``: its :class:`~ckptctl.catalog.ls.LsResult` when
    already made); a pack's row has its ``pack_ratio`` (``format`` is that of the
    checkpoint it holds, as ``ls`` says). A place that cannot be listed gives a run with
    ``error`` set (the report says so and shows the other tiers).

    >>> tier_run("/nonexistent/place").error is not None
    True
    """
    from ..catalog.ls import ls
    from ..formats.pack import is_pack

    run = TierRun(name, url)
    try:
        res = listed if listed is not None else ls(url, storage_options)
    except CkptError as e:
        run.error = e.message
        return run
    for row in res.checkpoints:
        doc = row.to_dict()
        packed = row.located is not None and is_pack(row.located[1])
        doc["pack_ratio"] = _pack_ratio(row.url, storage_options) if packed else None
        run.checkpoints.append(doc)
    run.gaps = step_gaps([c["step"] for c in run.checkpoints if c["step"] is not None])
    return run


def _pack_ratio(url: str, storage_options: dict | None) -> float | None:
    from ..formats.detect import open_checkpoint

    try:
        ck = open_checkpoint(url, storage_options)
        return (ck.info.get("pack") or {}).get("ratio")
    except CkptError:
        return None


def breakdown(url: str, storage_options: dict | None = None) -> Breakdown:
    """The bytes of the checkpoint at ``url`` by part, layer and dtype (metadata only)."""
    from ..catalog.inspect import inspect
    from ..convert.diff import layer_of
    from ..model import natural_key

    r = inspect(url, storage_options)
    out = Breakdown(url, r.step, r.format, r.bytes, r.tensor_bytes)  # the URL as given
    layers: dict[str, dict] = {}
    for t in r.tensors:
        out.parts[t.part] = out.parts.get(t.part, 0) + t.bytes
        out.dtypes[t.dtype] = out.dtypes.get(t.dtype, 0) + t.bytes
        key = layer_of(t.name)
        x = layers.setdefault(key, {"layer": key, "part": t.part, "bytes": 0, "params": 0})
        x["bytes"] += t.bytes
        n = 1
        for d in t.shape:
            n *= d
        x["params"] += n
    out.layers = [layers[k] for k in sorted(layers, key=natural_key)]
    return out


def change(a: str, b: str, *, only: list[str] | None, max_memory: int | str,
           workers: int, a_options: dict | None = None,
           b_options: dict | None = None) -> Change:
    """``ckptctl diff A B``'s per-layer change (B the reference)."""
    from ..convert.diff import by_layer, diff

    r = diff(a, b, a_options, b_options, only=only, max_memory=max_memory, workers=workers,
             common=True)
    return Change(a, b, r.a.get("step"), r.b.get("step"), r.verdict,
                  [asdict(x) for x in by_layer(r.entries)], r.seconds)


def collect(target: str | None = None, storage_options: dict | None = None, *,
            config=None, against: str | None = None, only: list[str] | None = ("model",),
            pairs: int = PAIRS, max_memory: int | str = 1 << 30, workers: int = 4,
            plan: dict | None = None) -> ReportData:
    """Gather the report of ``target`` (a root, or one checkpoint) or of every tier of
    ``config`` (a :class:`~ckptctl.tiering.config.Config`). ``plan``: ``save_seconds``,
    ``mtbf_seconds`` and optionally ``interval_seconds`` for the overhead curve."""
    t0 = time.monotonic()
    only = list(only) if only else None
    data = ReportData(target or (config.path if config is not None else ""), only,
                      against=against)
    places = _places(target, storage_options, config)
    order = _run_order(data, places)
    if target is not None and not data.tiers:  # one checkpoint
        order = [(None, target, storage_options)]
    newest = next(((u, o) for _, u, o in reversed(order)), None)
    if newest is not None:
        try:
            data.breakdown = breakdown(newest[0], newest[1])
        except CkptError as e:
            data.notes.append(f"bytes of {newest[0]}: {e.message}")
    data.changes = _changes(order, against, storage_options, only=only, pairs=pairs,
                            max_memory=max_memory, workers=workers, notes=data.notes)
    if plan:
        from ..tiering.plan import overhead_curve

        data.plan = overhead_curve(plan["save_seconds"], plan["mtbf_seconds"],
                                   chosen=plan.get("interval_seconds"))
    data.seconds = round(time.monotonic() - t0, 3)
    return data


def _places(target, storage_options, config) -> list[tuple]:
    """(tier name, url, options, its ``ls`` when made here) of each place whose run is
    shown; a single checkpoint as ``target`` shows no run."""
    if config is not None:
        from ..tiering.config import merge_options

        return [(t.name, t.url, merge_options(t.storage_options, storage_options), None)
                for t in config.tiers]
    from ..catalog.ls import ls

    listed = ls(target, storage_options)  # a target that is not there: its error
    rows = listed.checkpoints
    if len(rows) == 1 and rows[0].url.rstrip("/") == target.rstrip("/"):
        return []  # the target is one checkpoint
    return [(None, target, storage_options, listed)]


def _run_order(data: ReportData, places: list[tuple]) -> list[tuple]:
    """List each place; the readable checkpoints by step, each step from the hottest place
    that holds it: ``[(step, url, options)]``."""
    seen: dict[int, tuple] = {}
    unnumbered: list[tuple] = []
    for name, url, options, listed in places:
        run = tier_run(url, name, options, listed=listed)
        data.tiers.append(run)
        for c in run.checkpoints:
            if c["state"] not in READABLE:
                continue
            if c["step"] is None:
                unnumbered.append((None, c["url"], options))
            elif c["step"] not in seen:
                seen[c["step"]] = (c["step"], c["url"], options)
    if unnumbered and not seen:
        return unnumbered
    return [seen[s] for s in sorted(seen)]


def _changes(order: list[tuple], against: str | None, storage_options: dict | None, *,
             only, pairs: int, max_memory, workers: int, notes: list[str]) -> list[Change]:
    if against is not None:
        todo = [(u, o, against, storage_options) for _, u, o in order[-pairs:]
                if u.rstrip("/") != against.rstrip("/")]
    else:
        todo = [(b[1], b[2], a[1], a[2]) for a, b in zip(order, order[1:])][-pairs:]
        if len(order) < 2:
            notes.append("fewer than two readable checkpoints: no change to show")
    out = []
    for a, ao, b, bo in todo:
        try:
            out.append(change(a, b, only=only, max_memory=max_memory, workers=workers,
                              a_options=ao, b_options=bo))
        except UsageError:
            raise  # the command line is wrong, not the checkpoint
        except CkptError as e:
            notes.append(f"change {posixpath.basename(a.rstrip('/'))} against "
                         f"{posixpath.basename(b.rstrip('/'))}: {e.message}")
    return out


__all__ = ["Breakdown", "Change", "ReportData", "TierRun", "breakdown", "change", "collect",
           "step_gaps", "tier_run"]
