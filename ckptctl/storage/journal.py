"""The journal of a resumable transfer: what is already at the destination, durably.

JSON lines appended one event at a time (a header naming the source, then ``file`` /
``upload`` / ``part`` events), so a process killed at any instant leaves a journal that
says exactly what it finished; a torn last line is ignored. A rerun reads it back and
skips finished files and finished parts of multipart uploads. Only the lines whose loss
would cost more than a re-send are fsynced (the header, a started upload: without it the
upload's parts would be left on the server, billed, with nobody to abort them); a lost
``file`` or ``part`` line (a power loss, not a kill: the page cache outlives the process)
only makes the rerun send that file or part again, and a file already whole at the
destination is adopted by promote without any journal line.

>>> import tempfile, os
>>> p = os.path.join(tempfile.mkdtemp(), "j.jsonl")
>>> j = Journal(p, {"source": "xxh3-128:ab"})
>>> j.upload_started("big.bin", "U1", 8 << 20); j.part_done("big.bin", 1, "e1", 8 << 20, "h1")
>>> j.file_done("small.bin", "d0", 10)
>>> again = Journal(p, {"source": "xxh3-128:ab"})
>>> again.files, again.uploads["big.bin"].parts[1].etag
({'small.bin': ('d0', 10)}, 'e1')
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PartRecord:
    etag: str
    size: int
    digest: str  # of the part's bytes, to check the source still holds them on resume


@dataclass
class UploadRecord:
    upload_id: str
    part_size: int
    parts: dict[int, PartRecord] = field(default_factory=dict)


def cache_dir() -> str:
    """``$XDG_CACHE_HOME/ckptctl`` (default ``~/.cache/ckptctl``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ckptctl")


def journal_path_for(url: str) -> str:
    """Where the journal of a transfer to a remote ``url`` is kept (local cache).

    >>> journal_path_for("s3://b/run/step-1").endswith(".jsonl")
    True
    """
    key = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:24]
    return os.path.join(cache_dir(), "promote", key + ".jsonl")


class Journal:
    """An append-only record of finished work for one destination.

    ``header`` identifies the transfer (the source's manifest id); a journal on disk with
    another header belongs to another transfer and is started afresh. ``path=None`` keeps
    the journal in memory only. ``durable=False``: no event is fsynced, for a destination
    that is a local disk (a power loss can cost the journal only what it could cost the
    data, and the data is proven by its hash before it is published); otherwise the
    header and started uploads are (see the module docstring).
    """

    def __init__(self, path: str | None, header: dict, *, durable: bool = True):
        self.path, self.header, self.durable = path, dict(header), durable
        self.files: dict[str, tuple[str, int]] = {}
        self.uploads: dict[str, UploadRecord] = {}
        self._lock = threading.Lock()
        self._fd: int | None = None
        if path is None:
            return
        if os.path.exists(path) and not self._load():
            os.unlink(path)  # another transfer's journal: its state means nothing here
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fresh = not os.path.exists(path)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0),
                           0o600)
        if fresh:
            self._append({"header": self.header}, sync=True)

    @classmethod
    def peek(cls, path: str, header: dict) -> "Journal":
        """What the journal at ``path`` records for the transfer ``header`` names, read
        and never written (nothing when it is absent or another transfer's): a dry run.

        >>> Journal.peek("/no/such/journal.jsonl", {"source": "x"}).resumed
        False
        """
        j = cls(None, header)
        j.path = path
        try:
            if not j._load():
                j.files, j.uploads = {}, {}
        except OSError:
            pass
        j.path = None
        return j

    def pending_bytes(self, rel: str, size: int) -> int:
        """Bytes of the file ``rel`` (``size`` bytes) a rerun still sends: 0 when it is
        done, less the parts of its unfinished upload that are recorded.

        >>> j = Journal(None, {}); j.uploads["a"] = UploadRecord("U", 4)
        >>> j.uploads["a"].parts[1] = PartRecord("e", 4, "h"); j.pending_bytes("a", 10)
        6
        """
        if rel in self.files:
            return 0
        up = self.uploads.get(rel)
        return size - (sum(p.size for p in up.parts.values()) if up else 0)

    @property
    def resumed(self) -> bool:
        return bool(self.files or self.uploads)

    def _load(self) -> bool:
        with open(self.path, "rb") as f:
            lines = f.read().split(b"\n")
        events = []
        for line in lines:
            try:
                events.append(json.loads(line))
            except ValueError:
                break  # a torn last line (killed mid-write): what came before holds
        if not events or events[0].get("header") != self.header:
            return False
        for ev in events[1:]:
            if not isinstance(ev, dict):
                continue
            kind = ev.get("e")
            if kind == "file":
                self.files[ev["rel"]] = (ev["digest"], ev["size"])
                self.uploads.pop(ev["rel"], None)
            elif kind == "upload":
                self.uploads[ev["rel"]] = UploadRecord(ev["id"], ev["part_size"])
            elif kind == "part" and ev.get("rel") in self.uploads:
                up = self.uploads[ev["rel"]]
                if up.upload_id == ev.get("id"):
                    up.parts[ev["n"]] = PartRecord(ev["etag"], ev["size"], ev["digest"])
            elif kind == "forget":
                self.files.pop(ev["rel"], None)
                self.uploads.pop(ev["rel"], None)
        return True

    def _append(self, event: dict, *, sync: bool = False) -> None:
        if self._fd is None:
            return
        line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)
            if sync and self.durable:
                os.fsync(self._fd)

    def file_done(self, rel: str, digest: str, size: int) -> None:
        """``rel`` is complete and verified at the destination."""
        with self._lock:
            self.files[rel] = (digest, size)
            self.uploads.pop(rel, None)
        self._append({"e": "file", "rel": rel, "digest": digest, "size": size})

    def upload_started(self, rel: str, upload_id: str, part_size: int) -> None:
        with self._lock:
            self.uploads[rel] = UploadRecord(upload_id, part_size)
        self._append({"e": "upload", "rel": rel, "id": upload_id, "part_size": part_size},
                     sync=True)

    def part_done(self, rel: str, number: int, etag: str, size: int, digest: str) -> None:
        with self._lock:
            up = self.uploads[rel]
            up.parts[number] = PartRecord(etag, size, digest)
            upload_id = up.upload_id
        self._append({"e": "part", "rel": rel, "id": upload_id, "n": number, "etag": etag,
                      "size": size, "digest": digest})

    def forget(self, rel: str) -> None:
        """What the journal said of ``rel`` no longer holds (the destination lost it)."""
        with self._lock:
            self.files.pop(rel, None)
            self.uploads.pop(rel, None)
        self._append({"e": "forget", "rel": rel})

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def remove(self) -> None:
        """The transfer is committed: the journal has nothing left to say."""
        self.close()
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)
