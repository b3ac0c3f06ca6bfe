"""``ckptctl watch``: drain new checkpoints down the tiers of the config, trim each tier."""
from __future__ import annotations

import signal
import sys
import threading

import typer

from ..errors import EXIT_FINDING
from .app import app
from .common import (SCHEMA_VERSION, JsonOpt, QuietOpt, emit_json, human_bytes, human_rate,
                     human_seconds, plural, say)


@app.command()
def watch(
    ctx: typer.Context,
    once: bool = typer.Option(False, "--once",
                              help="One pass, then exit (for cron): 0 when nothing failed "
                                   "and whatever is left is on its way (settling, or "
                                   "waiting for the next tier; the summary says which), 1 "
                                   "when a step failed or a checkpoint is incomplete."),
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
    metrics_file: str | None = typer.Option(
        None, "--metrics-file", metavar="PATH",
        help="Keep Prometheus metrics in PATH (node_exporter's textfile collector: name it "
             "*.prom), rewritten whole (temp file + rename) after each event; PATH must be "
             "a regular file or not exist yet."),
    metrics_addr: str | None = typer.Option(
        None, "--metrics-addr", metavar="HOST:PORT",
        help="Also serve the metrics over HTTP at http://HOST:PORT/metrics (:PORT: "
             "127.0.0.1 only; every interface must be named: 0.0.0.0:PORT or [::]:PORT)."),
    log_format: str = typer.Option(
        "text", "--log-format", metavar="FORMAT",
        help="text (a summary per pass on stdout) or json (one JSON line per event on "
             "stderr, as it happens: time, level, event, tier, name, step, bytes, "
             "seconds, reason; nothing else is printed, stdout stays empty unless "
             "--json)."),
    drain_signal: str = typer.Option(
        "USR1", "--drain-signal", metavar="SIG",
        help="On this signal, promote the newest checkpoint of the first tier to the next "
             "tier at once (ahead of any backlog), commit it, exit 0 (Slurm: #SBATCH "
             "--signal=B:USR1@120); none: ignore."),
    ready: bool = typer.Option(
        False, "--ready",
        help="Exit 0 when the watch of this config runs and has listed its first tier, "
             "else 1; print nothing (a readiness probe)."),
    print_unit: bool = typer.Option(
        False, "--print-unit",
        help="Print the systemd template unit ckptctl-watch@.service (Type=notify, "
             "watchdog, metrics file) for this ckptctl, then exit."),
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
    document per pass (JSON lines). --once exits 0 when nothing failed and what is
    still pending only settles or waits for the next tier (settling is no failure: its
    summary says how long the newest has been unchanged), 1 on a failure or an
    incomplete checkpoint.

    As a service: under systemd Type=notify (NOTIFY_SOCKET) watch sends READY=1 once
    the first tier is listed, STATUS= lines, WATCHDOG=1 at half of WatchdogSec while it
    makes progress, and STOPPING=1 (a template unit: ckptctl/contrib/). The drain
    signal (--drain-signal, USR1) is pre-emption: the newest checkpoint of the first
    tier goes to the next one at once, committed last, then watch exits 0 (1 when it
    could not). A checkpoint already sealed in the first tier needs no settle time; a
    tier is trimmed as soon as each hop out of it is committed.

    \b
    EXAMPLES
      ckptctl watch --config ckptctl.toml       # loop, low priority
      ckptctl watch --once --settle 0 --json    # cron: exit 1 on a failure
      ckptctl watch --status
      ckptctl watch --node-rank 1               # multi-node
      ckptctl watch --metrics-file /var/lib/ckptctl.prom --log-format json
      ckptctl watch --print-unit > /etc/systemd/system/ckptctl-watch@.service
    """
    from ..tiering.config import CONFIG_ENV, CONFIG_NAME
    from ..errors import UsageError
    from ..service.watch import Watcher, lower_priority
    from .common import current_config

    if print_unit:
        from .watch_service import systemd_unit

        sys.stdout.write(systemd_unit())
        return
    config = current_config(ctx)
    if config.path is None or not config.tiers:
        raise UsageError(f"no tier config: pass --config FILE, set {CONFIG_ENV} or create "
                         f"./{CONFIG_NAME}")
    if node_rank is None:
        from ..service.multinode import node_rank_from_env

        node_rank = node_rank_from_env()
    if ready:
        from ..service.status import watch_ready

        if not watch_ready(config, node_rank):
            raise typer.Exit(EXIT_FINDING)
        return
    if status:
        from ..service.drains import measured_plan
        from ..service.status import watch_alive, watch_status

        ran, doc = watch_status(config, node_rank)  # a running watch of a copy: its status
        figures = measured_plan(ran, doc)
        pid = watch_alive(config, node_rank)
        if json:
            emit_json({"config": ran.path, "alive": pid is not None, "pid": pid,
                       "status": doc, "plan": figures.to_dict() if figures else None})
        elif not quiet:
            _print_status(ran.path, doc, pid, rates=figures is None)
            _print_plan(figures)
        return
    from ..service.sdnotify import Notifier
    from .watch_service import Drain, parse_signal

    if log_format not in ("text", "json"):
        raise UsageError(f"--log-format {log_format}: expected text or json")
    signum = parse_signal(drain_signal)
    # a service's journal records stdout and stderr both: with the JSON log on stderr,
    # a text line for the same event on stdout would be logged twice
    text_quiet = quiet or log_format == "json"
    if not no_nice:
        lower_priority()
    w = Watcher(config, settle=settle, node_rank=node_rank)
    w.lock()
    notifier = Notifier()
    try:
        heartbeat, metrics = _serve(w, config, notifier, metrics_file, metrics_addr,
                                    log_format)
    except BaseException:  # a refused metrics file or address: the lock goes too
        w.unlock()
        raise
    wake, stop = threading.Event(), threading.Event()
    drain = Drain(w, signum, wake, stop)
    try:
        if once:
            try:
                p = w.run_once()
            except KeyboardInterrupt:
                if not drain.requested:
                    raise
            if not drain.requested:
                _report(p, json, text_quiet, settle, lines=False)
                if not p.ok:
                    raise typer.Exit(EXIT_FINDING)
                return
        else:
            def report(p):
                if json or p.promoted or p.failed or any(p.removed.values()):
                    _report(p, json, text_quiet, settle, lines=True)

            previous = _stop_between_passes(w, wake, stop)
            try:
                w.loop(interval=interval, jitter=jitter, on_pass=report, wake=wake, stop=stop,
                       own_files=(metrics_file,) if metrics_file else ())
            except KeyboardInterrupt:  # a signal mid-pass: promote left resumable state
                w.save()
            finally:
                if previous is not None:
                    signal.signal(signal.SIGTERM, previous)
        if drain.requested:
            _drain(w, notifier, json, text_quiet, lines=not once)
            return
        say("watch: stopped (status saved)", quiet=text_quiet or json)
    finally:
        drain.restore()
        heartbeat.stop()
        if metrics is not None:
            metrics.close()
        notifier.stopping()
        w.unlock()


def _serve(w, config, notifier, metrics_file, metrics_addr, log_format):
    """Hang the service's listeners on the watcher (JSON log, metrics, notify) and start
    the watchdog heartbeat (a no-op without WATCHDOG_USEC); returns the heartbeat and the
    metrics (None without them)."""
    import time

    from ..service.sdnotify import Heartbeat
    from .watch_service import json_logger, notify_listener

    names = [t.name for t in config.tiers]
    m = None
    if log_format == "json":
        w.listeners.append(json_logger())
    if metrics_file or metrics_addr:
        from ..service.metrics import WatchMetrics

        m = WatchMetrics(names, path=metrics_file, addr=metrics_addr,
                         warn=_warner(log_format))
        m.write()
        w.listeners.append(m.observe)
    if notifier.enabled:
        w.listeners.append(notify_listener(notifier, names))
    period = notifier.watchdog_seconds or 0
    hb = Heartbeat(notifier, alive=lambda: w.waiting or time.monotonic() - w.progress < period)
    hb.start()
    return hb, m


def _warner(log_format: str):
    """How the service warns: a ``ckptctl: warning:`` line on stderr, or with the JSON
    log one JSON line there like every event (level ``warning``).

    >>> import contextlib, io; err = io.StringIO()
    >>> with contextlib.redirect_stderr(err):
    ...     _warner("json")("metrics file: disk full")
    >>> err.getvalue().rstrip().endswith('"level": "warning", "event": "warning", '
    ...                                  '"reason": "metrics file: disk full"}')
    True
    """
    def warn(msg: str) -> None:
        if log_format == "json":
            import json
            import time

            from ..service.results import iso_time

            line = {"time": iso_time(time.time()), "level": "warning", "event": "warning",
                    "reason": msg}
            sys.stderr.write(json.dumps(line) + "\n")
            sys.stderr.flush()
        else:
            print(f"ckptctl: warning: {msg}", file=sys.stderr)

    return warn


def _report(p, json: bool, quiet: bool, settle: float, *, lines: bool) -> None:
    """A pass on stdout: its --json document (``lines``: on one line, the loop's JSON
    lines), else its summary in words unless ``quiet``."""
    if json:
        _emit(p.to_dict(), lines)
    elif not quiet:
        _print_pass(p, settle)


def _emit(doc: dict, line: bool) -> None:
    """A --json document, as every verb prints it, or (``line``) on a single line: one
    journal record per document when a service manager logs stdout.

    >>> _emit({"drained": True}, True)
    {"schema_version": 3, "drained": true}
    """
    if not line:
        emit_json(doc)
        return
    import json

    sys.stdout.write(json.dumps({"schema_version": SCHEMA_VERSION, **doc}, default=str)
                     + "\n")
    sys.stdout.flush()


def _drain(w, notifier, json: bool, quiet: bool, *, lines: bool) -> None:
    """The drain signal came: the newest checkpoint of the first tier to the next tier,
    then exit 0 (1 when it failed)."""
    notifier.status("draining the newest checkpoint (pre-emption)")
    p, name = w.drain_newest()
    if json:
        _emit({**p.to_dict(), "drain": name}, lines)
    elif not quiet:
        if name is None:
            say("watch: drain signal: no committed checkpoint in the first tier")
        for h in p.promoted:
            say(f"drained {h.name}: {h.src} -> {h.dst} ({human_bytes(h.bytes)})")
        for f in p.failed:
            say(f"drain failed: {f.what} {f.tier}" + (f":{f.name}" if f.name else "")
                + f": {f.message}")
        if name is not None and not p.failed and not p.promoted:
            say(f"watch: drain signal: {name} is already in the next tier")
    if p.failed:
        raise typer.Exit(EXIT_FINDING)


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


def _print_pass(p, settle: float) -> None:
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
        f"{pending_words(p.pending, p.unchanged, settle)}, {len(p.failed)} failed"
        + (": drained" if p.drained else ""))


def pending_words(pending: list[dict], unchanged: dict[str, float], settle: float) -> str:
    """What a pass left pending, by reason, in the order they came: settling ones with how
    long the newest has been unchanged (``unchanged``: name -> seconds), of the
    ``--settle`` it needs.

    >>> pending_words([], {}, 30)
    '0 pending'
    >>> s = {"tier": "hot", "why": "settling"}
    >>> pending_words([{**s, "name": "a"}, {**s, "name": "b"}], {"a": 50.0, "b": 12.4}, 60)
    '2 pending: settling (newest unchanged for 12 s; --settle 60)'
    >>> pending_words([{**s, "name": "a"}, {"tier": "hot", "name": "b", "why": "incomplete"}],
    ...               {}, 60)
    '2 pending: 1 settling (--settle 60), 1 incomplete'
    """
    groups: dict[str, list[dict]] = {}
    for x in pending:
        groups.setdefault(x["why"], []).append(x)
    words = []
    for why, xs in groups.items():
        word = why if len(groups) == 1 else f"{len(xs)} {why}"
        if why == "settling":
            ages = [unchanged[x["name"]] for x in xs if x["name"] in unchanged]
            word += (f" (newest unchanged for {min(ages):.0f} s; " if ages else " (") \
                + f"--settle {settle:g})"
        words.append(word)
    return f"{len(pending)} pending" + (": " + ", ".join(words) if words else "")


def _when(ts: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%H:%M:%SZ")


def _print_status(path: str, doc: dict | None, pid: int | None, *, rates: bool) -> None:
    """The status document in words; ``rates``: each hop's measured rate too (when no
    plan figures follow: their hop table shows that same rate, once)."""
    if doc is None:
        say(f"no watch has run for {path}" + (f" (pid {pid} holds its lock)" if pid else ""))
        return
    last = doc.get("last_pass") or {}
    say(f"watch of {path}: " + (f"running (pid {pid})" if pid is not None
                                else f"not running (last pid {doc.get('pid')})")
        + f", updated {doc.get('updated')}, last pass "
        + ("drained" if last.get("drained") else "not drained"))
    fl = doc.get("in_flight")
    if fl and pid is None:
        say(f"interrupted: {fl['name']} {fl['src']} -> {fl['dst']} since {fl['since']} "
            "(the next watch resumes it)")
    else:
        say("in flight: " + (f"{fl['name']} {fl['src']} -> {fl['dst']} since {fl['since']}"
                             if fl else "none"))
    for q in doc.get("queued") or []:
        say(f"queued: {q['tier']}:{q['name']} ({q['why']})")
    for d in (doc.get("done") or [])[-10:]:
        say(f"done: {d['name']} {d['src']} -> {d['dst']} {d['action']} "
            f"({human_bytes(d['bytes'])}, {d['seconds']} s) at "
            f"{d.get('finished') or d.get('time')}")
    for key, f in sorted((doc.get("failed") or {}).items()):
        say(f"failed: {key}: {f['message']} (attempt {f['attempts']}, next retry "
            f"{_when(f['next_retry'])})")
    for pair, rate in sorted((doc.get("rates") or {}).items()) if rates else ():
        src, _, dst = pair.partition("->")
        say(f"rate: {src} -> {dst} {human_rate(rate)} (measured on its newest hop)")


def _print_plan(r) -> None:
    """plan's figures from what watch measured (the layout of ``ckptctl plan``)."""
    from .common import print_table

    if r is None:
        return
    tau = (f"{human_seconds(r.interval_seconds)} (median of {plural(r.gaps, 'gap')} between arrivals)"
           if r.interval_seconds is not None else "unknown (one arrival so far)")
    say(f"plan from what watch measured: S = {human_bytes(r.checkpoint_bytes)} "
        f"({r.checkpoint_name}), interval tau = {tau}")
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
