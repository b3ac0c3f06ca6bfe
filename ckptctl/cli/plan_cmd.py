"""``ckptctl plan``: the checkpoint interval, its cost, and what the tiers must sustain."""
from __future__ import annotations

import math
import sys
from typing import List, Optional

import typer

from .app import app
from .common import (JsonOpt, QuietOpt, emit_json, human_bytes, human_rate, human_seconds,
                     YEAR, positive_duration, print_table, say)


def _size(flag: str, text: str) -> int:
    """A size in bytes: ``TB``/``GB`` powers of 1000, ``TiB``/``GiB`` and a bare ``T``/``G``
    powers of 1024 (``parse_size``'s units, read by ``parse_rate``, which imports no
    numpy)."""
    from ..errors import UsageError
    from ..storage.ratelimit import parse_rate

    bad = UsageError(f"{flag}: bad size {text!r} (examples: 1TB, 800GiB, 1.5e12)")
    if "/" in text or text.strip().lower() in ("off", "none", "unlimited"):
        raise bad
    try:
        value = parse_rate(text)
    except UsageError:
        raise bad from None
    if value is None:
        raise UsageError(f"{flag} must be more than 0, not {text!r}")
    return int(round(value))


def _rate(flag: str, text: str | None) -> float | None:
    """Bytes/s in ``text`` (``parse_rate``'s units: ``2GB/s``, ``1.5GiB/s``); 0 and
    ``off`` are refused here: a write rate is needed.

    >>> _rate("--write-bandwidth", "2GB/s"), _rate("--write-bandwidth", None)
    (2000000000.0, None)
    """
    from ..errors import UsageError
    from ..units import parse_rate

    if text is None:
        return None
    try:
        value = parse_rate(text)
    except UsageError:
        value = -1.0
    if value is None or value <= 0:
        raise UsageError(f"{flag}: bad rate {text[:40]!r} (a write rate, e.g. 2GB/s, "
                         "1.5GiB/s)")
    return value


@app.command()
def plan(
    ctx: typer.Context,
    checkpoint_size: Optional[str] = typer.Option(
        None, "--checkpoint-size", metavar="SIZE",
        help="Size S of one whole checkpoint (all ranks): 1TB = 10^12 bytes, 1TiB = 2^40; "
             "a bare T/G/M is binary."),
    checkpoint: Optional[str] = typer.Option(
        None, "--checkpoint", metavar="URL",
        help="Take S from this checkpoint's listing instead (path, s3://..., TIER:NAME; a "
             "folder of checkpoints: its newest committed one)."),
    save_seconds: Optional[float] = typer.Option(
        None, "--save-seconds", metavar="C",
        help="Seconds training is blocked by one save (writing to the first tier)."),
    write_bandwidth: Optional[str] = typer.Option(
        None, "--write-bandwidth", metavar="RATE",
        help="Instead of --save-seconds: one node's write rate to the first tier (2GB/s); "
             "C = S / (P x RATE), a lower bound of the real save."),
    mtbf: Optional[str] = typer.Option(
        None, "--mtbf", metavar="DUR",
        help="Mean time between failures of the whole job (2.8h, 1d, 90m, or seconds)."),
    node_mtbf: Optional[str] = typer.Option(
        None, "--node-mtbf", metavar="DUR",
        help="Instead of --mtbf: one node's MTBF, as vendors quote it (5y, 50000h); "
             "the job's is DUR / P (--nodes)."),
    nodes: Optional[int] = typer.Option(
        None, "--nodes", metavar="P",
        help="Nodes the checkpoint is spread over (each writes S/P); default 1, or "
             "ceil(--gpus / --gpus-per-node)."),
    gpus: Optional[int] = typer.Option(
        None, "--gpus", metavar="N",
        help="Instead of --nodes: GPUs of the job, with --gpus-per-node."),
    gpus_per_node: Optional[int] = typer.Option(
        None, "--gpus-per-node", metavar="K",
        help="GPUs per node: P = ceil(--gpus / K)."),
    interval: Optional[str] = typer.Option(
        None, "--interval", metavar="DUR",
        help="The interval you use or consider; drains are checked against it (default: "
             "the optimal one)."),
    measure: Optional[List[str]] = typer.Option(
        None, "--measure", metavar="TIER",
        help="Time a write and a read of a test object at this tier of the config, then "
             "remove it; repeatable. Measured rates replace unknown ones and cap bwlimit."),
    measure_size: str = typer.Option(
        "64MiB", "--measure-size", metavar="SIZE",
        help="Largest test object --measure writes."),
    measure_seconds: float = typer.Option(
        5.0, "--measure-seconds", metavar="S",
        help="--measure stops writing (and reading) after about this long."),
    plot: bool = typer.Option(
        False, "--plot", help="After the figures, a chart of the expected overhead against "
        "the interval (log scale, tau*/10 to 10 tau*), drawn in the terminal: * marks the "
        "optimal interval, o the chosen one (--interval). Ignored with --json and --quiet."),
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    storage_option: Optional[List[str]] = typer.Option(
        None, "--storage-option", "-o", metavar="KEY=VALUE",
        help="fsspec storage option for --checkpoint, repeatable (endpoint_url=...)."),
):
    """How often to checkpoint, what it costs, and whether the tiers keep up.

    \b
    FORMULAS (S size, P nodes, C save seconds, M job MTBF, tau the interval)
      job MTBF (--node-mtbf)       M = node MTBF / P  (independent failures)
      save (--write-bandwidth B)   C = S / (P B)      (a lower bound)
      interval, C/M <= 0.1         tau* = sqrt(2 C M)              (Young)
      interval, C/M > 0.1          tau* = sqrt(2 C M) (1 + sqrt(r)/3 + r/9) - C,
                                   r = C / (2 M)      (Daly 2006; warns)
      expected overhead            1 - tau / (M (e^((tau + C)/M) - 1))  (Daly)
      per-node drain bandwidth     B >= S / (P tau)   (S/P per interval)
      local capacity per node      2 S / P            (current + previous)
      drain of a tier hop          bytes / rate; fits when it ends within tau
      recovery from a tier         bytes / read rate

    The overhead is Daly's expected wall-clock model (a failure can strike
    during a save too): never above 100%, never more than 24 h lost per day.
    A save no interval makes progress at (C >= M, or under 25% of the time
    training at the best interval) is refused (exit 2). Durations take y
    (365 d), w, d, h, m and s: --node-mtbf 5y.

    Tiers come from the config (--config, $CKPTCTL_CONFIG or ./ckptctl.toml),
    hottest first; the first is node-local: its hop out moves S/P on every
    node at once (the rate is one node's), later hops and a restart from a
    shared tier move S. A hop's rate is the smallest known of the
    destination's bwlimit, its measured write and the source's measured read.
    A bwlimit is a ceiling, not a rate (shown as <=): a hop fits ("yes") only
    when both of its tiers were measured (--measure); at a ceiling it is "NO"
    (even the ceiling is too slow) or "unknown", as is a hop with no rate. A
    tier that cannot be measured is exit 3.

    \b
    EXAMPLES
      ckptctl plan --checkpoint-size 1TB --save-seconds 60 --mtbf 2.8h \\
          --nodes 128
      ckptctl plan --checkpoint-size 1TB --write-bandwidth 2GB/s \\
          --node-mtbf 5y --nodes 512 --interval 30m
      ckptctl plan --checkpoint warm:step-12000 --save-seconds 45 --mtbf 1d
      ckptctl plan --checkpoint-size 800GiB --save-seconds 60 --mtbf 6h \\
          --measure hot --measure warm --json
      ckptctl plan --checkpoint-size 1TB --save-seconds 60 --mtbf 2.8h \\
          --interval 30m --plot
    """
    from ..errors import UsageError
    from ..tiering.plan import TierInput, checkpoint_size as measure_size_of, measure_tier
    from ..tiering.plan import nodes_from_gpus
    from ..tiering.plan import plan as do_plan
    from .common import current_config, resolve_place

    if checkpoint_size is None and checkpoint is None:
        raise UsageError("give the checkpoint size: --checkpoint-size SIZE or "
                         "--checkpoint URL")
    if checkpoint_size is not None and checkpoint is not None:
        raise UsageError("--checkpoint-size and --checkpoint both give the size: give one")
    if save_seconds is not None and write_bandwidth is not None:
        raise UsageError("--save-seconds and --write-bandwidth both give the save time: "
                         "give one")
    if save_seconds is None and write_bandwidth is None:
        raise UsageError("give --save-seconds C (seconds one save blocks training) or "
                         "--write-bandwidth RATE (one node's write rate, e.g. 2GB/s)")
    if mtbf is not None and node_mtbf is not None:
        raise UsageError("--mtbf (the job's) and --node-mtbf (one node's) both give the "
                         "MTBF: give one")
    if mtbf is None and node_mtbf is None:
        raise UsageError("give --mtbf DUR (the job's mean time between failures, e.g. 2.8h)"
                         " or --node-mtbf DUR (one node's, e.g. 5y)")
    nodes_from_gpus(nodes, gpus, gpus_per_node)  # exit 2 before any tier is measured
    if plot and not (json or quiet):
        from .textplot import require_plotext

        require_plotext()  # missing: exit 3 before any tier is measured
    mtbf_s = positive_duration("--mtbf", mtbf)
    node_mtbf_s = positive_duration("--node-mtbf", node_mtbf)
    write_rate = _rate("--write-bandwidth", write_bandwidth)
    interval_s = positive_duration("--interval", interval)
    probe_size = _size("--measure-size", measure_size)
    if not measure_seconds > 0:
        raise UsageError(f"--measure-seconds must be more than 0, not {measure_seconds:g}")
    config = current_config(ctx)
    wanted = [m[:-1] if m.endswith(":") else m for m in measure or ()]
    if wanted and config.path is None:
        raise UsageError("--measure needs a tier config: pass --config FILE, set "
                         "$CKPTCTL_CONFIG or create ./ckptctl.toml")
    for name in wanted:
        config.tier(name)  # an unknown tier: exit 2 before anything is written
    url = None
    if checkpoint is not None:
        place = resolve_place(ctx, checkpoint, storage_option)
        url, size = measure_size_of(place.url, place.storage_options)
    else:
        size = _size("--checkpoint-size", checkpoint_size)
    tiers = []
    for t in config.tiers:
        m = measure_tier(t, size=probe_size, seconds=measure_seconds) \
            if t.name in wanted else None
        tiers.append(TierInput(t.name, t.url, t.bwlimit, m))
    r = do_plan(size, save_seconds, mtbf_s, nodes=nodes, interval_seconds=interval_s,
                tiers=tiers, checkpoint_url=url, node_mtbf_seconds=node_mtbf_s,
                node_write_bytes_per_second=write_rate, gpus=gpus,
                gpus_per_node=gpus_per_node)
    if not quiet:
        for w in r.warnings:
            print(f"ckptctl: warning: {w}", file=sys.stderr)
    if json:
        emit_json(r.to_dict())
        return
    if quiet:
        return
    _show(r)
    if plot:
        say()
        print(overhead_chart(r))


def overhead_chart(r, *, width: int | None = None, color: bool | None = None) -> str:
    """``--plot``: the expected overhead (%) of :class:`~ckptctl.tiering.plan.PlanResult`
    ``r`` against the interval (:func:`~ckptctl.tiering.plan.overhead_curve`), on a log
    axis ticked at factors of sqrt(10) of tau*, the optimum marked ``*`` and the chosen
    interval ``o``, each with a line under the chart saying what it is.

    >>> from ckptctl.tiering.plan import plan
    >>> text = overhead_chart(plan(10**12, 60, 10080, interval_seconds=1800), width=60,
    ...                       color=False)
    >>> print("\\n".join(text.splitlines()[-2:]))
    * optimal interval tau* = 18m19s (Young): 10.52% overhead
    o chosen interval 30m: 11.88% overhead
    """
    from ..tiering.plan import overhead_curve
    from ..tiering.policy import format_duration
    from .textplot import curve, short_duration

    c = overhead_curve(r.save_seconds, r.mtbf_seconds, chosen=r.chosen_interval_seconds)
    xs, best, chosen = c["intervals_seconds"], c["optimal"], c["chosen"]
    marks = [(best["interval_seconds"], 100 * best["overhead"], "*")]
    if chosen:
        marks.append((chosen["interval_seconds"], 100 * chosen["overhead"], "o"))
    decades = math.log10(xs[-1] / xs[0])
    step = 0.5  # ticks at tau* x sqrt(10)^k; wider apart on a span of many decades
    while decades / step > 6:
        step *= 2
    low = math.ceil(math.log10(xs[0] / best["interval_seconds"]) / step - 1e-9)
    high = math.floor(math.log10(xs[-1] / best["interval_seconds"]) / step + 1e-9)
    ticks = [best["interval_seconds"] * 10 ** (k * step) for k in range(low, high + 1)]
    chart = curve(xs, [100 * o for o in c["overheads"]], marks=marks, logx=True,
                  xticks=[(t, short_duration(t)) for t in ticks], height=15, width=width,
                  color=color)
    who = "Young" if best["formula"] == "young" else "Daly"
    lines = ["overhead, % of time lost to saves and redone work, by interval (log scale):",
             chart,
             f"* optimal interval tau* = {format_duration(best['interval_seconds'])} ({who}): "
             f"{best['overhead']:.2%} overhead"]
    if chosen:
        lines.append(f"o chosen interval {format_duration(chosen['interval_seconds'])}: "
                     f"{chosen['overhead']:.2%} overhead")
    return "\n".join(lines)


def _long(seconds: float) -> str:
    """``human_seconds``, in years too past one.

    >>> _long(5 * YEAR)
    '157,680,000.0 s (1825d, 5 y)'
    >>> _long(90)
    '90.0 s (1m30s)'
    """
    text = human_seconds(seconds)
    return text[:-1] + f", {seconds / YEAR:.3g} y)" if seconds >= YEAR else text


def _show(r) -> None:
    from ..tiering.policy import format_duration

    src = f" ({r.checkpoint_url})" if r.checkpoint_url else ""
    if r.save_source == "write-bandwidth":
        save = (f"save C = S/(P x {human_rate(r.node_write_bytes_per_second)}) = "
                f"{r.save_seconds:,.3g} s (--write-bandwidth: a lower bound)")
    else:
        save = f"save C = {r.save_seconds:g} s"
    gpus = ""
    if r.gpus is not None:
        per = f", {r.gpus_per_node} per node" if r.gpus_per_node else ""
        gpus = f" ({r.gpus:,} GPU{'s' if r.gpus != 1 else ''}{per})"
    say(f"checkpoint S = {human_bytes(r.checkpoint_bytes)} ({r.checkpoint_bytes:,} bytes){src}"
        f" on P = {r.nodes} node{'s' if r.nodes != 1 else ''}{gpus}; {save}")
    if r.mtbf_source == "node":
        say(f"MTBF M = node MTBF {_long(r.node_mtbf_seconds)} / {r.nodes} = "
            f"{human_seconds(r.mtbf_seconds)} (--node-mtbf, independent node failures); "
            f"C/M = {r.save_mtbf_ratio:.3g}")
    else:
        say(f"MTBF M = {_long(r.mtbf_seconds)} (--mtbf, the job's); "
            f"C/M = {r.save_mtbf_ratio:.3g}")
    if r.interval_formula == "young":
        say(f"optimal interval tau* = sqrt(2 C M) = {human_seconds(r.optimal_interval_seconds)}"
            " (Young, first order: C/M is small)")
    else:
        say(f"optimal interval tau* = {human_seconds(r.optimal_interval_seconds)} (Daly's "
            f"higher-order estimate; Young's sqrt(2 C M) = "
            f"{human_seconds(r.young_interval_seconds)} does not hold at this C/M)")
    say(f"overhead at the optimal interval: {r.overhead_optimal:.2%} "
        f"({r.hours_lost_per_day_optimal:.2f} h lost per day; Daly's expected-time model)")
    if r.chosen_interval_seconds is not None:
        say(f"overhead at the chosen interval {format_duration(r.chosen_interval_seconds)}: "
            f"{r.overhead_chosen:.2%} ({r.hours_lost_per_day_chosen:.2f} h lost per day)")
    which = "chosen" if r.chosen_interval_seconds is not None else "optimal"
    say(f"per-node drain bandwidth B >= S/(P tau) = {human_rate(r.node_bandwidth_bytes_per_second)}"
        f" at the {which} interval ({human_rate(r.total_bandwidth_bytes_per_second)} in all)")
    say(f"local capacity per node 2 S/P = {human_bytes(r.local_capacity_bytes)} "
        "(current + previous checkpoint)")
    for m in r.measured:
        say(f"measured {m.tier}: wrote {human_bytes(m.write_bytes)} in {m.write_seconds:.2f} s"
            f" ({human_rate(m.write_bytes_per_second)}), read {human_bytes(m.read_bytes)} in "
            f"{m.read_seconds:.2f} s ({human_rate(m.read_bytes_per_second)})"
            + (", page cache dropped first" if m.cache_dropped else "")
            + "; test object removed")

    def at_most(kind, rate):
        return ("<= " if kind == "ceiling" else "") + human_rate(rate)

    def at_least(kind, seconds):
        return (">= " if kind == "ceiling" and seconds is not None else "") \
            + human_seconds(seconds)

    if r.hops:
        rows = [[f"{h.src} -> {h.dst}",
                 human_bytes(h.bytes) + (f" x {h.streams} nodes" if h.streams > 1 else ""),
                 at_most(h.rate_kind, h.bytes_per_second), h.rate_source,
                 at_least(h.rate_kind, h.drain_seconds),
                 {True: "yes", False: "NO", None: "unknown"}[h.fits]] for h in r.hops]
        print_table(["hop", "moves", "rate", "rate from", "drain", f"fits {which} tau"], rows)
    if r.recovery:
        rows = [[x.tier, human_bytes(x.bytes) + (" per node" if i == 0 and r.nodes > 1 else ""),
                 at_most(x.rate_kind, x.bytes_per_second), x.rate_source,
                 at_least(x.rate_kind, x.seconds)]
                for i, x in enumerate(r.recovery)]
        print_table(["recover from", "reads", "rate", "rate from", "time"], rows)
    if r.rates_unknown:  # nothing to check a drain against: say how to learn the rates
        say("every hop's rate is unknown (no bwlimit, nothing measured): rerun with "
            + " ".join(f"--measure {h}" for h in [r.hops[0].src, *(h.dst for h in r.hops)])
            + " to time each tier, or see `ckptctl watch --status` for the rates a running "
            "watch measured")
    if any(h.rate_kind == "ceiling" for h in r.hops) or \
            any(x.rate_kind == "ceiling" for x in r.recovery):
        say("<= a ceiling (a bwlimit, or one end measured), not a rate: the real rate may "
            "be lower; --measure both tiers of a hop to know whether it fits")
