"""Where a watch keeps its state and what other processes read of it: its state folder
(:func:`state_dir`) with ``status.json`` (:func:`read_status`), its lock on the first tier
(:func:`lock_path`, :func:`take_lock`, :func:`lock_holder`), and what ``watch --status``,
``--ready`` and the liveness checks ask (:func:`watch_status`, :func:`watch_alive`,
:func:`watch_ready`).

>>> read_status("/no/such/config.toml") is None
True
"""
from __future__ import annotations

import errno
import hashlib
import json
import os

from ..errors import CkptError, StorageError, UsageError
from ..tiering.config import Config, Tier


def state_dir(config_path: str, node_rank: int | None = None) -> str:
    """Where watch keeps its log, status and lock for the config at ``config_path``:
    ``$XDG_CACHE_HOME`` (default ``~/.cache``) ``/ckptctl/watch/<16 hex digits>``, with
    ``-node<N>`` for ``--node-rank N`` (a home directory shared by the nodes).

    >>> d = state_dir("/etc/ckptctl.toml")
    >>> d.split(os.sep)[-3:-1], len(os.path.basename(d))
    (['ckptctl', 'watch'], 16)
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha256(os.path.abspath(config_path).encode()).hexdigest()[:16]
    return os.path.join(base, "ckptctl", "watch", digest
                        + ("" if node_rank is None else f"-node{node_rank}"))


def read_status(config_path: str, node_rank: int | None = None) -> dict | None:
    """The status file of the watch of ``config_path``; None when no watch has run.

    >>> read_status("/no/such/config.toml") is None
    True
    """
    path = os.path.join(state_dir(config_path, node_rank), "status.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StorageError(path,
                           f"cannot read the watch status ({e})") from None


def lock_path(config: Config, node_rank: int | None = None) -> str:
    """The lock of a watch of ``config``: ``$XDG_CACHE_HOME/ckptctl/watch-locks/<16 hex
    digits>.lock`` (``-node<N>`` for ``--node-rank N``), the digits a hash of the first
    tier (the tier a watch seals, drains and trims, and the node's own) with its URL
    normalised: a local path resolved (symlinks too), a remote URL with its endpoint. Any
    copy of a config names the same lock; so does any config with the same first tier.

    >>> a = lock_path(Config("a.toml", (Tier("hot", "/nvme/run1"), Tier("warm", "/lustre/r"))))
    >>> a == lock_path(Config("/etc/copy.toml", (Tier("nvme", "/nvme/run1/"),)))
    True
    >>> a == lock_path(Config("a.toml", (Tier("hot", "/nvme/run2"),)))
    False
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha256(_tier_identity(config.tiers[0]).encode()).hexdigest()[:16]
    return os.path.join(base, "ckptctl", "watch-locks", digest
                        + ("" if node_rank is None else f"-node{node_rank}") + ".lock")


def _tier_identity(tier: Tier) -> str:
    url = tier.url
    if url.startswith("file://"):
        url = url[len("file://"):]
    if "://" not in url:
        return "file://" + os.path.realpath(url)
    scheme, rest = url.split("://", 1)
    opts = tier.storage_options or {}
    endpoint = (opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                or "")
    scheme = "s3" if scheme in ("s3", "s3a") else scheme
    return f"{scheme}://{rest.strip('/')} at {str(endpoint).rstrip('/')}"


def take_lock(config: Config, node_rank: int | None = None) -> int:
    """Take the lock of ``config``'s first tier (:func:`lock_path`; flock, released when
    the returned descriptor is closed or the process ends) and write who holds it; a
    UsageError (exit 2) naming the running watch (pid, config) when another holds it,
    whatever config file it was started with."""
    import fcntl

    path = lock_path(config, node_rank)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise StorageError(path, f"cannot create the watch lock ({e.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            held = lock_holder(config, node_rank) or {}
            tier = config.tiers[0]
            raise UsageError(
                f"another watch (pid {held.get('pid', '?')}, config "
                f"{held.get('config', '?')}) is draining tier {tier.name!r} "
                f"({tier.url}): one watch per node and first tier (lock {path} is held)",
                config.path) from None
        raise StorageError(path, f"cannot lock ({e.strerror})") from None
    tier = config.tiers[0]
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps({"pid": os.getpid(), "config": os.path.abspath(
        config.path), "tier": tier.name, "url": tier.url}) + "\n").encode())
    return fd


def lock_holder(config: Config, node_rank: int | None = None) -> dict | None:
    """The watch that holds, or last held, the lock of ``config``'s first tier
    (:func:`lock_path`): ``{"pid", "config", "tier", "url"}`` as it wrote them when it took
    the lock (``{}`` before it has); None when no watch ever took it. Read without locking
    (a probe by lock would make a starting watch see it held); whether that watch still
    runs is the lock's to say (:func:`watch_alive`).

    >>> lock_holder(Config("c.toml", (Tier("hot", "/no/such/tier"),))) is None
    True
    """
    path = lock_path(config, node_rank)
    try:
        with open(path, "rb") as f:
            data = f.read(64 << 10)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StorageError(path, f"cannot read the watch lock ({e.strerror})") from None
    try:
        doc = json.loads(data or b"{}")
    except ValueError:
        return {}  # torn, or written by an older ckptctl (a bare pid)
    return doc if isinstance(doc, dict) else {}


def watch_status(config: Config, node_rank: int | None = None) -> tuple[Config, dict | None]:
    """What ``watch --status`` shows: the status of the watch that holds, or last held,
    the lock of ``config``'s first tier (:func:`lock_holder`), even when it was started
    from a copy of this config file, with the config it ran (this one when that file
    cannot be read); else the status of the last watch of this config file (None: none
    has run).

    >>> watch_status(Config("/no/such.toml", (Tier("hot", "/no/such/tier"),)))[1] is None
    True
    """
    from ..tiering.config import load_config

    held = lock_holder(config, node_rank) or {}
    other = held.get("config")
    if isinstance(other, str) and other != os.path.abspath(config.path):
        doc = read_status(other, node_rank)
        if doc is not None:
            try:
                return load_config(other), doc
            except CkptError:
                return Config(other, config.tiers), doc
    return config, read_status(config.path, node_rank)


def watch_alive(config: Config, node_rank: int | None = None) -> int | None:
    """The pid of the watch that holds the lock of ``config``'s first tier now, None
    when none does (a SIGKILLed watch's lock went with it). Read from ``/proc/locks``
    (which names the holder of a flock without taking it, so a watch starting meanwhile
    is not turned away); elsewhere, whether the pid the lock file names still runs.

    >>> watch_alive(Config("c.toml", (Tier("hot", "/no/such/tier"),))) is None
    True
    """
    path = lock_path(config, node_rank)
    try:
        st = os.stat(path)
    except OSError:
        return None
    pid = (lock_holder(config, node_rank) or {}).get("pid")
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                # "1: FLOCK  ADVISORY  WRITE 4242 fd:01:1234 0 EOF" (a blocked waiter: "->");
                # an overlay file system may show another device: then the pid must match
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[0] != "->" \
                        and fields[5].rsplit(":", 1)[-1] == str(st.st_ino) \
                        and (fields[5] == device or fields[4] == str(pid)):
                    return int(fields[4]) if fields[4].isdigit() else -1
        return None
    except OSError:
        if not isinstance(pid, int):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return pid


def watch_ready(config: Config, node_rank: int | None = None) -> bool:
    """A readiness probe: does a watch of ``config``'s first tier run now
    (:func:`watch_alive`) and has it listed that tier since it started?

    >>> watch_ready(Config("c.toml", (Tier("hot", "/no/such/tier"),)))
    False
    """
    pid = watch_alive(config, node_rank)
    if pid is None:
        return False
    ran, doc = watch_status(config, node_rank)
    return bool(doc) and doc.get("ready_pid") == pid
