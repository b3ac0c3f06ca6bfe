"""``plan``: the arithmetic behind the tiers (issue 11). How often to save, what it costs,
whether each tier hop drains before the next save, what each node needs, how long a
restart takes; plus :func:`measure_tier`, which times a bounded write and read at a tier.

Pure arithmetic except :func:`measure_tier` and :func:`checkpoint_size`. Units: bytes,
seconds, bytes per second. Every rate is one process's (one node's ``watch``, one
``--measure``): the first tier is node-local, so its hop out runs on all P nodes at once,
each moving S/P bytes; later hops, and a restart from a shared tier, move S bytes at the
tier's rate (conservative: as if the rate were the tier's total).

>>> r = plan(10**12, 60, 2.8 * 3600, nodes=128)
>>> round(r.optimal_interval_seconds, 1), round(r.overhead_optimal, 4)
(1099.8, 0.1091)
>>> r.node_bandwidth_bytes_per_second == 10**12 / (128 * r.interval_seconds)
True
"""
from __future__ import annotations

import math
import os
import secrets
import time
from dataclasses import asdict, dataclass, field

from ..errors import CkptError, NotFoundError, StorageError, UsageError

#: Default bounds of a ``--measure`` probe: at most this many bytes ...
MEASURE_BYTES = 64 << 20
#: ... and about this long for the write, and again for the read.
MEASURE_SECONDS = 5.0
_BLOCK = 4 << 20
DAY = 86400.0


def young_daly(save_seconds: float, mtbf_seconds: float) -> float:
    """The Young/Daly checkpoint interval tau* = sqrt(2 * C * MTBF), in seconds.

    >>> round(young_daly(60, 2.8 * 3600))      # C = 60 s, MTBF = 2.8 h (the issue's case)
    1100
    >>> young_daly(50, 10000)                  # sqrt(1e6)
    1000.0
    """
    return math.sqrt(2.0 * save_seconds * mtbf_seconds)


def overhead(save_seconds: float, interval_seconds: float, mtbf_seconds: float) -> float:
    """Expected fraction of time lost, C/tau + tau/(2 * MTBF): saving (C every tau) plus
    the work redone after a failure (half an interval on average).

    >>> overhead(50, 1000, 10000)              # 0.05 + 0.05
    0.1
    >>> overhead(60, 1800, 2.8 * 3600)         # doctest: +ELLIPSIS
    0.1226...
    """
    return save_seconds / interval_seconds + interval_seconds / (2.0 * mtbf_seconds)


def node_bandwidth(size_bytes: int, nodes: int, interval_seconds: float) -> float:
    """Bytes/s each node must drain its first tier at so a save is gone before the next:
    B >= S / (P * tau) (the issue's "B >= S/P", per interval).

    >>> node_bandwidth(10**12, 100, 1000)     # 10 GB per node in 1,000 s
    10000000.0
    """
    return size_bytes / (nodes * interval_seconds)


def local_capacity(size_bytes: int, nodes: int) -> int:
    """Bytes each node's first tier must hold: the current and the previous checkpoint's
    share, 2 * S / P (rounded up).

    >>> local_capacity(10**12, 128)
    15625000000
    >>> local_capacity(3, 2)
    3
    """
    return -(-2 * size_bytes // nodes)


def drain_seconds(nbytes: int | float, rate: float | None) -> float | None:
    """Seconds to move ``nbytes`` at ``rate`` bytes/s (None: the rate is unknown).

    >>> drain_seconds(10**9, 2 * 10**8), drain_seconds(10**9, None)
    (5.0, None)
    """
    return None if not rate else nbytes / rate


@dataclass
class Measurement:
    """What ``--measure`` timed at one tier: a write of ``write_bytes`` (made durable:
    fsynced, or the upload completed) and a read back of ``read_bytes``; rates in bytes/s.
    ``cache_dropped``: local reads were made after asking the kernel to drop the file's
    cached pages (else a local read may come from memory and read too fast)."""

    tier: str
    url: str
    write_bytes: int
    write_seconds: float
    read_bytes: int
    read_seconds: float
    cache_dropped: bool = False
    removed: bool = True

    @property
    def write_bytes_per_second(self) -> float | None:
        return self.write_bytes / self.write_seconds if self.write_seconds > 0 else None

    @property
    def read_bytes_per_second(self) -> float | None:
        return self.read_bytes / self.read_seconds if self.read_seconds > 0 else None

    def to_dict(self) -> dict:
        return {**asdict(self), "write_bytes_per_second": self.write_bytes_per_second,
                "read_bytes_per_second": self.read_bytes_per_second}


@dataclass
class TierInput:
    """One tier as plan sees it: its ``bwlimit`` (bytes/s, None: none) and, when
    ``--measure`` ran there, the :class:`Measurement`."""

    name: str
    url: str = ""
    bwlimit: float | None = None
    measured: Measurement | None = None


@dataclass
class Hop:
    """Draining one checkpoint from tier ``src`` to ``dst``: ``bytes`` per stream (S/P
    from the node-local first tier, run on every node at once; S later), the rate (the
    smallest known of dst's bwlimit, dst's measured write, src's measured read) and
    whether it fits in the interval."""

    src: str
    dst: str
    bytes: int
    streams: int
    bytes_per_second: float | None
    rate_source: str
    drain_seconds: float | None
    fits: bool | None


@dataclass
class Recovery:
    """Reading a checkpoint back from ``tier`` at restart: S/P per node from the first
    (node-local) tier, S from a shared one, at its measured read rate, else its bwlimit."""

    tier: str
    bytes: int
    bytes_per_second: float | None
    rate_source: str
    seconds: float | None


@dataclass
class PlanResult:
    """Every figure of ``ckptctl plan``; ``interval_seconds`` is the chosen interval when
    one was given, else the optimal one, and is what drains are checked against."""

    checkpoint_bytes: int
    nodes: int
    save_seconds: float
    mtbf_seconds: float
    optimal_interval_seconds: float
    chosen_interval_seconds: float | None
    interval_seconds: float
    overhead_optimal: float
    overhead_chosen: float | None
    node_bandwidth_bytes_per_second: float
    total_bandwidth_bytes_per_second: float
    local_capacity_bytes: int
    hops: list[Hop] = field(default_factory=list)
    recovery: list[Recovery] = field(default_factory=list)
    measured: list[Measurement] = field(default_factory=list)
    checkpoint_url: str | None = None

    @property
    def hours_lost_per_day_optimal(self) -> float:
        return self.overhead_optimal * 24

    @property
    def hours_lost_per_day_chosen(self) -> float | None:
        return None if self.overhead_chosen is None else self.overhead_chosen * 24

    @property
    def all_fit(self) -> bool | None:
        """False when a hop is known not to fit; None when some drain is unknown."""
        fits = [h.fits for h in self.hops]
        return False if False in fits else None if None in fits else True

    def to_dict(self) -> dict:
        return {
            "optimal_interval_seconds": self.optimal_interval_seconds,
            "chosen_interval_seconds": self.chosen_interval_seconds,
            "interval_seconds": self.interval_seconds,
            "checkpoint_url": self.checkpoint_url,
            "checkpoint_bytes": self.checkpoint_bytes,
            "nodes": self.nodes,
            "save_seconds": self.save_seconds,
            "mtbf_seconds": self.mtbf_seconds,
            "overhead_optimal": self.overhead_optimal,
            "overhead_chosen": self.overhead_chosen,
            "hours_lost_per_day_optimal": self.hours_lost_per_day_optimal,
            "hours_lost_per_day_chosen": self.hours_lost_per_day_chosen,
            "node_bandwidth_bytes_per_second": self.node_bandwidth_bytes_per_second,
            "total_bandwidth_bytes_per_second": self.total_bandwidth_bytes_per_second,
            "local_capacity_bytes": self.local_capacity_bytes,
            "all_fit": self.all_fit,
            "hops": [asdict(h) for h in self.hops],
            "recovery": [asdict(r) for r in self.recovery],
            "measured": [m.to_dict() for m in self.measured],
        }


def _slowest(*rates: tuple[float | None, str]) -> tuple[float | None, str]:
    known = [(r, why) for r, why in rates if r]
    return min(known, key=lambda x: x[0]) if known else (None, "unknown")


def plan(size_bytes: int, save_seconds: float, mtbf_seconds: float, *, nodes: int = 1,
         interval_seconds: float | None = None, tiers: list[TierInput] | tuple = (),
         checkpoint_url: str | None = None) -> PlanResult:
    """Every figure for a checkpoint of ``size_bytes`` on ``nodes`` nodes that blocks
    training ``save_seconds`` per save, with failures every ``mtbf_seconds`` on average,
    over ``tiers`` (hottest first; the first is node-local). Inputs out of range are a
    UsageError.

    >>> r = plan(4 * 10**11, 50, 10000, nodes=4, interval_seconds=2000,
    ...          tiers=[TierInput("hot"), TierInput("warm", bwlimit=2e8)])
    >>> r.optimal_interval_seconds, r.overhead_optimal, r.overhead_chosen
    (1000.0, 0.1, 0.125)
    >>> h = r.hops[0]; (h.bytes, h.bytes_per_second, h.drain_seconds, h.fits)
    (100000000000, 200000000.0, 500.0, True)
    >>> r.node_bandwidth_bytes_per_second, r.local_capacity_bytes
    (50000000.0, 200000000000)
    >>> plan(1, 0, 10)
    Traceback (most recent call last):
    ckptctl.errors.UsageError: --save-seconds must be more than 0, not 0
    """
    _positive(size_bytes, "the checkpoint size")
    _positive(save_seconds, "--save-seconds")
    _positive(mtbf_seconds, "--mtbf")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise UsageError(f"--nodes must be a whole number >= 1, not {nodes!r}")
    if interval_seconds is not None:
        _positive(interval_seconds, "--interval")
    best = young_daly(save_seconds, mtbf_seconds)
    tau = interval_seconds if interval_seconds is not None else best
    hops, recovery = drains(size_bytes, tiers, nodes=nodes, interval_seconds=tau)
    return PlanResult(
        size_bytes, nodes, float(save_seconds), float(mtbf_seconds), best,
        None if interval_seconds is None else float(interval_seconds), float(tau),
        overhead(save_seconds, best, mtbf_seconds),
        None if interval_seconds is None else overhead(save_seconds, tau, mtbf_seconds),
        node_bandwidth(size_bytes, nodes, tau), size_bytes / tau,
        local_capacity(size_bytes, nodes), hops, recovery,
        [t.measured for t in tiers if t.measured], checkpoint_url)


def drains(size_bytes: int, tiers: list[TierInput] | tuple, *, nodes: int = 1,
           interval_seconds: float | None = None) -> tuple[list[Hop], list[Recovery]]:
    """The tier hops of a checkpoint of ``size_bytes`` (each checked against
    ``interval_seconds`` when given) and the recovery from each tier, as :func:`plan`
    reports them; ``watch --status`` calls it with the rates watch measured.

    >>> hops, rec = drains(10**9, [TierInput("hot"), TierInput("warm", bwlimit=1e8)],
    ...                    interval_seconds=5)
    >>> (hops[0].drain_seconds, hops[0].fits), [r.seconds for r in rec]
    ((10.0, False), [None, 10.0])
    """
    tau = interval_seconds
    tiers = list(tiers)
    hops = []
    for i in range(1, len(tiers)):
        src, dst = tiers[i - 1], tiers[i]
        rate, why = _slowest(
            (dst.bwlimit, f"{dst.name} bwlimit"),
            (dst.measured.write_bytes_per_second if dst.measured else None,
             f"{dst.name} measured write"),
            (src.measured.read_bytes_per_second if src.measured else None,
             f"{src.name} measured read"))
        streams = nodes if i == 1 else 1
        nbytes = -(-size_bytes // streams)
        t = drain_seconds(nbytes, rate)
        hops.append(Hop(src.name, dst.name, nbytes, streams, rate, why, t,
                        None if t is None or tau is None else t <= tau))
    recovery = []
    for i, t in enumerate(tiers):
        rate, why = _slowest(
            (t.measured.read_bytes_per_second if t.measured else None,
             f"{t.name} measured read"))
        if rate is None:
            rate, why = _slowest((t.bwlimit, f"{t.name} bwlimit"))
        nbytes = -(-size_bytes // nodes) if i == 0 else size_bytes
        recovery.append(Recovery(t.name, nbytes, rate, why, drain_seconds(nbytes, rate)))
    return hops, recovery


def _positive(value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise UsageError(f"{what} must be more than 0, not {value!r}")


def checkpoint_size(url: str, storage_options: dict | None = None) -> tuple[str, int]:
    """(checkpoint URL, bytes) of the checkpoint at ``url`` from its listing (``ls``'s
    sizes: every file, the pin file excluded). A folder holding several checkpoints gives
    its newest committed one (``latest``'s order); none at all is exit 3.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp(), "step-1"); d.mkdir()
    >>> checkpoint_size(str(d))                 # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ckptctl.errors.NotFoundError: ...: no checkpoint to size (ckptctl ls lists none)
    """
    from .ls import ls

    rows = ls(url, storage_options).checkpoints
    committed = [r for r in rows if r.state in ("sealed", "complete")]
    if not rows:
        raise NotFoundError(url, "no checkpoint to size (ckptctl ls lists none)")
    row = (committed or rows)[-1]  # ls sorts by step, then name: the last is the newest
    return row.url, int(row.bytes)


def measure_tier(tier, *, size: int = MEASURE_BYTES, seconds: float = MEASURE_SECONDS,
                 clock=time.monotonic) -> Measurement:
    """Time a write of at most ``size`` random bytes to ``.ckptctl-probe-<random>`` at the
    root of ``tier`` (a :class:`~ckptctl.config.Tier`), stopping early once ``seconds``
    have passed, then a read of it back (same bounds), then remove it; a local root that
    did not exist is removed again. Any failure is one StorageError (exit 3) naming the
    tier; the probe is removed in every case.

    >>> import tempfile, os
    >>> from ckptctl.config import Tier
    >>> d = tempfile.mkdtemp()
    >>> m = measure_tier(Tier("hot", d), size=3 << 20)
    >>> (m.write_bytes, m.read_bytes, m.removed, os.listdir(d))
    (3145728, 3145728, True, [])
    """
    from ..storage import open_store
    from .tiers import PROBE_PREFIX, missing_dirs

    if size <= 0 or seconds <= 0:
        raise UsageError("--measure-size and --measure-seconds must be more than 0")
    store = None
    rel = PROBE_PREFIX + secrets.token_hex(8)
    made: list[str] = []
    written = 0
    try:
        store = open_store(tier.url, tier.storage_options)
        made = missing_dirs(store.root) if store.is_local else []
        block = secrets.token_bytes(min(_BLOCK, size))
        start = clock()

        def blocks():
            nonlocal written
            n = 0
            while written < size and (n == 0 or clock() - start < seconds):
                k = min(len(block), size - written)
                # a different first 8 bytes per block: no two blocks alike (dedup, compression)
                yield n.to_bytes(8, "little") + block[8:k] if k > 8 else block[:k]
                written += k
                n += 1

        _, total = store.write_file(rel, blocks(), algo=None)
        write_s = clock() - start
        dropped = _drop_cache(store.local_path(rel)) if store.is_local else False
        start = clock()
        got = 0
        for b in store.iter_blocks(rel, block=_BLOCK):
            got += len(b) if not isinstance(b, memoryview) else b.nbytes
            if clock() - start >= seconds:
                break
        read_s = clock() - start
    except CkptError as e:
        raise StorageError(tier.url, f"cannot measure tier {tier.name}: {e.message}",
                           code=str(e.code)) from None
    except OSError as e:
        raise StorageError(tier.url, f"cannot measure tier {tier.name}: "
                           f"{e.strerror or type(e).__name__}") from None
    finally:
        removed = _remove_probe(store, rel, made)
    if not removed:
        raise StorageError(tier.url, f"measured tier {tier.name}, but could not remove "
                           f"the probe {rel}")
    return Measurement(tier.name, tier.url, int(total), write_s, got, read_s, dropped, True)


def _drop_cache(path: str | None) -> bool:
    """Ask Linux to drop the (clean, fsynced) cached pages of ``path``; False where it
    cannot."""
    if not path or not hasattr(os, "posix_fadvise"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _remove_probe(store, rel: str, made: list[str]) -> bool:
    if store is None:
        return True
    try:
        store.remove(rel)
        gone = not store.exists(rel)
    except CkptError:
        gone = False
    for d in made:  # deepest first; only folders the probe made, and only if empty
        try:
            os.rmdir(d)
        except OSError:
            break
    return gone
