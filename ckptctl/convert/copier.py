"""The copier: move the bytes a :class:`~ckptctl.convert.planner.Plan` describes, in row
blocks, so memory stays bounded whatever the tensor sizes. It decides nothing.

:func:`copy_to_dcp` is the one executor reshard and ``consolidate --to dcp`` call: the
plan's chunks into a new DCP checkpoint, data files first, ``.metadata`` next, the
manifest last. consolidate's safetensors and torch.save writers use the same
:class:`BlockStream`.

>>> list(row_ranges(10, row_bytes=100, budget=350))
[(0, 3), (3, 6), (6, 9), (9, 10)]
>>> r = copy_to_dcp(ck, plan, "out/", max_memory=1 << 30, workers=4)   # doctest: +SKIP
>>> r.files, r.bytes_written                                            # doctest: +SKIP
(['.metadata', '__0_0.distcp', '__1_0.distcp', 'ckptctl.manifest.json'], 4194816)
"""
from __future__ import annotations

import io
import os
import queue
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import numpy as np

from ..errors import Finding, FormatError, ProblemCode, StorageError, UnsafeInputError, shorten
from ..formats.dcp_write import DcpWriter
from ..formats.tensorio import byte_dtype, chunk_bytes, read_rows, read_rows_into, row_major_span
from ..formats.torchwrite import TorchZipWriter, pickle_state
from ..model import Checkpoint
from ..storage import HashBehind, Store, open_store
from ..storage.directwrite import BUFFER as DIRECT_BUFFER
from ..storage.directwrite import DirectWriter
from ..storage.localio import copies_through_memory
from ..writing.commit import commit_written
from ..writing.output import OutputDir
from .planner import Plan, TargetChunk

#: ``convert(block, out=None) -> memoryview``, with ``convert.out_size(nbytes)``
Converter = Callable[..., memoryview]


def row_ranges(rows: int, *, row_bytes: int, budget: int) -> Iterator[tuple[int, int]]:
    """Split ``rows`` into ranges of at most ``budget`` bytes (at least one row each)."""
    step = max(1, budget // max(1, row_bytes))
    for r in range(0, rows, step):
        yield r, min(rows, r + step)


def _src_row_bytes(tc: TargetChunk) -> int:
    best = 0
    for p in tc.pieces:
        n = 1
        for s in p.src.sizes[1:]:
            n *= s
        best = max(best, tc.dtype.nbytes(n))
    return best


def fill_rows(ck: Checkpoint, tc: TargetChunk, r0: int, r1: int,
              out: np.ndarray | None = None) -> np.ndarray:
    """Rows ``[r0, r1)`` of a target chunk, assembled from its source pieces (into ``out``
    when given: a reused buffer of that shape). A piece whose rows are whole in both source
    and target is read straight into place; others go through numpy slicing."""
    t = ck.tensors[tc.name]
    vt = byte_dtype(tc.dtype)
    if out is None:
        out = np.empty((r1 - r0, *tc.sizes[1:]), dtype=vt)
    flat = out.reshape(-1).view(np.uint8)
    row = tc.dtype.nbytes(int(np.prod(tc.sizes[1:], dtype=np.int64)))
    for p in tc.pieces:
        a = max(r0, p.dst_offsets[0])
        b = min(r1, p.dst_offsets[0] + p.sizes[0])
        if a >= b:
            continue
        s0 = p.src_offsets[0] + (a - p.dst_offsets[0])
        if p.sizes[1:] == tc.sizes[1:] == p.src.sizes[1:]:  # whole rows: contiguous both sides
            read_rows_into(ck, t, p.src, s0, s0 + (b - a),
                           memoryview(flat[(a - r0) * row:(b - r0) * row]))
            continue
        src = np.frombuffer(read_rows(ck, t, p.src, s0, s0 + (b - a)), dtype=vt)
        src = src.reshape((b - a, *p.src.sizes[1:]))
        inner_src = tuple(slice(o, o + s) for o, s in zip(p.src_offsets[1:], p.sizes[1:]))
        inner_dst = tuple(slice(o, o + s) for o, s in zip(p.dst_offsets[1:], p.sizes[1:]))
        out[(slice(a - r0, b - r0), *inner_dst)] = src[(slice(None), *inner_src)]
    return out


def chunk_blocks(ck: Checkpoint, tc: TargetChunk, budget: int,
                 convert: Converter | None = None,
                 pool: "_BufferPool | None" = None) -> Iterator[memoryview | bytes]:
    """The target chunk's row-major bytes, in blocks of about ``budget`` bytes, each valid
    until the next one is asked for (the buffers are reused); ``convert``
    (:func:`dtype_converter`) casts each block in its own buffer."""
    if not tc.sizes or tc.dtype.bits % 8 or not tc.pieces:
        if not tc.pieces:
            return
        if len(tc.pieces) != 1 or tc.pieces[0].sizes != tc.pieces[0].src.sizes:
            raise NotImplementedError(f"{tc.name}: resharding sub-byte or 0-dim tensors")
        data = chunk_bytes(ck, ck.tensors[tc.name], tc.pieces[0].src)
        yield convert(data) if convert else data
        return
    inner = 1
    for s in tc.sizes[1:]:
        inner *= s
    row = max(tc.dtype.nbytes(inner), _src_row_bytes(tc))
    pool = pool or _BufferPool(BUFFERS)
    vt = byte_dtype(tc.dtype)
    for r0, r1 in row_ranges(tc.sizes[0], row_bytes=row, budget=budget):
        shape = (r1 - r0, *tc.sizes[1:])
        need = tc.dtype.nbytes((r1 - r0) * inner)
        if convert is None:
            out = pool.next(need).view(vt).reshape(shape)
            yield memoryview(fill_rows(ck, tc, r0, r1, out).reshape(-1).view(np.uint8))
            continue
        # converted in place: the rows at the buffer's end, the result from its start
        cap = max(need, convert.out_size(need))
        buf = pool.next(cap)
        rows = fill_rows(ck, tc, r0, r1, buf[cap - need:].view(vt).reshape(shape))
        yield convert(memoryview(rows.reshape(-1).view(np.uint8)), buf)


#: Blocks in flight per chunk stream: one being filled, one queued by ``prefetch``, one
#: being written. A buffer is reused only after its consumer asked for a later block.
BUFFERS = 3


class _BufferPool:
    """Rotating reusable byte buffers (fresh memory is slow to touch the first time)."""

    def __init__(self, count: int):
        self.bufs: list[np.ndarray | None] = [None] * count
        self.i = 0

    def next(self, nbytes: int) -> np.ndarray:
        i = self.i
        self.i = (i + 1) % len(self.bufs)
        buf = self.bufs[i]
        if buf is None or buf.nbytes < nbytes:
            buf = self.bufs[i] = np.empty(nbytes, dtype=np.uint8)
        return buf[:nbytes]


#: Largest block moved at once: small enough to stay in the CPU cache between the read and
#: the write (a 64 MiB block ran at 0.7-1.9 GB/s, 4 MiB at 2.6-3.2 GB/s, page cache to
#: page cache here) and under glibc's threshold for fresh mmap'ed allocations.
IO_BLOCK = 4 << 20


def stream_depth(max_memory: int, streams: int, staged: bool = False) -> int:
    """Blocks to read ahead per write stream so that all streams stay within
    ``max_memory`` (each holds depth + 2 blocks of :data:`IO_BLOCK`, and, ``staged``,
    its writer's two :func:`staging_size` buffers).

    >>> stream_depth(1 << 30, 4), stream_depth(8 << 20, 1), stream_depth(256 << 20, 4, staged=True)
    (14, 1, 10)
    """
    streams = max(1, streams)
    if staged:
        max_memory -= streams * 2 * staging_size(max_memory, streams)
    return max(1, min(14, max_memory // (streams * IO_BLOCK) - 2))


def staging_size(max_memory: int, streams: int) -> int:
    """The staging buffer of each write stream's
    :class:`~ckptctl.storage.directwrite.DirectWriter` (which holds two) within
    ``max_memory``: an eighth of a stream's share, 1 MiB to the writer's 32 MiB in whole MiB.

    >>> [staging_size(m << 20, 4) >> 20 for m in (1024, 256, 16)]
    [32, 8, 1]
    """
    share = max_memory // max(1, streams)
    return max(1 << 20, min(DIRECT_BUFFER, (share // 8) >> 20 << 20))


class BlockStream:
    """The blocks of several target chunks, in write order, read ahead ``depth`` blocks by
    one thread (so reading overlaps writing across chunk boundaries too), through one
    pool of reused buffers. A writer asks for each chunk's blocks in the same order:
    ``for tc in chunks: write(stream.blocks(tc.name))``.
    """

    def __init__(self, ck: Checkpoint, chunks: list[TargetChunk], *, depth: int,
                 convert_for: Callable[[TargetChunk], Converter | None] = lambda tc: None):
        pool = _BufferPool(depth + 2)  # filled, queued (depth), being written
        budget = IO_BLOCK

        def gen():
            for tc in chunks:
                for b in chunk_blocks(ck, tc, budget, convert_for(tc), pool):
                    yield tc.name, b

        self._it = prefetch(gen(), depth)
        self._pending: tuple[str, object] | None = None

    def blocks(self, name: str) -> Iterator:
        """The blocks of chunk ``name``: the next chunk in write order."""
        while True:
            if self._pending is None:
                try:
                    self._pending = next(self._it)
                except StopIteration:
                    return
            if self._pending[0] != name:
                return
            block = self._pending[1]
            self._pending = None
            yield block


@dataclass(frozen=True)
class Span:
    """Bytes ``[offset, offset + length)`` of a source file, to be copied as stored."""

    file: str
    offset: int
    length: int

    def __len__(self) -> int:  # a writer counts a span like the block it stands for
        return self.length


def kernel_spans(ck: Checkpoint, tc: TargetChunk,
                 convert: Converter | None = None) -> list[Span] | None:
    """The target chunk's row-major bytes as runs of its local source files, in order,
    when they can be copied exactly as stored: no dtype conversion, and every piece whole
    rows of a raw (or uncompressed-zip, row-major) source chunk, the pieces tiling dim 0
    (FSDP's and ZeRO's dim-0 shards). None otherwise: the block path then reads them.

    >>> kernel_spans(ck, plan.chunks[0])      # doctest: +SKIP
    [Span(file='__0_0.distcp', offset=0, length=4096), Span(file='__1_0.distcp', ...)]
    """
    if convert is not None or not ck.store.is_local or tc.dtype.bits % 8 or not tc.pieces:
        return None
    t = ck.tensors[tc.name]
    if t.dtype != tc.dtype:
        return None
    if not tc.sizes:  # 0-dim: one piece, the whole value
        (p,) = tc.pieces if len(tc.pieces) == 1 else (None,)
        span = row_major_span(ck, t, p.src) if p is not None else None
        if span is None or span[1] != tc.nbytes:
            return None
        return [Span(p.src.extent.file, span[0], span[1])]
    inner = 1
    for n in tc.sizes[1:]:
        inner *= n
    row = tc.dtype.nbytes(inner)
    spans: list[Span] = []
    at = 0
    for p in sorted(tc.pieces, key=lambda p: p.dst_offsets[0]):
        if p.dst_offsets[0] != at or p.sizes[1:] != tc.sizes[1:] or p.src.sizes[1:] != tc.sizes[1:]:
            return None
        span = row_major_span(ck, t, p.src)
        if span is None or span[1] != tc.dtype.nbytes(p.src.numel):
            return None  # the block path names what is wrong with it
        s = Span(p.src.extent.file, span[0] + p.src_offsets[0] * row, p.sizes[0] * row)
        last = spans[-1] if spans else None
        if last and last.file == s.file and last.offset + last.length == s.offset:
            spans[-1] = Span(s.file, last.offset, last.length + s.length)
        else:
            spans.append(s)
        at += p.sizes[0]
    return spans if at == tc.sizes[0] else None


#: Largest run copied in one call: the hash behind the copies follows at this distance.
COPY_STEP = 64 << 20


class SpanWriter:
    """A binary writer for a local output file (an :class:`~.output.OutputDir` file)
    that takes blocks of bytes and :class:`Span` s of local source files alike, so
    :meth:`result` is the hash of what landed. Used as ``HashingWriter`` is, by a format
    writer that just calls ``write``. On ext2/3/4
    (:func:`~ckptctl.storage.localio.copies_through_memory`) blocks and spans go through
    a :class:`~ckptctl.storage.directwrite.DirectWriter`, past the page cache and hashed
    on the way; elsewhere blocks are written, spans copied in the kernel (no pass through
    Python, as ``cp`` does: XFS and btrfs reflink it), and the whole file is hashed from
    the page cache right behind (:class:`HashBehind`). ``buffer``: the DirectWriter's
    staging buffer size (:func:`staging_size`, so it fits the caller's memory budget).

    >>> w = SpanWriter(f, ck.store); w.write(header); w.write(Span("__0_0.distcp", 0, 64))  # doctest: +SKIP
    >>> w.result()                                                                        # doctest: +SKIP
    ('5f1c...', 80)
    """

    def __init__(self, out, src: Store, algo: str = "xxh3-128",
                 on_bytes: Callable[[int], None] | None = None, *,
                 buffer: int = DIRECT_BUFFER):
        self.out, self.src, self.on_bytes = out, src, on_bytes
        self.pos = 0
        self._fds: dict[str, int] = {}
        self._direct = self._hash = None
        if copies_through_memory(out.path):
            self._direct = DirectWriter(out.path, algo, buffer=buffer)
        else:
            self._hash = HashBehind(out.path, algo)

    def write(self, b) -> int:
        if isinstance(b, Span):
            self._copy(b)
        else:
            n = memoryview(b).nbytes
            if self._direct is not None:
                self.out.guarded(self._direct.write, b)
            else:
                self.out.write_at(b, self.pos)
            self._advance(n)
        return len(b)

    def _copy(self, s: Span) -> None:
        fd = self._fds.get(s.file)
        if fd is None:
            with self.src._errors(s.file):
                fd = self._fds[s.file] = os.open(self.src.full(s.file), os.O_RDONLY)
        for o in range(0, s.length, COPY_STEP):
            n = min(COPY_STEP, s.length - o)
            if self._direct is not None:
                got = self.out.guarded(self._direct.read_in, fd, s.offset + o, n)
            else:
                got = self.out.copy_in(fd, s.offset + o, n, self.pos)
            if got != n:
                raise FormatError(self.src.display(s.file), f"file is truncated (shorter "
                                  f"than {s.offset + s.length} bytes)", code="SIZE_MISMATCH")
            self._advance(n)

    def _advance(self, n: int) -> None:
        self.pos += n
        if self._hash is not None:
            self._hash.advance(n)
        if self.on_bytes:
            self.on_bytes(n)

    def result(self) -> tuple[str, int]:
        """(hex digest, size) of the file as written; closes the sources."""
        try:
            if self._direct is not None:  # a write error: in words, by the output file
                digest, n = self.out.guarded(self._direct.result)
            else:
                digest, n = self._hash.result()
        except EOFError as e:
            raise FormatError(self.out.rel, f"read back: {e}", code="SIZE_MISMATCH") from None
        except OSError as e:
            raise StorageError(self.out.rel, f"cannot read back what was written "
                               f"({e.strerror or type(e).__name__})") from None
        finally:
            self.close()
        if n != self.pos:
            raise FormatError(self.out.rel, f"hashed {n} of {self.pos} bytes written",
                              code="SIZE_MISMATCH")
        return digest, n

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close()
        if self._hash is not None:
            self._hash.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def prefetch(it: Iterator, depth: int = 1) -> Iterator:
    """Run ``it`` in a thread, ``depth`` items ahead, so reading overlaps writing."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    err: list[BaseException] = []
    stop = threading.Event()

    def run():
        try:
            for item in it:
                if stop.is_set():
                    return
                q.put(item)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            err.append(e)
        finally:
            q.put(done)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    try:
        while True:
            item = q.get()
            if item is done:
                break
            yield item
    finally:
        stop.set()
        while th.is_alive():  # drain so the producer can finish
            try:
                q.get(timeout=0.1)
            except queue.Empty:
                pass
    if err:
        raise err[0]


# --------------------------------------------------------------------------- dtype casts
#
# The floating casts are numpy, bit for bit what torch's ``.to(dtype)`` gives for a
# contiguous CPU tensor on x86-64 with AVX2 or AVX-512 (measured with torch 2.13). Numbers
# round to nearest even in every pair, as torch does; NaN bits differ between torch's own
# code paths (its vectorized loop; the scalar loop it runs on the last few elements of a
# tensor, or everywhere with ATEN_CPU_CAPABILITY=default; other CPUs, not measured), and
# follow the vectorized loop, the one that casts all but the last 15 elements of a tensor:
#
# ==============  =====================================================================
# f32 -> bf16     upper 16 bits rounded to nearest even; every NaN -> 0xFFFF (torch's
#                 scalar loop: 0x7FC0)
# f32 -> f16      IEEE round to nearest even; NaN -> quiet, its sign and the top of its
#                 payload kept (F16C); numpy alone keeps a NaN signalling
# f16 -> f32      exact; NaN -> quiet, payload kept (torch's scalar loop: 0x7FFFFFFF)
# bf16 -> f32     exact: the bits shifted left 16, a NaN's included
# f64 <-> f32     numpy's casts (IEEE; NaN quieted, payload kept or truncated)
# other pairs     through f32, as torch goes (f64 -> bf16 and f64 -> f16 round twice, as
#                 torch does), but f16 -> bf16 turns every NaN into 0x7FC0
# ==============  =====================================================================
#
# Blocks are cast in slices that stay in the CPU cache, through per-thread scratch
# arrays, into a caller's reusable buffer: no torch, no fresh memory per block.

#: Elements per cast step: scratch arrays of 512 KiB at most, so they stay in the CPU cache
#: (and few enough steps that numpy's per-call cost stays small: 4x fewer ran 1.4x faster).
CAST_STEP = 1 << 16

_VIEW = {"float32": np.dtype("<f4"), "float64": np.dtype("<f8"), "float16": np.dtype("<f2"),
         "bfloat16": np.dtype("<u2")}
_HI = 1 if sys.byteorder == "little" else 0  # which uint16 half of a uint32 is the high one
_BF16_NAN = 0xFFFF  # what torch's vectorized f32 -> bf16 writes for every NaN
_BF16_QNAN = 0x7FC0  # c10's canonical bf16 NaN (f16 -> bf16)


class _Scratch(threading.local):
    """Per-thread scratch arrays: one per ``slot``, reused by every cast in the thread."""

    def __init__(self):
        self.raw = [np.empty(CAST_STEP * 8, dtype=np.uint8) for _ in range(3)]
        self.mask = np.empty(CAST_STEP, dtype=np.bool_)


_scratch = _Scratch()


def _tmp(slot: int, dtype, n: int) -> np.ndarray:
    return _scratch.raw[slot].view(dtype)[:n]


def _nan_mask(x: np.ndarray) -> np.ndarray | None:
    """Where ``x`` is NaN, or None when nowhere (the usual case: one pass, no fix-up)."""
    m = _scratch.mask[:x.size]
    np.isnan(x, out=m)
    return m if m.any() else None


def _f32_bf16(x: np.ndarray, slot: int, nan: int = _BF16_NAN) -> np.ndarray:
    u = x.view(np.uint32)
    t = _tmp(slot, np.uint32, x.size)
    np.right_shift(u, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, 0x7FFF, out=t)
    np.add(t, u, out=t)  # the rounding bias: ties go to the even upper half
    m = _nan_mask(x)
    if m is not None:
        np.putmask(t, m, nan << 16)
    return t.view(np.uint16)[_HI::2]


def _bf16_f32(x: np.ndarray, slot: int) -> np.ndarray:
    t = _tmp(slot, np.uint32, x.size)
    np.copyto(t, x)
    np.left_shift(t, 16, out=t)
    return t.view(np.float32)


def _f32_f16(x: np.ndarray, slot: int) -> np.ndarray:
    h = _tmp(slot, np.float16, x.size)
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are meant
        np.copyto(h, x, casting="unsafe")
    m = _nan_mask(x)
    if m is not None:  # quiet, sign and the payload's top 9 bits, as F16C does
        u = x.view(np.uint32)[m]
        h.view(np.uint16)[m] = ((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x1FF)
    return h


def _f16_f32(x: np.ndarray, slot: int) -> np.ndarray:
    t = _tmp(slot, np.float32, x.size)
    np.copyto(t, x)
    m = _nan_mask(x)
    if m is not None:  # numpy keeps a signalling NaN signalling
        u = t.view(np.uint32)
        np.putmask(u, m, u | 0x400000)
    return t


def _numpy_cast(dtype):
    def cast(x: np.ndarray, slot: int) -> np.ndarray:
        t = _tmp(slot, dtype, x.size)
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(t, x, casting="unsafe")
        return t

    return cast


_f64_f32, _f32_f64 = _numpy_cast(np.float32), _numpy_cast(np.float64)


def _then(*steps):
    """Casts one after the other, each into the next scratch slot."""
    def cast(x: np.ndarray, slot: int = 0) -> np.ndarray:
        for i, step in enumerate(steps):
            x = step(x, i)
        return x

    return cast


def _to_bf16_qnan(x: np.ndarray, slot: int) -> np.ndarray:
    return _f32_bf16(x, slot, _BF16_QNAN)


def _table(dtype, steps: tuple):
    """A 16-bit source cast as one gather from a table of all 65536 results (numpy's own
    float16 casts are software, ~4x slower), the table made once by ``steps``."""
    table: list[np.ndarray] = []

    def cast(x: np.ndarray, slot: int = 0) -> np.ndarray:
        if not table:
            every = np.arange(1 << 16, dtype=np.uint16).view(x.dtype)
            out = np.empty(1 << 16, dtype=dtype)
            for i in range(0, 1 << 16, CAST_STEP):
                out[i:i + CAST_STEP] = _then(*steps)(every[i:i + CAST_STEP])
            table.append(out)
        return np.take(table[0], x.view(np.uint16), out=_tmp(slot, dtype, x.size), mode="clip")

    return cast


#: (source, destination) -> the cast of one slice of elements (a view of a scratch array).
CASTS = {
    ("float32", "bfloat16"): _then(_f32_bf16),
    ("float32", "float16"): _then(_f32_f16),
    ("float32", "float64"): _then(_f32_f64),
    ("bfloat16", "float32"): _then(_bf16_f32),
    ("bfloat16", "float16"): _table(np.float16, (_bf16_f32, _f32_f16)),
    ("bfloat16", "float64"): _then(_bf16_f32, _f32_f64),
    ("float16", "float32"): _table(np.float32, (_f16_f32,)),
    ("float16", "bfloat16"): _table(np.uint16, (_f16_f32, _to_bf16_qnan)),
    ("float16", "float64"): _table(np.float64, (_f16_f32, _f32_f64)),
    ("float64", "float32"): _then(_f64_f32),
    ("float64", "bfloat16"): _then(_f64_f32, _f32_bf16),
    ("float64", "float16"): _then(_f64_f32, _f32_f16),
}


class Cast:
    """Convert blocks of ``src`` elements to ``dst`` (``Cast("float32", "bfloat16")``),
    without torch, into a reused ``out`` buffer when given. ``out`` may be the very buffer
    the block lives in, the block at its end (``out_size`` bytes in all): the cast goes
    front to back through scratch arrays and never overwrites input it has not read.

    >>> c = Cast("float32", "bfloat16")
    >>> bytes(c(np.array([1.0, -2.5, np.inf], dtype="<f4").tobytes())).hex()
    '803f20c0807f'
    >>> buf = np.frombuffer(np.array([1.0, 3.0], dtype="<f4").tobytes(), np.uint8).copy()
    >>> bytes(c(buf.data, out=buf)).hex(), c.out_size(8)
    ('803f4040', 4)
    """

    def __init__(self, src: str, dst: str):
        self.src, self.dst = _VIEW[src], _VIEW[dst]
        self.cast = CASTS[src, dst]

    def out_size(self, nbytes: int) -> int:
        """Bytes out for ``nbytes`` in."""
        return nbytes // self.src.itemsize * self.dst.itemsize

    def __call__(self, block, out=None) -> memoryview:
        x = np.frombuffer(block, dtype=self.src)
        nbytes = x.size * self.dst.itemsize
        if out is None:
            out = np.empty(nbytes, dtype=np.uint8)
        elif not isinstance(out, np.ndarray):
            out = np.frombuffer(out, dtype=np.uint8)
        y = out[:nbytes].view(self.dst)
        for i in range(0, x.size, CAST_STEP):
            np.copyto(y[i:i + CAST_STEP], self.cast(x[i:i + CAST_STEP]))
        return memoryview(out[:nbytes])


def _torch_cast(src: str, dst: str) -> Converter:
    """The pairs :data:`CASTS` leaves out (float8, complex...): torch's ``.to``."""
    import torch

    s, d = getattr(torch, src), getattr(torch, dst)
    ratio = (torch.empty(0, dtype=d).element_size(), torch.empty(0, dtype=s).element_size())

    def convert(block, out=None):
        if len(block) == 0:
            return memoryview(b"")
        got = torch.frombuffer(bytearray(block), dtype=s).to(d).view(torch.uint8).numpy()
        if out is None:
            return memoryview(got)
        o = out if isinstance(out, np.ndarray) else np.frombuffer(out, dtype=np.uint8)
        o[:got.size] = got
        return memoryview(o[:got.size])

    convert.out_size = lambda nbytes: nbytes // ratio[1] * ratio[0]
    return convert


def dtype_converter(src: str, dst: str) -> Converter | None:
    """A block converter ``src`` -> ``dst`` (a :class:`Cast` for the floating pairs,
    torch's for others), or None when there is nothing to convert. Called as
    ``convert(block, out=None)``; ``convert.out_size(n)`` is the bytes out for ``n`` in.

    >>> bytes(dtype_converter("bfloat16", "float32")(bytes.fromhex("803f"))).hex()
    '0000803f'
    >>> dtype_converter("float32", "float32") is None
    True
    """
    if src == dst:
        return None
    if (src, dst) in CASTS:
        return Cast(src, dst)
    return _torch_cast(src, dst)


# --------------------------------------------------------------------------- executor


def carry_check(ck: Checkpoint, name: str, *, zipped: bytes | None = None) -> None:
    """Refuse to carry object ``name`` into an output when the safe loader refuses it
    (:func:`~ckptctl.formats.tensorio.scan_object`, the check seal makes):
    :class:`~ckptctl.errors.Finding` (exit 1, ``UNSAFE_INPUT``) naming the entry and the
    global, and how to leave it out. ``zipped``: its bytes, already read.

    >>> carry_check(ck, "extra.payload")                    # doctest: +SKIP
    Traceback (most recent call last):
    ckptctl.errors.Finding: ckpt/__0_0.distcp: object entry 'extra.payload' names posix.system (the safe loader refuses it); pass --drop 'extra.payload' to leave it out
    """
    from ..formats.tensorio import scan_object

    hint = f"pass --drop {quote_arg(name)} to leave it out"
    try:
        scan_object(ck, ck.objects[name], zipped=zipped)
    except UnsafeInputError as e:
        what = f"names {e.global_name}" if getattr(e, "global_name", None) else e.message
        raise Finding(e.path, f"object entry {name!r} {what} (the safe loader refuses it); "
                      f"{hint}", code=ProblemCode.UNSAFE_INPUT) from None
    except FormatError as e:
        raise FormatError(e.path, f"object entry {name!r}: {e.message}; {hint}",
                          code=e.code) from None


def check_objects(ck: Checkpoint, names, *, workers: int = 4) -> None:
    """:func:`carry_check` of every object in ``names``, before a conversion writes a
    byte: an object the safe loader refuses is never carried (nor sealed) unless dropped.

    >>> check_objects(ck, plan.objects, workers=4)          # doctest: +SKIP
    """
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> tuple[str, Finding] | None:
        try:
            carry_check(ck, name)
        except Finding as e:
            return name, e
        return None

    names = sorted(names)
    if not names:
        return
    with ThreadPoolExecutor(max(1, min(workers, len(names)))) as pool:
        refused = [hit for hit in pool.map(one, names) if hit is not None]
    if len(refused) == 1:
        raise refused[0][1]
    if refused:
        from ..catalog.inspect import few_names

        first, rest = refused[0][1], [n for n, _ in refused[1:]]
        raise Finding(first.path, f"{first.message}; {len(rest)} more object "
                      f"entr{'y' if len(rest) == 1 else 'ies'} the safe loader refuses: "
                      f"{few_names(rest)}", code=ProblemCode.UNSAFE_INPUT)


def quote_arg(text: str) -> str:
    """``text`` in single quotes, as a shell takes it (for the hints in messages).

    >>> print(quote_arg("extra.payload"), quote_arg("it's"))
    'extra.payload' 'it'"'"'s'
    """
    return "'" + text.replace("'", "'\"'\"'") + "'"


def object_payload(ck: Checkpoint, name: str) -> bytes:
    """A DCP bytes entry for object ``name``: the source's own torch.save zip when it is
    DCP (decompressed), else a torch.save zip of the value (already loaded safely; written
    without torch when it is :func:`plain_value`). A zip the safe loader refuses is never
    handed out (:func:`carry_check`)."""
    o = ck.objects[name]
    if o.extent is not None and o.extent.encoding in ("torch_zip", "torch_zip+zstd"):
        from ..formats.tensorio import decompress_bounded

        ext = o.extent
        blob = ck.store.read_range(ext.file, ext.offset, ext.offset + ext.length)
        if len(blob) != o.extent.length:
            raise FormatError(ck.store.display(o.extent.file), f"{name}: truncated")
        if o.extent.encoding == "torch_zip+zstd":
            blob = decompress_bounded(blob, ck.store.display(o.extent.file), 1 << 30)
        carry_check(ck, name, zipped=blob)
        return blob
    buf = io.BytesIO()
    if plain_value(o.value):  # torch.save's records (its very data.pkl), without torch
        TorchZipWriter(buf, pickle_state(o.value)).close()
        return buf.getvalue()
    import torch

    torch.save(o.value, buf)
    return buf.getvalue()


_PLAIN = (type(None), bool, int, float, str)


def plain_value(v, depth: int = 0) -> bool:
    """Whether ``v`` is numbers, strings, None and tuples, lists and dicts of them (an
    optimizer's hyperparameters, a step): what pickles the same with or without torch.

    >>> plain_value({"betas": (0.9, 0.95), "params": ["w"], "step": 3}), plain_value(b"x")
    (True, False)
    """
    t = type(v)
    if t in _PLAIN:
        return True
    if depth > 32 or t not in (tuple, list, dict):
        return False
    items = [*v.keys(), *v.values()] if t is dict else v
    return all(plain_value(x, depth + 1) for x in items)


def write_dcp(ck: Checkpoint, plan: Plan, out: OutputDir, *, max_memory: int, workers: int,
              convert_dtype: str | None = None,
              on_bytes: Callable[[int], None] | None = None,
              share: Callable[[list[int]], list[int]] | None = None) -> DcpWriter:
    """Execute ``plan`` into a DCP checkpoint in ``out`` (data files, then ``.metadata``);
    ``out`` is neither committed nor sealed (see :func:`copy_to_dcp`). ``share``: of the
    rank files (in rank order), the ones this process writes (a distributed run, see
    :mod:`~ckptctl.writing.distributed`): then ``.metadata`` is left to rank 0."""
    by_rank = {r: cs for r, cs in plan.by_rank().items() if cs or r == 0}
    if share is not None:
        by_rank = {r: by_rank[r] for r in share(sorted(by_rank))}
    nworkers = max(1, min(workers, len(by_rank)))
    writer = DcpWriter(out.store, on_bytes=on_bytes, sink=out)

    def converts(tc) -> bool:
        return bool(convert_dtype and tc.dtype.kind == "float" and tc.dtype.name != convert_dtype)

    def items(rank):
        stream = BlockStream(ck, by_rank[rank], depth=stream_depth(max_memory, nworkers),
                             convert_for=lambda tc: dtype_converter(tc.dtype.name, convert_dtype)
                             if converts(tc) else None)
        for tc in by_rank[rank]:
            dtype = convert_dtype if converts(tc) else tc.dtype.name
            shape = ck.tensors[tc.name].shape
            yield ("tensor", tc.name, dtype, shape, tc.offsets, tc.sizes, stream.blocks(tc.name))
        if rank == 0:
            for name in plan.objects:
                yield ("object", name, object_payload(ck, name))

    out.map(lambda r: writer.write_rank(r, items(r)), sorted(by_rank), nworkers)
    if share is None:
        writer.commit(planner_data(ck, plan))
    return writer


def planner_data(ck: Checkpoint, plan: Plan) -> dict:
    """``.metadata``'s ``planner_data``: each entry's path in the nested state dict."""
    paths = ck.info.get("paths") or {}
    names = {tc.name for tc in plan.chunks} | set(plan.objects)
    return {n: paths.get(n, (n,)) for n in sorted(names)}


@dataclass(frozen=True)
class Copied:
    """What :func:`copy_to_dcp` wrote: each file's (digest, size), the manifest aside."""

    hashes: Mapping[str, tuple[str, int]]
    manifest_id: str

    @property
    def files(self) -> list[str]:
        """Every file written, the manifest included."""
        from ..formats.manifest import MANIFEST

        return sorted([*self.hashes, MANIFEST])

    @property
    def bytes_written(self) -> int:
        """Bytes of data and metadata written (the manifest aside)."""
        return sum(n for _, n in self.hashes.values())


def _write_after(out: OutputDir, hashes: dict, after: list[tuple[str, bytes]]) -> None:
    """Write the files that commit a framework's layout on top of DCP (Megatron's
    ``common.pt``, then ``metadata.json``), in order, after ``.metadata``."""
    from ..storage.hashing import HashingWriter

    for rel, data in after:
        with out.open(rel) as f:
            w = HashingWriter(f)
            w.write(data)
        hashes[rel] = w.result()


def copy_to_dcp(ck: Checkpoint, plan: Plan, dst: str, *, max_memory: int, workers: int,
                storage_options: dict | None = None, convert_dtype: str | None = None,
                force: bool = False, command: str = "reshard", source: str | None = None,
                on_bytes: Callable[[int], None] | None = None, group=None,
                after: list[tuple[str, bytes]] | None = None) -> Copied:
    """Execute ``plan`` over ``ck`` into a new DCP checkpoint at ``dst``: data files, then
    ``.metadata``, then the ``after`` files in order (``(name, bytes)``: what a framework
    adds to DCP), then the manifest (sealed from the hashes computed while writing).

    ``dst`` must be new or empty; ``force`` replaces what it holds. ``convert_dtype``
    (``bfloat16``...) converts floating tensors on the way. Memory stays within about
    ``max_memory`` bytes whatever the tensor sizes; ``workers`` ranks are written at once.
    ``group``: this process's :class:`~ckptctl.writing.distributed.Group` when several share
    the rank files (rank 0 writes ``.metadata`` and the manifest; others get
    ``manifest_id`` None and their own files' hashes).
    """
    if group is not None and group.active:
        return _copy_to_dcp_shared(ck, plan, dst, max_memory=max_memory, workers=workers,
                                   storage_options=storage_options, convert_dtype=convert_dtype,
                                   force=force, command=command, source=source,
                                   on_bytes=on_bytes, group=group, after=after or [])
    with OutputDir(open_store(dst, storage_options), command=command, force=force,
                   source=source) as out:
        writer = write_dcp(ck, plan, out, max_memory=max_memory, workers=workers,
                           convert_dtype=convert_dtype, on_bytes=on_bytes)
        hashes = dict(writer.hashes)
        _write_after(out, hashes, after or [])
        out.commit()
        mid = commit_written(out.store, hashes, step=ck.step)
    return Copied(hashes, mid)


def _copy_to_dcp_shared(ck, plan, dst, *, max_memory, workers, storage_options, convert_dtype,
                        force, command, source, on_bytes, group, after) -> Copied:
    """:func:`copy_to_dcp` as one process of ``group`` (:func:`~ckptctl.writing.distributed.write_shared`)."""
    from ..formats.dcp_write import rank_file
    from ..writing.distributed import dcp_report, merge_dcp, write_shared

    out = OutputDir(open_store(dst, storage_options), command=command, force=force,
                    source=source)

    def write() -> dict:
        w = write_dcp(ck, plan, out, max_memory=max_memory, workers=workers,
                      convert_dtype=convert_dtype, on_bytes=on_bytes, share=group.mine)
        return dcp_report(w)

    def finish(reports: list[dict]) -> Copied:
        writer = DcpWriter(out.store, sink=out)
        for rep in reports:
            merge_dcp(writer, rep)
        writer.commit(planner_data(ck, plan))
        hashes = dict(writer.hashes)
        _write_after(out, hashes, after)
        out.commit()
        return Copied(hashes, commit_written(out.store, hashes, step=ck.step))

    planned = [rank_file(r) for r, cs in plan.by_rank().items() if cs or r == 0]
    done = write_shared(group, out, write, finish, planned=planned)
    if isinstance(done, Copied):
        return done
    return Copied({rel: (d, n) for rel, (d, n) in done["hashes"].items()}, None)


def nest(items: list[tuple[tuple, object]]):
    """Rebuild the nested state dict from (path, value) pairs (ints index lists).

    >>> nest([(("a", "b"), 1), (("c", 0), 2)])
    {'a': {'b': 1}, 'c': [2]}
    """
    root: dict = {}
    for path, value in items:
        node = root
        for i, key in enumerate(path[:-1]):
            nxt = path[i + 1]
            if isinstance(node, list):
                while len(node) <= key:
                    node.append(None)
                if node[key] is None:
                    node[key] = [] if isinstance(nxt, int) else {}
                node = node[key]
            else:
                node = node.setdefault(key, [] if isinstance(nxt, int) else {})
        last = path[-1]
        if isinstance(node, list):
            while len(node) <= last:
                node.append(None)
            node[last] = value
        else:
            node[last] = value
    return root


def decode_object(ck: Checkpoint, name: str):
    """An object entry's value for a writer that pickles it again: plain data without
    torch, else torch's weights-only loader (anything it refuses is refused by name)."""
    o = ck.objects[name]
    if o.extent is None or o.extent.encoding == "torch_save":
        return o.value
    from ..errors import CkptError
    from ..formats.tensorio import read_object

    try:  # plain data (numbers, strings, lists): no torch, no globals
        return read_object(ck, o)
    except CkptError:
        pass
    import pickle

    import torch

    from ..formats.safe_pickle import admitted_classes, numpy_globals

    try:
        with torch.serialization.safe_globals(numpy_globals() + admitted_classes(o.admitted)):
            return torch.load(io.BytesIO(object_payload(ck, name)), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as e:
        from ..errors import UnsafeInputError

        raise UnsafeInputError(ck.store.display(o.extent.file), f"{name}: object refused by the "
                               f"weights-only loader ({shorten(e, 100)})") from None
