"""ckptctl packs: a checkpoint stored losslessly as compressed (and optionally
delta-encoded) chunks, read back as the original files through :class:`PackStore`.

A pack is a folder::

    ckptctl.pack.json     the index (:class:`PackIndex`): every original file as segments
                          (raw bytes, or one tensor chunk's bytes) cut into chunks
    data-00000.bin ...    the chunks' encoded payloads, concatenated (each file <= 256 MiB)
    ckptctl.manifest.json the pack's own manifest (``packs``: the id it restores)

A pack of a single-file checkpoint (``train.pt``) is such a folder too; its index names
the file (``single``) and holds the checkpoint's sidecar manifest
(``train.pt.ckptctl.manifest.json``) where a folder's holds ``ckptctl.manifest.json``:
read in place, it is that file and its sidecar (:func:`pack_view`), and it unpacks back
to them.

The index is validated whole before anything is read or allocated from it: safe names,
segments that tile each file, chunks that sum to their segment and lie inside the data
files' listed sizes, no chunk larger than ``chunk_size``.

>>> def one(n, at):
...     return {"size": n, "segments": [{"kind": "raw", "offset": 0, "length": n, "itemsize": 1,
...             "base": None, "chunks": [{"data": "data-00000.bin", "at": at, "clen": 9,
...             "mode": "zstd", "size": n, "check": "0123456789abcdef"}]}]}
>>> doc = {"pack": 1, "source": {"files": {"a.bin": {"size": 4, "hash": "x"}}}, "chunk_size": 4,
...        "base": None, "files": {"a.bin": one(4, 0), "ckptctl.manifest.json": one(3, 9)}}
>>> from ckptctl.formats.manifest import Manifest
>>> doc["source_id"] = Manifest.parse(json.dumps(doc["source"]).encode(), "m").id
>>> idx = PackIndex.parse(json.dumps(doc).encode(), "p", {"data-00000.bin": 18})
>>> idx.files["a.bin"].size, idx.num_chunks, idx.payload_bytes
(4, 2, 18)
>>> PackIndex.parse(json.dumps(doc).encode(), "p", {"data-00000.bin": 12})
Traceback (most recent call last):
ckptctl.errors.UnsafeInputError: p: ckptctl.manifest.json: chunk 0 lies past the end of data-00000.bin (9 bytes at 9, the file has 12)
"""
from __future__ import annotations

import bisect
import collections
import json
import os
import posixpath
import re
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ..errors import (CkptError, FormatError, NotFoundError, StorageError,
                      UnsafeInputError, UsageError)
from ..storage import Capabilities, IOStats, Store, safe_relpath
from .limits import MAX_TENSOR_BYTES, count_key, load_json
from .manifest import MANIFEST, WRITING_MARKER, Manifest, control_name, writer_unfinished

PACK_INDEX = "ckptctl.pack.json"
PACK_VERSION = 1
#: Largest data file a writer makes; a reader accepts any size the listing gives.
DATA_FILE_SIZE = 256 << 20
DATA_NAME = re.compile(r"^data-\d{5,9}\.bin$")
MAX_INDEX_BYTES = 512 << 20
#: Largest chunk a reader agrees to decode (the writer uses packcodec.CHUNK_SIZE, 4 MiB).
MAX_CHUNK_SIZE = 64 << 20
#: Most records an index may hold, counted in its bytes before they are parsed and again
#: in the parsed document before any is validated (a 200,000-file index would cost tens of
#: seconds and ~1 GB to parse before a late error). A pack of a 10,000-rank DCP checkpoint
#: holds ~10,000 files; its ~300,000 chunks make ~600,000 segments (a zip's header bytes,
#: then the tensor bytes) and as many chunks plus one per 4 MiB of data. MAX_SEGMENTS and
#: MAX_CHUNKS are about as many of the smallest records as MAX_INDEX_BYTES can hold.
MAX_FILES = 100_000
MAX_SEGMENTS = 3_000_000
MAX_CHUNKS = 6_000_000
MODES = ("zstd", "planes", "xor", "same")
#: Longest chain of delta packs a reader follows (``--max-chain`` writes at most this).
MAX_DEPTH = 64
#: Longest chain a writer makes unless told otherwise (``--max-chain``, a tier's
#: ``max_chain``): a hop past it gets a full pack.
DEFAULT_MAX_CHAIN = 8
#: A pack being re-rooted (``gc`` on a pack tier) is written again beside itself as
#: ``.NAME`` + this suffix, committed, then installed in place of NAME; while NAME is
#: being replaced, readers of the packs made against it take their base from there.
REROOT_SUFFIX = ".ckptctl-reroot"
#: A base chain's data files up to this size are read whole, one GET each, when read at
#: all (a delta decodes against every level below it); larger ones by ranges. About what
#: one request costs on S3 in bytes: the reads a chain walk needs cost nothing more then.
CHAIN_WHOLE_FILE = 2 << 20
#: Whole files one level of a chain keeps in memory at most (LRU past that).
CHAIN_CACHE_BUDGET = 8 << 20
ITEMSIZES = (1, 2, 4, 8)
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


def reroot_stage(url: str) -> str:
    """Where the pack at ``url`` is written again while it is re-rooted: a hidden sibling.

    >>> reroot_stage("s3://b/run/step-70"), reroot_stage("/r/a/step-7/")
    ('s3://b/run/.step-70.ckptctl-reroot', '/r/a/.step-7.ckptctl-reroot')
    """
    head, _, name = url.rstrip("/").rpartition("/")
    return f"{head}/.{name}{REROOT_SUFFIX}" if head else f".{name}{REROOT_SUFFIX}"


def reroot_target(name: str) -> str | None:
    """The checkpoint a re-root stage (a checkpoint name or URL, as :func:`reroot_stage`
    makes them) is for, None for any other name.

    >>> reroot_target("run/.step-70.ckptctl-reroot"), reroot_target("step-70")
    ('run/step-70', None)
    """
    head, sep, base = name.rstrip("/").rpartition("/")
    if not (base.startswith(".") and base.endswith(REROOT_SUFFIX)) \
            or len(base) <= len(REROOT_SUFFIX) + 1:
        return None
    return head + sep + base[1:-len(REROOT_SUFFIX)]


def is_pack(files: dict[str, int]) -> bool:
    """Does a folder's listing hold a pack?

    >>> is_pack({"ckptctl.pack.json": 10, "data-00000.bin": 5}), is_pack({"a.pt": 1})
    (True, False)
    """
    return PACK_INDEX in files


def data_name(n: int) -> str:
    """The name of the ``n``-th data file.

    >>> data_name(3)
    'data-00003.bin'
    """
    return f"data-{n:05d}.bin"


@dataclass(frozen=True)
class ChunkRef:
    """One encoded chunk: ``clen`` payload bytes at ``at`` in data file ``data``, decoding
    (``mode``) to ``size`` bytes whose xxh3-64 is ``check``."""

    data: str
    at: int
    clen: int
    mode: str
    size: int
    check: str

    def to_dict(self) -> dict:
        return {"data": self.data, "at": self.at, "clen": self.clen, "mode": self.mode,
                "size": self.size, "check": self.check}


@dataclass
class Segment:
    """A byte range of an original file: ``raw`` bytes or one tensor chunk's element bytes
    (``itemsize`` wide), optionally against ``base`` = (file, offset) in the base."""

    kind: str
    offset: int
    length: int
    itemsize: int
    base: tuple[str, int] | None
    chunks: list[ChunkRef]

    def to_dict(self) -> dict:
        return {"kind": self.kind, "offset": self.offset, "length": self.length,
                "itemsize": self.itemsize,
                "base": {"file": self.base[0], "offset": self.base[1]} if self.base else None,
                "chunks": [c.to_dict() for c in self.chunks]}


@dataclass
class PackedFile:
    """An original file: its size and the segments that tile it. ``starts[i]`` is where
    chunk ``refs[i]`` (of segment ``segs[i]``, at ``seg_off[i]`` in it) begins."""

    size: int
    segments: list[Segment]
    starts: list[int] = field(default_factory=list, repr=False)
    refs: list[ChunkRef] = field(default_factory=list, repr=False)
    segs: list[Segment] = field(default_factory=list, repr=False)
    seg_off: list[int] = field(default_factory=list, repr=False)

    def index_chunks(self) -> None:
        self.starts, self.refs, self.segs, self.seg_off = [], [], [], []
        for s in self.segments:
            pos = 0
            for c in s.chunks:
                self.starts.append(s.offset + pos)
                self.refs.append(c)
                self.segs.append(s)
                self.seg_off.append(pos)
                pos += c.size


def _int(v, what: str, where: str, *, low: int = 0, high: int = MAX_TENSOR_BYTES) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
        raise UnsafeInputError(where, f"{what} must be an integer in [{low}, {high}], "
                               f"got {str(v)[:40]}")
    return v


def _check_counts(where: str, files: int, segments: int, chunks: int) -> None:
    """Refuse an index holding more records than :data:`MAX_FILES`, :data:`MAX_SEGMENTS`
    or :data:`MAX_CHUNKS` (one line naming the limit).

    >>> _check_counts("p", 200_000, 200_000, 200_000)
    Traceback (most recent call last):
    ckptctl.errors.UnsafeInputError: p: pack index lists 200000 files, over the limit of 100000 files a pack may hold
    """
    for n, limit, what in ((files, MAX_FILES, "files"), (segments, MAX_SEGMENTS, "segments"),
                           (chunks, MAX_CHUNKS, "chunks")):
        if n > limit:
            raise UnsafeInputError(where, f"pack index lists {n} {what}, over the limit of "
                                   f"{limit} {what} a pack may hold")


def _count_parsed(where: str, files, source_files) -> None:
    """:func:`_check_counts` on the parsed index (its ``files`` table and the source
    manifest's), before any record is validated: what the count in the bytes missed (keys
    spelled with escapes) is caught here, still before the per-file work."""
    segments = chunks = 0
    if isinstance(files, dict):
        for rec in files.values():
            segs = rec.get("segments") if isinstance(rec, dict) else None
            if isinstance(segs, list):
                segments += len(segs)
                chunks += sum(len(s["chunks"]) for s in segs
                              if isinstance(s, dict) and isinstance(s.get("chunks"), list))
    n = max(len(files) if isinstance(files, dict) else 0,
            len(source_files) if isinstance(source_files, dict) else 0)
    _check_counts(where, n, segments, chunks)


@dataclass
class PackIndex:
    """The parsed, validated ``ckptctl.pack.json``."""

    source: Manifest
    source_id: str
    chunk_size: int
    files: dict[str, PackedFile]
    #: {"id", "depth", "url", "chain"}: "chain" (optional, written since stop 30) the URLs of
    #: the base's own bases, nearest first, relative to this pack: a hint that lets a
    #: reader open every level at once (:func:`chain_urls`); each level is still checked
    base: dict | None = None
    doc: dict = field(default_factory=dict, repr=False)
    #: the one file of a single-file checkpoint (its manifest is packed as its sidecar)
    single: str | None = None

    @property
    def manifest_name(self) -> str:
        """The packed file that is the source's manifest (a single file's: its sidecar)."""
        return control_name(MANIFEST, self.single)

    @property
    def num_chunks(self) -> int:
        return sum(len(f.refs) for f in self.files.values())

    @property
    def payload_bytes(self) -> int:
        return sum(c.clen for f in self.files.values() for c in f.refs)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def depth(self) -> int:
        """Deltas to resolve before the bytes are whole: 0 for a full pack."""
        return int(self.base["depth"]) if self.base else 0

    @property
    def needs_base(self) -> bool:
        """Does any chunk decode against the base (``xor``/``same``)? A pack made against
        a base where no delta paid off restores without it."""
        return self.base is not None and any(
            c.mode in ("xor", "same") for f in self.files.values() for c in f.refs)

    def modes(self) -> dict[str, int]:
        """Chunks by mode."""
        out: dict[str, int] = {}
        for f in self.files.values():
            for c in f.refs:
                out[c.mode] = out.get(c.mode, 0) + 1
        return dict(sorted(out.items()))

    def to_bytes(self) -> bytes:
        return (json.dumps(self.doc, sort_keys=True, separators=(",", ":")) + "\n").encode()

    @classmethod
    def build(cls, source_doc: dict, source_id: str, chunk_size: int,
              files: dict[str, tuple[int, list[Segment]]], base: dict | None,
              single: str | None = None) -> "PackIndex":
        """The index a writer made (already valid by construction); ``single``: the
        source is that one file."""
        doc = {"pack": PACK_VERSION, "source": source_doc, "source_id": source_id,
               "base": base, "chunk_size": chunk_size,
               "files": {rel: {"size": size, "segments": [s.to_dict() for s in segs]}
                         for rel, (size, segs) in sorted(files.items())}}
        if single is not None:
            doc["single"] = single
        return cls.parse(json.dumps(doc).encode(), PACK_INDEX, None)

    @classmethod
    def parse(cls, data: bytes, where: str, pack_files: dict[str, int] | None) -> "PackIndex":
        """Validate and parse index bytes. ``pack_files``: the pack folder's listing (name
        -> size); every chunk must lie inside a listed data file (None: trust, for a writer
        checking its own index). Anything inconsistent is one
        :class:`~ckptctl.errors.UnsafeInputError` / :class:`~ckptctl.errors.FormatError`
        naming ``where``, raised before anything else is read."""
        if len(data) > MAX_INDEX_BYTES:
            raise UnsafeInputError(where, f"pack index is absurdly large ({len(data)} bytes)")
        # the counts first, in the bytes: an absurd index is refused before the JSON is built
        _check_counts(where, count_key(data, "segments"), count_key(data, "kind"),
                      count_key(data, "check"))
        doc = load_json(data, where, "pack index")
        if not isinstance(doc, dict) or doc.get("pack") != PACK_VERSION:
            raise FormatError(where, f"not a version-{PACK_VERSION} pack index")
        src = doc.get("source")
        if not isinstance(src, dict):
            raise FormatError(where, "pack index has no source manifest")
        _count_parsed(where, doc.get("files"), src.get("files"))
        source = Manifest.parse(json.dumps(src).encode(), where)
        source_id = doc.get("source_id")
        if source_id != source.id:
            raise FormatError(where, f"source_id {str(source_id)[:60]!r} is not the id of the "
                              f"source manifest ({source.id})", code="MANIFEST_MISMATCH")
        chunk_size = _int(doc.get("chunk_size"), "chunk_size", where, low=1, high=MAX_CHUNK_SIZE)
        base = doc.get("base")
        if base is not None:
            if not isinstance(base, dict) or not isinstance(base.get("id"), str) \
                    or len(base["id"]) > 200:
                raise FormatError(where, "pack base must name the base's id")
            _int(base.get("depth"), "base depth", where, low=1, high=MAX_DEPTH)
            if base.get("url") is not None and not isinstance(base.get("url"), str):
                raise FormatError(where, "pack base url must be a string")
            chain = base.get("chain")
            if chain is not None and (not isinstance(chain, list) or len(chain) > MAX_DEPTH
                                      or not all(isinstance(u, str) and 0 < len(u) <= 4096
                                                 for u in chain)):
                raise FormatError(where, f"pack base chain must be a list of at most "
                                  f"{MAX_DEPTH} URLs")
        files = doc.get("files")
        if not isinstance(files, dict):
            raise FormatError(where, "pack index has no files table")
        single = _single(doc.get("single"), source, where)
        mname = control_name(MANIFEST, single)
        want = set(source.files) | {mname}
        if set(files) != want:
            odd = sorted(set(files) ^ want)[:3]
            raise FormatError(where, f"pack files differ from the source manifest's "
                              f"({', '.join(odd)})", code="MANIFEST_MISMATCH")
        total = 0
        parsed: dict[str, PackedFile] = {}
        for rel, rec in files.items():
            if safe_relpath(rel, where=where) != rel:
                raise FormatError(where, f"pack names {rel!r}, not a normalised path")
            f = _parse_file(rel, rec, chunk_size, base is not None, pack_files, where)
            if rel != mname and f.size != source.files[rel].size:
                raise FormatError(where, f"{rel}: {f.size} bytes, the source manifest says "
                                  f"{source.files[rel].size}", code="SIZE_MISMATCH")
            total += f.size
            if total > MAX_TENSOR_BYTES:
                raise UnsafeInputError(where, "pack restores an absurd number of bytes")
            parsed[rel] = f
        return cls(source, source_id, chunk_size, parsed, base, doc, single)


def _single(name, source: Manifest, where: str) -> str | None:
    """The index's ``single`` (the one file of a single-file source), checked: a plain
    file name, the one file its source manifest lists.

    >>> from ckptctl.formats.manifest import FileEntry
    >>> _single("a.pt", Manifest({"a.pt": FileEntry(1, "h")}), "p")
    'a.pt'
    >>> _single("../a.pt", Manifest({"a.pt": FileEntry(1, "h")}), "p")
    Traceback (most recent call last):
    ckptctl.errors.FormatError: p: pack index names '../a.pt' as its single file, not the one file of its source
    """
    if name is None:
        return None
    if not isinstance(name, str) or "/" in name or list(source.files) != [name]:
        raise FormatError(where, f"pack index names {str(name)[:80]!r} as its single file, "
                          "not the one file of its source")
    return name


def _parse_file(rel: str, rec, chunk_size: int, has_base: bool,
                pack_files: dict[str, int] | None, where: str) -> PackedFile:
    if not isinstance(rec, dict) or not isinstance(rec.get("segments"), list):
        raise FormatError(where, f"{rel}: pack entry needs a size and segments")
    size = _int(rec.get("size"), f"{rel}: size", where)
    pos = 0
    segs = []
    n = 0
    for s in rec["segments"]:
        if not isinstance(s, dict) or s.get("kind") not in ("raw", "tensor") \
                or not isinstance(s.get("chunks"), list):
            raise FormatError(where, f"{rel}: malformed segment")
        off = _int(s.get("offset"), f"{rel}: segment offset", where)
        length = _int(s.get("length"), f"{rel}: segment length", where, low=1)
        if off != pos:
            raise UnsafeInputError(where, f"{rel}: segments do not tile the file (one starts at "
                                   f"{off}, the previous ends at {pos})", code="CHUNK_OVERLAP"
                                   if off < pos else "CHUNK_GAP")
        pos = off + length
        if pos > size:
            raise UnsafeInputError(where, f"{rel}: segment at {off} ends past the file's size "
                                   f"{size}", code="OUT_OF_BOUNDS")
        itemsize = s.get("itemsize")
        if itemsize not in ITEMSIZES or isinstance(itemsize, bool) or length % itemsize:
            raise FormatError(where, f"{rel}: segment at {off} has a bad itemsize")
        sb = s.get("base")
        base = None
        if sb is not None:
            if not has_base or s["kind"] != "tensor" or not isinstance(sb, dict) \
                    or not isinstance(sb.get("file"), str):
                raise FormatError(where, f"{rel}: segment at {off} names a base it cannot have")
            base = (safe_relpath(sb["file"], where=where),
                    _int(sb.get("offset"), f"{rel}: base offset", where))
        # chunks are cut the one way a writer cuts them: `step` bytes each, the last shorter
        step = chunk_size - chunk_size % itemsize
        if step <= 0:
            raise FormatError(where, f"{rel}: chunk_size {chunk_size} is below the itemsize")
        expect = -(-length // step)
        if len(s["chunks"]) != expect:
            raise UnsafeInputError(where, f"{rel}: segment at {off} has {len(s['chunks'])} "
                                   f"chunks, expected {expect}")
        chunks = []
        got = 0
        for j, c in enumerate(s["chunks"]):
            if not isinstance(c, dict):
                raise FormatError(where, f"{rel}: malformed chunk {n}")
            csize = _int(c.get("size"), f"{rel}: chunk {n} size", where, low=1, high=chunk_size)
            want = step if j < expect - 1 else length - step * (expect - 1)
            if csize != want:
                raise UnsafeInputError(where, f"{rel}: chunk {n} holds {csize} bytes, the "
                                       f"segment's chunking says {want}")
            mode, check, data = c.get("mode"), c.get("check"), c.get("data")
            if mode not in MODES or not isinstance(check, str) or not _HEX16.match(check) \
                    or not isinstance(data, str) or not DATA_NAME.match(data):
                raise FormatError(where, f"{rel}: chunk {n} has a bad mode, check or data file")
            if mode in ("xor", "same") and base is None:
                raise FormatError(where, f"{rel}: chunk {n} is a delta without a base")
            at = _int(c.get("at"), f"{rel}: chunk {n} offset", where)
            clen = _int(c.get("clen"), f"{rel}: chunk {n} length", where,
                        high=csize + (csize >> 3) + (1 << 16))
            if mode == "same" and clen:
                raise FormatError(where, f"{rel}: chunk {n} is 'same' but has a payload")
            if pack_files is not None:
                have = pack_files.get(data)
                if have is None:
                    raise FormatError(where, f"{rel}: chunk {n} is in {data}, which is missing",
                                      code="MISSING_FILE")
                if at + clen > have:
                    raise UnsafeInputError(where, f"{rel}: chunk {n} lies past the end of {data} "
                                           f"({clen} bytes at {at}, the file has {have})",
                                           code="OUT_OF_BOUNDS")
            got += csize
            chunks.append(ChunkRef(data, at, clen, mode, csize, check))
            n += 1
        if got != length:
            raise UnsafeInputError(where, f"{rel}: chunks of the segment at {off} hold {got} "
                                   f"bytes, the segment {length}", code="DTYPE_SIZE_MISMATCH")
        segs.append(Segment(s["kind"], off, length, itemsize, base, chunks))
    if pos != size:
        raise UnsafeInputError(where, f"{rel}: segments cover {pos} of {size} bytes",
                               code="CHUNK_GAP")
    f = PackedFile(size, segs)
    f.index_chunks()
    return f


# --------------------------------------------------------------------------- reading


def _codec():
    from . import packcodec

    return packcodec


class _Reader:
    """A read-only file object over a :class:`PackStore` file (``torch.load`` of a remote
    or packed torch.save file copies it through this)."""

    def __init__(self, store: "PackStore", rel: str):
        self.store, self.rel, self.pos = store, rel, 0
        self.size = store.size(rel)
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        data = self.store.read_range(self.rel, self.pos, end)
        self.pos += len(data)
        return data

    def readinto(self, b) -> int:
        n = self.store.read_into(self.rel, self.pos, memoryview(b).cast("B"))
        self.pos += n
        return n

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.size + pos}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def close(self) -> None:
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class PackStore:
    """The original files of a packed checkpoint, read through a pack: a read-only
    stand-in for :class:`~ckptctl.storage.Store` (``list_files``, ``read_range``,
    ``read_into``, ``read``, ``iter_blocks``, ``size``, ``exists``...).

    A read decodes only the chunks it covers (recently decoded chunks are kept, up to
    ``cache_bytes``), and every chunk's checksum is verified as it is decoded. Delta chunks
    read their base bytes from the store ``base_resolver()`` returns (resolved on first
    need: reading a delta pack's metadata needs no base).
    """

    protocol = "pack"
    is_local = False
    is_s3 = False
    caps = Capabilities(False, False, False, False)

    def __init__(self, raw: Store, index: PackIndex, *,
                 base_resolver: Callable[[], object] | None = None,
                 cache_bytes: int = 64 << 20, workers: int | None = None):
        self.raw, self.index = raw, index
        self.url, self.root = raw.url, raw.root
        self.stats = IOStats()
        self._resolver = base_resolver
        self._base = None
        self._lock = threading.Lock()
        self._cache: "collections.OrderedDict[tuple[str, int], bytes]" = collections.OrderedDict()
        self._cached = 0
        self._cache_bytes = cache_bytes
        self._loading: dict[tuple[str, int], threading.Lock] = {}
        self.workers = max(1, workers or min(8, os.cpu_count() or 1))
        self._pool = None
        self.files = {rel: f.size for rel, f in sorted(index.files.items())}

    # ------------------------------------------------------------ info
    def display(self, rel: str = "") -> str:
        return self.raw.display(rel)

    def full(self, rel: str = "") -> str:
        return self.raw.full(rel) if not rel else self.raw.full(safe_relpath(rel))

    def local_path(self, rel: str) -> None:
        return None

    def same_server(self, other) -> bool:
        return False

    def cache_small_files(self, sizes, **kw) -> None:
        """No effect: decoded chunks are cached already."""

    def info(self) -> dict:
        """What ``inspect`` shows of a pack: its size and ratio, chunks by mode, base."""
        packed = sum(v for k, v in self.raw_files.items())
        idx = self.index
        return {"pack_bytes": packed, "source_bytes": idx.total_bytes,
                "ratio": round(idx.total_bytes / packed, 4) if packed else None,
                "chunks": idx.modes(), "base": idx.base["id"] if idx.base else None,
                "depth": idx.depth, "manifest_id": idx.source_id}

    raw_files: dict[str, int] = {}

    # ------------------------------------------------------------ listing
    def list_files(self, rel: str = "", *, recursive: bool = True) -> dict[str, int]:
        if not rel:
            out = self.files
        else:
            p = safe_relpath(rel).rstrip("/") + "/"
            out = {k: v for k, v in self.files.items() if k.startswith(p)}
        if not recursive:
            p = (rel.rstrip("/") + "/") if rel else ""
            out = {k: v for k, v in out.items() if "/" not in k[len(p):]}
        self.stats.lists += 1
        return dict(out)

    def list_dirs(self, rel: str = "") -> list[str]:
        p = (safe_relpath(rel) + "/") if rel else ""
        return sorted({p + k[len(p):].split("/", 1)[0] for k in self.files
                       if k.startswith(p) and "/" in k[len(p):]})

    def _file(self, rel: str) -> PackedFile:
        f = self.index.files.get(rel)
        if f is None:
            raise NotFoundError(self.display(rel), "not found (not a file of the packed "
                                "checkpoint)", code="MISSING_FILE")
        return f

    def size(self, rel: str) -> int:
        return self._file(rel).size

    def exists(self, rel: str = "") -> bool:
        if not rel:
            return True
        rel = rel.rstrip("/")
        return rel in self.files or any(k.startswith(rel + "/") for k in self.files)

    def isdir(self, rel: str = "") -> bool:
        return self.exists(rel) and rel.rstrip("/") not in self.files

    def modified(self, rel: str) -> float | None:
        return self.raw.modified(PACK_INDEX)

    # ------------------------------------------------------------ decoding
    def _base_store(self):
        with self._lock:
            if self._base is None:
                if self._resolver is None:
                    raise NotFoundError(self.display(), "delta pack needs its base "
                                        f"{self.index.base['id'] if self.index.base else '?'}; "
                                        "pass --base URL", code="MISSING_BASE")
                self._base = self._resolver()
            return self._base

    def chunk_name(self, rel: str, i: int) -> str:
        """How an error names chunk ``i`` of original file ``rel``."""
        f = self._file(rel)
        c = f.refs[i]
        return (f"chunk {i} of {rel} (bytes {f.starts[i]}-{f.starts[i] + c.size}, "
                f"{c.clen} payload bytes at {c.at})")

    def _bad(self, rel: str, i: int, what: str, code: str = "MALFORMED_CHUNK") -> FormatError:
        c = self._file(rel).refs[i]
        return FormatError(self.display(c.data), f"{self.chunk_name(rel, i)}: {what}", code=code)

    def decode_group(self, rel: str, i: int, j: int) -> list[bytes]:
        """Chunks ``i`` to ``j - 1`` of ``rel`` (payloads side by side in one data file:
        see :meth:`groups`), their payloads read in one request, decoded and checked."""
        f = self._file(rel)
        first, last = f.refs[i], f.refs[j - 1]
        blob = self.raw.read_range(first.data, first.at, last.at + last.clen) \
            if last.at + last.clen > first.at else b""
        mv = memoryview(blob)
        out = []
        for k in range(i, j):
            a = f.refs[k].at - first.at
            out.append(self.decode(rel, k, mv[a:a + f.refs[k].clen]))
        return out

    def groups(self, rel: str, limit: int = 8 << 20) -> list[tuple[int, int]]:
        """``(i, j)`` runs of consecutive chunks whose payloads lie side by side in one
        data file, up to ``limit`` decoded bytes each: a DCP file's many small segments
        then cost one read per run, not per chunk (S3 requests cost more than bytes)."""
        f = self._file(rel)
        runs = []
        i = 0
        n = len(f.refs)
        while i < n:
            j = i + 1
            total = f.refs[i].size  # decoded bytes bound the run (a 'same' run reads none)
            while j < n and f.refs[j].data == f.refs[i].data \
                    and f.refs[j].at == f.refs[j - 1].at + f.refs[j - 1].clen \
                    and total + f.refs[j].size <= limit:
                total += f.refs[j].size
                j += 1
            runs.append((i, j))
            i = j
        return runs

    def decode(self, rel: str, i: int, payload=None) -> bytes:
        """Chunk ``i`` of ``rel``, decoded and checked (not cached); ``payload``: its
        bytes when the caller read them already."""
        codec = _codec()
        f = self._file(rel)
        c, seg = f.refs[i], f.segs[i]
        if payload is None:
            payload = self.raw.read_range(c.data, c.at, c.at + c.clen) if c.clen else b""
        if len(payload) != c.clen:
            raise self._bad(rel, i, f"data file is truncated ({len(payload)} of {c.clen} "
                            "payload bytes there)", "SIZE_MISMATCH")
        base = None
        if c.mode in ("xor", "same"):
            bfile, boff = seg.base
            at = boff + f.seg_off[i]
            base = self._base_store().read_range(bfile, at, at + c.size)
            if len(base) != c.size:
                raise self._bad(rel, i, f"base file {bfile} is shorter than the pack expects "
                                "(wrong base?)", "MANIFEST_MISMATCH")
        try:
            data = codec.decode(c.mode, payload, itemsize=seg.itemsize, size=c.size, base=base,
                                where=self.display(c.data))
        except FormatError as e:
            raise self._bad(rel, i, e.message) from None
        if len(data) != c.size or codec.check(data) != c.check:
            raise self._bad(rel, i, "checksum mismatch: the chunk is corrupt")
        with self._lock:
            self.stats.reads += 1
            self.stats.bytes_read += c.size
        return data

    def _cached_chunk(self, rel: str, i: int) -> bytes:
        key = (rel, i)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            lk = self._loading.setdefault(key, threading.Lock())
        with lk:
            with self._lock:
                if key in self._cache:
                    return self._cache[key]
            try:
                data = self.decode(rel, i)
            finally:
                with self._lock:
                    self._loading.pop(key, None)
            with self._lock:
                self._cache[key] = data
                self._cached += len(data)
                while self._cached > self._cache_bytes and len(self._cache) > 1:
                    _, old = self._cache.popitem(last=False)
                    self._cached -= len(old)
            return data

    # ------------------------------------------------------------ reads
    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of original file ``rel`` (short at the file's end)."""
        f = self._file(rel)
        start, end = max(0, start), min(end, f.size)
        if end <= start:
            return b""
        i = bisect.bisect_right(f.starts, start) - 1
        parts = []
        while i < len(f.refs) and f.starts[i] < end:
            s = f.starts[i]
            data = self._cached_chunk(rel, i)
            a, b = max(start, s) - s, min(end, s + len(data)) - s
            parts.append(data if (a == 0 and b == len(data)) else data[a:b])
            i += 1
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_into(self, rel: str, start: int, buf: memoryview) -> int:
        data = self.read_range(rel, start, start + len(buf))
        buf[:len(data)] = data
        return len(data)

    def read(self, rel: str) -> bytes:
        return self.read_range(rel, 0, self.size(rel))

    def _executor(self):
        with self._lock:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="ckptctl-pack")
            return self._pool

    def iter_blocks(self, rel: str, *, block: int = 8 << 20,
                    on_bytes: Callable[[int], None] | None = None,
                    ahead: int | None = None) -> Iterator[bytes]:
        """Stream original file ``rel`` chunk by chunk, in order; the next chunks are
        decoded ahead on the store's thread pool (``ahead`` in flight at most, default
        2 x workers: memory stays at a few chunks per reader)."""
        limit = max(1, ahead or 2 * self.workers)
        runs = self.groups(rel, limit=self.index.chunk_size)
        if not runs:
            return
        pool = self._executor()
        queue: collections.deque = collections.deque()
        k = 0
        try:
            while k < len(runs) or queue:
                while k < len(runs) and len(queue) < limit:
                    queue.append(pool.submit(self.decode_group, rel, *runs[k]))
                    k += 1
                for data in queue.popleft().result():
                    if on_bytes:
                        on_bytes(len(data))
                    yield data
        finally:
            for fut in queue:
                fut.cancel()

    def open(self, rel: str, mode: str = "rb", **kw) -> _Reader:
        if mode not in ("r", "rb"):
            raise UsageError(f"{self.display(rel)}: a pack is read-only (unpack it first)")
        self._file(rel)
        return _Reader(self, rel)

    def child(self, rel: str):
        raise UsageError(f"{self.display(rel)}: cannot open a folder inside a pack")

    def _readonly(self, *a, **kw):
        raise UsageError(f"{self.url}: a pack is read-only (unpack it first)")

    write_atomic = write_file = remove = remove_many = _readonly

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self.raw.close()

    def __del__(self):
        try:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


# --------------------------------------------------------------------------- opening


def read_index(store: Store, files: dict[str, int]) -> PackIndex:
    """The pack index at ``store``, validated against the folder's listing ``files``
    (an index larger than :data:`MAX_INDEX_BYTES` is refused before it is read).

    >>> read_index(store, store.list_files()).source_id              # doctest: +SKIP
    'xxh3-128:...'
    """
    where = store.display(PACK_INDEX)
    if files[PACK_INDEX] > MAX_INDEX_BYTES:
        raise UnsafeInputError(where, f"pack index is absurdly large ({files[PACK_INDEX]} bytes)")
    return PackIndex.parse(store.read(PACK_INDEX), where, files)


def join_url(url: str, rel: str) -> str:
    """``rel`` (a base's URL as a pack records it) resolved against the pack's ``url``.

    >>> join_url("s3://b/run/pack-2", "../step-1"), join_url("/r/p", "../s"), join_url("/r/p", "s3://x/y")
    ('s3://b/run/step-1', '/r/s', 's3://x/y')
    """
    if "://" in rel or rel.startswith("/"):
        return rel
    if "://" in url:
        proto, rest = url.split("://", 1)
        return f"{proto}://{posixpath.normpath(posixpath.join(rest.rstrip('/'), rel))}"
    return os.path.normpath(os.path.join(url, rel))


def relative_url(from_url: str, to_url: str) -> str:
    """How a pack at ``from_url`` records a base at ``to_url``: relative when both are on
    the same filesystem (same bucket), else the absolute URL.

    >>> relative_url("s3://b/run/p2", "s3://b/run/step-1"), relative_url("s3://b/p", "s3://c/q")
    ('../step-1', 's3://c/q')
    >>> relative_url("/r/packs/p2", "/r/step-1")
    '../../step-1'
    """
    if "://" in from_url or "://" in to_url:
        a, _, ra = from_url.partition("://")
        b, _, rb = to_url.partition("://")
        if a != b or ra.split("/", 1)[0] != rb.split("/", 1)[0] or a == "file":
            return to_url
        return posixpath.relpath(rb.rstrip("/"), ra.rstrip("/"))
    return os.path.relpath(os.path.abspath(to_url), os.path.abspath(from_url))


def chain_urls(pack_url: str, index: PackIndex) -> list[str]:
    """The URLs of a delta pack's bases as its index records them, its base first: the
    base's ``url``, then its ``chain`` (empty for a full pack or one without a recorded
    place). A hint only: each level is checked as it is opened.

    >>> i = PackIndex(None, "", 1, {}, {"id": "x", "depth": 2, "url": "../s2", "chain": ["../s1"]})
    >>> chain_urls("s3://b/run/s3", i)
    ['s3://b/run/s2', 's3://b/run/s1']
    """
    base = index.base
    if not base or not base.get("url"):
        return []
    return [join_url(pack_url, rel) for rel in [base["url"], *(base.get("chain") or [])]]


class ChainWalk(dict):
    """What one walk down a delta chain shares between its levels: as a dict, the levels
    opened ahead of need (url -> Future, :func:`_read_ahead`); ``listed``: a listing of
    the folder that holds the levels, already made (``(store, groups)``, the groups of
    :func:`~ckptctl.formats.detect.group_checkpoints`), so a level found there is opened
    without a listing of its own; ``persist``: the levels' small files may come from the
    persistent object cache (:mod:`~ckptctl.storage.objcache`): a pack hop's walks, where
    a chain of 8 then costs what a chain of 1 does; never a verify or a restore, which
    must read what the store holds.

    >>> ChainWalk().locate("/nonexistent/x", None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ckptctl.errors.NotFoundError: /nonexistent/x: no such file or directory
    """

    def __init__(self, listed: tuple | None = None, persist: bool = False):
        super().__init__()
        self.listed, self.persist, self.started = listed, persist, False

    def locate(self, url: str, storage_options: dict | None) -> tuple:
        """:func:`~ckptctl.formats.locate.locate` of ``url``, cut from ``listed`` when the
        listing holds that folder."""
        from .locate import locate, located_in

        if self.listed is not None:
            root, groups = self.listed
            prefix = root.url.rstrip("/") + "/"
            rel = url[len(prefix):].strip("/") if url.startswith(prefix) else None
            if rel and rel in groups:
                return located_in(root, rel, groups[rel])
        return locate(url, storage_options)


def _open_level(url: str, storage_options: dict | None, ahead: ChainWalk) -> tuple:
    """What :func:`pack_view` makes of a chain level at ``url``, read with its small files
    whole: the listing, manifest and index, and (when it is a pack) its packed manifest,
    decoded. Run ahead of need on a thread (:func:`_read_ahead`)."""
    store, files, single = located = ahead.locate(url, storage_options)
    if single or not is_pack(files) or WRITING_MARKER in files:
        return located  # the resolver says what is wrong with it
    ps = open_pack(store, files, storage_options=storage_options, ahead=ahead)
    return ps, ps.list_files(), None


def _whole_small_files(store: Store, files: dict[str, int], persist: bool = False) -> None:
    """A pack's files of up to :data:`CHAIN_WHOLE_FILE` bytes come in one GET each when
    first read (no effect on local stores): a delta decodes against every level of its
    chain, chunk by chunk. ``persist``: see :class:`ChainWalk`."""
    store.cache_small_files({rel: n for rel, n in files.items() if n <= CHAIN_WHOLE_FILE},
                            max_file=CHAIN_WHOLE_FILE, budget=CHAIN_CACHE_BUDGET,
                            persist=persist)


def _read_ahead_urls(pack_url: str, index: PackIndex) -> list[str]:
    """The levels below a remote pack's base worth opening ahead: those its chain records
    relative to the pack (same bucket). An absolute URL there is never read ahead of need:
    a hostile index would otherwise send requests anywhere it names (only the URLs a walk
    actually follows are asked, and reported).

    >>> i = PackIndex(None, "", 1, {}, {"id": "x", "depth": 3, "url": "../s3",
    ...               "chain": ["../s2", "http://169.254.169.254/x"]})
    >>> _read_ahead_urls("s3://b/run/s4", i), _read_ahead_urls("/local/run/s4", i)
    (['s3://b/run/s2'], [])
    """
    if "://" not in pack_url or pack_url.startswith("file://"):
        return []  # a local walk costs no round trips
    rels = (index.base or {}).get("chain") or []
    return [join_url(pack_url, rel) for rel in rels if "://" not in rel and not
            rel.startswith("/")]


def _read_ahead(urls: list[str], storage_options: dict | None,
                walk: ChainWalk | None = None) -> ChainWalk:
    """Open the chain levels at ``urls`` at once, one thread each: url -> Future of what
    :func:`_open_level` returns, in ``walk`` (a new one by default). The walk down a
    chain of 8 then waits about as long as for one level; it takes each level from here,
    or opens it itself when that failed (so its errors are the usual ones)."""
    from concurrent.futures import ThreadPoolExecutor

    ahead = walk if walk is not None else ChainWalk()
    ahead.started = True
    if not urls:
        return ahead
    pool = ThreadPoolExecutor(len(urls), thread_name_prefix="ckptctl-chain")
    try:
        for url in urls:
            ahead[url] = pool.submit(_open_level, url, storage_options, ahead)
    finally:
        pool.shutdown(wait=False)  # the threads end with their one job
    return ahead


def base_resolver(pack_url: str, index: PackIndex, base: str | None = None,
                  storage_options: dict | None = None, *,
                  ahead: ChainWalk | None = None) -> Callable[[], object]:
    """A function that opens a delta pack's base: ``base`` (a URL) when given, else the
    URL the index records (relative to the pack). The base must be sealed and its
    checkpoint id must be the one the pack was made against; it may itself be a pack.
    On a remote store the first call also starts opening the levels below it that the
    index's chain names (``ahead``: the walk this level belongs to, shared down the
    chain; see :class:`ChainWalk`). While the recorded base is being re-rooted (``gc``
    replaces it: its folder is held by a writer for a moment), the committed copy
    beside it (:func:`reroot_stage`, same checkpoint id, never deeper) serves instead.

    >>> base_store = base_resolver(url, index, "ckpt/step-1000")()  # doctest: +SKIP
    """
    want = index.base["id"] if index.base else None

    def resolve():
        url = base or (join_url(pack_url, index.base["url"]) if index.base.get("url") else None)
        if url is None:
            raise NotFoundError(pack_url, f"delta pack needs its base {want}; pass --base URL",
                                code="MISSING_BASE")
        shared = ahead
        if shared is None or not shared.started:  # the top of a walk: the levels below
            below = _read_ahead_urls(pack_url, index) if base is None else []  # the base
            shared = _read_ahead(below, storage_options, shared)
        try:
            return opened(url, shared, shared.pop(url, None))
        except StorageError:
            raise  # the store failed: no verdict on the base
        except CkptError:
            if base is not None:  # the caller named it: never another place
                raise
            try:  # being re-rooted (``gc``): its committed copy beside it, while it is
                return opened(reroot_stage(url), shared, None)
            except CkptError:
                pass
            raise

    def opened(url: str, shared: ChainWalk, ahead_of_need) -> object:
        located = None
        if ahead_of_need is not None:
            try:
                located = ahead_of_need.result()
            except CkptError:
                located = None  # asked again below: the answer reported is that one
        try:
            if located is None:
                located = shared.locate(url, storage_options)
            store, files, single = pack_view(located, storage_options, ahead=shared)
        except NotFoundError:
            raise NotFoundError(url, f"base of {pack_url} not found (the pack needs checkpoint "
                                f"{want}; pass --base URL)", code="MISSING_BASE") from None
        if writer_unfinished(files, single):  # being written or removed (rm, gc)
            raise FormatError(url, f"base of {pack_url} is held by a ckptctl writer or "
                              f"remover ({WRITING_MARKER}); the pack needs checkpoint {want}",
                              code="MISSING_BASE")
        # a pack names the checkpoint it restores in its own manifest, checked against its
        # index when opened: the packed manifest (in a data file) need not be decoded
        man = store.manifest if isinstance(store, PackStore) else \
            Manifest.read(store, files, single)
        if man is None:
            raise FormatError(url, f"base is not sealed, so its id cannot be checked (the pack "
                              f"needs checkpoint {want}); run `ckptctl seal` on it",
                              code="MISSING_BASE")
        if man.checkpoint_id != want:
            raise FormatError(url, f"wrong base: this is checkpoint {man.checkpoint_id}, the "
                              f"pack needs {want}", code="MISSING_BASE")
        if isinstance(store, PackStore) and store.index.depth >= index.depth:
            raise FormatError(url, f"base is a pack {store.index.depth} deep, this pack says "
                              f"{index.depth}: a chain of packs must get shorter towards its "
                              "root (a cycle?)", code="MISSING_BASE")
        return store

    return resolve


def open_pack(store: Store, files: dict[str, int], *, base: str | None = None,
              storage_options: dict | None = None, workers: int | None = None,
              ahead: ChainWalk | None = None) -> PackStore:
    """Open the pack at ``store`` (``files``: its listing) as the checkpoint it holds.

    The pack's own manifest must be there (a pack without one is an unfinished write) and
    list the pack's files with their sizes; the index is validated whole. ``base``: the
    base's URL for a delta pack (default: the one the index records); ``ahead``: see
    :func:`base_resolver`.

    >>> ps = open_pack(store, store.list_files()); ps.info()["ratio"]  # doctest: +SKIP
    1.51
    """
    _whole_small_files(store, files, persist=ahead is not None and ahead.persist)
    man = Manifest.read(store, files)
    if man is None or WRITING_MARKER in files:
        raise FormatError(store.url, "pack is not committed (no manifest: a pack write did "
                          "not finish)", code="NOT_COMMITTED")
    for rel, rec in man.files.items():
        if files.get(rel) != rec.size:
            what = "missing" if rel not in files else f"{files[rel]} bytes, manifest says {rec.size}"
            raise FormatError(store.display(rel), f"pack file {what}",
                              code="MISSING_FILE" if rel not in files else "SIZE_MISMATCH")
    index = read_index(store, files)
    if man.extra.get("packs") not in (None, index.source_id):
        raise FormatError(store.display(MANIFEST), "the pack's manifest and index name "
                          "different checkpoints", code="MANIFEST_MISMATCH")
    resolver = base_resolver(store.url, index, base, storage_options, ahead=ahead) \
        if index.base else None
    ps = PackStore(store, index, base_resolver=resolver, workers=workers)
    ps.raw_files = {k: v for k, v in files.items() if k != MANIFEST}
    ps.raw_files[MANIFEST] = files[MANIFEST]
    ps.manifest = man
    return ps


def pack_view(located: tuple, storage_options: dict | None = None, *,
              base: str | None = None, ahead: ChainWalk | None = None) -> tuple:
    """What :func:`~ckptctl.formats.detect.locate` returned, with a committed pack folder
    replaced by the checkpoint it holds (``(PackStore, original files, None)``; a pack of a
    single-file checkpoint: ``(PackStore, {file, its sidecar manifest}, file)``); anything
    else (an unfinished pack write included) as it was. ``locate`` itself leaves a pack
    folder as its own files (``pin``, ``rm``, ``seal`` and ``promote`` manage those);
    readers (``open_checkpoint``, ``verify``) call this.

    >>> import tempfile
    >>> from ckptctl.storage import open_store
    >>> d = tempfile.mkdtemp(); s = open_store(d)
    >>> pack_view((s, {"a.safetensors": 8}, None))[1]
    {'a.safetensors': 8}
    """
    store, files, single = located
    if single or isinstance(store, PackStore) or not is_pack(files) or WRITING_MARKER in files:
        return located
    ps = open_pack(store, files, base=base, storage_options=storage_options, ahead=ahead)
    return ps, ps.list_files(), ps.index.single  # a single file's pack: that file


__all__ = ["PACK_INDEX", "PackIndex", "PackStore", "Segment", "ChunkRef", "is_pack",
           "open_pack", "pack_view", "base_resolver", "chain_urls", "ChainWalk",
           "reroot_stage", "reroot_target"]
