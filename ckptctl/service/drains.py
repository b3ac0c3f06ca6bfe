"""How fast watch drains the tiers, from what it measured: the rate of each hop
(:func:`drain_rate`, kept by :func:`record_done`), the first tier's arrivals (kept by
:func:`record_arrival`), the backlog's age (:func:`newest_pending_ages`) and ``plan``'s
figures from them (:class:`MeasuredPlan`, :func:`measured_plan`), which ``watch --status``
reports.

>>> status = {}
>>> record_done(status, "step-1", "hot", "warm", "promoted", 100, 2.0, rate=50.0, finished=0)
>>> status["rates"]
{'hot->warm': 50}
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from ..tiering.config import Config
from ..tiering.policy import COMMITTED
from .results import iso_time

#: How many finished hops status.json remembers.
DONE_KEPT = 50
#: How many first-tier arrivals (name, bytes, time) status.json remembers: the interval
#: ``--status`` reports is the median gap between them.
ARRIVALS_KEPT = 20


def drain_rate(nbytes: int, bytes_sent: int, seconds: float, *, pack: bool) -> float | None:
    """The rate a hop measured, in bytes of the checkpoint drained per second: what it
    sent (a resumed copy sends only what was missing) over its time; into a pack tier the
    checkpoint's bytes (a pack sends fewer, compressed or a delta, and S over that rate is
    the drain time ``--status`` reports). None when it sent nothing.

    >>> drain_rate(100, 40, 2.0, pack=False), drain_rate(100, 10, 2.0, pack=True)
    (20.0, 50.0)
    >>> drain_rate(100, 0, 0.1, pack=False) is None
    True
    """
    if not bytes_sent or seconds <= 0:
        return None
    return (nbytes if pack else bytes_sent) / seconds


def arrival_time(arrival: dict) -> float:
    """When a first-tier checkpoint arrived (seconds since the epoch), from an entry of
    the status's ``arrivals``: ``modified`` (ISO-8601 UTC, as ``ls``), or ``time`` (a
    number: the status files of ckptctl before 2026-12).

    >>> arrival_time({"modified": "1970-01-01T00:16:40Z"}), arrival_time({"time": 5.0})
    (1000.0, 5.0)
    """
    import calendar

    if "modified" in arrival:
        return float(calendar.timegm(time.strptime(arrival["modified"], "%Y-%m-%dT%H:%M:%SZ")))
    return float(arrival["time"])


def record_done(status: dict, name: str, src: str, dst: str, action: str, nbytes: int,
                seconds: float, *, rate: float | None, finished: float) -> None:
    """Add a finished hop (or multi-node part), ended at ``finished``, to a watch status:
    ``done`` (the last :data:`DONE_KEPT`), each with the rate measured on it
    (``bytes_per_second``, None when it moved nothing), and ``rates``, the newest of each
    hop.

    >>> status = {}
    >>> record_done(status, "s-1", "hot", "warm", "up-to-date", 10, 0.1, rate=None, finished=0)
    >>> status["done"][0]["bytes_per_second"], status["done"][0]["finished"], "rates" in status
    (None, '1970-01-01T00:00:00Z', False)
    """
    rate = round(rate) if rate else None
    if rate:
        status.setdefault("rates", {})[f"{src}->{dst}"] = rate
    done = status.setdefault("done", [])
    done.append({"name": name, "src": src, "dst": dst, "action": action,
                 "bytes": nbytes, "seconds": seconds, "bytes_per_second": rate,
                 "finished": iso_time(finished)})
    del done[:-DONE_KEPT]


def record_arrival(status: dict, name: str, row, now: float) -> None:
    """Add a first-tier checkpoint's size and time (its commit marker's, else ``now``) to
    a watch status's ``arrivals`` (the last :data:`ARRIVALS_KEPT`), for the interval and
    size ``--status`` reports.

    >>> from types import SimpleNamespace as Row
    >>> status = {}
    >>> record_arrival(status, "s-1", Row(bytes=10, modified=None), 1000.0)
    >>> status["arrivals"]
    [{'name': 's-1', 'bytes': 10, 'modified': '1970-01-01T00:16:40Z'}]
    """
    arrivals = status.setdefault("arrivals", [])
    arrivals.append({"name": name, "bytes": row.bytes,
                     "modified": iso_time(row.modified if row.modified else now)})
    del arrivals[:-ARRIVALS_KEPT]


def newest_pending_ages(tiers, listings: list, arrivals: list | None,
                        now: float) -> dict[str, float]:
    """The backlog of each tier after the first that could be listed (``listings``, by
    tier; None: not listed): the age at ``now`` of the newest checkpoint committed in a
    tier before it and not yet in it (by its first-tier arrival time in ``arrivals``, else
    its commit marker's), 0.0 when none waits.

    >>> from types import SimpleNamespace as Row
    >>> tiers = [Row(name="hot"), Row(name="warm"), Row(name="cold")]
    >>> hot = {"s-1": Row(state="sealed", modified=100.0)}
    >>> newest_pending_ages(tiers, [hot, {}, None], [], now=130.0)
    {'warm': 30.0}
    """
    arrived = {a["name"]: arrival_time(a) for a in arrivals or []}
    out, before = {}, {}
    for tier, rows in zip(tiers, listings):
        if before and rows is not None:
            times = [arrived.get(n, r.modified or now) for n, r in before.items()
                     if not (n in rows and rows[n].state in COMMITTED)]
            out[tier.name] = max(0.0, now - max(times)) if times else 0.0
        for n, r in (rows or {}).items():
            if r.state in COMMITTED:
                before.setdefault(n, r)
    return out


@dataclass
class MeasuredPlan:
    """``plan``'s figures from what watch measured (``watch --status``): S the newest
    first-tier checkpoint's bytes (in multi-node, this node's part: the figures are then
    per node), tau the median gap between the last first-tier arrivals, each tier's rates
    from its newest hops, each labelled by the hop it was measured on (``measured on hot
    -> warm``: warm's write and hot's read; a tier nothing is read from yet is recovered
    at its write rate, "(a write)"). No save time or MTBF is known here: the optimal
    interval is ``ckptctl plan``'s."""

    checkpoint_name: str
    checkpoint_bytes: int
    interval_seconds: float | None
    gaps: int
    node_bandwidth_bytes_per_second: float | None
    local_capacity_bytes: int
    hops: list = field(default_factory=list)
    recovery: list = field(default_factory=list)

    @property
    def all_fit(self) -> bool | None:
        """False when a hop does not fit, True when every one does, None when one is
        unknown or there is no hop (nothing was checked)."""
        fits = [h.fits for h in self.hops]
        return False if False in fits else None if None in fits or not fits else True

    def to_dict(self) -> dict:
        from ..tiering.plan import whole_rate

        def whole(d: dict) -> dict:
            return {**d, "bytes_per_second": whole_rate(d["bytes_per_second"])}

        doc = {k: v for k, v in asdict(self).items() if k not in ("hops", "recovery")}
        doc["node_bandwidth_bytes_per_second"] = whole_rate(
            self.node_bandwidth_bytes_per_second)
        return {**doc, "all_fit": self.all_fit,
                "hops": [whole(asdict(h)) for h in self.hops],
                "recovery": [whole({**asdict(r), "rate_kind": r.rate_kind})
                             for r in self.recovery]}


def measured_plan(config: Config, doc: dict | None) -> MeasuredPlan | None:
    """The plan figures of :class:`MeasuredPlan` from a watch status document (see
    :func:`~.status.read_status`); None before the first arrival. The arithmetic is
    :mod:`~ckptctl.tiering.plan`'s.

    >>> measured_plan(Config("c.toml", ()), {}) is None
    True
    """
    import itertools
    import statistics

    from ..tiering.plan import (Measurement, TierInput, drain_seconds, drains,
                                local_capacity, node_bandwidth)

    arrivals = (doc or {}).get("arrivals") or []
    if not arrivals or not config.tiers:
        return None
    newest = max(arrivals, key=arrival_time)
    times = sorted(map(arrival_time, arrivals))
    gaps = [b - a for a, b in itertools.pairwise(times) if b > a]
    tau = statistics.median(gaps) if gaps else None
    last: dict[tuple[str, str], float] = {}  # (src, dst) -> the rate its newest hop measured
    for d in (doc or {}).get("done") or []:
        rate = _done_rate(d)
        if rate:
            last[(d["src"], d["dst"])] = rate
    names = [t.name for t in config.tiers]
    tiers = []
    for i, t in enumerate(config.tiers):
        into = last.get((names[i - 1], t.name)) if i > 0 else None
        out = last.get((t.name, names[i + 1])) if i + 1 < len(names) else None
        # one rate per hop: the write into dst and the read out of src are the same figure
        m = None if not (into or out) else Measurement(
            t.name, t.url, into or 0, 1.0 if into else 0.0, out or 0, 1.0 if out else 0.0,
            write_source=f"measured on {names[i - 1]} -> {t.name}" if into else "",
            read_source=f"measured on {t.name} -> {names[i + 1]}" if out else "")
        tiers.append(TierInput(t.name, t.url, t.bwlimit, m))
    size = int(newest["bytes"])
    hops, recovery = drains(size, tiers, interval_seconds=tau)
    for r, t in zip(recovery, tiers):
        write = t.measured.write_bytes_per_second if t.measured else None
        if r.bytes_per_second is None and write:
            r.bytes_per_second, r.rate_source = write, t.measured.source("write") + " (a write)"
            r.seconds = drain_seconds(r.bytes, write)
    return MeasuredPlan(newest["name"], size, tau, len(gaps),
                        None if tau is None else node_bandwidth(size, 1, tau),
                        local_capacity(size, 1), hops, recovery)


def _done_rate(d: dict) -> float | None:
    """The rate a ``done`` entry of the status measured: its ``bytes_per_second`` (None:
    it moved nothing); an entry an older ckptctl wrote, without one: its bytes over
    its seconds, unless it was up to date.

    >>> _done_rate({"bytes": 10, "seconds": 2.0, "bytes_per_second": None})
    >>> _done_rate({"bytes": 10, "seconds": 2.0, "action": "promoted"})
    5.0
    """
    if "bytes_per_second" in d:
        return d["bytes_per_second"]
    if d.get("action") != "up-to-date" and d.get("seconds") and d.get("bytes"):
        return d["bytes"] / d["seconds"]
    return None
