"""Part scheduling for :class:`~ckptctl.storage.transfer.Transfer`: what one copy did
(:class:`FileCopy`), how a file is cut into parts (:func:`part_spans`), and
:class:`PartScheduler`, the pool of part workers with its slots for parts in flight,
their reused buffers, cancellation (:class:`Cancelled`) and retries that stop waiting
when cancelled.

>>> s = PartScheduler(workers=2)
>>> buf, view = s.take(10, at_least=16); len(view), len(buf) >= 16
(10, True)
>>> s.give(buf); s.retry(lambda: "done", "a.bin")
'done'
>>> s.shutdown()
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, TypeVar

from ..errors import Finding
from .localio import aligned_buffer
from .retry import with_retries

T = TypeVar("T")


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


def part_spans(size: int, part_size: int) -> list[tuple[int, int, int]]:
    """The parts of a ``size``-byte file: ``(part number from 1, start, end)`` each.

    >>> part_spans(10, 4)
    [(1, 0, 4), (2, 4, 8), (3, 8, 10)]
    """
    return [(number, start, min(size, start + part_size))
            for number, start in enumerate(range(0, size, part_size), 1)]


def hash_mismatch(shown: str, digest: str) -> Finding:
    """The error of a file whose bytes did not hash to its manifest's digest (nothing of
    it is published): exit 1, ``HASH_MISMATCH``.

    >>> hash_mismatch("s3://b/x.bin", "ab" * 16).code
    'HASH_MISMATCH'
    """
    return Finding(shown, f"content hash {digest[:16]}... differs from the "
                   "manifest: the source changed or is corrupt; nothing was published",
                   code="HASH_MISMATCH")


class PartScheduler:
    """The part workers of one transfer (``workers`` threads), the slots for parts read
    but not yet sent (``2 * workers``: memory stays about ``2 * workers * part size``),
    the buffers they are read into (reused: first touches of fresh memory run at a
    fraction of copy speed, FACTS.md), and the transfer's cancel flag."""

    def __init__(self, workers: int):
        self.workers = max(1, workers)
        self.cancel = threading.Event()
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="ckptctl-part")
        # parts read but not yet sent: bounds memory to about 2 * workers * part_size
        self.in_flight = threading.BoundedSemaphore(2 * self.workers)
        self._buffers: list = []  # localio.aligned_buffer()s
        self._buffers_lock = threading.Lock()

    def shutdown(self) -> None:
        """Cancel what has not started and wait for the workers."""
        self.cancel.set()
        self.pool.shutdown(wait=True, cancel_futures=True)

    def check(self) -> None:
        """Raise :class:`Cancelled` once the transfer is being abandoned."""
        if self.cancel.is_set():
            raise Cancelled()

    def backoff(self, seconds: float) -> None:
        """A retry's wait, cut short when the transfer is cancelled (SIGTERM, a failed
        file): a worker asleep for seconds would hold up the exit."""
        if self.cancel.wait(seconds):
            raise Cancelled()

    def retry(self, call: Callable[[], T], what: str) -> T:
        """``call()``, retried on transient failures (:func:`~.retry.with_retries`)
        with waits that a cancel cuts short."""
        return with_retries(call, what=what, sleep=self.backoff)

    def take(self, n: int, hash_one: Callable[[], bool] | None = None, *,
             at_least: int = 0) -> tuple[object, memoryview]:
        """A slot for one part in flight and a reused buffer of ``n`` bytes (a new one
        holds ``max(n, at_least)``). While every slot is taken, ``hash_one()`` is called
        to hash (and so free) the caller's next part; it returns False when the caller
        holds no part waiting for its hash."""
        while not self.in_flight.acquire(blocking=False):
            if hash_one is None or not hash_one():
                while not self.in_flight.acquire(timeout=0.1):
                    self.check()
                break
        with self._buffers_lock:
            buf = self._buffers.pop() if self._buffers else None
        if buf is None or len(buf) < n:  # page-aligned: a local part goes out with O_DIRECT
            buf = aligned_buffer(max(n, at_least))
        return buf, memoryview(buf)[:n]

    def give(self, buf) -> None:
        """Return a buffer :meth:`take` gave, and its slot."""
        with self._buffers_lock:
            self._buffers.append(buf)
        self.in_flight.release()

    def in_lanes(self, send: Callable[[int, int, int], T], todo: list[tuple[int, int, int]],
                 lanes: int) -> tuple[dict[int, Future], list[Future]]:
        """Run ``send(number, start, n)`` for the parts ``todo`` (in their order) on at
        most ``lanes`` pool workers at once. Returns a future per part number (the first
        part that fails fails every part not yet started, with :class:`Cancelled`) and the
        lanes' own futures (to wait for).

        >>> s = PartScheduler(workers=2)
        >>> futures, lanes = s.in_lanes(lambda number, start, n: n, [(1, 0, 4), (2, 4, 2)], 1)
        >>> [futures[k].result() for k in (1, 2)]; s.shutdown()
        [4, 2]
        """
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
