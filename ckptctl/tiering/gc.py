"""``gc``: apply a retention policy to the checkpoints under a root.

One listing of the root (:func:`~ckptctl.catalog.ls.ls`, which also sees pins and reads
manifests for tags, ids and pack bases), one pure decision
(:func:`~ckptctl.tiering.policy.apply_policy`; checkpoints in different folders are different
series, so a root holding several runs keeps each run's newest and last N), then each
checkpoint to remove is deleted
marker first (:func:`~ckptctl.writing.removal.remove_checkpoint`), oldest first; on a remote
root, many at once in phases across them (:func:`remove_batched`: DeleteObjects batches
of up to 1,000 keys). A big remote root is classified from its one listing (``ls``'s
``check="auto"``) and only the rows the decision rests on are read (:func:`settle`).
Unfinished multipart uploads under the root older than the grace period are aborted (S3;
ckptctl's own hidden ``.upload`` files locally). ``dry_run`` computes the very same plan and
deletes nothing: a real run right after does exactly what it printed.

>>> r = gc("/ckpt/run1", Policy(last=3), dry_run=True)         # doctest: +SKIP
>>> r.decision.remove                                          # doctest: +SKIP
['step-300', 'step-200', 'step-100']
"""
from __future__ import annotations

import datetime as dt
import posixpath
import time
from dataclasses import dataclass, field

from ..errors import CkptError, StorageError, UsageError
from ..formats.pack import DEFAULT_MAX_CHAIN
from ..catalog.ls import CheckpointRow, iso_utc, ls
from ..catalog.ownership import foreign_list, split_owned
from .policy import (DEFAULT_GRACE, Decision, Item, Policy, apply_policy, newest_first,
                     parse_duration)


@dataclass
class GcCheckpoint:
    name: str
    url: str
    step: int | None
    state: str
    pinned: bool
    action: str  # "keep" or "remove"
    reasons: list[str]
    bytes: int
    time: float | None  # what the time rules rank by: ``created``, else ``modified``
    #: newest modification time as the listing shows it (``ls``'s ``modified``)
    modified: float | None = None
    #: when it was sealed: its manifest's ``created`` (kept by every copy), else None
    created: float | None = None


@dataclass
class GcUpload:
    url: str
    upload_id: str
    initiated: float | None
    action: str  # "abort" (older than the grace period) or "keep"


@dataclass
class GcReroot:
    """A pack re-rooted so that the bases kept only for it can go (a pack tier: the count
    is exact). ``was``: what held its base; ``base``/``base_url``: what it is made
    against after (None: a full pack), ``depth`` then; ``frees``: what that lets go.
    ``action``: ``would re-root``, ``re-rooted``, ``failed`` (``reason`` says why: the
    pack and its bases stay), or for a re-root a crash interrupted, ``would finish``,
    ``finished``, ``would discard`` / ``discarded`` (its leftovers cleared: the pack was
    not touched yet, or is done) or ``busy`` (another process)."""

    name: str
    url: str
    was: tuple[str, ...]
    base: str | None
    base_url: str | None
    depth: int
    frees: tuple[str, ...]
    action: str
    reason: str | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "url": self.url, "base_was": list(self.was),
                "base_name": self.base, "base_url": self.base_url, "depth": self.depth,
                "frees": list(self.frees), "action": self.action, "reason": self.reason}


@dataclass
class GcResult:
    root: str
    policy: str
    dry_run: bool
    grace: float
    now: float
    decision: Decision
    checkpoints: list[GcCheckpoint] = field(default_factory=list)
    uploads: list[GcUpload] = field(default_factory=list)
    #: False where the store cannot list unfinished uploads (then none are reported)
    uploads_checked: bool = False
    #: name -> files that are not the checkpoint's: the policy would remove it, but gc
    #: deletes only what it recognises (a finding: the CLI exits 1)
    blocked: dict[str, list[str]] = field(default_factory=dict)
    #: packs re-rooted (``reroot``), and re-roots a crash interrupted, finished
    reroots: list[GcReroot] = field(default_factory=list)
    #: what the root holds at most under the policy, in words, and as a number (None:
    #: it grows with the run, or pack bases come on top)
    holds: str = ""
    max_checkpoints: int | None = None

    @property
    def removed(self) -> list[GcCheckpoint]:
        return [c for c in self.checkpoints if c.action == "remove"]

    @property
    def bytes_freed(self) -> int:
        return sum(c.bytes for c in self.removed)

    def to_dict(self) -> dict:
        return {
            "root": self.root, "policy": self.policy, "dry_run": self.dry_run,
            "grace_seconds": self.grace, "now": iso_utc(self.now),
            "keep": {k: list(v) for k, v in self.decision.keep.items()},
            "remove": list(self.decision.remove),
            "bytes": self.bytes_freed,
            "checkpoints": [{"name": c.name, "url": c.url, "step": c.step, "state": c.state,
                             "pinned": c.pinned, "action": c.action, "reasons": c.reasons,
                             "bytes": c.bytes, "modified": iso_utc(c.modified),
                             "created": iso_utc(c.created)}
                            for c in self.checkpoints],
            "blocked": [{"name": n, "foreign_files": f} for n, f in self.blocked.items()],
            "reroots": [r.to_dict() for r in self.reroots],
            "holds": self.holds, "max_checkpoints": self.max_checkpoints,
            "uploads_checked": self.uploads_checked,
            "uploads": [{"url": u.url, "upload_id": u.upload_id,
                         "initiated": iso_utc(u.initiated), "action": u.action}
                        for u in self.uploads],
        }


def _manifest_created(row: CheckpointRow) -> float | None:
    """When the checkpoint was sealed: its manifest's ``created`` (kept by every copy),
    None without a manifest or a time that does not parse.

    >>> from types import SimpleNamespace as NS
    >>> sealed = NS(manifest=NS(created="1970-01-01T00:01:00Z"))
    >>> _manifest_created(sealed), _manifest_created(NS(manifest=None))
    (60.0, None)
    """
    created = getattr(row.manifest, "created", None)
    if created:
        try:
            t = dt.datetime.fromisoformat(str(created).replace("Z", "+00:00"))
            return (t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)).timestamp()
        except ValueError:
            pass
    return None


def _created(row: CheckpointRow) -> float | None:
    """When the checkpoint was made: its manifest's ``created`` (kept by every copy),
    else its commit marker's modification time from the listing."""
    created = _manifest_created(row)
    return row.modified if created is None else created


def _last_touched(row: CheckpointRow) -> float | None:
    """The newest modification time of any of the checkpoint's files (a write in
    progress touches some file; one stat or HEAD each: asked only of an uncommitted
    checkpoint that the marker's time alone would call old)."""
    from ..errors import NotFoundError

    store, files, single = row.located
    times = []
    for rel in [single] if single else files:
        try:
            times.append(store.modified(rel))
        except NotFoundError:  # removed since the listing (another gc): a change
            times.append(time.time())
    times = [t for t in times if t is not None]
    return max(times) if times else None


def _writing_base(row: CheckpointRow) -> str | None:
    """The base id a delta pack being written names in its ``.ckptctl-writing`` marker
    (its index and manifest come last): while gc keeps the write, it keeps that base.
    One small read, only for an unfinished write holding pack data files."""
    import json

    from ..errors import CkptError
    from ..formats.manifest import WRITING_MARKER
    from ..formats.pack import DATA_NAME, PACK_INDEX

    store, files, single = row.located or (None, {}, None)
    if single or WRITING_MARKER not in files or not (
            PACK_INDEX in files or any(DATA_NAME.match(f) for f in files)):
        return None
    try:
        doc = json.loads(store.read(WRITING_MARKER))
    except StorageError:
        raise
    except (CkptError, ValueError):
        return None
    base = doc.get("base") if isinstance(doc, dict) else None
    return base if isinstance(base, str) else None


def _live_writer(row: CheckpointRow) -> str | None:
    """``"pid N on HOST, COMMAND"`` when the row's writing marker names a ckptctl process
    still running on this host (a promote's staging folder, a reshard), else None.
    Local stores only: there the marker costs no request."""
    from ..formats.manifest import WRITING_MARKER
    from ..catalog.writers import live_writer

    store, files, single = row.located
    if single or WRITING_MARKER not in files or not store.is_local:
        return None  # remote: a GET each, and the grace period covers remote writers
    doc = live_writer(store)
    return None if doc is None else \
        f"pid {doc['pid']} on {doc['host']}, {doc.get('command') or 'ckptctl'}"


def gc_items(rows: list[CheckpointRow], *, now: float, grace: float,
             needed: dict[str, list[str]] | None = None) -> list[Item]:
    """The policy's view of an ``ls``: committed checkpoints are dated by creation; an
    uncommitted one by the last time any of its files changed (looked up only when it
    would otherwise be old enough to go). ``needed``: name -> packs elsewhere that need
    it (:func:`needed_elsewhere`)."""
    needed = needed or {}
    items = []
    for r in rows:
        m = r.manifest
        t = _created(r)
        writer = None
        if r.state not in ("sealed", "complete") and not r.pinned and r.located \
                and t is not None and now - t >= grace:
            t = _last_touched(r)
            writer = _live_writer(r) if t is None or now - t >= grace else None
        base = getattr(m, "base", None)
        if base is None and r.state not in ("sealed", "complete"):
            base = _writing_base(r)
        items.append(Item(r.name, r.step, t, r.state, r.pinned,
                          tuple(getattr(m, "tags", None) or ()),
                          m.checkpoint_id if m is not None else None, base,
                          series=posixpath.dirname(r.name),
                          missing_base=r.reason.startswith("MISSING_BASE"),
                          needed_by=tuple(needed.get(r.name, ())), live_writer=writer))
    return items


def needed_elsewhere(rows: list[CheckpointRow],
                     storage_options: dict | None = None) -> dict[str, list[str]]:
    """name -> URLs of the live delta packs outside this root that need that checkpoint
    (:func:`~ckptctl.catalog.ownership.external_dependants`); read only for the rows whose
    listing holds such references."""
    from ..formats.manifest import NEEDED_BY_PREFIX
    from ..catalog.ownership import external_dependants

    listed = {r.url.rstrip("/") for r in rows}  # packs under this root: the policy sees them
    out = {}
    for r in rows:
        if r.located is None or r.located[2] is not None:
            continue
        store, files, _ = r.located
        if any(f.startswith(NEEDED_BY_PREFIX) for f in files):
            urls = [u for u in external_dependants(store, files, None, storage_options)
                    if u.rstrip("/") not in listed]
            if urls:
                out[r.name] = urls
    return out


def settle(rows: list[CheckpointRow], policy: Policy, storage_options: dict | None = None,
           *, now: float, grace: float, needed: dict[str, list[str]] | None = None,
           protect: dict[str, str] | None = None
           ) -> tuple[list[CheckpointRow], list[Item], Decision]:
    """The decision over an ``ls`` whose rows may come from the listing alone
    (``exact`` False), reading only the rows it rests on: ``(rows, items, decision)``,
    the same decision as if every checkpoint had been read (steps taken from names).

    Read (:func:`~ckptctl.catalog.ls.confirm`, with manifests), until nothing changes: every
    provisional row the policy keeps for being committed (the newest, the last N, one per
    block of steps; a row kept only for its pin needs no read), and every provisional one
    to be removed that changed within the grace period (if it read as incomplete it would
    stay). Tags and creation times live in manifests: a policy with ``tags``, ``within``,
    ``hourly`` or ``daily`` reads every provisional row; so does a kept pack whose base is
    not among the rows read (the base is found by its id).

    >>> rows, items, d = settle(ls("s3://b/run", check="listing").checkpoints,
    ...                         Policy(last=2), now=time.time(), grace=86400)  # doctest: +SKIP
    """
    from ..catalog.ls import confirm

    rows = list(rows)
    if any(not r.exact for r in rows) and (policy.tags or policy.within or policy.hourly
                                           or policy.daily):
        rows = confirm(rows, storage_options, manifests=True)
    while True:
        items = gc_items(rows, now=now, grace=grace, needed=needed)
        decision = apply_policy(items, policy, now=now, grace=grace, protect=protect)
        todo = _unsettled(rows, items, decision, now=now, grace=grace)
        if not todo:
            return rows, items, decision
        idx = [i for i, r in enumerate(rows) if r.name in todo]
        for i, r in zip(idx, confirm([rows[i] for i in idx], storage_options, manifests=True)):
            rows[i] = r


def _unsettled(rows: list[CheckpointRow], items: list[Item], decision: Decision, *,
               now: float, grace: float) -> set[str]:
    """The provisional rows whose reading could change ``decision`` (see :func:`settle`)."""
    todo = set()
    for r in rows:
        if r.exact:
            continue
        reasons = decision.keep.get(r.name)
        if reasons is not None:
            if reasons != ["pinned"]:
                todo.add(r.name)
        elif r.located:
            touched = _last_touched(r)  # the listing's times: no request
            if touched is not None and now - touched < grace:
                todo.add(r.name)
    ids = {i.id for i in items if i.id}
    if any(i.base and i.base not in ids for i in items if i.name in decision.keep):
        todo |= {r.name for r in rows if not r.exact}
    return todo


def remove_batched(store, rows: list[CheckpointRow]) -> None:
    """Delete many checkpoints under one remote root (``store``) in few requests, each
    checkpoint in :func:`~ckptctl.writing.removal.remove_checkpoint`'s order, done as phases
    across all of them: a ``.ckptctl-writing`` marker first where needed (one PUT each, S3
    has no batch write; in parallel; not for a checkpoint with a format marker of its own or
    a single data file), then every manifest, then every ``.metadata`` / index
    (each commit marker rank its own DeleteObjects batches, of up to 1,000 keys), then all
    data (pins last), then the writing markers. A crash at any moment leaves each
    checkpoint whole or ``incomplete``. A pinned one is refused (exit 1) before anything
    is written.

    >>> remove_batched(open_store("s3://b/run"), doomed_rows)     # doctest: +SKIP
    """
    import json
    import os
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from ..errors import Finding
    from ..formats.manifest import PIN_FILE, WRITING_MARKER
    from ..writing.commit import is_format_marker
    from ..writing.removal import COMMIT_MARKERS, deletion_order

    plans = []
    for r in rows:
        files = r.located[1]
        if PIN_FILE in files:
            raise Finding(r.url, "pinned; unpin it first (ckptctl unpin)")
        order = deletion_order(files)
        markers = [rel for rel in order if rel.rsplit("/", 1)[-1] in COMMIT_MARKERS]
        plans.append((r.name, markers, order[len(markers):]))
    doc = {"pid": os.getpid(), "host": socket.gethostname(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": "gc"}
    marker = (json.dumps(doc) + "\n").encode()
    # The writing marker is only needed where deleting the commit markers first does not
    # already make the rest read as incomplete: with the format's own marker (.metadata,
    # an HF index) gone, or a single data file (one delete), no marker costs a PUT each.
    names = [name for name, markers, rest in plans
             if not (any(is_format_marker(m) and "/" not in m for m in markers) or len(rest) <= 1)]
    if names:
        with ThreadPoolExecutor(min(16, len(names))) as pool:
            list(pool.map(lambda n: store.write_atomic(f"{n}/{WRITING_MARKER}", marker), names))
    for k in range(max((len(m) for _, m, _ in plans), default=0)):
        store.remove_many([f"{n}/{m[k]}" for n, m, _ in plans if k < len(m)])
    store.remove_many([f"{n}/{rel}" for n, _, rest in plans for rel in rest])
    if names:
        store.remove_many([f"{n}/{WRITING_MARKER}" for n in names])


def gc(root: str, policy: Policy, storage_options: dict | None = None, *,
       dry_run: bool = False, grace: float | str = DEFAULT_GRACE,
       now: float | None = None, protect: dict[str, str] | None = None,
       listed: set[str] | None = None, reroot: bool = False,
       max_chain: int = DEFAULT_MAX_CHAIN) -> GcResult:
    """Keep what ``policy`` and the rails keep under ``root``; remove the rest (``dry_run``:
    only say so). ``protect`` (name -> reason) is kept whatever the policy says
    (:func:`~ckptctl.tiering.policy.apply_policy`'s ``protect``, with the bases it needs;
    ``watch``: "not yet in TIER"); so is a checkpoint holding files it does not own
    (``blocked`` when only that keeps it). ``listed``: the names the
    caller's rail was computed from; any other name found here (it appeared since) is kept
    too, as the rail could not judge it. Raises UsageError (exit 2)
    on an empty policy, before anything is read.

    ``reroot`` (a pack tier): the count is exact. A pack kept for its own sake whose base
    is kept only as its base is re-rooted first (:func:`~ckptctl.tiering.policy.plan_reroots`,
    :func:`~ckptctl.packs.reroot.reroot`: against an older checkpoint kept for its own sake
    when the chain stays within ``max_chain`` and the pack's own depth, else as a full
    pack), then the bases no longer needed go with the rest. A re-root a crash
    interrupted is finished (or its leftovers cleared) before anything is decided, with
    or without ``reroot``; a dry run says what it would do.

    >>> import pathlib, tempfile, numpy as np
    >>> from safetensors.numpy import save_file
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> for s in (100, 200, 300):
    ...     (root / f"step-{s}").mkdir()
    ...     save_file({"w": np.zeros(2)}, str(root / f"step-{s}" / "model.safetensors"))
    >>> r = gc(str(root), Policy(last=2))
    >>> r.decision.keep, r.decision.remove, sorted(p.name for p in root.iterdir())
    ({'step-300': ['last 2', 'newest committed'], 'step-200': ['last 2']}, ['step-100'], ['step-200', 'step-300'])
    """
    if policy.is_empty:
        raise UsageError("empty policy: give at least one --keep-* rule (gc never removes "
                         "everything)")
    grace = parse_duration(grace) if isinstance(grace, str) else float(grace)
    now = time.time() if now is None else now
    ctx = _Decide(root, policy, storage_options, now, grace, protect, listed, max_chain)
    recovered = ctx.recover(dry_run)
    d = ctx.decide(reroot)
    reroots = [*recovered, *d.reroots]
    if d.reroots and not dry_run:
        done = _reroot_all(d, storage_options, max_chain)
        d = ctx.decide(False)  # the packs as they are now: a failed one keeps its bases
        reroots = [*recovered, *done]
    rows, items, decision = d.rows, d.items, d.decision
    blocked = {n: f for n, f in d.foreign.items() if decision.keep.get(n) == [d.why_foreign[n]]}
    result = GcResult(d.root, policy.describe(), dry_run, grace, now, decision,
                      blocked=blocked, reroots=reroots,
                      holds=policy.holds(pack=reroot or d.packs, reroot=reroot,
                                         max_chain=max_chain),
                      max_checkpoints=policy.bound if reroot or not d.packs else None)
    for item in newest_first(items):
        r = rows[item.name]
        keep = item.name in decision.keep
        result.checkpoints.append(GcCheckpoint(
            r.name, r.url, r.step, r.state, r.pinned, "keep" if keep else "remove",
            list(decision.keep.get(r.name, [])), r.bytes, item.time, r.modified,
            _manifest_created(r)))
    if not dry_run:
        from ..writing.removal import remove_checkpoint

        doomed = [rows[name] for name in reversed(decision.remove)]  # oldest first
        if len(doomed) > 1 and all(not r.located[0].is_local and r.located[2] is None
                                   and r.url != d.root for r in doomed):
            from ..storage import open_store

            remove_batched(open_store(root, storage_options), doomed)
        else:
            for r in doomed:
                store, files, single = r.located
                remove_checkpoint(store, files, single=single)
    _uploads(result, root, storage_options, now=now, grace=grace, dry_run=dry_run)
    return result


@dataclass
class _Decided:
    """One decision over one listing: the rows it rests on (re-root stages aside), the
    policy's items, the decision, the re-roots it needs, the foreign files found."""

    root: str
    rows: dict[str, CheckpointRow]
    items: list[Item]
    decision: Decision
    reroots: list[GcReroot]
    foreign: dict[str, list[str]]
    why_foreign: dict[str, str]
    packs: bool


class _Decide:
    """List ``root`` and decide (:meth:`decide`), as many times as a run needs: once, or
    again after its re-roots; finish the re-roots a crash left (:meth:`recover`)."""

    def __init__(self, root, policy, storage_options, now, grace, protect, listed,
                 max_chain):
        self.root, self.policy, self.opts = root, policy, storage_options
        self.now, self.grace, self.protect, self.listed = now, grace, protect, listed
        self.max_chain = max_chain
        self.listing = None
        self.pending: dict[str, str] = {}  # target name -> why its re-root is unfinished
        self.staged: dict[str, CheckpointRow] = {}  # dry run: what a finished re-root puts there

    def _list(self):
        self.listing = ls(self.root, self.opts, manifests=True, check="auto")
        return self.listing

    def recover(self, dry_run: bool) -> list[GcReroot]:
        """Finish the re-roots an interrupted run left (a staged copy beside a pack:
        :func:`~ckptctl.packs.reroot.finish_reroot`), then list again. A dry run only says
        so, and decides as if it were done (a committed staged copy stands for its pack).
        What a live process holds keeps its pack ("re-root in progress")."""
        import dataclasses

        from ..formats.pack import reroot_target
        from ..packs.reroot import finish_reroot

        listing = self._list()
        out = []
        for r in listing.checkpoints:
            target = reroot_target(r.name)
            if target is None:
                continue
            url = reroot_target(r.url)
            if dry_run:
                staged = r.state == "sealed"
                out.append(GcReroot(target, url, (), None, None, 0, (),
                                    "would finish" if staged else "would discard"))
                if staged:
                    self.staged[target] = dataclasses.replace(r, name=target, url=url)
                continue
            done = finish_reroot(url, self.opts)
            if done.action == "none":  # gone since the listing (another gc finished it)
                continue
            out.append(GcReroot(target, url, (), None, None, 0, (), done.action))
            if done.action == "busy":
                self.pending[target] = "re-root in progress (another process)"
        if out and not dry_run:
            self._list()
        return out

    def decide(self, reroot: bool) -> _Decided:
        from ..formats.pack import PACK_INDEX, reroot_target

        listing = self.listing if self.listing is not None else self._list()
        self.listing = None  # the next decision lists again
        rows = {r.name: self.staged.get(r.name, r) for r in listing.checkpoints
                if reroot_target(r.name) is None}
        foreign = _foreign(rows, list(rows), self.opts)  # confirms the rows it must read
        why_foreign = {n: f"holds files not its own ({foreign_list(f)})"
                       for n, f in foreign.items()}
        protect = {**_named_by_latest(rows, listing.pointers), **why_foreign,
                   **{n: why for n, why in self.pending.items() if n in rows},
                   **(self.protect or {})}
        if self.listed is not None:
            protect = {**{n: "appeared after the listing" for n in rows
                          if n not in self.listed}, **protect}
        settled, items, decision = settle(
            list(rows.values()), self.policy, self.opts, now=self.now, grace=self.grace,
            protect=protect, needed=needed_elsewhere(listing.checkpoints, self.opts))
        rows = {r.name: r for r in settled}
        packs = {n for n, r in rows.items()
                 if r.located and r.located[2] is None and PACK_INDEX in r.located[1]}
        plan = []
        if reroot:
            plan, decision = _plan(rows, items, decision, packs - set(self.pending),
                                   self.max_chain)
        return _Decided(listing.root, rows, items, decision, plan, foreign, why_foreign,
                        bool(packs))


def _plan(rows: dict[str, CheckpointRow], items: list[Item], decision: Decision,
          rerootable: set[str], max_chain: int) -> tuple[list[GcReroot], Decision]:
    """The re-roots ``decision`` needs (:func:`~ckptctl.tiering.policy.plan_reroots`), each
    against its planned base only where the chain stays within ``max_chain`` and the
    pack's own depth (the packs made against it must stay deeper), else full; and the
    decision once they are done. Reads the index of each pack involved (one small read)."""
    from .policy import plan_reroots

    depths: dict[str, int] = {}

    def depth(name: str) -> int:
        if name not in depths:
            depths[name] = _depth(rows[name])
        return depths[name]

    full: set[str] = set()
    while True:  # until no planned base is too deep (each turn makes one more pack full)
        plan, after = plan_reroots(items, decision, rerootable=rerootable, full=full)
        new: dict[str, int] = {}
        for r in plan:  # oldest first: a base re-rooted here has its new depth already
            new[r.name] = 0 if r.base is None else new.get(r.base, depth(r.base)) + 1
            if new[r.name] > min(max_chain, depth(r.name)):
                full.add(r.name)
                break
        else:
            break
    return [GcReroot(r.name, rows[r.name].url, r.was, r.base,
                     rows[r.base].url if r.base else None, new[r.name], r.frees,
                     "would re-root") for r in plan], after


def _depth(row: CheckpointRow) -> int:
    """How many deltas deep the checkpoint of ``row`` is (0: plain, or a full pack)."""
    from ..formats.pack import PACK_INDEX, read_index

    store, files, single = row.located
    if single is not None or PACK_INDEX not in files:
        return 0
    return read_index(store, files).depth


def _reroot_all(d: _Decided, storage_options: dict | None,
                max_chain: int) -> list[GcReroot]:
    """Run the planned re-roots, oldest first (a base re-rooted first is then the next
    one's); one that fails is reported and leaves its pack, and so its bases, as they
    were. A storage failure stops the run (exit 3): nothing was removed yet."""
    from ..packs.reroot import reroot

    out = []
    for r in d.reroots:
        try:
            done = reroot(r.url, base=r.base_url, max_chain=min(max_chain, r.depth)
                          if r.base_url else max_chain, storage_options=storage_options)
        except StorageError:
            raise
        except CkptError as e:
            out.append(GcReroot(r.name, r.url, r.was, r.base, r.base_url, r.depth, r.frees,
                                "failed", e.message))
            continue
        out.append(GcReroot(r.name, r.url, r.was, r.base if done.base else None,
                            done.base_url, done.depth, r.frees, done.action,
                            done.full_reason))
    return out


def _named_by_latest(rows: dict[str, CheckpointRow], found: list[dict]) -> dict[str, str]:
    """Checkpoints a framework's pointer file beside them names (``found``: the listing's
    :func:`~ckptctl.formats.locate.pointers`: DeepSpeed's ``latest`` / ``latest_universal``,
    Megatron's ``latest_checkpointed_iteration.txt``): what the framework's own loader
    resumes from, kept whatever the policy says."""
    named = {posixpath.join(posixpath.dirname(p["file"]), p["names"]): p["file"]
             for p in found if p["names"]}
    return {name: f"named by {posixpath.basename(named[name])} (the framework resumes from it)"
            for name in rows if name in named}


def _foreign(rows: dict[str, CheckpointRow], names: list[str],
             storage_options: dict | None) -> dict[str, list[str]]:
    """The checkpoints among ``names`` that hold files they do not own
    (:func:`~ckptctl.catalog.ownership.split_owned`), with those files: from the listing, and
    the manifest of a sealed one (read here if the listing alone classified it)."""
    from ..formats.manifest import MANIFEST
    from ..catalog.ls import confirm

    out = {}
    for name in names:
        r = rows[name]
        if r.located is None:
            continue
        foreign = split_owned(r.located[1], r.manifest, single=r.located[2])[1]
        if foreign and not r.exact and MANIFEST in r.located[1]:  # what does it list?
            r = rows[name] = confirm([r], storage_options, manifests=True)[0]
            foreign = split_owned(r.located[1], r.manifest, single=r.located[2])[1]
        if foreign:
            out[name] = foreign
    return out


def _uploads(result: GcResult, root: str, storage_options: dict | None, *, now: float,
             grace: float, dry_run: bool) -> None:
    """Report (and unless ``dry_run``, abort) unfinished multipart uploads under ``root``
    started longer than ``grace`` ago; younger ones may still be running."""
    try:
        from ..storage import multipart
    except ImportError:  # storage without multipart support: nothing to look for
        return
    from ..storage import open_store

    store = open_store(root, storage_options)
    if not store.caps.multipart:
        return
    try:
        uploads = multipart.list_uploads(store)
    except StorageError as e:
        if e.code in ("REMOTE_TIMEOUT", "REMOTE_UNREACHABLE"):
            raise
        return  # a server without ListMultipartUploads: nothing it can report
    result.uploads_checked = True
    for up in sorted(uploads, key=lambda u: (u.rel, u.upload_id)):
        old = up.initiated is not None and now - up.initiated >= grace
        result.uploads.append(GcUpload(store.display(up.rel), up.upload_id, up.initiated,
                                       "abort" if old else "keep"))
        if old and not dry_run:
            multipart.abort_upload(store, up.rel, up.upload_id)
