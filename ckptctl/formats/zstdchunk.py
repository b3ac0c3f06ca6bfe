"""Stream the tensor out of a zstd-compressed DCP chunk (DCP's ``stream.zstd/1``), once,
with bounded memory.

The compressed bytes are a whole ``torch.save`` zip. Its local headers carry no sizes (torch
writes data descriptors), so the zip is parsed as it streams: the records before
``data/0`` (``data.pkl`` among them) are kept (they are small), the tensor bytes are handed
to the caller block by block, and the records after it and the central directory are kept
at the end to check the CRC-32 of every record. Output is bounded by what the metadata
declares, so a decompression bomb costs what its declared tensor costs, not more.

>>> import io, torch, zstandard
>>> from ckptctl.storage import open_store
>>> import tempfile, pathlib
>>> buf = io.BytesIO(); torch.save(torch.arange(6, dtype=torch.float32), buf)
>>> d = tempfile.mkdtemp(); blob = zstandard.ZstdCompressor().compress(buf.getvalue())
>>> _ = pathlib.Path(d, "f").write_bytes(blob)
>>> z = ZstdChunk(open_store(d), "f", 0, len(blob), limit=24)
>>> z.stored.size, bytes(z.read(8)) == torch.arange(2, dtype=torch.float32).numpy().tobytes()
((6,), True)
>>> _ = z.read(16); z.finish(); z.bad_records
[]
"""
from __future__ import annotations

import struct

from ..errors import FormatError
from .torchzip import LOCAL_SIG, StoredTensor, central_directory, parse_tensor_pickle

try:  # same values as zlib's, ~3x faster
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover
    from zlib import crc32

#: Records before and after the tensor (data.pkl, byteorder, version, central directory)
#: are a few KiB in any torch.save zip; more is not a torch chunk.
MAX_SIDE_BYTES = 1 << 20
READ_SIZE = 4 << 20


class ExtentFile:
    """A read-only file object over bytes ``[offset, offset + length)`` of a store's file,
    read in ranged requests of :data:`READ_SIZE` (what the zstd reader pulls from)."""

    def __init__(self, store, rel: str, offset: int, length: int):
        self.store, self.rel, self.pos, self.end = store, rel, offset, offset + length

    def read(self, n: int = -1) -> bytes:
        n = self.end - self.pos if n is None or n < 0 else min(n, self.end - self.pos)
        if n <= 0:
            return b""
        data = self.store.read_range(self.rel, self.pos, self.pos + n)
        if not data:
            raise FormatError(self.store.display(self.rel), "file ends inside a zstd chunk",
                              code="SIZE_MISMATCH")
        self.pos += len(data)
        return data


class ZstdChunk:
    """Sequential reader of one zstd chunk: :attr:`stored` (the tensor's layout, from
    ``data.pkl``) is known once it is opened; :meth:`read` returns the storage's bytes in
    order; :meth:`finish` reads the rest and checks every record's CRC-32 when ``crc``.

    ``limit``: the most storage bytes the metadata allows (the declared tensor size).
    """

    def __init__(self, store, rel: str, offset: int, length: int, *, limit: int,
                 crc: bool = False, read_size: int = READ_SIZE):
        import zstandard

        self.where = store.display(rel)
        self.crc_wanted = crc
        self._zstd_error = zstandard.ZstdError
        self._src = ExtentFile(store, rel, offset, length)
        self._r = zstandard.ZstdDecompressor().stream_reader(self._src, read_size=read_size,
                                                              read_across_frames=True)
        self.pos = 0  # storage bytes handed out so far
        self.crc = 0
        self.bad_records: list[str] = []
        self._pending = b""
        self._open(limit)

    # ----------------------------------------------------------------- parsing
    def _more(self, n: int) -> bytes:
        try:
            return self._r.read(n)
        except self._zstd_error as e:
            raise FormatError(self.where, f"zstd stream is corrupt ({e})",
                              code="MALFORMED_CHUNK") from None

    def _open(self, limit: int) -> None:
        prefix = b""
        start = -1
        while start < 0:
            block = self._more(64 << 10)
            if not block:
                raise FormatError(self.where, "zstd chunk ends before its tensor record",
                                  code="MALFORMED_CHUNK")
            prefix += block
            start = self._find_payload(prefix)
            if start < 0 and len(prefix) > MAX_SIDE_BYTES:
                raise FormatError(self.where, "zstd chunk has no tensor record in its first "
                                  "1 MiB", code="MALFORMED_CHUNK")
        self.prefix, self.payload_start = prefix[:start], start
        self._pending = prefix[start:]
        if len(prefix) < 30 or prefix[:4] != LOCAL_SIG:
            raise FormatError(self.where, "zstd chunk is not a torch.save zip", code="MALFORMED_CHUNK")
        nlen, xlen = struct.unpack_from("<HH", prefix, 26)
        self.stored: StoredTensor = parse_tensor_pickle(prefix[30 + nlen + xlen:start],
                                                        where=self.where)
        from ..model import DTYPES

        d = DTYPES.get(self.stored.dtype)
        self.nbytes = d.nbytes(self.stored.storage_numel) if d else 0
        if d is None or self.nbytes > limit:
            raise FormatError(self.where, f"zstd chunk declares {self.nbytes} bytes of storage, "
                              f"more than the {limit} its metadata allows", code="MALFORMED_CHUNK")

    def _find_payload(self, prefix: bytes) -> int:
        """Offset of the ``<archive>/data/0`` record's bytes, or -1 if not yet seen."""
        if len(prefix) < 30 or prefix[:4] != LOCAL_SIG:
            return -1
        nlen = struct.unpack_from("<H", prefix, 26)[0]
        archive = prefix[30:30 + nlen].rsplit(b"/", 1)[0]
        want = archive + b"/data/0"
        i = 30
        while True:
            i = prefix.find(LOCAL_SIG, i)
            if i < 0 or i + 30 > len(prefix):
                return -1
            nlen, xlen = struct.unpack_from("<HH", prefix, i + 26)
            if i + 30 + nlen + xlen > len(prefix):
                return -1
            if prefix[i + 30:i + 30 + nlen] == want:
                self.payload_header = i
                return i + 30 + nlen + xlen
            i += 4

    # ----------------------------------------------------------------- reading
    def read(self, n: int) -> bytes:
        """The next ``n`` storage bytes (fewer only at the end of the storage)."""
        n = min(n, self.nbytes - self.pos)
        if n <= 0:
            return b""
        parts, got = [], 0
        if self._pending:
            take = self._pending[:n]
            self._pending = self._pending[len(take):]
            parts.append(take)
            got = len(take)
        while got < n:
            block = self._more(n - got)
            if not block:
                raise FormatError(self.where, f"zstd chunk ends {n - got} bytes into its tensor "
                                  "record early", code="MALFORMED_CHUNK")
            parts.append(block)
            got += len(block)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        if len(data) > n:  # the stream gave more than asked: keep the rest
            self._pending, data = data[n:] + self._pending, data[:n]
        if self.crc_wanted:
            self.crc = crc32(data, self.crc)
        self.pos += len(data)
        return data

    def skip(self, n: int) -> None:
        while n > 0:
            n -= len(self.read(min(n, READ_SIZE)))

    def finish(self) -> None:
        """Read the rest of the zip; with ``crc``, check every record against the central
        directory (mismatches go to :attr:`bad_records`)."""
        self.skip(self.nbytes - self.pos)
        suffix = self._pending
        while True:
            block = self._more(64 << 10)
            if not block:
                break
            suffix += block
            if len(suffix) > MAX_SIDE_BYTES:
                raise FormatError(self.where, "zstd chunk runs on past its zip's end",
                                  code="MALFORMED_CHUNK")
        zip_len = self.payload_start + self.nbytes + len(suffix)
        entries, need = central_directory(suffix, zip_len, where=self.where)
        if need:
            raise FormatError(self.where, "zip directory of a zstd chunk is misplaced",
                              code="MALFORMED_CHUNK")
        if not self.crc_wanted:
            return
        tail_start = self.payload_start + self.nbytes
        for en in entries:
            if en.header_offset == self.payload_header:
                if en.usize != self.nbytes:
                    self.bad_records.append(f"{en.name} (size)")
                elif en.crc != self.crc:
                    self.bad_records.append(en.name)
                continue
            if en.method != 0:
                continue
            if en.header_offset < self.payload_header:
                buf, base = self.prefix, 0
            else:
                buf, base = suffix, tail_start
            h = en.header_offset - base
            if h < 0 or h + 30 > len(buf) or buf[h:h + 4] != LOCAL_SIG:
                self.bad_records.append(f"{en.name} (header)")
                continue
            nlen, xlen = struct.unpack_from("<HH", buf, h + 26)
            body = buf[h + 30 + nlen + xlen:h + 30 + nlen + xlen + en.usize]
            if len(body) != en.usize or crc32(body) != en.crc:
                self.bad_records.append(en.name)

    def close(self) -> None:
        try:
            self._r.close()
        except Exception:  # noqa: BLE001 - closing a reader that failed
            pass
