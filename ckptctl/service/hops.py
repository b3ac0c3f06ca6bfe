"""A watch's hops: a ready first-tier checkpoint sealed where it is (:func:`seal_in_place`,
adopting no file its format does not name: :func:`refuse_adopting`), then promoted down
the tiers (:func:`promote_down`), one checkpoint at a time per tier pair, oldest first,
each :func:`hop` a ``promote`` with the destination tier's ``pack`` and ``bwlimit``; the
source tier is trimmed as soon as a hop out of it is committed.

The functions take the :class:`~.watch.Watcher` (``w``) whose config, status and event
log they use, and the :class:`~.results.WatchPass` (``p``) that records what they did."""
from __future__ import annotations

from dataclasses import replace

from ..errors import CkptError, Finding, StorageError
from ..tiering.config import Tier
from ..tiering.policy import COMMITTED
from .drains import drain_rate
from .results import Hop, iso_time
from .trims import retain_rows


def seal_in_place(w, p, row) -> bool:
    """Seal a first-tier checkpoint (its listing ``row``) where it is (nothing to do when
    it is sealed); False when it failed or its retry is not due (a failure recorded)."""
    from ..integrity.seal import seal

    tier = w.config.tiers[0]
    if row.state == "sealed":
        return True
    key = f"seal {tier.name}:{row.name}"
    waiting = w.backing_off(key, w.clock())
    if waiting is not None:
        p.failed.append(waiting)
        return False
    try:
        refuse_adopting(row.url, tier.storage_options, row.located)
        seal(row.url, tier.storage_options)
    except (CkptError, OSError) as e:
        w.fail(p, key, "seal", tier.name, row.name, e)
        return False
    w.succeed(key)
    p.sealed.append(row.name)
    w.event("sealed", tier=tier.name, name=row.name, url=row.url)
    return True


def refuse_adopting(url: str, storage_options: dict | None = None,
                    located: tuple | None = None) -> None:
    """A seal by watch adopts nothing its checkpoint's format does not name: a
    :class:`~ckptctl.errors.Finding` (``FOREIGN_FILES``) naming the other files of the
    checkpoint at ``url`` (the check ``rm`` makes,
    :func:`~ckptctl.catalog.ownership.refuse_foreign`), whose manifest would otherwise own
    them, and whose trims would take them from every tier. ``located``: its listing, when
    ``ls`` has it.

    >>> refuse_adopting("hot/step-1", None,  # doctest: +ELLIPSIS
    ...                 (None, {".metadata": 1, "NOTES.md": 3}, None))
    Traceback (most recent call last):
    ckptctl.errors.Finding: hot/step-1: holds files that are not the checkpoint's (NOTES.md); ...
    """
    from ..catalog.ownership import refuse_foreign
    from ..formats.detect import locate

    _store, files, single = located or locate(url, storage_options)
    refuse_foreign(url, files, single=single, advice=f"seal it by hand to adopt them "
                   f"(ckptctl seal {url}), or move them away")


def promote_down(w, p, listings: list, movable: set, start: int = 0) -> None:
    """Promote hop by hop from tier ``start`` on, appending each next tier's listing
    to ``listings``; from the first tier only the names in ``movable``, never a
    re-root's staged copy (gc's, beside the pack it replaces)."""
    from ..formats.pack import reroot_target

    tiers = w.config.tiers
    for i in range(start, len(tiers) - 1):
        src, dst = tiers[i], tiers[i + 1]
        rows = listings[i]
        after = w.list_tier(p, dst)
        if rows is not None and after is not None:
            _adopt_interrupted(w, src, dst, after)
            todo = [n for n, r in rows.items() if r.state in COMMITTED
                    and (i > 0 or n in movable) and reroot_target(n) is None
                    and not (n in after and after[n].state in COMMITTED)]
            for name in todo:
                if not hop(w, p, src, dst, rows[name], name):
                    done = {h.name for h in p.promoted if h.dst == dst.name}
                    for rest in todo[todo.index(name) + 1:]:
                        if rest not in done:
                            p.pending.append({"tier": src.name, "name": rest,
                                              "why": f"waiting for {dst.name}"})
                    break
                # committed in dst (promote commits last): the source tier is trimmed
                # now, not at the end of the pass, so a slow next tier does not let
                # the source fill up with what it already holds
                after[name] = replace(rows[name], url=dst.url.rstrip("/") + "/" + name)
                retain_rows(w, p, i, rows, after)
            if any(h.dst == dst.name for h in p.promoted):
                after = w.list_tier(p, dst)
        listings.append(after)


def _adopt_interrupted(w, src: Tier, dst: Tier, after: dict) -> None:
    """Log the hop of a killed watcher that committed before it died (its event was
    never written): a "promoted" event with action ``committed-before-restart``, so
    the event log explains every later removal from ``src``."""
    was = w.interrupted
    if not was or (was.get("src"), was.get("dst")) != (src.name, dst.name):
        return
    w.interrupted = None
    row = after.get(was.get("name"))
    if row is not None and row.state in COMMITTED:
        w.event("promoted", name=row.name, src=src.name, dst=dst.name,
                action="committed-before-restart", bytes=row.bytes, pack=dst.pack)


def hop(w, p, src: Tier, dst: Tier, row, name: str) -> bool:
    """Promote one checkpoint (``row``, its listing in ``src``) to ``dst``; False when it
    failed in a way that stops this tier pair for the pass (the destination or the
    network, not this checkpoint)."""
    from ..tiering.promote import promote

    key = f"promote {src.name}->{dst.name}:{name}"
    waiting = w.backing_off(key, w.clock())
    if waiting is not None:
        p.failed.append(waiting)
        return False
    url = dst.url.rstrip("/") + "/" + name
    w.status["in_flight"] = {"name": name, "src": src.name, "dst": dst.name,
                             "since": iso_time(w.clock())}
    w.save()
    w.tell({"event": "hop-started", "name": name, "src": src.name, "dst": dst.name,
            "bytes": row.bytes})
    try:
        r = promote(row.url, url, src.storage_options, dst.storage_options,
                    bwlimit=dst.bwlimit, pack=dst.pack, on_bytes=w.touch,
                    max_chain=dst.max_chain)
    except (CkptError, OSError) as e:
        w.fail(p, key, "promote", dst.name, name, e)
        # a finding is about this checkpoint: the others may still go
        return isinstance(e, Finding) and not isinstance(e, StorageError)
    finally:
        w.status["in_flight"] = None
    w.succeed(key)
    done = Hop(name, src.name, dst.name, r.action, r.bytes, r.bytes_sent, r.seconds)
    p.promoted.append(done)
    w.record_done(name, src.name, dst.name, r.action, r.bytes, r.seconds,
                  rate=drain_rate(r.bytes, r.bytes_sent, r.seconds, pack=dst.pack))
    w.event("promoted", name=name, src=src.name, dst=dst.name, action=r.action,
            bytes=r.bytes, bytes_sent=r.bytes_sent, seconds=r.seconds,
            bytes_per_second=round(done.rate), pack=dst.pack)
    return True
