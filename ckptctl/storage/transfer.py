"""Copy files between two stores: hashed while copying, checked against the hash they
must have *before* they are published, rate-limited, in parallel parts, resumable.

A file is published at the destination only once its bytes hashed to the expected
digest: a small file in one atomic write, a large one as a multipart upload completed
last (local stores: a temp file renamed into place). So anything that exists at the
destination under its name is whole and proven, and a killed transfer leaves only
unfinished uploads, which the :class:`~ckptctl.storage.journal.Journal` lets a rerun
resume part by part (parts already sent are re-read and re-hashed, never re-sent).

>>> t = Transfer(src, dst, journal=j, limiter=RateLimiter(200 << 20))   # doctest: +SKIP
>>> t.copy("__0_0.distcp", 1 << 30, "9f2c...").sent                     # doctest: +SKIP
1073741824
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

from ..errors import CkptError, Finding
from . import multipart
from .hashing import hash_file, new_hasher
from .journal import Journal
from .localio import aligned_buffer, copies_through_memory, start_writeback
from .ratelimit import RateLimiter
from .retry import with_retries
from .store import Store

DEFAULT_PART_SIZE = 32 << 20
#: Small files a local destination holds staged (written, not yet durable nor under their
#: names) before they are published together: at most this many files or bytes.
STAGE_FILES = 512
STAGE_BYTES = 256 << 20
#: Parts of one file copied in the kernel at once (local to local). One, as ``cp``: ext4
#: serializes writers of one inode on its lock, and four workers spinning on it cost up
#: to 4x the system CPU of one (perf: 23% of samples in ``rwsem_spin_on_owner``), for no
#: gain in wall time; files still go in parallel, one per worker.
KERNEL_LANES = 1


def _discard(temps) -> None:
    """Remove staged temp files, best effort: cleanup must not hide the error that led
    here (some may be renamed or gone already; the commit removes strays)."""
    for tmp in temps:
        try:
            os.unlink(tmp)
        except OSError:
            pass


class Cancelled(Exception):
    """The transfer is being abandoned (Ctrl-C, another file failed)."""


@dataclass
class FileCopy:
    """What copying one file did. ``how``: ``put`` (one write), ``multipart``,
    ``server-copy`` or ``skipped`` (already complete at the destination)."""

    rel: str
    size: int
    digest: str
    how: str
    sent: int = 0
    parts_sent: int = 0
    parts_resumed: int = 0


class Transfer:
    """Copies files from ``src`` to ``dst`` with one rate limit, one pool of part
    uploads (``workers``) and one journal. Thread-safe: call :meth:`copy` from several
    threads (one per file) at once."""

    def __init__(self, src: Store, dst: Store, *, journal: Journal, algo: str = "xxh3-128",
                 limiter: RateLimiter | None = None, part_size: int = DEFAULT_PART_SIZE,
                 workers: int = 4, on_bytes: Callable[[int], None] | None = None):
        self.src, self.dst, self.journal, self.algo = src, dst, journal, algo
        self.limiter = limiter or RateLimiter(None)
        self.part_size, self.workers, self.on_bytes = part_size, max(1, workers), on_bytes
        if self.limiter.rate:
            # a part goes out in one burst once its bytes are paid for, so any window can
            # hold one part more than the rate allows: keep a part within a quarter second
            # of the limit (32 MiB parts at 20 MiB/s overshot 10 s windows by 12%)
            self.part_size = min(self.part_size,
                                 max(multipart.MIN_PART, int(self.limiter.rate / 4)))
        self.cancel = threading.Event()
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="ckptctl-part")
        # parts read but not yet sent: bounds memory to about 2 * workers * part_size
        self.in_flight = threading.BoundedSemaphore(2 * self.workers)
        # local sources are read into these, reused: first touches of fresh memory run at
        # a fraction of copy speed (FACTS.md), and a part a second costs a fresh buffer
        self._buffers: list = []  # localio.aligned_buffer()s
        self._buffers_lock = threading.Lock()
        self.server_copy = (not src.is_local and src.same_server(dst)
                            and dst.caps.server_side_copy)
        # the limit holds where the bytes cross the network: a remote source is paced as
        # it is read (else 2 * workers parts arrive in one unpaced burst), a local one as
        # it is sent (so re-reading the parts of a resumed upload costs nothing)
        self.pace_reads = not src.is_local
        # local to local: onto ext4 the parts go through memory (read, hashed from the
        # buffer, written with O_DIRECT: localio.copies_through_memory says why); onto
        # other file systems they are copied in the kernel (a reflink on XFS and btrfs)
        # and the file is proven where it landed, hashed from the page cache behind them
        self.kernel = (src.is_local and dst.is_local
                       and not copies_through_memory(dst.full("")))
        # a local destination takes small files in batches (:meth:`flush`): written to temp
        # files, made durable together, then renamed; the journal hears of them after that
        self.batch = dst.is_local
        self._staged: dict[str, tuple[str, str, int]] = {}  # rel -> (temp path, digest, size)
        self._staged_bytes = 0
        self._staged_lock = threading.Lock()
        self._flush_lock = threading.Lock()

    def close(self) -> None:
        """Stop the part workers; staged files not yet flushed are removed (a rerun sends
        them again)."""
        self.cancel.set()
        self.pool.shutdown(wait=True, cancel_futures=True)
        with self._staged_lock:
            left, self._staged = self._staged, {}
        _discard(tmp for tmp, _, _ in left.values())

    def flush(self) -> None:
        """Publish the small files staged so far (:meth:`Store.publish_staged`) and
        journal them. :func:`~ckptctl.tiering.promote.copy_files` calls it once its files are
        copied; :meth:`copy` calls it every :data:`STAGE_FILES` files or
        :data:`STAGE_BYTES` bytes, so a kill costs a rerun at most that much."""
        with self._flush_lock:
            with self._staged_lock:
                batch, self._staged, self._staged_bytes = self._staged, {}, 0
            if not batch:
                return
            try:
                self.dst.publish_staged({rel: tmp for rel, (tmp, _, _) in batch.items()})
            except BaseException:
                _discard(tmp for tmp, _, _ in batch.values())
                raise
            for rel, (_, digest, size) in batch.items():
                self.journal.file_done(rel, digest, size)

    def _stage(self, rel: str, data: memoryview, digest: str) -> None:
        tmp = self.dst.stage(rel, data)
        with self._staged_lock:
            old = self._staged.pop(rel, None)
            self._staged[rel] = (tmp, digest, len(data))
            self._staged_bytes += len(data)
            full = len(self._staged) >= STAGE_FILES or self._staged_bytes >= STAGE_BYTES
        if old is not None:
            _discard([old[0]])
        if full:
            self.flush()

    def _take(self, n: int, hash_one: Callable[[], bool] | None = None
              ) -> tuple[object, memoryview]:
        """A slot for one part in flight and a reused buffer of ``n`` bytes. While every
        slot is taken, ``hash_one()`` is called to hash (and so free) the caller's next
        part; it returns False when the caller holds no part waiting for its hash."""
        while not self.in_flight.acquire(blocking=False):
            if hash_one is None or not hash_one():
                while not self.in_flight.acquire(timeout=0.1):
                    self._check()
                break
        with self._buffers_lock:
            buf = self._buffers.pop() if self._buffers else None
        if buf is None or len(buf) < n:  # page-aligned: a local part goes out with O_DIRECT
            buf = aligned_buffer(max(n, self.part_size))
        return buf, memoryview(buf)[:n]

    def _give(self, buf) -> None:
        with self._buffers_lock:
            self._buffers.append(buf)
        self.in_flight.release()

    def _check(self) -> None:
        if self.cancel.is_set():
            raise Cancelled()

    def _backoff(self, seconds: float) -> None:
        """A retry's wait, cut short when the transfer is cancelled (SIGTERM, a failed
        file): a worker asleep for seconds would hold up the exit."""
        if self.cancel.wait(seconds):
            raise Cancelled()

    def _progress(self, n: int) -> None:
        if self.on_bytes and n:
            self.on_bytes(n)

    def _mismatch(self, rel: str, digest: str) -> Finding:
        return Finding(self.src.display(rel), f"content hash {digest[:16]}... differs from the "
                       "manifest: the source changed or is corrupt; nothing was published",
                       code="HASH_MISMATCH")

    # ------------------------------------------------------------------ one file
    def copy(self, rel: str, size: int, want: str) -> FileCopy:
        """Copy ``rel`` (``size`` bytes, content hash ``want``) unless the journal says it
        is already complete at the destination at that size."""
        self._check()
        done = self.journal.files.get(rel)
        if done == (want, size):
            self._progress(size)
            return FileCopy(rel, size, want, "skipped")
        if self.server_copy:
            return self._server_copy(rel, size, want)
        if size <= self.part_size:
            return self._put(rel, size, want)
        if self.kernel:
            return self._kernel_multipart(rel, size, want)
        return self._multipart(rel, size, want)

    def _put(self, rel: str, size: int, want: str) -> FileCopy:
        buf, view = self._take(size)
        try:
            if self.pace_reads:
                self.limiter.acquire(size)
            got = (with_retries(lambda: self.src.read_whole_into(rel, view), what=rel,
                                sleep=self._backoff) if size else 0)
            data = view[:got]
            h = new_hasher(self.algo)
            h.update(data)
            digest = h.hexdigest()
            if got != size or digest != want:
                raise self._mismatch(rel, digest)
            self._check()
            if not self.pace_reads:
                self.limiter.acquire(size)
            if self.batch:
                self._stage(rel, data, digest)
            else:
                with_retries(lambda: self.dst.write_atomic(rel, data), what=rel,
                             sleep=self._backoff)
        finally:
            self._give(buf)
        if not self.batch:
            self.journal.file_done(rel, digest, size)
        self._progress(size)
        return FileCopy(rel, size, digest, "put", sent=size)

    def _server_copy(self, rel: str, size: int, want: str) -> FileCopy:
        with_retries(lambda: multipart.copy_object(self.src, rel, self.dst, rel), what=rel,
                     sleep=self._backoff)
        digest, n = hash_file(self.dst, rel, self.algo)  # proven where it landed
        if (digest, n) != (want, size):
            self.dst.remove(rel)
            raise self._mismatch(rel, digest)
        self.journal.file_done(rel, digest, size)
        self._progress(size)
        return FileCopy(rel, size, digest, "server-copy")

    def _resumable(self, rel: str) -> tuple[str, int, dict[int, multipart.Part]] | None:
        """(upload id, part size, parts the server holds that the journal vouches for) of
        an upload a killed run left, or None."""
        rec = self.journal.uploads.get(rel)
        if rec is None:
            return None
        try:
            listed = {p.number: p for p in multipart.list_parts(self.dst, rel, rec.upload_id)}
        except CkptError as e:
            if e.code != "MISSING_FILE":  # NoSuchUpload: aborted or completed meanwhile
                raise
            self.journal.forget(rel)
            return None
        good = {n: p for n, p in listed.items()
                if n in rec.parts and (rec.parts[n].etag, rec.parts[n].size) == (p.etag, p.size)}
        return rec.upload_id, rec.part_size, good

    def _multipart(self, rel: str, size: int, want: str) -> FileCopy:
        """A multipart copy through memory: each part is read into a reused buffer and sent
        by one worker (so ``workers`` reads and sends are in flight at once, S3 GETs
        included), while this thread hashes the parts in order as they arrive and
        completes the upload only if the whole file hashes to ``want``. Parts a killed run
        left are re-read and re-hashed, never re-sent."""
        resumed = self._resumable(rel)
        if resumed is None:
            part_size = multipart.part_size_for(size, self.part_size)
            upload_id = with_retries(lambda: multipart.create_upload(self.dst, rel,
                                                                     part_size=part_size),
                                     what=rel, sleep=self._backoff)
            self.journal.upload_started(rel, upload_id, part_size)
            have: dict[int, multipart.Part] = {}
        else:
            upload_id, part_size, have = resumed
        rec = self.journal.uploads[rel]
        parts: dict[int, multipart.Part] = {}
        result = FileCopy(rel, size, "", "multipart")
        lock = threading.Lock()
        changed = threading.Event()  # a resumed part differs: the upload cannot be finished

        def move(number: int, start: int, end: int, buf, view: memoryview,
                 arrived: Future) -> None:
            """Read part ``number`` into ``view``, hand it to the hashing thread through
            ``arrived``, send it; the buffer goes back once both are done with it."""
            holds = [2]

            def release() -> None:
                with lock:
                    holds[0] -= 1
                    last = holds[0] == 0
                if last:
                    self._give(buf)

            try:
                self._check()
                if self.pace_reads:
                    self.limiter.acquire(end - start)
                got = with_retries(lambda: self.src.read_into(rel, start, view),
                                   what=rel, sleep=self._backoff)
                if got != end - start:
                    raise Finding(self.src.display(rel), f"shorter than its manifest size "
                                  f"({start + got} of {size} bytes)", code="SIZE_MISMATCH")
            except BaseException as e:
                arrived.set_exception(e)
                self._give(buf)
                raise
            arrived.set_result((view, release))
            try:
                ph = new_hasher(self.algo)
                ph.update(view)
                part_digest = ph.hexdigest()
                old = rec.parts.get(number)
                if number in have and old is not None:
                    if old.digest != part_digest:  # servers may refuse a part sent twice
                        changed.set()
                        raise Finding(self.src.display(rel), "changed since the interrupted "
                                      f"run (part {number} differs); rerun to send it afresh",
                                      code="HASH_MISMATCH")
                    with lock:
                        parts[number] = have[number]
                        result.parts_resumed += 1
                    self._progress(end - start)
                    return
                self._check()
                if not self.pace_reads:
                    self.limiter.acquire(end - start)
                part = with_retries(lambda: multipart.upload_part(self.dst, rel, upload_id,
                                                                  number, view),
                                    what=rel, sleep=self._backoff)
                self.journal.part_done(rel, number, part.etag, part.size, part_digest)
                with lock:
                    parts[number] = part
                    result.sent += end - start
                    result.parts_sent += 1
                self._progress(end - start)
            finally:
                release()

        h = new_hasher(self.algo)
        spans = [(number, start, min(size, start + part_size))
                 for number, start in enumerate(range(0, size, part_size), 1)]
        arrivals: dict[int, Future] = {}
        jobs: list[Future] = []
        hashed = 0  # parts of spans hashed so far, in order

        def hash_next(block: bool) -> bool:
            """Hash the next part in order if it has arrived (``block``: wait for it);
            False when there is none submitted to wait for."""
            nonlocal hashed
            arrived = arrivals.get(spans[hashed][0]) if hashed < len(spans) else None
            if arrived is None or not (block or arrived.done()):
                return False
            view, release = arrived.result()
            try:
                h.update(view)
            finally:
                release()
            hashed += 1
            return True

        def hash_arrived(block: bool) -> None:
            while hash_next(block):
                pass

        try:
            for number, start, end in spans:
                self._check()
                for f in jobs:
                    if f.done() and f.exception() is not None:
                        raise f.exception()
                jobs = [f for f in jobs if not f.done()]
                hash_arrived(block=False)
                buf, view = self._take(end - start, lambda: hash_next(block=True))
                arrivals[number] = Future()
                try:
                    jobs.append(self.pool.submit(move, number, start, end, buf, view,
                                                 arrivals[number]))
                except BaseException:
                    self._give(buf)
                    raise
            hash_arrived(block=True)
            wait(jobs)
            for f in jobs:
                f.result()
        except BaseException:
            self.cancel.set()  # the other files stop too; the upload stays for a rerun
            wait(jobs)
            if changed.is_set():
                multipart.abort_upload(self.dst, rel, upload_id)
                self.journal.forget(rel)
            raise
        result.digest = h.hexdigest()
        if result.digest != want:
            multipart.abort_upload(self.dst, rel, upload_id)
            self.journal.forget(rel)
            raise self._mismatch(rel, result.digest)
        ordered = [parts[n] for n in sorted(parts)]
        try:
            with_retries(lambda: multipart.complete_upload(self.dst, rel, upload_id, ordered),
                         what=rel, sleep=self._backoff)
        except CkptError as e:  # a retry after a lost answer finds the upload completed
            if e.code != "MISSING_FILE" or not self._landed(rel, size):
                raise
        self.journal.file_done(rel, result.digest, size)
        return result

    def _kernel_multipart(self, rel: str, size: int, want: str) -> FileCopy:
        """A local-to-local multipart copy: the parts go from file to file in the kernel
        (:func:`~.multipart.copy_part`) on the pool; this thread hashes the upload's data
        file part by part right behind them (from the page cache) and completes the upload
        only if the whole file hashes to ``want``. One pass over the bytes in Python
        (the hash), one fsync (at completion). Parts a killed run left are kept as listed
        and proven by the same hash."""
        resumed = self._resumable(rel)
        if resumed is None:
            part_size = multipart.part_size_for(size, self.part_size)
            upload_id = multipart.create_upload(self.dst, rel, part_size=part_size)
            self.journal.upload_started(rel, upload_id, part_size)
            have: dict[int, multipart.Part] = {}
        else:
            upload_id, part_size, have = resumed
        result = FileCopy(rel, size, "", "multipart")
        lock = threading.Lock()

        def send(number: int, start: int, n: int) -> multipart.Part:
            self._check()
            self.limiter.acquire(n)
            self._check()
            part = multipart.copy_part(self.src, rel, self.dst, rel, upload_id, number, start, n)
            self.journal.part_done(rel, number, part.etag, part.size, "")
            with lock:
                result.sent += n
                result.parts_sent += 1
            self._progress(n)
            return part

        spans = [(number, start, min(size, start + part_size) - start)
                 for number, start in enumerate(range(0, size, part_size), 1)]
        parts: dict[int, multipart.Part] = {}
        todo = []
        for number, start, n in spans:
            if number in have:
                parts[number] = have[number]
                result.parts_resumed += 1
                self._progress(n)
            else:
                todo.append((number, start, n))
        futures, lanes = self._in_lanes(send, todo, KERNEL_LANES)
        data_path = multipart.upload_data_path(self.dst, rel, upload_id)
        h = new_hasher(self.algo)
        buf = bytearray(min(part_size, 8 << 20))
        view = memoryview(buf)
        try:
            fd = os.open(data_path, os.O_RDONLY)
            try:
                for number, start, n in spans:
                    if number in futures:
                        parts[number] = futures[number].result()
                    done = 0
                    while done < n:
                        got = os.preadv(fd, [view[:min(len(buf), n - done)]], start + done)
                        if got == 0:
                            break
                        h.update(view[:got])
                        done += got
                    start_writeback(fd, start, done)  # the fsync at completion waits less
                    if done != n:
                        raise Finding(self.dst.display(rel), f"part {number} holds {done} of "
                                      f"its {n} bytes at the destination", code="SIZE_MISMATCH")
            finally:
                os.close(fd)
        except BaseException:
            self.cancel.set()  # the other files stop too; the upload stays for a rerun
            wait(lanes)
            raise
        result.digest = h.hexdigest()
        if result.digest != want:  # the source changed, or a part was lost: start afresh
            multipart.abort_upload(self.dst, rel, upload_id)
            self.journal.forget(rel)
            raise self._mismatch(rel, result.digest)
        multipart.complete_upload(self.dst, rel, upload_id, [parts[n] for n in sorted(parts)])
        self.journal.file_done(rel, result.digest, size)
        return result

    def _in_lanes(self, send: Callable[[int, int, int], multipart.Part],
                  todo: list[tuple[int, int, int]], lanes: int
                  ) -> tuple[dict[int, Future], list[Future]]:
        """Run ``send(number, start, n)`` for the parts ``todo`` (in their order) on at
        most ``lanes`` pool workers at once. Returns a future per part number (the first
        part that fails fails every part not yet started, with :class:`Cancelled`) and the
        lanes' own futures (to wait for)."""
        futures = {number: Future() for number, _, _ in todo}
        queue = iter(todo)
        lock = threading.Lock()

        def take():
            with lock:
                return next(queue, None)

        def drain(_=None) -> None:  # also a lane's done callback: a cancelled lane ran nothing
            with lock:
                rest = list(queue)
            for number, _, _ in rest:
                futures[number].set_exception(Cancelled())

        def lane() -> None:
            while (job := take()) is not None:
                number, start, n = job
                try:
                    futures[number].set_result(send(number, start, n))
                except BaseException as e:  # noqa: BLE001 - raised where the part is awaited
                    futures[number].set_exception(e)
                    drain()
                    return

        jobs = [self.pool.submit(lane) for _ in range(min(lanes, len(todo)))]
        for job in jobs:
            job.add_done_callback(drain)
        return futures, jobs

    def _landed(self, rel: str, size: int) -> bool:
        try:
            return self.dst.size(rel) == size
        except CkptError:
            return False

