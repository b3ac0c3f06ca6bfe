"""What a pass of a watch decides (:meth:`~.watch.Watcher.run_once`, :func:`run_pass`): the
first tier listed, its checkpoints that have settled (:func:`settled`) sealed and promoted
down the tiers (:mod:`.hops`), each tier trimmed (:mod:`.trims`), the backlog measured
(:mod:`.drains`); and pre-emption (:func:`pre_empt`), the newest checkpoint to the next
tier at once. A multi-node pass's first hop is :mod:`.multinode`'s.

The functions take the :class:`~.watch.Watcher` (``w``) whose config, status and event
log they use, and the :class:`~.results.WatchPass` (``p``) that records what they did.

>>> from types import SimpleNamespace as Row
>>> newest_committed({"s-1": Row(state="sealed"), "s-2": Row(state="incomplete")})
's-1'
"""
from __future__ import annotations

from ..tiering.policy import COMMITTED
from .drains import newest_pending_ages, record_arrival
from .hops import hop, promote_down, seal_in_place
from .trims import retain


def run_pass(w, p) -> None:
    """One pass over the tiers of ``w`` (see :mod:`.watch`), into ``p``."""
    tiers = w.config.tiers
    if w.node_rank is not None:
        from .multinode import node_pass, retain_node

        listings = node_pass(w, p)
        if w.node_rank == 0:  # one node drains the shared tier further
            promote_down(w, p, listings, set(), start=1)
            for i in range(1, len(tiers)):
                retain(w, p, i, listings)
        retain_node(w, p, listings)
        return
    listings = [w.list_tier(p, tiers[0])]
    first = listings[0]
    ready = settled(w, p, tiers[0], first) if first is not None else []
    for name in ready:
        seal_in_place(w, p, first[name])
    if first is not None and p.sealed:
        listings[0] = first = w.list_tier(p, tiers[0])
    # one that holds a user's file stays where it is: promote would adopt the file too
    held = {f.name for f in p.failed if f.what == "seal" and f.code == "FOREIGN_FILES"}
    promote_down(w, p, listings, set(ready) - held)
    for i in range(len(tiers)):
        retain(w, p, i, listings)
    p.behind = newest_pending_ages(tiers, listings, w.status.get("arrivals"), w.clock())


def settled(w, p, tier, rows: dict) -> list[str]:
    """First-tier names (of its listing ``rows``) that are committed and settled, oldest
    first: a checkpoint is settled when it is sealed, or when its listing (bytes, files,
    marker time) has not changed for ``w.settle`` seconds; what is not is pending in
    ``p``. A checkpoint seen for the first time is announced (``found``) and its arrival
    recorded."""
    now = w.clock()
    seen = w.status.setdefault("seen", {})
    ready = []
    for name, r in rows.items():
        sig = r.signature
        old = seen.get(name)
        if old is None:
            p.found.append(name)
            w.event("found", tier=tier.name, name=name, state=r.state, bytes=r.bytes)
            record_arrival(w.status, name, r, now)
        if old is None or old["sig"] != sig:
            seen[name] = old = {"sig": sig, "since": now}
        if r.state not in COMMITTED:
            p.pending.append({"tier": tier.name, "name": name, "why": r.state})
        elif r.state != "sealed" and now - old["since"] < w.settle:
            # sealed: its manifest was committed last, nothing more will be written
            p.pending.append({"tier": tier.name, "name": name, "why": "settling"})
        else:
            ready.append(name)
    for name in [n for n in seen if n not in rows]:
        del seen[name]  # gone from the first tier (trimmed, or removed by hand)
    return ready


def settling_ages(pending: list[dict], seen: dict, now: float) -> dict[str, float]:
    """How long the listing of each ``settling`` checkpoint of ``pending`` has been
    unchanged at ``now``, as watch saw it (``seen``: the status's name -> ``since``), so a
    report can say how far along it is.

    >>> settling_ages([{"name": "s-1", "why": "settling"}], {"s-1": {"since": 10.0}}, 12.5)
    {'s-1': 2.5}
    """
    return {x["name"]: round(max(0.0, now - seen[x["name"]]["since"]), 3) for x in pending
            if x.get("why") == "settling" and x.get("name") in seen}


def newest_committed(rows: dict) -> str | None:
    """The newest committed checkpoint of a listing (``ls`` order: by step, then name),
    the one ``latest`` would name; None when none is committed."""
    names = [n for n, r in rows.items() if r.state in COMMITTED]
    return names[-1] if names else None


def newest_settled_part(w, hot: dict) -> str | None:
    """Multi-node pre-emption: this node's newest part (of its first-tier listing
    ``hot``) whose listing has settled (unchanged for ``w.settle`` seconds as last seen),
    else its newest part.

    >>> from types import SimpleNamespace as Row
    >>> w = Row(status={"seen": {"s-1": {"sig": 1, "since": 0.0}}}, clock=lambda: 60.0,
    ...         settle=30.0)
    >>> newest_settled_part(w, {"s-1": Row(signature=1), "s-2": Row(signature=2)})
    's-1'
    """
    seen, now = w.status.get("seen") or {}, w.clock()
    settled_parts = [n for n, r in hot.items() if n in seen
                     and seen[n]["sig"] == r.signature
                     and now - seen[n]["since"] >= w.settle]
    return settled_parts[-1] if settled_parts else (list(hot)[-1] if hot else None)


def pre_empt(w, p) -> str | None:
    """Pre-emption (``watch``'s drain signal), into ``p``: promote the newest committed
    checkpoint of the first tier to the second at once, with no settle time, sealed
    first when it is not (multi-node: this node's part of it). Returns that checkpoint's
    name (None: the first tier holds none committed). The backoff is the caller's to lift
    (``w.urgent``: :meth:`~.watch.Watcher.drain_newest`)."""
    tiers = w.config.tiers
    if len(tiers) < 2:
        return None
    if w.node_rank is not None:
        from .multinode import node_pass

        name = newest_settled_part(w, w.list_tier(p, tiers[0]) or {})
        if name is not None:
            node_pass(w, p, only=name)
        return name
    first = w.list_tier(p, tiers[0])
    after = w.list_tier(p, tiers[1])
    name = newest_committed(first or {})
    if name is None or after is None:
        return name
    if name in after and after[name].state in COMMITTED:
        return name  # already there
    row = first[name]
    if seal_in_place(w, p, row):
        hop(w, p, tiers[0], tiers[1], row, name)
    return name
