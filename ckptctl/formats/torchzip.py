"""Find the raw tensor bytes inside a ``torch.save`` zip without loading it.

DCP writes each chunk as a complete ``torch.save`` zip whose ``<archive>/data/0`` record
holds the row-major bytes, stored (not deflated). torch's writer uses data descriptors, so
local headers carry no sizes: we read the central directory from the zip's tail, then the
one local header of the payload.

>>> import io, zipfile
>>> b = io.BytesIO()
>>> with zipfile.ZipFile(b, "w") as z:
...     z.writestr("archive/data.pkl", b"x"); z.writestr("archive/data/0", b"\\x01\\x02")
>>> blob = b.getvalue(); off, n = payload_span(blob)
>>> blob[off:off + n]
b'\\x01\\x02'
"""
from __future__ import annotations

import struct

from ..errors import FormatError

EOCD_SIG = b"PK\x05\x06"
ZIP64_LOCATOR_SIG = b"PK\x06\x07"
ZIP64_EOCD_SIG = b"PK\x06\x06"
CDIR_SIG = b"PK\x01\x02"
LOCAL_SIG = b"PK\x03\x04"
LOCAL_HEADER_LEN = 30
#: How much of a zip's tail to read to find its central directory: a DCP chunk zip has
#: seven records (~0.5 KiB of directory); larger tails are read again if needed.
TAIL_GUESS = 4096


class ZipEntry:
    __slots__ = ("name", "method", "csize", "usize", "header_offset")

    def __init__(self, name, method, csize, usize, header_offset):
        self.name, self.method, self.csize, self.usize, self.header_offset = (
            name, method, csize, usize, header_offset)


def _zip64_extra(extra: bytes, need: list[str], vals: dict) -> None:
    i = 0
    while i + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, i)
        if tag == 1:
            body, j = extra[i + 4:i + 4 + size], 0
            for k in need:
                if j + 8 <= len(body):
                    vals[k] = struct.unpack_from("<Q", body, j)[0]
                    j += 8
            return
        i += 4 + size


def central_directory(tail: bytes, zip_len: int, *, where: str = "") -> tuple[list[ZipEntry], int]:
    """Parse the central directory from the last bytes of a zip of length ``zip_len``.

    Returns the entries and, if ``tail`` did not reach back far enough, how many bytes of
    tail are needed (else 0).
    """
    base = zip_len - len(tail)  # offset of tail[0] within the zip
    e = tail.rfind(EOCD_SIG)
    if e < 0 or len(tail) - e < 22:
        raise FormatError(where or None, "not a torch.save zip (no end of central directory)")
    _, _, _, _, total, cd_size, cd_off = struct.unpack_from("<IHHHHII", tail, e)
    if cd_off == 0xFFFFFFFF or total == 0xFFFF or cd_size == 0xFFFFFFFF:
        loc = tail.rfind(ZIP64_LOCATOR_SIG, 0, e)
        if loc < 0:
            raise FormatError(where or None, "zip64 locator missing")
        (z64_off,) = struct.unpack_from("<Q", tail, loc + 8)
        i = z64_off - base
        if i < 0:
            return [], zip_len - z64_off
        if tail[i:i + 4] != ZIP64_EOCD_SIG:
            raise FormatError(where or None, "zip64 end of central directory is corrupt")
        total, _, cd_size, cd_off = struct.unpack_from("<QQQQ", tail, i + 24)
    if cd_off + cd_size > zip_len or total > 1_000_000:
        raise FormatError(where or None, "central directory lies outside the zip")
    i = cd_off - base
    if i < 0:
        return [], zip_len - cd_off
    entries = []
    for _ in range(total):
        if tail[i:i + 4] != CDIR_SIG:
            raise FormatError(where or None, "central directory is corrupt")
        (method, csize, usize, nlen, xlen, clen, hoff) = (
            struct.unpack_from("<H", tail, i + 10)[0],
            *struct.unpack_from("<IIHHH", tail, i + 20),
            struct.unpack_from("<I", tail, i + 42)[0])
        name = tail[i + 46:i + 46 + nlen].decode("utf-8", "replace")
        vals = {"usize": usize, "csize": csize, "hoff": hoff}
        need = [k for k in ("usize", "csize", "hoff") if vals[k] == 0xFFFFFFFF]
        if need:
            _zip64_extra(tail[i + 46 + nlen:i + 46 + nlen + xlen], need, vals)
        entries.append(ZipEntry(name, method, vals["csize"], vals["usize"], vals["hoff"]))
        i += 46 + nlen + xlen + clen
    return entries, 0


def payload_entry(entries: list[ZipEntry], *, where: str = "") -> ZipEntry:
    """The ``*/data/0`` record of a one-storage torch.save zip."""
    hits = [en for en in entries if en.name.endswith("/data/0") or en.name == "data/0"]
    if len(hits) != 1:
        raise FormatError(where or None, "torch.save zip has no single data/0 record")
    en = hits[0]
    if en.method != 0:
        raise FormatError(where or None, "tensor record is compressed inside the zip")
    return en


def local_data_offset(header: bytes, entry: ZipEntry, *, where: str = "") -> int:
    """Offset of the payload, given the bytes at ``entry.header_offset``."""
    if len(header) < LOCAL_HEADER_LEN or header[:4] != LOCAL_SIG:
        raise FormatError(where or None, "zip local header is corrupt")
    nlen, xlen = struct.unpack_from("<HH", header, 26)
    return entry.header_offset + LOCAL_HEADER_LEN + nlen + xlen


def payload_span(blob: bytes | memoryview, *, where: str = "") -> tuple[int, int]:
    """(offset, length) of the tensor bytes inside a whole torch.save zip in memory."""
    mv = memoryview(blob)
    tail = bytes(mv[-min(len(mv), 1 << 20):])
    entries, need = central_directory(tail, len(mv), where=where)
    if need:
        entries, _ = central_directory(bytes(mv), len(mv), where=where)
    en = payload_entry(entries, where=where)
    off = local_data_offset(bytes(mv[en.header_offset:en.header_offset + 512]), en, where=where)
    if off + en.usize > len(mv):
        raise FormatError(where or None, "tensor record runs past the end of its zip")
    return off, en.usize
