"""How ``pack`` turns planned segments into data files: every chunk to encode
(:func:`chunk_jobs`), which data file each goes to (:func:`data_layout`, decided from the
source's sizes alone, so processes under torchrun/srun can write different ones), and the
encoding itself (:func:`encode_all`): chunks encoded by :mod:`ckptctl.formats.packcodec`
on a thread pool, their payloads appended in order to data files of at most 256 MiB of
source each, every source file hashed on the way against the source manifest.
"""
from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from ..errors import Finding, FormatError
from ..formats.manifest import MANIFEST, Manifest
from ..formats.pack import DATA_FILE_SIZE, data_name
from ..storage import new_hasher
from ..writing.output import OutputDir


def chunk_jobs(names, plans, chunk_size: int) -> tuple[list[tuple], list[list[int]]]:
    """Every chunk to encode, ``(file, segment, position in it, bytes)``, in file and
    segment order; and the batches they are read in: consecutive small chunks of one file
    in one request (a DCP file is mostly small segments: on S3 requests cost more than
    bytes).

    >>> from ckptctl.formats.pack import Segment
    >>> head, t = Segment("raw", 0, 100, 1, None, []), Segment("tensor", 100, 8192, 4, None, [])
    >>> jobs, batches = chunk_jobs(["a", "b"], {"a": [(head, [100]), (t, [4096, 4096])],
    ...                                         "b": [(head, [100])]}, 8192)
    >>> [(rel, seg.kind, pos, n) for rel, seg, pos, n in jobs]  # doctest: +NORMALIZE_WHITESPACE
    [('a', 'raw', 0, 100), ('a', 'tensor', 0, 4096), ('a', 'tensor', 4096, 4096),
     ('b', 'raw', 0, 100)]
    >>> batches   # one read: 4196 bytes of a; 8292 would pass 8192; another file
    [[0, 1], [2], [3]]
    """
    jobs = []
    for rel in names:
        for seg, sizes in plans[rel]:
            pos = 0
            for n in sizes:
                jobs.append((rel, seg, pos, n))
                pos += n
    batches: list[list[int]] = []
    for i, (rel, seg, pos, n) in enumerate(jobs):
        if batches:
            prev = batches[-1]
            prel, pseg, ppos, pn = jobs[prev[-1]]
            start = jobs[prev[0]][1].offset + jobs[prev[0]][2]
            if prel == rel and pseg.offset + ppos + pn == seg.offset + pos \
                    and seg.offset + pos + n - start <= chunk_size:
                prev.append(i)
                continue
        batches.append([i])
    return jobs, batches


def data_layout(jobs, batches, sizes: dict[str, int],
                limit: int | None = None) -> tuple[list[int], list[int]]:
    """Which data file each batch goes to, and which unit each data file belongs to;
    decided from the source's sizes alone, so several processes can write different data
    files and get the bytes one process writes. A data file holds at most ``limit`` bytes
    of source (whole small files together; a larger file starts a new data file and spans
    several); a unit is the data files that share a source file (one process hashes each
    source file whole). No chunk at all: one empty data file.

    >>> jobs = [("a", None, 0, 6), ("b", None, 0, 3), ("c", None, 0, 5), ("c", None, 5, 5)]
    >>> data_layout(jobs, [[0], [1], [2], [3]], {"a": 6, "b": 3, "c": 10}, limit=9)
    ([0, 0, 1, 2], [0, 1, 1])
    """
    limit = limit or DATA_FILE_SIZE
    data_of: list[int] = []
    unit_of: list[int] = []
    used = 0
    prev = None
    for b in batches:
        rel = jobs[b[0]][0]
        n = sum(jobs[i][3] for i in b)
        if rel != prev:  # a new source file: here, or a new data file and a new unit
            if not unit_of or (used and used + sizes[rel] > limit):
                unit_of.append(unit_of[-1] + 1 if unit_of else 0)
                used = 0
            prev = rel
        elif used and used + n > limit:  # the same file goes on in a new data file
            unit_of.append(unit_of[-1])
            used = 0
        data_of.append(len(unit_of) - 1)
        used += n
    return data_of, unit_of or [0]


def encode_all(store, names, jobs, batches, data_of, unit_of, man: Manifest, base_store,
               out: OutputDir, level: int, workers: int, on_bytes, codec, *,
               share=None, manifest_bytes: bytes | None = None,
               manifest_name: str = MANIFEST) -> dict:
    """Encode the chunks of this process's data files (``share`` picks its units; None:
    all) on a thread pool (at most 2 x workers batches in flight), append the payloads to
    the data files :func:`data_layout` chose, in order; hash every source file on the way
    against the source manifest. Returns this share's report: ``hashes`` {data file:
    [hash, size]}, ``chunks`` by mode, ``refs`` [[job index, ChunkRef fields...]].
    ``manifest_bytes``: the source manifest, when it is no file of the source (a source
    left unsealed); ``manifest_name``: its name among ``names`` (a single file's sidecar)."""
    units = sorted(set(unit_of))
    mine_units = set(share(units) if share is not None else units)
    mine = [k for k, b in enumerate(batches) if unit_of[data_of[k]] in mine_units]
    files_mine = [k for k, u in enumerate(unit_of) if u in mine_units]
    writer = _DataWriter(store, jobs, man, out, on_bytes)
    if 0 in mine_units:
        for rel in [rel for rel in names if rel not in writer.last_of]:  # empty files
            writer.check_source(rel, new_hasher(man.hash))
    fed = {data_of[b] for b in mine}
    for k in files_mine:  # a data file with no batch (an all-empty source): made, empty
        if k not in fed:
            writer.open_data(k)

    def encode(k: int) -> list[tuple]:
        return _encode_batch(batches[k], jobs, store, base_store, codec, level,
                             manifest_bytes, manifest_name)

    def take(k: int, results: list[tuple]) -> None:
        if data_of[k] != writer.k:
            writer.open_data(data_of[k])
        for i, res in zip(batches[k], results):
            writer.consume(i, *res)

    _in_order(encode, mine, take, workers)
    writer.close()
    return {"hashes": writer.hashes, "chunks": writer.chunks, "refs": writer.refs}


def _encode_batch(batch: list[int], jobs, store, base_store, codec, level: int,
                  manifest_bytes: bytes | None, manifest_name: str) -> list[tuple]:
    """Read one batch's source bytes in one request (the source manifest from
    ``manifest_bytes`` when given) and encode each of its chunks, against the base's bytes
    for a segment that has them: ``(data, mode, payload, check)`` per chunk."""
    rel, seg0, pos0, _ = jobs[batch[0]]
    start = seg0.offset + pos0
    _, lseg, lpos, ln = jobs[batch[-1]]
    end = lseg.offset + lpos + ln
    blob = manifest_bytes[start:end] if rel == manifest_name and manifest_bytes is not None \
        else store.read_range(rel, start, end)
    if len(blob) != end - start:
        raise FormatError(store.display(rel), f"file ends before byte {end} (changed "
                          "while packing?)", code="SIZE_MISMATCH")
    mv = memoryview(blob)
    res = []
    for i in batch:
        _, seg, pos, n = jobs[i]
        data = mv[seg.offset + pos - start:seg.offset + pos - start + n]
        b = None
        if seg.base is not None:
            bfile, boff = seg.base
            b = base_store.read_range(bfile, boff + pos, boff + pos + n)
            if len(b) != n:
                raise FormatError(base_store.display(bfile), "base file is shorter than "
                                  "its metadata says", code="SIZE_MISMATCH")
        mode, payload = codec.encode(data, itemsize=seg.itemsize, base=b, level=level)
        res.append((data, mode, payload, codec.check(data)))
    return res


def _in_order(work: Callable, items: list, take: Callable, workers: int) -> None:
    """``take(item, work(item))`` for each item in order, ``work`` running on a pool of
    ``workers`` threads at most 2 x workers items ahead; on any failure the items not
    started are cancelled and the pool is drained before the error goes on."""
    ahead: collections.deque = collections.deque()
    with ThreadPoolExecutor(workers, thread_name_prefix="ckptctl-pack") as pool:
        it = iter(items)
        try:
            while True:
                while len(ahead) < 2 * workers:
                    nxt = next(it, None)
                    if nxt is None:
                        break
                    ahead.append((nxt, pool.submit(work, nxt)))
                if not ahead:
                    break
                k, fut = ahead.popleft()
                take(k, fut.result())
        except BaseException:
            for _, f in ahead:
                f.cancel()
            raise


class _DataWriter:
    """The one thread that writes a share's data files: appends each chunk's payload to
    the open data file, hashing it, records the chunk's ref, and hashes each source file
    as its chunks pass, checking it against the source manifest at its last one."""

    def __init__(self, store, jobs, man: Manifest, out: OutputDir, on_bytes):
        self.store, self.jobs, self.man, self.out, self.on_bytes = \
            store, jobs, man, out, on_bytes
        self.hashes: dict[str, list] = {}
        self.chunks: dict[str, int] = {}
        self.refs: list[list] = []
        #: each source file's last job
        self.last_of = {rel: i for i, (rel, _, _, _) in enumerate(jobs)}
        self.k = None  # the data file open now: its number, file, hasher and size
        self.f = self.h = self.file_h = None
        self.size = 0

    def open_data(self, k: int) -> None:
        """Close the data file open now (if any) and start data file ``k``."""
        self.close()
        self.k = k
        self.f = self.out.open(data_name(k))
        self.h = new_hasher("xxh3-128")
        self.size = 0

    def close(self) -> None:
        """Close the data file open now (if any), recording its hash and size."""
        if self.f is not None:
            self.f.close()
            self.f = None
            self.hashes[data_name(self.k)] = [self.h.hexdigest(), self.size]

    def check_source(self, rel: str, h) -> None:
        """Refuse source file ``rel`` if ``h`` (its whole content's hasher) is not the
        hash its manifest records."""
        want = self.man.files[rel].hash if rel in self.man.files else None
        if want is not None and h.hexdigest() != want:
            raise Finding(self.store.display(rel), f"content hash differs from the source "
                          f"manifest ({self.man.hash}); the source is damaged (run `ckptctl "
                          "verify`)", code="HASH_MISMATCH")

    def consume(self, i: int, data, mode: str, payload: bytes, chk) -> None:
        """Write job ``i``'s encoded chunk."""
        rel, seg, pos, n = self.jobs[i]
        if self.file_h is None:
            self.file_h = new_hasher(self.man.hash)
        self.file_h.update(data)
        self.refs.append([i, data_name(self.k), self.size, len(payload), mode, n, chk])
        if payload:
            self.f.write(payload)
            self.h.update(payload)
            self.size += len(payload)
        self.chunks[mode] = self.chunks.get(mode, 0) + 1
        if self.on_bytes:
            self.on_bytes(n)
        if self.last_of[rel] == i:
            self.check_source(rel, self.file_h)
            self.file_h = None
