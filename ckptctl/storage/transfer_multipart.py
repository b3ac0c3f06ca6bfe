"""The two ways :class:`~ckptctl.storage.transfer.Transfer` copies a large file as a
multipart upload, one object per file copied: :class:`MemoryMultipart` (each part read
into a reused buffer, hashed in order here and sent by a pool worker) and
:class:`KernelMultipart` (local to local: the parts copied in the kernel, the file hashed
where it landed, right behind them). Both resume an upload a killed run left
(:mod:`~ckptctl.storage.upload_resume`) and complete it only once the whole file hashed
to the digest it must have.

>>> MemoryMultipart(transfer, "big.bin", 1 << 30, "9f2c...").run().how  # doctest: +SKIP
'multipart'
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, wait
from typing import Protocol

from ..errors import CkptError, Finding
from . import multipart
from .hashing import new_hasher
from .journal import Journal
from .localio import start_writeback
from .ratelimit import RateLimiter
from .store import Store
from .transfer_parts import FileCopy, PartScheduler, hash_mismatch, part_spans
from .upload_resume import landed, start_upload


class Copier(Protocol):
    """What a file's multipart copy uses of its :class:`~ckptctl.storage.transfer.Transfer`
    (named by its parts: transfer.py imports this module)."""

    src: Store
    dst: Store
    journal: Journal
    algo: str
    limiter: RateLimiter
    #: the part size asked for (a resumed upload keeps its own)
    part_size: int
    #: a remote source is paced as it is read, a local one as it is sent
    pace_reads: bool
    parts: PartScheduler

    def progress(self, n: int) -> None:
        """``n`` more bytes of the transfer are done."""


class MemoryMultipart:
    """A multipart copy through memory: each part is read into a reused buffer and sent
    by one worker (so ``workers`` reads and sends are in flight at once, S3 GETs
    included), while the calling thread hashes the parts in order as they arrive and
    completes the upload only if the whole file hashes to ``want``. Parts a killed run
    left are re-read and re-hashed, never re-sent."""

    def __init__(self, t: Copier, rel: str, size: int, want: str):
        self.t, self.rel, self.size, self.want = t, rel, size, want
        self.sched = t.parts
        plan = start_upload(t.journal, t.dst, rel, size, t.part_size,
                            retry=lambda call: self.sched.retry(call, rel))
        self.upload_id, self.have = plan.upload_id, plan.have
        self.rec = t.journal.uploads[rel]
        self.parts: dict[int, multipart.Part] = {}
        self.result = FileCopy(rel, size, "", "multipart")
        self.lock = threading.Lock()
        self.changed = threading.Event()  # a resumed part differs: the upload cannot finish
        self.h = new_hasher(t.algo)
        self.spans = part_spans(size, plan.part_size)
        self.arrivals: dict[int, Future] = {}
        self.jobs: list[Future] = []
        self.hashed = 0  # parts of spans hashed so far, in order

    def run(self) -> FileCopy:
        """Send every part, hash the file, complete the upload. On failure the other
        files stop too and the upload stays for a rerun (aborted where a resumed part
        differs: it cannot be finished)."""
        try:
            self._send_all()
        except BaseException:
            self.sched.cancel.set()  # the other files stop too; the upload stays for a rerun
            wait(self.jobs)
            if self.changed.is_set():
                multipart.abort_upload(self.t.dst, self.rel, self.upload_id)
                self.t.journal.forget(self.rel)
            raise
        return self._complete()

    def _send_all(self) -> None:
        """Hand every part to a worker (one slot and buffer each, hashing arrived parts
        while slots are short), then hash the rest and wait for the sends."""
        for number, start, end in self.spans:
            self.sched.check()
            for f in self.jobs:
                if f.done() and f.exception() is not None:
                    raise f.exception()
            self.jobs = [f for f in self.jobs if not f.done()]
            self._hash_arrived(block=False)
            buf, view = self.sched.take(end - start, lambda: self._hash_next(block=True),
                                        at_least=self.t.part_size)
            self.arrivals[number] = Future()
            try:
                self.jobs.append(self.sched.pool.submit(self._move, number, start, end, buf,
                                                        view, self.arrivals[number]))
            except BaseException:
                self.sched.give(buf)
                raise
        self._hash_arrived(block=True)
        wait(self.jobs)
        for f in self.jobs:
            f.result()

    def _hash_next(self, block: bool) -> bool:
        """Hash the next part in order if it has arrived (``block``: wait for it);
        False when there is none submitted to wait for."""
        spans = self.spans
        arrived = self.arrivals.get(spans[self.hashed][0]) if self.hashed < len(spans) else None
        if arrived is None or not (block or arrived.done()):
            return False
        view, release = arrived.result()
        try:
            self.h.update(view)
        finally:
            release()
        self.hashed += 1
        return True

    def _hash_arrived(self, block: bool) -> None:
        while self._hash_next(block):
            pass

    def _move(self, number: int, start: int, end: int, buf, view: memoryview,
              arrived: Future) -> None:
        """Read part ``number`` into ``view``, hand it to the hashing thread through
        ``arrived``, send it; the buffer goes back once both are done with it."""
        holds = [2]

        def release() -> None:
            with self.lock:
                holds[0] -= 1
                last = holds[0] == 0
            if last:
                self.sched.give(buf)

        self._read_part(start, end, buf, view, arrived)
        arrived.set_result((view, release))
        try:
            self._send_part(number, end - start, view)
        finally:
            release()

    def _read_part(self, start: int, end: int, buf, view: memoryview,
                   arrived: Future) -> None:
        """Read bytes ``[start, end)`` of the source into ``view``; on failure the
        hashing thread hears of it through ``arrived`` and the buffer goes back."""
        t, rel = self.t, self.rel
        try:
            self.sched.check()
            if t.pace_reads:
                t.limiter.acquire(end - start)
            got = self.sched.retry(lambda: t.src.read_into(rel, start, view), rel)
            if got != end - start:
                raise Finding(t.src.display(rel), f"shorter than its manifest size "
                              f"({start + got} of {self.size} bytes)", code="SIZE_MISMATCH")
        except BaseException as e:
            arrived.set_exception(e)
            self.sched.give(buf)
            raise

    def _send_part(self, number: int, n: int, view: memoryview) -> None:
        """Send part ``number`` (``n`` bytes in ``view``) and journal it, or keep the
        part a killed run sent if it holds the same bytes."""
        t, rel = self.t, self.rel
        ph = new_hasher(t.algo)
        ph.update(view)
        part_digest = ph.hexdigest()
        old = self.rec.parts.get(number)
        if number in self.have and old is not None:
            if old.digest != part_digest:  # servers may refuse a part sent twice
                self.changed.set()
                raise Finding(t.src.display(rel), "changed since the interrupted "
                              f"run (part {number} differs); rerun to send it afresh",
                              code="HASH_MISMATCH")
            with self.lock:
                self.parts[number] = self.have[number]
                self.result.parts_resumed += 1
            t.progress(n)
            return
        self.sched.check()
        if not t.pace_reads:
            t.limiter.acquire(n)
        part = self.sched.retry(lambda: multipart.upload_part(t.dst, rel, self.upload_id,
                                                              number, view), rel)
        t.journal.part_done(rel, number, part.etag, part.size, part_digest)
        with self.lock:
            self.parts[number] = part
            self.result.sent += n
            self.result.parts_sent += 1
        t.progress(n)

    def _complete(self) -> FileCopy:
        """Complete the upload if the whole file hashed to ``want`` (else abort it)."""
        t, rel, result = self.t, self.rel, self.result
        result.digest = self.h.hexdigest()
        if result.digest != self.want:
            multipart.abort_upload(t.dst, rel, self.upload_id)
            t.journal.forget(rel)
            raise hash_mismatch(t.src.display(rel), result.digest)
        ordered = [self.parts[n] for n in sorted(self.parts)]
        try:
            self.sched.retry(lambda: multipart.complete_upload(t.dst, rel, self.upload_id,
                                                               ordered), rel)
        except CkptError as e:  # a retry after a lost answer finds the upload completed
            if e.code != "MISSING_FILE" or not landed(t.dst, rel, self.size):
                raise
        t.journal.file_done(rel, result.digest, self.size)
        return result


class KernelMultipart:
    """A local-to-local multipart copy: the parts go from file to file in the kernel
    (:func:`~.multipart.copy_part`) on the pool, ``lanes`` at once; the calling thread
    hashes the upload's data file part by part right behind them (from the page cache)
    and completes the upload only if the whole file hashes to ``want``. One pass over the
    bytes in Python (the hash), one fsync (at completion). Parts a killed run left are
    kept as listed and proven by the same hash."""

    def __init__(self, t: Copier, rel: str, size: int, want: str, *, lanes: int):
        self.t, self.rel, self.size, self.want, self.lanes = t, rel, size, want, lanes
        self.sched = t.parts
        plan = start_upload(t.journal, t.dst, rel, size, t.part_size)
        self.upload_id, self.part_size, self.have = plan.upload_id, plan.part_size, plan.have
        self.result = FileCopy(rel, size, "", "multipart")
        self.lock = threading.Lock()
        self.parts: dict[int, multipart.Part] = {}

    def run(self) -> FileCopy:
        """Copy the parts not yet sent, hash the file behind them, complete the upload."""
        t, rel = self.t, self.rel
        spans = [(number, start, end - start)
                 for number, start, end in part_spans(self.size, self.part_size)]
        todo = self._keep_resumed(spans)
        futures, lanes = self.sched.in_lanes(self._send, todo, self.lanes)
        data_path = multipart.upload_data_path(t.dst, rel, self.upload_id)
        h = new_hasher(t.algo)
        try:
            self._hash_behind(h, data_path, spans, futures)
        except BaseException:
            self.sched.cancel.set()  # the other files stop too; the upload stays for a rerun
            wait(lanes)
            raise
        self.result.digest = h.hexdigest()
        if self.result.digest != self.want:  # the source changed, or a part was lost
            multipart.abort_upload(t.dst, rel, self.upload_id)  # start afresh
            t.journal.forget(rel)
            raise hash_mismatch(t.src.display(rel), self.result.digest)
        multipart.complete_upload(t.dst, rel, self.upload_id,
                                  [self.parts[n] for n in sorted(self.parts)])
        t.journal.file_done(rel, self.result.digest, self.size)
        return self.result

    def _keep_resumed(self, spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """Keep the parts a killed run sent (counted as done); the rest, to send."""
        todo = []
        for number, start, n in spans:
            if number in self.have:
                self.parts[number] = self.have[number]
                self.result.parts_resumed += 1
                self.t.progress(n)
            else:
                todo.append((number, start, n))
        return todo

    def _send(self, number: int, start: int, n: int) -> multipart.Part:
        """Copy part ``number`` (``n`` bytes at ``start``) in the kernel; journal it."""
        t, rel = self.t, self.rel
        self.sched.check()
        t.limiter.acquire(n)
        self.sched.check()
        part = multipart.copy_part(t.src, rel, t.dst, rel, self.upload_id, number, start, n)
        t.journal.part_done(rel, number, part.etag, part.size, "")
        with self.lock:
            self.result.sent += n
            self.result.parts_sent += 1
        t.progress(n)
        return part

    def _hash_behind(self, h, data_path: str, spans: list[tuple[int, int, int]],
                     futures: dict[int, Future]) -> None:
        """Hash the upload's data file part by part, each once it has landed, into
        ``h``; a part that holds fewer bytes than it should raises."""
        buf = bytearray(min(self.part_size, 8 << 20))
        view = memoryview(buf)
        fd = os.open(data_path, os.O_RDONLY)
        try:
            for number, start, n in spans:
                if number in futures:
                    self.parts[number] = futures[number].result()
                done = hash_range(fd, h, view, start, n)
                start_writeback(fd, start, done)  # the fsync at completion waits less
                if done != n:
                    raise Finding(self.t.dst.display(self.rel), f"part {number} holds {done} "
                                  f"of its {n} bytes at the destination", code="SIZE_MISMATCH")
        finally:
            os.close(fd)


def hash_range(fd: int, h, view: memoryview, start: int, n: int) -> int:
    """Feed ``h`` the ``n`` bytes of ``fd`` at ``start``, read through ``view``; returns
    how many there were (fewer where the file ends first).

    >>> import hashlib, tempfile
    >>> f = tempfile.TemporaryFile(); _ = f.write(b"abcdef"); f.flush()
    >>> h = hashlib.sha256(); hash_range(f.fileno(), h, memoryview(bytearray(4)), 1, 9)
    5
    >>> h.hexdigest() == hashlib.sha256(b"bcdef").hexdigest()
    True
    """
    done = 0
    while done < n:
        got = os.preadv(fd, [view[:min(len(view), n - done)]], start + done)
        if got == 0:
            break
        h.update(view[:got])
        done += got
    return done
