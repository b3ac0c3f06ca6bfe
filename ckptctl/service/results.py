"""What a pass of ``watch`` found and did: :class:`WatchPass` with its :class:`Hop` and
:class:`Failure` records, :func:`on_its_way` (is a pending checkpoint a problem?) and
:func:`iso_time`, the times its documents carry.

>>> p = WatchPass(0.0, found=["step-1"])
>>> p.drained, p.to_dict()["started"]
(True, '1970-01-01T00:00:00Z')
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Hop:
    """One promotion: ``name`` from tier ``src`` to tier ``dst``."""

    name: str
    src: str
    dst: str
    action: str  # promoted | up-to-date
    bytes: int
    bytes_sent: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.bytes_sent / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Failure:
    """A step that failed: ``what`` is ``list``, ``seal``, ``promote`` or ``gc``."""

    key: str
    what: str
    tier: str
    name: str | None
    code: str
    message: str
    attempts: int
    next_retry: float


@dataclass
class WatchPass:
    """What one pass found and did. ``pending``: (tier, name, why) of what still waits."""

    started: float
    seconds: float = 0.0
    found: list[str] = field(default_factory=list)
    sealed: list[str] = field(default_factory=list)
    promoted: list[Hop] = field(default_factory=list)
    kept: dict[str, list[str]] = field(default_factory=dict)
    removed: dict[str, list[str]] = field(default_factory=dict)
    pending: list[dict] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    #: tier -> age in seconds of the newest checkpoint not yet committed there (0: none)
    behind: dict[str, float] = field(default_factory=dict)
    #: name -> seconds the listing of a ``settling`` one has been unchanged, as watch saw
    #: it (it is taken at ``settle`` seconds)
    unchanged: dict[str, float] = field(default_factory=dict)

    @property
    def drained(self) -> bool:
        """Nothing pending and nothing failed."""
        return not self.pending and not self.failed

    @property
    def ok(self) -> bool:
        """Nothing failed, and whatever is pending is on its way (:func:`on_its_way`):
        ``--once`` exits 0.

        >>> WatchPass(0.0, pending=[{"tier": "hot", "name": "s-1", "why": "settling"}]).ok
        True
        >>> WatchPass(0.0, pending=[{"tier": "hot", "name": "s-1", "why": "incomplete"}]).ok
        False
        """
        return not self.failed and all(on_its_way(x["why"]) for x in self.pending)

    def to_dict(self) -> dict:
        return {
            "started": iso_time(self.started), "seconds": round(self.seconds, 3),
            "drained": self.drained, "ok": self.ok, "found": list(self.found),
            "sealed": list(self.sealed),
            "promoted": [{**asdict(h), "bytes_per_second": round(h.rate)}
                         for h in self.promoted],
            "kept": {k: list(v) for k, v in self.kept.items()},
            "removed": {k: list(v) for k, v in self.removed.items()},
            "pending": [dict(p) for p in self.pending],
            "failed": [{**asdict(f), "next_retry": iso_time(f.next_retry)} for f in self.failed],
            "newest_pending_age_seconds": {k: round(v, 3) for k, v in self.behind.items()},
            "unchanged_seconds": dict(self.unchanged),
        }

    def queued(self, tiers: list[str]) -> dict[str, int]:
        """How many checkpoints wait in each tier (every tier named, 0 included)."""
        out = dict.fromkeys(tiers, 0)
        for x in self.pending:
            out[x["tier"]] = out.get(x["tier"], 0) + 1
        return out


def on_its_way(why: str) -> bool:
    """Is a pending checkpoint's reason (``why``) one that time alone resolves, not a
    problem: ``settling`` (complete, its listing not yet unchanged for ``--settle``
    seconds), or ``waiting for`` the next tier or the other nodes? An ``incomplete`` or
    ``corrupt`` one is not: a save that died stays so.

    >>> on_its_way("settling"), on_its_way("waiting for warm"), on_its_way("incomplete")
    (True, True, False)
    """
    return why == "settling" or why.startswith("waiting for ")


def iso_time(ts: float | None) -> str | None:
    """A time (seconds since the epoch) as watch's documents write it: ISO-8601 UTC, as
    ``ls`` does.

    >>> iso_time(1000.0)
    '1970-01-01T00:16:40Z'
    """
    from ..catalog.ls import iso_utc

    return iso_utc(ts)
