"""``ckptctl watch``: drain new checkpoints down the tiers of the config, trim each tier."""
from __future__ import annotations

import signal
import threading

import typer

from ..errors import EXIT_FINDING
from .app import app
from .common import (JsonOpt, QuietOpt, emit_json, human_bytes, human_rate, human_seconds, plural,
                     say)


@app.command()
def watch(
    ctx: typer.Context,
    once: bool = typer.Option(False, "--once",
                              help="One pass, then exit: 0 when everything is drained, 1 "
                                   "when something is still pending or failed (for cron)."),
    interval: float = typer.Option(60.0, "--interval", min=0.1, metavar="S",
                                   help="Seconds between passes (a change in a local first "
                                        "tier wakes the loop sooner)."),
    jitter: float = typer.Option(0.0, "--jitter", min=0.0, metavar="S",
                                 help="Add up to S random seconds to each wait (many nodes "
                                      "polling one store)."),
    settle: float = typer.Option(30.0, "--settle", min=0.0, metavar="S",
                                 help="A first-tier checkpoint is taken once it is complete "
                                      "and its listing has not changed for S seconds."),
    status: bool = typer.Option(False, "--status",
                                help="Print what the watch of this config has queued, in "
                                     "flight, done and failed, with rates, and plan's "
                                     "figures from what it measured; then exit."),
    node_rank: int | None = typer.Option(None, "--node-rank", min=0, metavar="N",
                                         help="Multi-node: drain this node's part of each "
                                              "checkpoint into the second (shared) tier, "
                                              "where the node that completes it seals it "
                                              "(default: GROUP_RANK, NODE_RANK or "
                                              "SLURM_NODEID when set; else single node)."),
    no_nice: bool = typer.Option(False, "--no-nice",
                                 help="Run at normal priority (default: nice 10 and the idle "
                                      "I/O class)."),
    json: bool = JsonOpt,
    quiet: bool = QuietOpt,
):
    """Promote each new checkpoint of the first tier down the tiers, and apply each tier's keep.

    A checkpoint of the first tier is taken when it is complete (DCP .metadata, HF index
    and shards, a manifest) and its listing has not changed for --settle seconds; it is
    sealed there, then promoted hop by hop (each destination tier's pack and bwlimit), one
    checkpoint at a time per tier pair. After the promotions each tier's keep table is
    applied; in every tier but the last, a checkpoint not yet committed in the next tier
    is kept ("not yet in TIER"). A failure (destination full, server down) is retried
    with exponential backoff across passes (at once after an edit of the config of the
    tiers involved) and reported, never turned into a deletion. --status adds plan's
    figures (drain time per hop, per-node bandwidth, capacity, recovery time per tier)
    from the rates and checkpoint interval watch measured.

    The tiers' listings are the state: a restart (even after SIGKILL) picks up where it
    stopped, and promote resumes a half-done hop. Beside that, watch keeps a JSON-lines
    event log and a status file under $XDG_CACHE_HOME/ckptctl/watch/ (default ~/.cache),
    and a lock in .../ckptctl/watch-locks/: one watch per node and first tier, whatever
    config file names it (a second one exits 2 naming the running one's pid and config;
    --status shows the running one's status). SIGTERM or Ctrl-C stops after the
    current part, saves the status and exits 0. With --json the loop prints one JSON
    document per pass (JSON lines).

    \b
    EXAMPLES
      ckptctl watch --config ckptctl.toml               # loop, low priority
      ckptctl watch --once --settle 0 --json            # cron: exit 1 while not drained
      ckptctl watch --status
      ckptctl watch --node-rank 1                       # multi-node
    """
    from ..config import CONFIG_ENV, CONFIG_NAME
    from ..errors import UsageError
    from ..ops.watch import Watcher, lower_priority
    from .common import current_config

    config = current_config(ctx)
    if config.path is None or not config.tiers:
        raise UsageError(f"no tier config: pass --config FILE, set {CONFIG_ENV} or create "
                         f"./{CONFIG_NAME}")
    if node_rank is None:
        from ..ops.multinode import node_rank_from_env

        node_rank = node_rank_from_env()
    if status:
        from ..ops.watch import measured_plan, watch_status

        ran, doc = watch_status(config, node_rank)  # a running watch of a copy: its status
        figures = measured_plan(ran, doc)
        if json:
            emit_json({"config": ran.path, "status": doc,
                       "plan": figures.to_dict() if figures else None})
        elif not quiet:
            _print_status(ran.path, doc)
            _print_plan(figures)
        return
    if not no_nice:
        lower_priority()
    w = Watcher(config, settle=settle, node_rank=node_rank)
    w.lock()
    try:
        if once:
            p = w.run_once()
            if json:
                emit_json(p.to_dict())
            elif not quiet:
                _print_pass(p)
            if not p.drained:
                raise typer.Exit(EXIT_FINDING)
            return

        def report(p):
            if json:
                emit_json(p.to_dict())
            elif not quiet and (p.promoted or p.failed or any(p.removed.values())):
                _print_pass(p)

        wake, stop = threading.Event(), threading.Event()
        previous = _stop_between_passes(w, wake, stop)
        try:
            w.loop(interval=interval, jitter=jitter, on_pass=report, wake=wake, stop=stop)
        except KeyboardInterrupt:  # SIGTERM or Ctrl-C mid-pass: promote left resumable state
            w.save()
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        say("watch: stopped (status saved)", quiet=quiet or json)
    finally:
        w.unlock()


def _stop_between_passes(w, wake, stop):
    """SIGTERM while the loop waits between passes ends it there (``stop``), the way a
    service manager expects; in the middle of a pass it interrupts the pass as Ctrl-C does
    (promote leaves resumable state). Returns the handler replaced (None off the main
    thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_term(signum, frame):
        stop.set()
        wake.set()
        if not getattr(w, "waiting", False):
            raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, on_term)


def _print_pass(p) -> None:
    for h in p.promoted:
        say(f"{h.action} {h.name}: {h.src} -> {h.dst} ({human_bytes(h.bytes)}"
            + (f", {human_bytes(int(h.rate))}/s" if h.bytes_sent else "") + ")")
    for tier, names in p.removed.items():
        for n in names:
            say(f"removed {tier}:{n}")
    for f in p.failed:
        say(f"failed {f.what} {f.tier}" + (f":{f.name}" if f.name else "")
            + f": {f.message} (attempt {f.attempts}, next retry {_when(f.next_retry)})")
    say(f"{plural(len(p.promoted), 'hop')}, {sum(map(len, p.removed.values()))} removed, "
        f"{len(p.pending)} pending, {len(p.failed)} failed"
        + (": drained" if p.drained else ""))


def _when(ts: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%H:%M:%SZ")


def _print_status(path: str, doc: dict | None) -> None:
    if doc is None:
        say(f"no watch has run for {path}")
        return
    last = doc.get("last_pass") or {}
    say(f"watch of {path}: updated {doc.get('updated')}, pid {doc.get('pid')}, last pass "
        + ("drained" if last.get("drained") else "not drained"))
    fl = doc.get("in_flight")
    say("in flight: " + (f"{fl['name']} {fl['src']} -> {fl['dst']} since {fl['since']}"
                         if fl else "none"))
    for q in doc.get("queued") or []:
        say(f"queued: {q['tier']}:{q['name']} ({q['why']})")
    for d in (doc.get("done") or [])[-10:]:
        say(f"done: {d['name']} {d['src']} -> {d['dst']} {d['action']} "
            f"({human_bytes(d['bytes'])}, {d['seconds']} s) at {d['time']}")
    for key, f in sorted((doc.get("failed") or {}).items()):
        say(f"failed: {key}: {f['message']} (attempt {f['attempts']}, next retry "
            f"{_when(f['next_retry'])})")
    for pair, rate in sorted((doc.get("rates") or {}).items()):
        say(f"rate: {pair} {human_bytes(int(rate))}/s")


def _print_plan(r) -> None:
    """plan's figures from what watch measured (the layout of ``ckptctl plan``)."""
    from .common import print_table

    if r is None:
        return
    tau = (f"{human_seconds(r.interval_seconds)} (median of {plural(r.gaps, 'gap')} between arrivals)"
           if r.interval_seconds is not None else "unknown (one arrival so far)")
    say(f"plan from what watch measured: S = {human_bytes(r.checkpoint_bytes)} "
        f"({r.checkpoint}), interval tau = {tau}")
    if r.node_bandwidth_bytes_per_second is not None:
        say(f"per-node drain bandwidth B >= S/(P tau) = "
            f"{human_rate(r.node_bandwidth_bytes_per_second)}")
    say(f"local capacity 2 S/P = {human_bytes(r.local_capacity_bytes)} "
        "(current + previous checkpoint)")
    if r.hops:
        print_table(["hop", "moves", "rate", "rate from", "drain", "fits tau"],
                    [[f"{h.src} -> {h.dst}", human_bytes(h.bytes), human_rate(h.bytes_per_second),
                      h.rate_source, human_seconds(h.drain_seconds),
                      {True: "yes", False: "NO", None: "unknown"}[h.fits]] for h in r.hops])
    print_table(["recover from", "reads", "rate", "rate from", "time"],
                [[x.tier, human_bytes(x.bytes), human_rate(x.bytes_per_second), x.rate_source,
                  human_seconds(x.seconds)] for x in r.recovery])
