"""``ckptctl tiers``: the tier config resolved, secrets masked, and a check that every tier
is reachable and writable (write, read back and delete a small probe object at its root).

>>> import tempfile
>>> from ckptctl.tiering.config import Config, Tier
>>> d = tempfile.mkdtemp()
>>> r = check_tiers(Config("ckptctl.toml", (Tier("hot", d + "/new/run1", {"token": "t0k3n"}),)))
>>> r.ok, r.tiers[0].ok, r.tiers[0].storage_options
(True, True, {'token': '***'})
>>> import os; os.listdir(d)  # the probe and the folders it made are gone
[]
"""
from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field

from .config import DEFAULT_MAX_CHAIN, Config, Tier, mask_secrets, secret_values
from ..errors import CkptError, StorageError

#: Name of the probe object, followed by a random suffix; never a checkpoint's name.
PROBE_PREFIX = ".ckptctl-probe-"


@dataclass
class TierCheck:
    """One tier as configured (storage options masked) and what its check found
    (``ok`` None: not checked)."""

    order: int
    name: str
    url: str
    bwlimit: float | None
    keep: dict | None
    pack: bool
    storage_options: dict
    #: a pack tier's longest delta chain (a hop past it gets a full pack)
    max_chain: int = DEFAULT_MAX_CHAIN
    #: what the tier holds at most under its keep, in words (:func:`holds`), and as a
    #: number (None: it keeps everything, or a number that grows with the run)
    holds: str = ""
    max_checkpoints: int | None = None
    ok: bool | None = None
    code: str | None = None
    reason: str | None = None
    seconds: float | None = None


@dataclass
class TiersResult:
    """The config file and its tiers, hottest first; ``ok`` unless a checked tier failed."""

    config: str | None
    tiers: list[TierCheck] = field(default_factory=list)
    checked: bool = True

    @property
    def ok(self) -> bool:
        return all(t.ok is not False for t in self.tiers)

    @property
    def failed(self) -> list[TierCheck]:
        return [t for t in self.tiers if t.ok is False]

    def to_dict(self) -> dict:
        """The ``--json`` document: a tier's ``bwlimit`` is ``bwlimit_bytes_per_second``
        there, an integer like every rate (README, "JSON vocabulary")."""
        def tier(t: TierCheck) -> dict:
            return {("bwlimit_bytes_per_second" if k == "bwlimit" else k):
                    (None if v is None else round(v)) if k == "bwlimit" else v
                    for k, v in asdict(t).items()}

        return {"config": self.config, "checked": self.checked, "ok": self.ok,
                "tiers": [tier(t) for t in self.tiers]}


def check_tiers(config: Config, *, check: bool = True, timeout: float | None = None) -> TiersResult:
    """Describe every tier of ``config`` and, with ``check``, probe them all at once: each
    gets ``timeout`` seconds (default: 4 remote requests' budget, see ``--timeout``)
    before it is reported as not answering. Never raises for a tier that fails: its
    one-line reason is in the result.

    >>> check_tiers(Config("c.toml", (Tier("cold", "s3://b/r", {"secret": "x"}),)),
    ...             check=False).tiers[0].storage_options
    {'secret': '***'}
    """
    rows = [TierCheck(i + 1, t.name, t.url, t.bwlimit, dict(t.keep) if t.keep else None, t.pack,
                      mask_secrets(t.storage_options), t.max_chain, *holds(t))
            for i, t in enumerate(config.tiers)]
    result = TiersResult(config.path, rows, checked=check)
    if not check:
        return result
    if timeout is None:
        from ..storage.filesystems import request_timeout

        timeout = 4 * request_timeout()
    outcomes: dict[int, tuple[str | None, str | None]] = {}
    started: dict[int, float] = {}
    threads = []
    for i, tier in enumerate(config.tiers):
        def run(i=i, tier=tier):
            outcomes[i] = _probe_outcome(tier)

        th = threading.Thread(target=run, name=f"ckptctl-probe-{tier.name}", daemon=True)
        started[i] = time.monotonic()
        th.start()
        threads.append(th)
    deadline = time.monotonic() + timeout
    for i, th in enumerate(threads):
        th.join(max(0.0, deadline - time.monotonic()))
        row = rows[i]
        row.seconds = round(time.monotonic() - started[i], 3)
        if i not in outcomes:  # a hung mount or server: leave the thread, report the tier
            row.ok, row.code = False, "REMOTE_TIMEOUT"
            row.reason = f"no answer within {timeout:g} s (see --timeout)"
            continue
        code, reason = outcomes[i]
        row.ok, row.code, row.reason = code is None, code, reason
    return result


def holds(tier: Tier) -> tuple[str, int | None]:
    """What ``tier`` holds at most, in words, and as a number: its ``keep`` applied by
    ``gc TIER:`` and ``watch``, which on a pack tier re-root a pack kept only as a base,
    so the count is exact (:meth:`~ckptctl.tiering.policy.Policy.holds`).

    >>> holds(Tier("cold", "s3://b/r", keep={"last": 4}, pack=True))
    ('holds at most 4 checkpoints (keep the last 4; packs kept only as bases are re-rooted)', 4)
    >>> holds(Tier("warm", "/w"))
    ('holds every checkpoint (no keep table)', None)
    """
    from .policy import Policy

    if not tier.keep:
        return "holds every checkpoint (no keep table)", None
    policy = Policy.from_dict(tier.keep, where=f"tier {tier.name}")
    return (policy.holds(pack=tier.pack, reroot=tier.pack, max_chain=tier.max_chain),
            policy.bound)


def _probe_outcome(tier: Tier) -> tuple[str | None, str | None]:
    """(None, None) when the probe went through, else (problem code, one-line reason
    with no secret in it)."""
    try:
        probe_tier(tier)
        return None, None
    except CkptError as e:
        code, reason = str(e.code), e.message
    except Exception as e:  # noqa: BLE001 - mapped like any storage failure, one line
        from ..storage.failures import storage_error

        err = storage_error(tier.url, e, remote="://" in tier.url)
        code, reason = str(err.code), err.message
    from ..storage.failures import scrub

    return code, scrub(reason, secret_values(tier.storage_options))


def probe_tier(tier: Tier) -> None:
    """Write a small object ``.ckptctl-probe-<random>`` at the tier's root, read it back
    and delete it (a local root that does not exist yet is made for the probe and
    removed after it). Raises the store's one-line error on any failure.

    >>> import tempfile
    >>> probe_tier(Tier("hot", tempfile.mkdtemp()))
    """
    from ..storage import open_store

    store = open_store(tier.url, tier.storage_options)
    rel = PROBE_PREFIX + secrets.token_hex(8)
    data = f"ckptctl probe of tier {tier.name}\n".encode() + secrets.token_bytes(16)
    made = missing_dirs(store.root) if store.is_local else []
    try:
        store.write_atomic(rel, data)
        try:
            back = store.read(rel)
        finally:
            store.remove(rel)
        if back != data:
            raise StorageError(store.display(rel), "read back differs from what was written")
    finally:
        for d in made:  # deepest first; only folders the probe made, and only if empty
            try:
                os.rmdir(d)
            except OSError:
                break


def missing_dirs(root: str) -> list[str]:
    """The folders from ``root`` up that do not exist yet, deepest first (what a probe
    creates, and removes after).

    >>> missing_dirs("/")
    []
    """
    out = []
    d = os.path.abspath(root)
    while d and not os.path.exists(d):
        out.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return out
