"""Retention policy: which checkpoints ``gc`` keeps, and why (restic's ``forget`` is the model).

:func:`apply_policy` is a pure function of the checkpoints (:class:`Item`), a
:class:`Policy`, the time ``now`` and the grace period: no I/O, so ``gc --dry-run`` and a
real run decide from the same call, and the tests can replay any history.

Policy words (``--keep-*`` flags, or a tier's ``keep = {...}`` table):

* ``last N``: the N newest committed checkpoints (by step, then time, then name);
* ``every STEPS``: one checkpoint per STEPS steps, the lowest step of each block
  ``[k*STEPS, (k+1)*STEPS)`` (so exactly the multiples of STEPS where they exist);
* ``within DUR``: every checkpoint made within DUR of the newest committed one (not of
  ``now``: a run that stalled for a month keeps its history, as restic does);
* ``hourly N`` / ``daily N``: the newest checkpoint of each of the N most recent UTC hours
  (days) that have one;
* ``tags T...``: every checkpoint whose manifest carries one of the tags.

They apply to committed checkpoints (state ``sealed`` or ``complete``); ``last`` and
``every`` rank only checkpoints with a step. A checkpoint is kept when any word keeps it.
Rails hold whatever the policy says: the newest committed checkpoint (with a step), a
pinned one, the base of a kept pack (transitively), one without a step (nothing ranks it:
"no step"), a delta pack whose base is missing (its own files are whole: it restores once
the base is named), and an incomplete or corrupt one younger than the grace period (it
may be being written) are never removed; a
checkpoint whose state cannot be read here (``unknown``) is kept, and so is a corrupt one
that no committed checkpoint supersedes (newer by step): what this version cannot read
may be what a newer framework wrote, and a run whose every checkpoint reads as corrupt
loses nothing. Words and rails rank checkpoints within their series (``Item.series``:
``gc`` gives each folder of checkpoints its own), so every run under a root keeps its
newest; pack bases are followed across series.

>>> items = [Item(f"step-{s}", s, 1000.0 + s, "sealed") for s in (100, 200, 300, 400)]
>>> d = apply_policy(items, Policy(last=2), now=2000.0)
>>> d.keep, d.remove
({'step-400': ['last 2', 'newest committed'], 'step-300': ['last 2']}, ['step-200', 'step-100'])
"""
from __future__ import annotations

import datetime as dt
import math
import re
from dataclasses import dataclass, field

from ..errors import UsageError

COMMITTED = ("sealed", "complete")
#: Default of ``--incomplete-grace``: an incomplete or corrupt checkpoint untouched this
#: long is taken as dead. No checkpoint write goes a day without touching a file, and an
#: S3 multipart upload abandoned for a day is what lifecycle rules usually abort.
DEFAULT_GRACE = "24h"

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, "y": 365 * 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdwy])")
_KEYS = ("last", "every", "within", "hourly", "daily", "tags")


def parse_duration(text: str | int | float) -> float:
    """Seconds in a duration: ``30d``, ``12h``, ``90m``, ``1d12h``, ``2w``, ``5y`` (365 d),
    ``45s`` (``m`` is minutes), or a plain number of seconds. UsageError (exit 2) on
    anything else.

    >>> parse_duration("30d"), parse_duration("1h30m"), parse_duration("90"), parse_duration(5)
    (2592000.0, 5400.0, 90.0, 5.0)
    >>> parse_duration("1.5y") == 1.5 * 365 * 86400
    True
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip().lower()
        try:
            value = float(s)
        except ValueError:
            parts = _DURATION.findall(s)
            if not parts or "".join(n + u for n, u in parts) != s:
                raise UsageError(f"not a duration: {text!r} (try 5y, 30d, 12h, 90m, 1d12h, 45s)") \
                    from None
            value = sum(float(n) * _UNITS[u] for n, u in parts)
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"not a duration: {text!r} (must be a finite, non-negative time)")
    return value


def format_duration(seconds: float) -> str:
    """The shortest ``1d12h``-style spelling of ``seconds`` (fractions of a second dropped).

    >>> format_duration(2592000), format_duration(5400), format_duration(0), format_duration(90061)
    ('30d', '1h30m', '0s', '1d1h1m1s')
    """
    left, out = int(seconds), []
    for unit in ("d", "h", "m", "s"):
        n, left = divmod(left, _UNITS[unit])
        if n:
            out.append(f"{n}{unit}")
    return "".join(out) or "0s"


@dataclass(frozen=True)
class Policy:
    """What to keep; every field None (or no tags) is the empty policy, which ``gc`` refuses.

    >>> Policy(last=3, every=5000).describe()
    'keep the last 3, one every 5000 steps'
    >>> Policy().is_empty
    True
    """

    last: int | None = None
    every: int | None = None
    within: float | None = None
    hourly: int | None = None
    daily: int | None = None
    tags: tuple[str, ...] = ()

    def __post_init__(self):
        for key in ("last", "every", "hourly", "daily"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise UsageError(f"keep {key} must be a positive whole number, not {v!r}")
        if self.within is not None and (not math.isfinite(self.within) or self.within <= 0):
            raise UsageError(f"keep within must be a positive duration, not {self.within!r}")
        if any(not isinstance(t, str) or not t for t in self.tags):
            raise UsageError(f"keep tags must be non-empty strings, not {list(self.tags)!r}")

    @property
    def is_empty(self) -> bool:
        return all(getattr(self, k) is None for k in _KEYS[:-1]) and not self.tags

    @classmethod
    def from_dict(cls, table: dict, where: str | None = None) -> "Policy":
        """A tier config's ``keep = {last = 10, every = 5000, within = "30d", hourly = 24,
        daily = 7, tags = ["release"]}``; UsageError (exit 2) naming the key on bad input.

        >>> Policy.from_dict({"last": 2, "within": "7d", "tags": "release"})
        Policy(last=2, every=None, within=604800.0, hourly=None, daily=None, tags=('release',))
        >>> Policy.from_dict({"lats": 2}, "ckptctl.toml")
        Traceback (most recent call last):
        ckptctl.errors.UsageError: ckptctl.toml: keep: unknown key 'lats' (known: last, every, within, hourly, daily, tags)
        """
        if not isinstance(table, dict):
            raise UsageError(f"keep must be a table like {{last = 3}}, not {table!r}", where)
        for key in table:
            if key not in _KEYS:
                raise UsageError(f"keep: unknown key {key!r} (known: {', '.join(_KEYS)})", where)
        try:
            tags = table.get("tags", ())
            tags = (tags,) if isinstance(tags, str) else tags
            if not isinstance(tags, (list, tuple)):
                raise UsageError(f"keep tags must be a list of strings, not {tags!r}")
            within = table.get("within")
            return cls(last=table.get("last"), every=table.get("every"),
                       within=None if within is None else parse_duration(within),
                       hourly=table.get("hourly"), daily=table.get("daily"),
                       tags=tuple(tags))
        except UsageError as e:
            raise UsageError(e.message if e.message.startswith("keep") else
                             f"keep: {e.message}", where) from None

    def describe(self) -> str:
        """The policy in words, for a report's header."""
        words = []
        if self.last:
            words.append(f"the last {self.last}")
        if self.every:
            words.append(f"one every {self.every} steps")
        if self.within:
            words.append(f"all within {format_duration(self.within)} of the newest")
        if self.hourly:
            words.append(f"{self.hourly} hourly")
        if self.daily:
            words.append(f"{self.daily} daily")
        if self.tags:
            words.append("tags " + ", ".join(self.tags))
        return "keep " + ", ".join(words) if words else "keep nothing (empty policy)"

    @property
    def bound(self) -> int | None:
        """The most checkpoints of one series this policy keeps, pinned ones and writes
        in progress aside; None when that grows with the run (``every``, ``within``,
        ``tags``). Without ``last``, the newest committed one (a rail) may come on top.

        >>> Policy(last=4).bound, Policy(hourly=24, daily=7).bound, Policy(every=5000).bound
        (4, 32, None)
        """
        if self.every or self.within or self.tags:
            return None
        n = (self.last or 0) + (self.hourly or 0) + (self.daily or 0)
        return n if self.last else n + 1

    def holds(self, *, pack: bool = False, reroot: bool = False,
              max_chain: int = 8) -> str:
        """What a place under this policy holds at most, in words. ``pack``: it stores
        delta packs, each of which keeps its bases; ``reroot``: a pack kept only as a base
        is re-rooted (``gc`` of a pack tier), so the count is exact.

        >>> Policy(last=4).holds(pack=True, reroot=True)
        'holds at most 4 checkpoints (keep the last 4; packs kept only as bases are re-rooted)'
        >>> Policy(last=4).holds(pack=True, max_chain=8)
        'holds at most 36 checkpoints (keep the last 4, each pack with up to 8 bases; re-rooting holds it to 4)'
        >>> Policy(every=5000).holds()
        'holds a number that grows with the run (keep one every 5000 steps)'
        """
        n = self.bound
        if n is None:
            return f"holds a number that grows with the run ({self.describe()})"

        def most(k: int) -> str:
            return f"holds at most {k} checkpoint{'s' if k != 1 else ''}"

        if not pack:
            return f"{most(n)} ({self.describe()})"
        if reroot:
            return f"{most(n)} ({self.describe()}; packs kept only as bases are re-rooted)"
        return (f"{most(n * (max_chain + 1))} ({self.describe()}, each pack with up to "
                f"{max_chain} bases; re-rooting holds it to {n})")


@dataclass(frozen=True)
class Item:
    """One checkpoint as the policy sees it. ``time``: seconds since the epoch (the
    manifest's creation time, else the commit marker's mtime); ``id``/``base``: the
    manifest's content id and, for a pack, the id of the checkpoint it is a delta of."""

    name: str
    step: int | None
    time: float | None
    state: str
    pinned: bool = False
    tags: tuple[str, ...] = ()
    id: str | None = None
    base: str | None = None
    #: checkpoints of one series (``gc``: the folder holding them, one run) are ranked
    #: against each other only: every run under a root keeps its own newest, its own last N
    series: str = ""
    #: a delta pack whose own files are whole but whose base chain is not (``incomplete``
    #: with ``MISSING_BASE``): no unfinished write, and restorable once its base is named
    #: (``unpack --base``), so never removed as garbage
    missing_base: bool = False
    #: delta packs elsewhere (URLs) that need this checkpoint as their base: kept, and
    #: so is its own chain
    needed_by: tuple[str, ...] = ()
    #: a ckptctl process on this host is writing it right now (its writing marker says
    #: so, and the process runs): kept whatever the grace period
    live_writer: str | None = None

    @property
    def committed(self) -> bool:
        return self.state in COMMITTED


@dataclass
class Decision:
    """``keep``: name -> reasons, newest first; ``remove``: names, newest first."""

    keep: dict[str, list[str]] = field(default_factory=dict)
    remove: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"keep": {k: list(v) for k, v in self.keep.items()}, "remove": list(self.remove)}


def newest_first(items) -> list[Item]:
    """Items ordered newest first: by step (step-less ones last), then time, then name.

    >>> [i.name for i in newest_first([Item("a", 5, 1, "sealed"), Item("b", None, 9, "sealed"),
    ...                               Item("c", 7, 0, "sealed")])]
    ['c', 'a', 'b']
    """
    from ..model import natural_key

    def key(i: Item):
        return (i.step is not None, i.step or 0, i.time or 0.0, natural_key(i.name))

    return sorted(items, key=key, reverse=True)


def _bucket(ts: float, hourly: bool) -> str:
    t = dt.datetime.fromtimestamp(ts, dt.timezone.utc)
    return t.strftime("%Y-%m-%dT%H" if hourly else "%Y-%m-%d")


def _series_reasons(ordered: list[Item], policy: Policy, now: float, grace: float,
                    reasons: dict[str, list[str]]) -> None:
    """Add the policy's and the rails' reasons for one series (newest first) to ``reasons``."""
    committed = [i for i in ordered if i.committed]
    ranked = [i for i in committed if i.step is not None]  # a step-less one has no rank

    for i in committed:  # tags are not counted, as in restic
        reasons[i.name] += [f"tag {t}" for t in policy.tags if t in i.tags]
    if policy.last:
        for i in ranked[:policy.last]:
            reasons[i.name].append(f"last {policy.last}")
    if policy.every:
        lowest: dict[int, Item] = {}
        for i in ranked:  # newest first: the last one seen per block has its lowest step
            lowest[i.step // policy.every] = i
        for i in lowest.values():
            reasons[i.name].append(f"every {policy.every} steps")
    timed = sorted((i for i in committed if i.time is not None),
                   key=lambda i: (i.time, i.step or 0, i.name), reverse=True)
    if policy.within and timed:
        newest = min(timed[0].time, now)  # a clock in the future does not widen the window
        for i in timed:
            if i.time >= newest - policy.within:
                reasons[i.name].append(f"within {format_duration(policy.within)}")
    for count, hourly in ((policy.hourly, True), (policy.daily, False)):
        if not count:
            continue
        seen: set[str] = set()
        for i in timed:
            b = _bucket(i.time, hourly)
            if b not in seen and len(seen) < count:
                seen.add(b)
                reasons[i.name].append("hourly checkpoint" if hourly else "daily checkpoint")

    # rails: whatever the policy says
    if ranked:
        reasons[ranked[0].name].append("newest committed")
    superseded = set(i.name for i in ordered[ordered.index(ranked[0]) + 1:]) \
        if ranked else set()
    for i in ordered:
        if i.pinned:
            reasons[i.name].append("pinned")
        for url in i.needed_by[:3]:
            reasons[i.name].append(f"base of {url}")
        if i.live_writer:
            reasons[i.name].append(f"being written ({i.live_writer})")
        if i.step is None and not reasons[i.name]:
            reasons[i.name].append("no step")  # nothing to rank it by: never garbage
        elif i.missing_base:
            reasons[i.name].append("its base is missing (restore with unpack --base, or rm)")
        elif i.state == "unknown":
            reasons[i.name].append("state unknown")
        elif not i.committed and not i.pinned and (i.time is None or now - i.time < grace):
            reasons[i.name].append(f"{i.state}, younger than grace")
        elif i.state == "corrupt" and not i.pinned and i.name not in superseded:
            # what this ckptctl cannot read may be what a newer framework wrote: only a
            # newer committed checkpoint makes a corrupt one garbage
            reasons[i.name].append("corrupt, newer than the newest committed")


def apply_policy(items, policy: Policy, *, now: float, grace: float = 86400.0,
                 protect: dict[str, str] | None = None) -> Decision:
    """Decide, for every item, keep (with its reasons) or remove. Pure: same inputs, same
    decision. Every item lands in exactly one of ``keep`` and ``remove``. ``protect``
    (name -> reason): kept whatever the policy says (``watch``: "not yet in warm"; ``gc``:
    "holds files not its own"), and like any kept pack, with its base chain.

    >>> h = [Item("step-5000", 5000, 10.0, "sealed"), Item("step-6000", 6000, 20.0, "sealed"),
    ...      Item("step-7000", 7000, 30.0, "incomplete"), Item("step-100", 100, 5.0, "sealed", pinned=True)]
    >>> d = apply_policy(h, Policy(every=5000), now=40.0, grace=3600)
    >>> d.keep
    {'step-7000': ['incomplete, younger than grace'], 'step-6000': ['newest committed'], 'step-5000': ['every 5000 steps'], 'step-100': ['every 5000 steps', 'pinned']}
    >>> d.remove
    []
    >>> apply_policy(h, Policy(last=1), now=40.0, grace=3600,
    ...              protect={"step-5000": "not yet in warm"}).keep["step-5000"]
    ['not yet in warm']
    """
    if policy.is_empty:
        raise UsageError("empty policy: give at least one --keep-* rule (gc never removes "
                         "everything)")
    ordered = newest_first(items)
    names = [i.name for i in ordered]
    if len(set(names)) != len(names):
        raise UsageError("two checkpoints have the same name: "
                         + next(n for n in names if names.count(n) > 1))
    reasons: dict[str, list[str]] = {i.name: [] for i in ordered}
    series: dict[str, list[Item]] = {}
    for i in ordered:
        series.setdefault(i.series, []).append(i)
    for members in series.values():
        _series_reasons(members, policy, now, grace, reasons)
    for name, why in (protect or {}).items():
        if name in reasons and why not in reasons[name]:
            reasons[name].append(why)
    by_id = _committed_by_id(ordered)
    _keep_bases(reasons, [i for i in ordered if reasons[i.name] and i.base], by_id,
                lambda i: i.base)
    return Decision({n: r for n, r in reasons.items() if r},
                    [n for n, r in reasons.items() if not r])


#: The reason a checkpoint is kept only because a kept pack needs it (its delta base).
BASE_OF_KEPT = "base of kept "


def _committed_by_id(ordered: list[Item]) -> dict[str, list[Item]]:
    by_id: dict[str, list[Item]] = {}
    for i in ordered:
        if i.committed and i.id:
            by_id.setdefault(i.id, []).append(i)
    return by_id


def _keep_bases(reasons: dict[str, list[str]], todo: list[Item],
                by_id: dict[str, list[Item]], base_of) -> None:
    """A kept pack (``todo``) keeps its base (``base_of(item)``: the id it is a delta
    of), and so on down the chain: ``base of kept NAME`` added to ``reasons``."""
    while todo:
        i = todo.pop()
        for b in by_id.get(base_of(i), []):
            why = f"{BASE_OF_KEPT}{i.name}"
            if why not in reasons[b.name]:
                if not reasons[b.name] and base_of(b):
                    todo.append(b)
                reasons[b.name].append(why)


@dataclass(frozen=True)
class Reroot:
    """A kept pack to write again so that the bases kept only for it can go (DESIGN.md: a
    retention count is exact). ``was``: the checkpoints holding its base now; ``base``:
    the one it is packed against instead (a checkpoint kept for its own sake, older, of
    its series), None for a full pack; ``frees``: what is then removed that its chain
    kept."""

    name: str
    was: tuple[str, ...]
    base: str | None
    frees: tuple[str, ...] = ()


def plan_reroots(items, decision: Decision, *, rerootable=None,
                 full=()) -> tuple[list[Reroot], Decision]:
    """The re-roots that make ``decision`` (:func:`apply_policy`'s, over ``items``) keep
    only what is kept for its own sake, and the decision once they are done. Pure.

    A committed pack kept for a reason of its own whose base is kept only as a base (no
    checkpoint with the base's id is kept otherwise, nor needed by a kept pack that
    cannot be re-rooted: a write in progress, a corrupt one) is re-rooted, oldest first:
    against the nearest older checkpoint of its series kept for its own sake (committed,
    not made from it), or as a full pack (``full``: names that must be full; no such
    checkpoint). Packs made against a re-rooted one are untouched: it keeps its
    checkpoint id. ``rerootable``: the names that may be re-rooted (``gc``: the packs
    of the listing); None: every committed item.

    >>> h = [Item(f"s-{s}", s, float(s), "sealed", id=f"i{s}", base=f"i{s - 1}" if s > 1 else None)
    ...      for s in range(1, 7)]
    >>> d = apply_policy(h, Policy(last=2), now=10.0)
    >>> d.remove
    []
    >>> plan, after = plan_reroots(h, d)
    >>> plan
    [Reroot(name='s-5', was=('s-4',), base=None, frees=('s-4', 's-3', 's-2', 's-1'))]
    >>> after.keep, after.remove
    ({'s-6': ['last 2', 'newest committed'], 's-5': ['last 2', 'base of kept s-6']}, ['s-4', 's-3', 's-2', 's-1'])
    """
    ordered = newest_first(items)
    by_name = {i.name: i for i in ordered}
    by_id = _committed_by_id(ordered)
    own = {n: [r for r in why if not r.startswith(BASE_OF_KEPT)]
           for n, why in decision.keep.items()}
    own = {n: why for n, why in own.items() if why and n in by_name}

    def movable(i: Item) -> bool:
        return bool(i.committed and i.base and i.id
                    and (rerootable is None or i.name in rerootable))

    fixed = [by_name[n] for n in own if by_name[n].base and not movable(by_name[n])]
    held: dict[str, list[str]] = {i.name: [] for i in ordered}
    _keep_bases(held, fixed, by_id, lambda i: i.base)
    keep = set(own) | {n for n, why in held.items() if why}
    new_base: dict[str, str | None] = {}  # re-rooted name -> the id it is made against
    plan = []
    for i in reversed(ordered):  # oldest first: a re-rooted one may be the next one's base
        was = tuple(b.name for b in by_id.get(i.base, [])) if i.base else ()
        if i.name not in own or not movable(i) or not was or any(n in keep for n in was):
            continue
        base = None if i.name in full else _nearest_kept(i, ordered, own, by_id, new_base)
        new_base[i.name] = by_name[base].id if base else None
        plan.append(Reroot(i.name, was, base))
    if not plan:
        return [], decision

    def base_of(i: Item) -> str | None:
        return new_base[i.name] if i.name in new_base else i.base

    reasons = {i.name: list(own.get(i.name, [])) for i in ordered}
    _keep_bases(reasons, [i for i in ordered if reasons[i.name] and base_of(i)], by_id,
                base_of)
    after = Decision({n: r for n, r in reasons.items() if r},
                     [n for n, r in reasons.items() if not r])
    gone = set(after.remove)
    return [Reroot(r.name, r.was, r.base, _chain_names(by_name[r.name], by_id, gone))
            for r in plan], after


def _nearest_kept(i: Item, ordered: list[Item], own: dict, by_id: dict,
                  new_base: dict) -> str | None:
    """The nearest checkpoint older than ``i`` in its series that is kept for its own sake,
    committed, and not made (through its chain) from ``i``; None if there is none."""
    for c in ordered[ordered.index(i) + 1:]:
        if c.series != i.series or c.name not in own or not c.committed or not c.id \
                or c.id == i.id:
            continue
        seen, cur = set(), c
        while cur is not None and cur.name not in seen:  # never a base made from i
            seen.add(cur.name)
            b = new_base[cur.name] if cur.name in new_base else cur.base
            if b == i.id:
                break
            cur = by_id.get(b, [None])[0] if b else None
        else:
            return c.name
    return None


def _chain_names(i: Item, by_id: dict, among: set[str]) -> tuple[str, ...]:
    """The names of ``i``'s base chain (nearest first) that are in ``among``."""
    out: list[str] = []
    todo, seen = [i.base], set()
    while todo:
        b = todo.pop(0)
        if not b or b in seen:
            continue
        seen.add(b)
        for x in by_id.get(b, []):
            if x.name in among and x.name not in out:
                out.append(x.name)
            todo.append(x.base)
    return tuple(out)
