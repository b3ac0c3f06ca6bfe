"""``watch --node-rank N``: one watch per node drains that node's PART of each checkpoint.

In a multi-node job each node writes only its ranks' ``.distcp`` files to its own first
tier (rank 0's node also ``.metadata``). Each node's watch (:class:`~.watch.Watcher` with
``node_rank``) does, per first-tier folder whose listing has settled:

1. hashes its files and copies them (:class:`~ckptctl.storage.transfer.Transfer`: hashed
   again while copied, published per file only when they match) into the shared (second)
   tier's folder of the same name, WITHOUT a manifest: ``ls`` calls it incomplete;
2. checks whether that folder now holds ``.metadata`` and every file it names; the node
   that sees it complete seals it there (:func:`~.seal.seal`: the manifest is written
   exclusively and read back; a second sealer of the same bytes gets the same id), so one
   committed manifest results whoever finishes first;
3. keeps its part in the first tier (the gc rail) until the shared tier holds a committed
   checkpoint of that name whose manifest lists this node's files with the same hashes.

Node 0 alone promotes committed checkpoints from the shared tier further down.

>>> w = Watcher(config, settle=0, node_rank=1)          # doctest: +SKIP
>>> w.run_once().pending                                # doctest: +SKIP
[{'tier': 'warm', 'name': 'step-100', 'why': 'waiting for the other nodes'}]
"""
from __future__ import annotations

import os
import time

from ..errors import CkptError
from ..formats.manifest import FileEntry, Manifest, is_control_file, is_temp_name
from ..tiering.policy import COMMITTED
from .drains import record_arrival
from .trims import trim

#: The env variables launchers set to a node's rank, each with its node count (torchrun,
#: generic launchers, Slurm).
NODE_RANK_ENV = (("GROUP_RANK", "GROUP_WORLD_SIZE"), ("NODE_RANK", "NNODES"),
                 ("SLURM_NODEID", "SLURM_NNODES"))


def node_rank_from_env(environ=None) -> int | None:
    """The node rank the launcher set (the first of :data:`NODE_RANK_ENV` present), or
    None; also None when its node count says the job has one node (a one-node Slurm job
    keeps the single-node behaviour).

    >>> node_rank_from_env({"SLURM_NODEID": "3"}), node_rank_from_env({})
    (3, None)
    >>> node_rank_from_env({"SLURM_NODEID": "0", "SLURM_NNODES": "1"}) is None
    True
    """
    from ..errors import UsageError

    environ = os.environ if environ is None else environ
    for var, count in NODE_RANK_ENV:
        value = environ.get(var)
        if value in (None, ""):
            continue
        try:
            rank, nodes = int(value), int(environ.get(count) or 0)
        except ValueError:
            raise UsageError(f"{var}={value!r} or {count}={environ.get(count)!r} is not an "
                             "integer") from None
        return None if nodes == 1 else rank
    return None


def _url(tier, name: str) -> str:
    return tier.url.rstrip("/") + "/" + name


def _part_files(store) -> dict[str, int]:
    return {rel: n for rel, n in store.list_files().items()
            if not is_control_file(rel) and not is_temp_name(rel)}


def copy_part(src_url: str, dst_url: str, src_options: dict | None, dst_options: dict | None,
              *, bwlimit=None, workers: int = 4, known: dict | None = None) -> dict:
    """Copy the files of the node part at ``src_url`` into ``dst_url`` (no manifest);
    return ``{rel: [digest, size]}`` of the part. Files ``known`` (the same map from an
    earlier copy) that are at the destination at their size are not sent again.

    >>> copy_part("/nvme/step-100", "/shared/step-100", None, None)   # doctest: +SKIP
    {'__1_0.distcp': ['9f2c...', 4096]}
    """
    from ..storage import hash_file, open_store
    from ..storage.journal import Journal
    from ..storage.ratelimit import RateLimiter, parse_rate
    from ..storage.transfer import Transfer
    from ..tiering.promote import copy_files
    from ..writing.commit import is_format_marker, write_order

    src, dst = open_store(src_url, src_options), open_store(dst_url, dst_options)
    files = _part_files(src)
    known = known or {}
    hashes = {rel: list(known[rel]) if rel in known and known[rel][1] == n
              else [hash_file(src, rel, "xxh3-128")[0], n] for rel, n in files.items()}
    there = dst.list_files_if_any()
    todo = [rel for rel in files if not (rel in known and there.get(rel) == files[rel])]
    man = Manifest({rel: FileEntry(n, h) for rel, (h, n) in hashes.items()})
    t = Transfer(src, dst, journal=Journal(None, {"source": "node part"}), algo=man.hash,
                 limiter=RateLimiter(parse_rate(bwlimit)), workers=workers)
    try:
        order = write_order(todo, files)
        markers = [rel for rel in order if is_format_marker(rel)]
        for batch in ([rel for rel in order if rel not in markers], markers):
            copy_files(t, batch, man, workers)  # .metadata once the data is durable
    finally:
        t.close()
    return hashes


def complete_in(url: str, options: dict | None) -> bool:
    """Does the DCP folder at ``url`` hold ``.metadata`` and every file it names?

    >>> complete_in("/shared/step-100", None)                          # doctest: +SKIP
    False
    """
    from ..formats.dcp import referenced_files
    from ..formats.detect import locate, open_checkpoint

    located = locate(url, options)
    files = located[1]
    if ".metadata" not in files:
        return False
    ck = open_checkpoint(url, options, strict=False, located=located)
    return all(rel in files for rel in referenced_files(ck))


def node_pass(w, p, only: str | None = None) -> list:
    """Step 1 and 2 of the module docstring for every settled first-tier folder (``only``:
    that one alone, settled or not: pre-emption); the listings [first tier, shared tier]
    after it."""
    from ..integrity.seal import seal

    hot_tier, shared_tier = w.config.tiers[0], w.config.tiers[1]
    hot, shared = w.list_tier(p, hot_tier), w.list_tier(p, shared_tier)
    if hot is None or shared is None:
        return [hot, shared]
    now = w.clock()
    seen, parts = w.status.setdefault("seen", {}), w.status.setdefault("parts", {})
    changed = False
    for name in sorted(hot) if only is None else [only]:
        r = hot[name]
        sig = r.signature
        old = seen.get(name)
        if old is None:
            p.found.append(name)
            w.event("found", tier=hot_tier.name, name=name, state=r.state, bytes=r.bytes,
                    node_rank=w.node_rank)
            record_arrival(w.status, name, r, now)
        if old is None or old["sig"] != sig:
            seen[name] = old = {"sig": sig, "since": now}
        if name in shared and shared[name].state in COMMITTED:
            continue
        if only is None and now - old["since"] < w.settle:
            p.pending.append({"tier": hot_tier.name, "name": name, "why": "settling"})
            continue
        key = f"part {hot_tier.name}->{shared_tier.name}:{name}"
        waiting = w.backing_off(key, now)
        if waiting is not None:
            p.failed.append(waiting)
            continue
        url = _url(shared_tier, name)
        try:
            prev = parts.get(name) or {}
            t0 = time.monotonic()
            hashes = copy_part(r.url, url, hot_tier.storage_options,
                               shared_tier.storage_options, bwlimit=shared_tier.bwlimit,
                               known=prev.get("files"))
            seconds = time.monotonic() - t0
            parts[name] = {"files": hashes, "sig": sig}
            if prev.get("files") != hashes:
                changed = True
                _done(w, name, hot_tier.name, shared_tier.name,
                      sum(n for _, n in hashes.values()), seconds)
                w.event("part-promoted", name=name, src=hot_tier.name, dst=shared_tier.name,
                        node_rank=w.node_rank, files=len(hashes),
                        bytes=sum(n for _, n in hashes.values()), seconds=round(seconds, 3))
            if complete_in(url, shared_tier.storage_options):
                s = seal(url, shared_tier.storage_options)
                changed = True
                p.sealed.append(name)
                w.event("sealed", tier=shared_tier.name, name=name, url=url,
                        action=s.action, manifest_id=s.manifest_id, node_rank=w.node_rank)
            else:
                p.pending.append({"tier": shared_tier.name, "name": name,
                                  "why": "waiting for the other nodes"})
        except (CkptError, OSError) as e:
            w.fail(p, key, "promote", shared_tier.name, name, e)
            continue
        w.succeed(key)
    for name in [n for n in seen if n not in hot and only is None]:
        del seen[name]
        parts.pop(name, None)
    if changed:
        shared = w.list_tier(p, shared_tier)
    return [hot, shared]


def _done(w, name: str, src: str, dst: str, nbytes: int, seconds: float) -> None:
    """Record a part's copy in the status (``done``, ``rates``) as a hop is recorded, for
    ``watch --status``'s rates and plan figures."""
    w.record_done(name, src, dst, "part", nbytes, round(seconds, 3),
                  rate=nbytes / seconds if nbytes and seconds > 0 else None)


def holds_part(shared_row, part: dict | None, hot_row, options: dict | None) -> bool:
    """Is ``part`` (what this node copied) listed, with the same hashes, in the manifest
    of the committed ``shared_row``, and is the hot listing still what was copied?"""
    from ..storage import open_store

    if shared_row is None or shared_row.state not in COMMITTED or not part:
        return False
    if part.get("sig", [None])[1:3] != [hot_row.bytes, hot_row.num_files]:
        return False
    try:
        man = Manifest.read(open_store(shared_row.url, options))
    except CkptError:
        return False
    return man is not None and all(
        rel in man.files and (man.files[rel].hash, man.files[rel].size) == (h, n)
        for rel, (h, n) in part["files"].items())


def _kept_by_policy(shared_tier, policy, names: set) -> dict[str, str]:
    """What ``policy`` keeps among the committed checkpoints ``names`` of the shared
    tier, with its reasons (name -> reason)."""
    import time

    from ..catalog.ls import ls
    from ..tiering.gc import gc_items
    from ..tiering.policy import apply_policy

    rows = [r for r in ls(shared_tier.url, shared_tier.storage_options,
                          manifests=True).checkpoints if r.name in names]
    now = time.time()
    d = apply_policy(gc_items(rows, now=now, grace=0), policy, now=now, grace=0)
    return {name: ", ".join(why) for name, why in d.keep.items()}


def retain_node(w, p, listings: list) -> None:
    """The first tier's keep, every part protected until :func:`holds_part`."""
    from ..tiering.policy import Policy

    hot_tier, shared_tier = w.config.tiers[0], w.config.tiers[1]
    hot, shared = listings[0], listings[1]
    if not hot_tier.keep or not hot:
        return
    protect = {}
    parts = w.status.get("parts", {})
    for name, row in hot.items():
        if shared is None:
            protect[name] = f"{shared_tier.name} cannot be listed"
        elif not holds_part(shared.get(name), parts.get(name), row,
                            shared_tier.storage_options):
            protect[name] = f"not yet committed in {shared_tier.name} with this node's part"
    key = f"gc {hot_tier.name}"
    waiting = w.backing_off(key, w.clock())  # asked once: a retry may fall due between two
    if waiting is not None:
        p.failed.append(waiting)
        return
    try:
        policy = Policy.from_dict(hot_tier.keep, where=f"tier {hot_tier.name}")
        if shared is not None and len(protect) < len(hot):
            protect.update(_kept_by_policy(shared_tier, policy, set(hot) - set(protect)))
    except (CkptError, OSError) as e:
        w.fail(p, key, "gc", hot_tier.name, None, e)
        return
    # a part is never committed in its own tier: the policy is applied to the shared tier's
    # committed copies above, the rail covers the rest, and ``listed`` keeps a part written
    # after this pass's listing, so gc's grace for incomplete folders (which would keep
    # every part a day) is not needed here
    trim(w, p, key, hot_tier, protect, set(hot), policy, grace=0)


