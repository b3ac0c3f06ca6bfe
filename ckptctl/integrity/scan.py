"""Read each file once and check everything at once: the content hash, the CRC-32 of every
zip record, NaN/Inf counts of every tensor. ``verify --level full`` hands each file a list
of :class:`Region` consumers; :func:`scan_file` streams the file through them in blocks.

>>> import tempfile, pathlib, zlib
>>> from ckptctl.storage import open_store
>>> d = tempfile.mkdtemp(); _ = pathlib.Path(d, "f").write_bytes(b"0123456789")
>>> r = Crc(2, 6, zlib.crc32(b"2345"), "r")
>>> scan_file(open_store(d), "f", [r]), r.ok
(10, True)
"""
from __future__ import annotations

import struct
from typing import Callable

import numpy as np

from ..formats.torchzip import LOCAL_SIG, ZipEntry
from ..model import DType
from .finite import count_non_finite

try:  # same values as zlib's, ~3x faster
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover
    from zlib import crc32

REMOTE_BLOCK = 8 << 20  # local files: Store.iter_blocks' 1 MiB buffer, reused per thread


class Region:
    """Bytes ``[start, end)`` of a file, fed to :meth:`feed` in order, then :meth:`finish`
    (``complete`` says whether every byte arrived)."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end

    def feed(self, data: memoryview) -> None:
        raise NotImplementedError

    def finish(self, complete: bool) -> None:
        pass


class Crc(Region):
    """One stored zip record whose CRC-32 the writer recorded."""

    def __init__(self, start: int, end: int, expect: int, name: str):
        super().__init__(start, end)
        self.expect, self.name, self.crc, self.ok = expect, name, 0, None

    def feed(self, data):
        self.crc = crc32(data, self.crc)

    def finish(self, complete):
        self.ok = complete and self.crc == self.expect


class ZipCrc(Region):
    """Every stored record of one zip (``entries`` from its central directory, offsets
    relative to ``start``): each local header is parsed as it streams by, then the record's
    bytes are CRC'd. ``bad`` lists the records that did not match."""

    def __init__(self, start: int, end: int, entries: list[ZipEntry], where: str):
        super().__init__(start, end)
        self.where = where
        self.todo = sorted((e for e in entries if e.method == 0), key=lambda e: e.header_offset)
        self.bad: list[str] = []
        self.records = len(self.todo)
        self.pos = start
        self._i = 0
        self._hdr = b""
        self._left = -1  # bytes of the current record still to CRC; -1: in its header
        self._crc = 0

    def feed(self, data):
        mv = memoryview(data)
        while len(mv) and self._i < len(self.todo):
            en = self.todo[self._i]
            hstart = self.start + en.header_offset
            if self._left < 0:
                if self.pos < hstart:  # bytes between records (data descriptors)
                    skip = min(hstart - self.pos, len(mv))
                    mv, self.pos = mv[skip:], self.pos + skip
                    continue
                need = 30 - len(self._hdr) if len(self._hdr) < 30 else \
                    30 + sum(struct.unpack_from("<HH", self._hdr, 26)) - len(self._hdr)
                take = min(need, len(mv))
                self._hdr += bytes(mv[:take])
                mv, self.pos = mv[take:], self.pos + take
                if len(self._hdr) >= 30 and self._hdr[:4] != LOCAL_SIG:
                    self.bad.append(f"{en.name} (header)")
                    self._next()
                elif len(self._hdr) >= 30 and len(self._hdr) == 30 + sum(
                        struct.unpack_from("<HH", self._hdr, 26)):
                    self._left, self._crc = en.usize, 0
                    if self._left == 0:
                        self._done(en)
                continue
            take = min(self._left, len(mv))
            self._crc = crc32(mv[:take], self._crc)
            mv, self.pos, self._left = mv[take:], self.pos + take, self._left - take
            if self._left == 0:
                self._done(en)

    def _done(self, en: ZipEntry) -> None:
        if self._crc != en.crc:
            self.bad.append(en.name)
        self._next()

    def _next(self) -> None:
        self._i += 1
        self._hdr, self._left, self._crc = b"", -1, 0

    def finish(self, complete):
        for en in self.todo[self._i:]:
            self.bad.append(f"{en.name} (truncated)")
        self._i = len(self.todo)


class Finite(Region):
    """NaN/Inf counts of a tensor's elements (any order: a permutation has the same)."""

    def __init__(self, start: int, end: int, dtype: DType, name: str):
        super().__init__(start, end)
        self.dtype, self.name = dtype, name
        self.counts = {"nan": 0, "inf": 0}
        self._carry = b""

    def feed(self, data):
        item = self.dtype.itemsize
        if self._carry:
            need = item - len(self._carry)
            self._carry += bytes(data[:need])
            data = data[need:]
            if len(self._carry) == item:
                self._add(self._carry)
                self._carry = b""
        whole = len(data) - len(data) % item
        if whole:
            self._add(data[:whole])
        if whole < len(data):
            self._carry = bytes(data[whole:])

    def _add(self, data) -> None:
        got = count_non_finite(np.frombuffer(data, dtype=f"V{self.dtype.itemsize}"), self.dtype)
        if got:
            self.counts["nan"] += got["nan"]
            self.counts["inf"] += got["inf"]


def scan_file(store, rel: str, regions: list[Region], *, hasher=None,
              on_bytes: Callable[[int], None] | None = None) -> int:
    """Stream file ``rel`` once through ``hasher`` (if any) and every region; returns the
    bytes read. Regions that run past the end of the file finish incomplete."""
    todo = sorted(regions, key=lambda r: r.start)
    active: list[Region] = []
    nxt = 0
    pos = 0

    def consume(mv: memoryview) -> None:
        nonlocal nxt, pos, active
        b0, b1 = pos, pos + len(mv)
        if hasher is not None:
            hasher.update(mv)
        while nxt < len(todo) and todo[nxt].start < b1:
            active.append(todo[nxt])
            nxt += 1
        still = []
        for r in active:
            a, b = max(b0, r.start), min(b1, r.end)
            if a < b:
                r.feed(mv[a - b0:b - b0])
            if r.end <= b1:
                r.finish(True)
            else:
                still.append(r)
        active = still
        pos = b1
        if on_bytes:
            on_bytes(len(mv))

    for block in store.iter_blocks(rel, block=REMOTE_BLOCK):
        consume(block if isinstance(block, memoryview) else memoryview(block))
    for r in active + todo[nxt:]:  # they reach past the end of the file
        r.finish(False)
    return pos

