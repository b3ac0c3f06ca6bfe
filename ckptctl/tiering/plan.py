"""``plan``: the arithmetic behind the tiers (issues 11 and 21). How often to save, what it
costs, whether each tier hop drains before the next save, what each node needs, how long
a restart takes; plus :func:`measure_tier`, which times a bounded write and read at a tier.

Pure arithmetic except :func:`measure_tier` and :func:`checkpoint_size`. Units: bytes,
seconds, bytes per second. Every rate is one process's (one node's ``watch``, one
``--measure``): the first tier is node-local, so its hop out runs on all P nodes at once,
each moving S/P bytes; later hops, and a restart from a shared tier, move S bytes at the
tier's rate (conservative: as if the rate were the tier's total).

The model (C the seconds one save blocks training, M the system MTBF, tau the compute
time between saves; failures exponential, and they can strike during a save too):

* interval: Young's first-order tau* = sqrt(2 C M) while C/M <= :data:`FIRST_ORDER_RATIO`,
  else Daly's higher-order estimate (:func:`daly`; J. T. Daly, "A higher order estimate
  of the optimum checkpoint interval for restart dumps", FGCS 22(3), 2006);
* cost: Daly's expected wall-clock time, T_w = M (e^((tau+C)/M) - 1) per tau of work
  (:func:`expected_efficiency`), which holds at any C, tau and M: the time lost is
  1 - tau/T_w, never more than all of it (the first-order C/tau + tau/(2M) of
  :func:`overhead` passes 100% once tau or C nears M);
* refusal: C >= M, or an expected efficiency below :data:`MIN_EFFICIENCY` at the best
  interval: no interval makes useful progress (a UsageError, exit 2).

>>> r = plan(10**12, 60, 2.8 * 3600, nodes=128)
>>> round(r.optimal_interval_seconds, 1), r.interval_formula, round(r.overhead_optimal, 4)
(1099.8, 'young', 0.1052)
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
#: Up to this C/M Young's first-order interval is used (at 0.1 its expected efficiency is
#: within 0.3 points of the model's optimum); above it, Daly's, with a warning.
FIRST_ORDER_RATIO = 0.1
#: Below this expected efficiency at the best interval (reached near C/M = 0.65), plan
#: refuses: more than three quarters of the machine's time would be lost whatever the
#: interval.
MIN_EFFICIENCY = 0.25


def young_daly(save_seconds: float, mtbf_seconds: float) -> float:
    """Young's first-order checkpoint interval tau* = sqrt(2 * C * MTBF), in seconds
    (holds while C is small against the MTBF; :func:`daly` is the higher-order one).

    >>> round(young_daly(60, 2.8 * 3600))      # C = 60 s, MTBF = 2.8 h (the issue's case)
    1100
    >>> young_daly(50, 10000)                  # sqrt(1e6)
    1000.0
    """
    return math.sqrt(2.0 * save_seconds * mtbf_seconds)


def daly(save_seconds: float, mtbf_seconds: float) -> float:
    """Daly's higher-order optimum interval (FGCS 2006): with r = C / (2 M),
    sqrt(2 C M) (1 + sqrt(r)/3 + r/9) - C for C < 2 M, else M. It tends to Young's
    sqrt(2 C M) as C/M -> 0 and stays near the exact optimum of Daly's cost model where
    Young's does not.

    >>> daly(50, 10000)                        # 1000 (1 + 0.05/3 + 0.0025/9) - 50
    966.9444444444445
    >>> daly(20000, 10000), daly(30000, 10000)  # C >= 2M: tau = M
    (10000, 10000)
    """
    c, m = save_seconds, mtbf_seconds
    if c >= 2 * m:
        return m
    r = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - c


def expected_efficiency(save_seconds: float, interval_seconds: float, mtbf_seconds: float,
                        restart_seconds: float = 0.0) -> float:
    """Expected fraction of wall-clock time that is training, in Daly's model (FGCS
    2006): tau of work costs M e^(R/M) (e^((tau+C)/M) - 1) of wall-clock time with
    exponential failures of mean M that can strike during a save or a restart (R).
    Always in [0, 1); 1 - it is :func:`expected_overhead`.

    >>> round(expected_efficiency(50, 1000, 10000), 4)   # 0.1 / (e^0.105 - 1)
    0.9033
    >>> expected_efficiency(60, 86400 * 365, 3600)        # an interval of years: nothing
    0.0
    """
    c, t, m = save_seconds, interval_seconds, mtbf_seconds
    x = (t + c) / m
    if x > 700:  # e^x overflows; the efficiency is 0 to double precision well before
        return 0.0
    return (t / m) * math.exp(-restart_seconds / m) / math.expm1(x)


def expected_overhead(save_seconds: float, interval_seconds: float, mtbf_seconds: float,
                      restart_seconds: float = 0.0) -> float:
    """Expected fraction of wall-clock time lost (saving, and redoing the work since the
    last save after each failure), 1 - :func:`expected_efficiency`: in [0, 1], so the time
    lost per day is never more than a day.

    >>> round(expected_overhead(50, 1000, 10000), 4), expected_overhead(3600, 86400, 60)
    (0.0967, 1.0)
    """
    return 1.0 - expected_efficiency(save_seconds, interval_seconds, mtbf_seconds,
                                     restart_seconds)


def overhead(save_seconds: float, interval_seconds: float, mtbf_seconds: float) -> float:
    """First-order fraction of time lost, C/tau + tau/(2 * MTBF): saving (C every tau)
    plus the work redone after a failure (half an interval on average). Holds only while
    C and tau are small against the MTBF (it passes 1 beyond): :func:`plan` reports
    :func:`expected_overhead`.

    >>> overhead(50, 1000, 10000)              # 0.05 + 0.05
    0.1
    >>> overhead(60, 1800, 2.8 * 3600)         # doctest: +ELLIPSIS
    0.1226...
    """
    return save_seconds / interval_seconds + interval_seconds / (2.0 * mtbf_seconds)


def overhead_curve(save_seconds: float, mtbf_seconds: float, *, chosen: float | None = None,
                   points: int = 81, span: float = 10.0) -> dict:
    """The expected overhead (:func:`expected_overhead`: saving plus the work redone after
    failures, as a fraction of wall-clock time) against the checkpoint interval, for a
    chart: what ``plan --plot`` draws and the HTML report's plan chart reads.

    The optimal interval tau* is :func:`plan`'s (Young's while C/M <=
    :data:`FIRST_ORDER_RATIO`, else :func:`daly`'s). ``points`` intervals are sampled
    evenly on a log scale from tau*/``span`` to tau* x ``span`` (with an odd count, tau*
    itself is the middle one), widened to a factor 2 beyond ``chosen`` where that falls
    outside. Returns a JSON-ready dict:

    * ``intervals_seconds``, ``overheads``: the samples, in increasing interval;
    * ``optimal``: ``{"interval_seconds", "overhead", "formula"}`` (``young``/``daly``);
    * ``chosen``: ``{"interval_seconds", "overhead"}`` for ``chosen``, else None;
    * ``save_seconds``, ``mtbf_seconds``, and ``model`` (``daly``: Daly's expected
      wall-clock model, the one :func:`plan`'s overheads come from).

    >>> c = overhead_curve(50, 10000, points=5, chosen=2000)
    >>> [round(t) for t in c["intervals_seconds"]]
    [100, 316, 1000, 3162, 10000]
    >>> [round(x, 3) for x in c["overheads"]]
    [0.338, 0.152, 0.097, 0.165, 0.423]
    >>> o = c["optimal"]; o["interval_seconds"], round(o["overhead"], 4), o["formula"]
    (1000.0, 0.0967, 'young')
    >>> c["chosen"]["interval_seconds"], round(c["chosen"]["overhead"], 4)  # as plan's
    (2000.0, 0.121)
    >>> overhead_curve(50, 10000, points=3, chosen=20)["intervals_seconds"][0]  # widened
    10.0
    """
    _positive(save_seconds, "--save-seconds")
    _positive(mtbf_seconds, "--mtbf")
    if chosen is not None:
        _positive(chosen, "--interval")
    if isinstance(points, bool) or not isinstance(points, int) or points < 2:
        raise UsageError(f"points must be a whole number >= 2, not {points!r}")
    if not span > 1:
        raise UsageError(f"span must be more than 1, not {span!r}")
    c, m = float(save_seconds), float(mtbf_seconds)
    formula, best = ("young", young_daly(c, m)) if c / m <= FIRST_ORDER_RATIO \
        else ("daly", daly(c, m))
    lo, hi = math.log10(best / span), math.log10(best * span)
    centred = chosen is None or best / span <= chosen <= best * span
    if not centred:
        lo = min(lo, math.log10(chosen / 2.0))
        hi = max(hi, math.log10(chosen * 2.0))
    xs = [10 ** (lo + (hi - lo) * i / (points - 1)) for i in range(points)]
    if points % 2 and centred:
        xs[points // 2] = best  # exactly, not 10 ** log10(best)
    return {
        "model": "daly",
        "save_seconds": c,
        "mtbf_seconds": m,
        "intervals_seconds": xs,
        "overheads": [expected_overhead(c, x, m) for x in xs],
        "optimal": {"interval_seconds": best, "overhead": expected_overhead(c, best, m),
                    "formula": formula},
        "chosen": None if chosen is None else {
            "interval_seconds": float(chosen),
            "overhead": expected_overhead(c, float(chosen), m)},
    }


def system_mtbf(node_mtbf_seconds: float, nodes: int) -> float:
    """The job's MTBF from a per-node one (as vendors quote it): with independent
    exponential failures, P nodes fail P times as often, M = node MTBF / P.

    >>> system_mtbf(5 * 365 * 86400, 128) / 3600    # 5 years per node, 128 nodes: 342 h
    342.1875
    """
    return node_mtbf_seconds / nodes


def nodes_from_gpus(nodes: int | None = None, gpus: int | None = None,
                    gpus_per_node: int | None = None) -> int:
    """P, the nodes a checkpoint is spread over, from ``--nodes``, or ``--gpus`` and
    ``--gpus-per-node`` (P = ceil(GPUs / per node)); 1 when none is given. A count that
    is not a whole number >= 1, and any two that contradict each other, are a UsageError.

    >>> nodes_from_gpus(), nodes_from_gpus(4), nodes_from_gpus(None, 64, 8), nodes_from_gpus(None, 60, 8)
    (1, 4, 8, 8)
    >>> nodes_from_gpus(8, 64, 8), nodes_from_gpus(8, 64), nodes_from_gpus(8, None, 4)
    (8, 8, 8)
    >>> nodes_from_gpus(4, 64, 8)
    Traceback (most recent call last):
    ckptctl.errors.UsageError: --nodes 4 contradicts --gpus 64 at --gpus-per-node 8 (8 nodes): give --nodes, or --gpus and --gpus-per-node
    """
    for flag, n in (("--nodes", nodes), ("--gpus", gpus), ("--gpus-per-node", gpus_per_node)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise UsageError(f"{flag} must be a whole number >= 1, not {n!r}")
    if gpus is not None and gpus_per_node is not None:
        derived = -(-gpus // gpus_per_node)
        if nodes is not None and nodes != derived:
            raise UsageError(f"--nodes {nodes} contradicts --gpus {gpus} at --gpus-per-node "
                             f"{gpus_per_node} ({derived} node{'s' if derived != 1 else ''}):"
                             " give --nodes, or --gpus and --gpus-per-node")
        return derived
    if gpus is not None:
        if nodes is None:
            raise UsageError(f"--gpus {gpus} needs --gpus-per-node K (nodes = ceil(GPUs / K))"
                             " or --nodes P")
        if gpus < nodes:
            raise UsageError(f"--gpus {gpus} cannot fill --nodes {nodes}: fewer GPUs than "
                             "nodes")
    elif gpus_per_node is not None and nodes is None:
        raise UsageError(f"--gpus-per-node {gpus_per_node} needs --gpus N (nodes = ceil(N / "
                         f"{gpus_per_node})) or --nodes P")
    return 1 if nodes is None else nodes


def save_seconds_from_bandwidth(size_bytes: int, nodes: int, node_bytes_per_second: float
                                ) -> float:
    """C from one node's write bandwidth to the first tier: every node writes its S/P at
    once, C = S / (P B). A lower bound of the real save (serialisation, the barrier).

    >>> save_seconds_from_bandwidth(10**12, 128, 2e9)  # 7.8 GB per node at 2 GB/s
    3.90625
    """
    return size_bytes / (nodes * node_bytes_per_second)


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
    #: what the rates were measured on when not this tier's own test object (watch: the
    #: hop into it, the hop out of it); the figures' "rate from" column names it
    write_source: str = ""
    read_source: str = ""

    @property
    def write_bytes_per_second(self) -> float | None:
        return self.write_bytes / self.write_seconds if self.write_seconds > 0 else None

    @property
    def read_bytes_per_second(self) -> float | None:
        return self.read_bytes / self.read_seconds if self.read_seconds > 0 else None

    def to_dict(self) -> dict:
        doc = {k: v for k, v in asdict(self).items()
               if k not in ("write_source", "read_source") or v}
        return {**doc, "write_bytes_per_second": self.write_bytes_per_second,
                "read_bytes_per_second": self.read_bytes_per_second}

    def source(self, what: str) -> str:
        """Where the ``write`` or ``read`` rate comes from, for the "rate from" column.

        >>> Measurement("warm", "", 1, 1.0, 1, 1.0).source("write")
        'warm measured write'
        """
        return getattr(self, f"{what}_source") or f"{self.tier} measured {what}"


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
    whether it fits in the interval.

    ``rate_kind``: ``measured`` when both ends were measured (src's read and dst's write;
    a bwlimit may cap them); ``ceiling`` when only a bwlimit or one end is known: the real
    rate may be lower, so ``drain_seconds`` is the shortest the drain can take, and
    ``fits`` is only ever False (not even the ceiling is fast enough) or None; ``unknown``
    when nothing is known. ``fits`` is True only for a ``measured`` rate."""

    src: str
    dst: str
    bytes: int
    streams: int
    bytes_per_second: float | None
    rate_source: str
    drain_seconds: float | None
    fits: bool | None
    rate_kind: str = "unknown"


@dataclass
class Recovery:
    """Reading a checkpoint back from ``tier`` at restart: S/P per node from the first
    (node-local) tier, S from a shared one, at its measured read rate, else its bwlimit
    (a ceiling: ``seconds`` is then the shortest the read can take)."""

    tier: str
    bytes: int
    bytes_per_second: float | None
    rate_source: str
    seconds: float | None

    @property
    def rate_kind(self) -> str:
        """``measured``, ``ceiling`` (a bwlimit) or ``unknown``, as :class:`Hop`'s.

        >>> Recovery("warm", 1, 2.0, "warm bwlimit", 0.5).rate_kind
        'ceiling'
        """
        if not self.bytes_per_second:
            return "unknown"
        return "measured" if "measured" in self.rate_source else "ceiling"


@dataclass
class PlanResult:
    """Every figure of ``ckptctl plan``; ``interval_seconds`` is the chosen interval when
    one was given, else the optimal one, and is what drains are checked against.
    Overheads and efficiencies are Daly's expected wall-clock model's
    (:func:`expected_overhead`); ``interval_formula`` says which interval the optimal one
    is (``young`` or ``daly``); ``mtbf_source`` (``system``: ``--mtbf``; ``node``:
    ``--node-mtbf`` / P) and ``save_source`` (``save-seconds``, ``write-bandwidth``) where
    M and C came from; ``warnings`` one line each."""

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
    interval_formula: str = "young"
    young_interval_seconds: float = 0.0
    mtbf_source: str = "system"
    node_mtbf_seconds: float | None = None
    save_source: str = "save-seconds"
    node_write_bytes_per_second: float | None = None
    warnings: list[str] = field(default_factory=list)
    #: what P came from, when given: all GPUs, and GPUs per node
    gpus: int | None = None
    gpus_per_node: int | None = None

    @property
    def rates_unknown(self) -> bool:
        """No tier hop has a rate (no bwlimit, nothing measured): no drain can be checked.

        >>> plan(10**12, 60, 10080, tiers=[TierInput("hot"), TierInput("warm")]).rates_unknown
        True
        """
        return bool(self.hops) and all(h.bytes_per_second is None for h in self.hops)

    @property
    def save_mtbf_ratio(self) -> float:
        """C / M: the first-order (Young) interval holds while it is small."""
        return self.save_seconds / self.mtbf_seconds

    @property
    def efficiency_optimal(self) -> float:
        return 1.0 - self.overhead_optimal

    @property
    def efficiency_chosen(self) -> float | None:
        return None if self.overhead_chosen is None else 1.0 - self.overhead_chosen

    @property
    def hours_lost_per_day_optimal(self) -> float:
        return self.overhead_optimal * 24

    @property
    def hours_lost_per_day_chosen(self) -> float | None:
        return None if self.overhead_chosen is None else self.overhead_chosen * 24

    @property
    def all_fit(self) -> bool | None:
        """False when a hop is known not to fit; None when some drain is unknown (or
        there are no hops: nothing was checked); True when every hop fits."""
        fits = [h.fits for h in self.hops]
        if not fits:
            return None
        return False if False in fits else None if None in fits else True

    def to_dict(self) -> dict:
        """The ``--json`` document: rates in whole bytes per second (the JSON vocabulary's
        integers), durations in seconds, sizes in bytes."""
        rates = ("bytes_per_second", "write_bytes_per_second", "read_bytes_per_second")

        def whole(d: dict) -> dict:
            return {k: whole_rate(v) if k in rates else v for k, v in d.items()}

        return {
            "optimal_interval_seconds": self.optimal_interval_seconds,
            "interval_formula": self.interval_formula,
            "young_interval_seconds": self.young_interval_seconds,
            "chosen_interval_seconds": self.chosen_interval_seconds,
            "interval_seconds": self.interval_seconds,
            "checkpoint_url": self.checkpoint_url,
            "checkpoint_bytes": self.checkpoint_bytes,
            "nodes": self.nodes,
            "gpus": self.gpus,
            "gpus_per_node": self.gpus_per_node,
            "save_seconds": self.save_seconds,
            "save_source": self.save_source,
            "node_write_bytes_per_second": whole_rate(self.node_write_bytes_per_second),
            "mtbf_seconds": self.mtbf_seconds,
            "mtbf_source": self.mtbf_source,
            "node_mtbf_seconds": self.node_mtbf_seconds,
            "save_mtbf_ratio": self.save_mtbf_ratio,
            "overhead_model": "daly",
            "overhead_optimal": self.overhead_optimal,
            "overhead_chosen": self.overhead_chosen,
            "efficiency_optimal": self.efficiency_optimal,
            "efficiency_chosen": self.efficiency_chosen,
            "hours_lost_per_day_optimal": self.hours_lost_per_day_optimal,
            "hours_lost_per_day_chosen": self.hours_lost_per_day_chosen,
            "node_bandwidth_bytes_per_second": whole_rate(self.node_bandwidth_bytes_per_second),
            "total_bandwidth_bytes_per_second": whole_rate(self.total_bandwidth_bytes_per_second),
            "local_capacity_bytes": self.local_capacity_bytes,
            "all_fit": self.all_fit,
            "hops": [whole(asdict(h)) for h in self.hops],
            "recovery": [whole({**asdict(r), "rate_kind": r.rate_kind})
                         for r in self.recovery],
            "measured": [whole(m.to_dict()) for m in self.measured],
            "warnings": list(self.warnings),
        }


def whole_rate(rate: float | None) -> int | None:
    """A rate for JSON: whole bytes per second (None stays None).

    >>> whole_rate(7103446.94778621), whole_rate(None)
    (7103447, None)
    """
    return None if rate is None else int(round(rate))


def _slowest(*rates: tuple[float | None, str]) -> tuple[float | None, str]:
    known = [(r, why) for r, why in rates if r]
    return min(known, key=lambda x: x[0]) if known else (None, "unknown")


def _pct(x: float) -> str:
    return f"{x:.0%}" if x >= 0.1 else f"{x * 100:.2g}%"


def plan(size_bytes: int, save_seconds: float | None = None,
         mtbf_seconds: float | None = None, *, nodes: int | None = None,
         interval_seconds: float | None = None, tiers: list[TierInput] | tuple = (),
         checkpoint_url: str | None = None, node_mtbf_seconds: float | None = None,
         node_write_bytes_per_second: float | None = None, gpus: int | None = None,
         gpus_per_node: int | None = None) -> PlanResult:
    """Every figure for a checkpoint of ``size_bytes`` on ``nodes`` nodes (or ``gpus`` at
    ``gpus_per_node``: :func:`nodes_from_gpus`; default 1) that blocks
    training ``save_seconds`` per save (or S / (P ``node_write_bytes_per_second``)), with
    failures every ``mtbf_seconds`` on average (or ``node_mtbf_seconds`` / P), over
    ``tiers`` (hottest first; the first is node-local). Inputs out of range, both or
    neither of a pair, and a save time no interval makes progress at are a UsageError.

    >>> r = plan(4 * 10**11, 50, 10000, nodes=4, interval_seconds=2000,
    ...          tiers=[TierInput("hot"), TierInput("warm", bwlimit=2e8)])
    >>> r.optimal_interval_seconds, round(r.overhead_optimal, 4), round(r.overhead_chosen, 4)
    (1000.0, 0.0967, 0.121)
    >>> h = r.hops[0]; (h.bytes, h.bytes_per_second, h.drain_seconds, h.rate_kind, h.fits)
    (100000000000, 200000000.0, 500.0, 'ceiling', None)
    >>> r.node_bandwidth_bytes_per_second, r.local_capacity_bytes
    (50000000.0, 200000000000)
    >>> plan(10**12, 60, node_mtbf_seconds=5 * 365 * 86400, nodes=128).mtbf_seconds
    1231875.0
    >>> plan(1, 0, 10)
    Traceback (most recent call last):
    ckptctl.errors.UsageError: --save-seconds must be more than 0, not 0
    >>> plan(10**12, 3600, 3600)               # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ckptctl.errors.UsageError: save time C = 3600 s is 100% of the MTBF M = 3600 s: ...
    """
    _positive(size_bytes, "the checkpoint size")
    nodes = nodes_from_gpus(nodes, gpus, gpus_per_node)
    if (save_seconds is None) == (node_write_bytes_per_second is None):
        raise UsageError("give one of --save-seconds C and --write-bandwidth RATE"
                         if save_seconds is not None else
                         "give --save-seconds C (seconds one save blocks training) or "
                         "--write-bandwidth RATE (one node's write rate to the first tier)")
    if (mtbf_seconds is None) == (node_mtbf_seconds is None):
        raise UsageError("give one of --mtbf (the job's) and --node-mtbf (one node's)"
                         if mtbf_seconds is not None else
                         "give --mtbf DUR (the job's mean time between failures, e.g. "
                         "2.8h) or --node-mtbf DUR (one node's, e.g. 5y)")
    if node_write_bytes_per_second is not None:
        _positive(node_write_bytes_per_second, "--write-bandwidth")
        save_seconds = save_seconds_from_bandwidth(size_bytes, nodes,
                                                   node_write_bytes_per_second)
    _positive(save_seconds, "--save-seconds")
    if node_mtbf_seconds is not None:
        _positive(node_mtbf_seconds, "--node-mtbf")
        mtbf_seconds = system_mtbf(node_mtbf_seconds, nodes)
    _positive(mtbf_seconds, "--mtbf")
    if interval_seconds is not None:
        _positive(interval_seconds, "--interval")
    c, m = float(save_seconds), float(mtbf_seconds)
    ratio = c / m
    young = young_daly(c, m)
    formula, best = ("young", young) if ratio <= FIRST_ORDER_RATIO else ("daly", daly(c, m))
    eff_best = expected_efficiency(c, best, m)
    if ratio >= 1 or eff_best < MIN_EFFICIENCY:
        raise UsageError(
            f"save time C = {c:g} s is {_pct(ratio)} of the MTBF M = {m:g} s: no checkpoint "
            f"interval makes useful progress (at best {_pct(eff_best)} of the time trains; "
            f"plan refuses below {MIN_EFFICIENCY:.0%}): shorten the save or raise the MTBF")
    warnings = []
    if formula == "daly":
        warnings.append(
            f"save time C is {_pct(ratio)} of the MTBF (C/M = {ratio:.3g} > "
            f"{FIRST_ORDER_RATIO:g}): the first-order (Young) interval does not hold; "
            "Daly's higher-order interval is used")
    tau = float(interval_seconds) if interval_seconds is not None else best
    if interval_seconds is not None and tau > m:
        warnings.append(
            f"the chosen interval is {tau / m:.3g} x the MTBF: most intervals end in a "
            f"failure (expected efficiency {_pct(expected_efficiency(c, tau, m))})")
    hops, recovery = drains(size_bytes, tiers, nodes=nodes, interval_seconds=tau)
    return PlanResult(
        size_bytes, nodes, c, m, best,
        None if interval_seconds is None else tau, tau,
        1.0 - eff_best,
        None if interval_seconds is None else expected_overhead(c, tau, m),
        node_bandwidth(size_bytes, nodes, tau), size_bytes / tau,
        local_capacity(size_bytes, nodes), hops, recovery,
        [t.measured for t in tiers if t.measured], checkpoint_url,
        interval_formula=formula, young_interval_seconds=young,
        mtbf_source="system" if node_mtbf_seconds is None else "node",
        node_mtbf_seconds=None if node_mtbf_seconds is None else float(node_mtbf_seconds),
        save_source="save-seconds" if node_write_bytes_per_second is None
        else "write-bandwidth",
        node_write_bytes_per_second=None if node_write_bytes_per_second is None
        else float(node_write_bytes_per_second),
        warnings=warnings, gpus=gpus if gpus is not None else
        None if gpus_per_node is None else nodes * gpus_per_node, gpus_per_node=gpus_per_node)


def drains(size_bytes: int, tiers: list[TierInput] | tuple, *, nodes: int = 1,
           interval_seconds: float | None = None) -> tuple[list[Hop], list[Recovery]]:
    """The tier hops of a checkpoint of ``size_bytes`` (each checked against
    ``interval_seconds`` when given) and the recovery from each tier, as :func:`plan`
    reports them; ``watch --status`` calls it with the rates watch measured. A hop fits
    only at a measured rate (both ends); at a ceiling (a bwlimit, or one end measured) it
    is either known not to fit or unknown (see :class:`Hop`).

    >>> hops, rec = drains(10**9, [TierInput("hot"), TierInput("warm", bwlimit=1e8)],
    ...                    interval_seconds=5)
    >>> (hops[0].drain_seconds, hops[0].rate_kind, hops[0].fits), [r.seconds for r in rec]
    ((10.0, 'ceiling', False), [None, 10.0])
    >>> drains(10**9, [TierInput("hot"), TierInput("warm", bwlimit=1e9)],
    ...        interval_seconds=5)[0][0].fits is None  # 1 s at best, if warm does 1 GB/s
    True
    """
    tau = interval_seconds
    tiers = list(tiers)
    hops = []
    for i in range(1, len(tiers)):
        src, dst = tiers[i - 1], tiers[i]
        read = src.measured.read_bytes_per_second if src.measured else None
        write = dst.measured.write_bytes_per_second if dst.measured else None
        rate, why = _slowest((dst.bwlimit, f"{dst.name} bwlimit"),
                             (write, dst.measured.source("write") if dst.measured else ""),
                             (read, src.measured.source("read") if src.measured else ""))
        kind = "unknown" if rate is None else "measured" if read and write else "ceiling"
        streams = nodes if i == 1 else 1
        nbytes = -(-size_bytes // streams)
        t = drain_seconds(nbytes, rate)
        if t is None or tau is None:
            fits = None
        elif kind == "measured":
            fits = t <= tau
        else:  # a ceiling: the real drain takes at least t
            fits = False if t > tau else None
        hops.append(Hop(src.name, dst.name, nbytes, streams, rate, why, t, fits, kind))
    recovery = []
    for i, t in enumerate(tiers):
        rate, why = _slowest(
            (t.measured.read_bytes_per_second if t.measured else None,
             t.measured.source("read") if t.measured else ""))
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
    from ..catalog.ls import ls

    rows = ls(url, storage_options).checkpoints
    committed = [r for r in rows if r.state in ("sealed", "complete")]
    if not rows:
        raise NotFoundError(url, "no checkpoint to size (ckptctl ls lists none)")
    row = (committed or rows)[-1]  # ls sorts by step, then name: the last is the newest
    return row.url, int(row.bytes)


def measure_tier(tier, *, size: int = MEASURE_BYTES, seconds: float = MEASURE_SECONDS,
                 clock=time.monotonic) -> Measurement:
    """Time a write of at most ``size`` random bytes to ``.ckptctl-probe-<random>`` at the
    root of ``tier`` (a :class:`~ckptctl.tiering.config.Tier`), stopping early once ``seconds``
    have passed, then a read of it back (same bounds), then remove it; a local root that
    did not exist is removed again. Any failure is one StorageError (exit 3) naming the
    tier; the probe is removed in every case.

    >>> import tempfile, os
    >>> from ckptctl.tiering.config import Tier
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
