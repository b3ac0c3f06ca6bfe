"""A watch's trims: each tier's ``keep`` applied by gc (:func:`retain`, :func:`trim`) behind
the rail (:func:`rail`): in every tier but the last, a checkpoint not yet committed in the
next tier is kept, and everything is kept when the next tier cannot be listed. A failed
trim is recorded with its backoff and never turns into a deletion.

The functions take the :class:`~.watch.Watcher` (``w``) whose config, status and event
log they use, and the :class:`~.results.WatchPass` (``p``) that records what they did.

>>> rail(["step-1"], "warm", None)
{'step-1': 'warm cannot be listed'}
"""
from __future__ import annotations

from ..errors import CkptError
from ..tiering.policy import COMMITTED


def rail(names, nxt: str, after: dict | None) -> dict[str, str]:
    """What the rail keeps of a tier's checkpoints ``names`` whatever its keep table says
    (name -> why): each one not yet committed in the next tier ``nxt``, whose listing is
    ``after`` (None: it could not be listed, and every one is kept).

    >>> from types import SimpleNamespace as Row
    >>> rail(["s-1", "s-2"], "warm", {"s-1": Row(state="sealed"), "s-2": Row(state="incomplete")})
    {'s-2': 'not yet in warm'}
    """
    protect: dict[str, str] = {}
    for name in names:
        if after is None:
            protect[name] = f"{nxt} cannot be listed"
        elif not (name in after and after[name].state in COMMITTED):
            protect[name] = f"not yet in {nxt}"
    return protect


def retain(w, p, i: int, listings: list) -> None:
    """Apply tier i's keep, with the "not yet in NEXT" rail (``listings``: the tiers'
    listings by index, None where a tier could not be listed)."""
    last = i + 1 >= len(w.config.tiers)
    retain_rows(w, p, i, listings[i], None if last else listings[i + 1])


def retain_rows(w, p, i: int, rows: dict | None, after: dict | None) -> None:
    """Apply tier i's keep to its listing ``rows``, with the rail from ``after``, the
    next tier's listing (None: it could not be listed); what is removed leaves
    ``rows``."""
    tier = w.config.tiers[i]
    if not tier.keep or not rows:
        return  # nothing kept to apply, nothing listed (or not listable) to trim
    key = f"gc {tier.name}"
    waiting = w.backing_off(key, w.clock())  # asked once: a retry may fall due between two
    if waiting is not None:
        p.failed.append(waiting)
        return
    protect: dict[str, str] = {}
    if i + 1 < len(w.config.tiers):
        protect = rail(rows, w.config.tiers[i + 1].name, after)
    for name in trim(w, p, key, tier, protect, set(rows)):
        rows.pop(name, None)


def trim(w, p, key: str, tier, protect: dict[str, str], listed: set[str],
         policy=None, **gc_kw) -> list[str]:
    """gc one tier with its keep table (or ``policy``), the ``protect`` rail, and
    ``listed``: what this pass saw there, so a checkpoint written since (not judged by
    the rail yet) is kept until the next pass. Returns the names removed; a failure is
    recorded under ``key``."""
    from ..tiering.gc import gc
    from ..tiering.policy import Policy

    try:
        policy = policy or Policy.from_dict(tier.keep, where=f"tier {tier.name}")
        r = gc(tier.url, policy, tier.storage_options, protect=protect, listed=listed,
               reroot=tier.pack, max_chain=tier.max_chain, **gc_kw)
    except (CkptError, OSError) as e:
        w.fail(p, key, "gc", tier.name, None, e)
        return []
    w.succeed(key)
    p.kept[tier.name] = list(r.decision.keep)
    p.removed.setdefault(tier.name, []).extend(c.name for c in r.removed)
    for c in r.removed:
        w.event("removed", tier=tier.name, name=c.name, bytes=c.bytes)
    return [c.name for c in r.removed]
