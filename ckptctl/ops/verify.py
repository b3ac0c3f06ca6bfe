"""``verify``: integrity checks for CI gates, at three levels, each including the one before.

* ``quick``: commit state (manifest, or the format's own marker), every file present at
  its recorded size, stray temp files and orphaned multipart uploads;
* ``structure``: metadata parses; chunks tile each tensor exactly; every byte extent lies
  inside its file; dtype x elements = bytes; DCP chunk zips are well-formed; HF index and
  files agree; state closure against ``require``;
* ``full``: every file's content hash against the manifest (unsealed: every tensor
  decoded); optionally NaN/Inf counts (``check_finite``) and a deterministic sample.

Problem codes are stable (see :data:`PROBLEM_CODES`); ``ok`` is False on any problem.

>>> r = verify("ckpt/", level="quick")                      # doctest: +SKIP
>>> r.ok, [p.code for p in r.problems]                      # doctest: +SKIP
(False, ['MISSING_FILE'])
"""
from __future__ import annotations

import bisect
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable

from ..errors import CkptError, UsageError
from ..formats import dcp
from ..formats.detect import locate, open_checkpoint
from ..formats.manifest import MANIFEST, is_temp_name, read_manifest
from ..model import Checkpoint, TensorEntry
from ..storage import hash_file, normalize_algo
from .closure import classify, parse_parts

LEVELS = ("quick", "structure", "full")

#: Every problem code verify reports, with what it means.
PROBLEM_CODES = {
    "NOT_COMMITTED": "no manifest and no format commit marker (DCP .metadata): a write never finished",
    "MISSING_FILE": "a file the manifest or metadata names is not there",
    "SIZE_MISMATCH": "a file's size differs from the manifest, or is too short for its extents",
    "EXTRA_FILE": "a file is present that the manifest does not list",
    "STRAY_TEMP": "a writer's temporary file is left over (.metadata.tmp, *.partial, ...)",
    "ORPHANED_UPLOAD": "an unfinished S3 multipart upload lies under the checkpoint's prefix",
    "MALFORMED_METADATA": "metadata does not parse or is inconsistent",
    "UNSAFE_INPUT": "metadata tries to run code or asks for absurd sizes",
    "PATH_ESCAPE": "a path in the metadata leaves the checkpoint root",
    "CHUNK_GAP": "chunks leave part of a tensor uncovered",
    "CHUNK_OVERLAP": "chunks cover part of a tensor twice",
    "OUT_OF_BOUNDS": "a chunk lies outside its tensor, or its bytes outside its file",
    "DTYPE_SIZE_MISMATCH": "stored bytes differ from dtype x number of elements",
    "MALFORMED_CHUNK": "a chunk's bytes do not decode (DCP zip, zstd stream)",
    "INDEX_MISMATCH": "the HF index and the shard files disagree",
    "MISSING_STATE": "a required part of the training state is absent (--require)",
    "HASH_MISMATCH": "a file's content hash differs from the manifest",
    "MANIFEST_MISMATCH": "the manifest describes another checkpoint than the files hold",
    "NON_FINITE": "a tensor holds NaN or Inf values (--check-finite)",
    "IO_ERROR": "a file could not be read",
}


@dataclass
class Problem:
    code: str
    severity: str  # "error" or "warning"
    path: str | None
    entry: str | None
    message: str


@dataclass
class VerifyResult:
    ok: bool
    level: str
    url: str
    format: str | None
    sealed: bool
    step: int | None = None
    problems: list[Problem] = field(default_factory=list)
    files_checked: int = 0
    bytes_read: int = 0
    tensors_checked: int = 0
    seconds: float = 0.0
    hash: str | None = None
    non_finite: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class _Checker:
    def __init__(self, url, storage_options, level, require, check_finite, sample, workers,
                 on_bytes):
        self.url, self.opts, self.level = url, storage_options, level
        self.require = parse_parts(require) if isinstance(require, str) else list(require or [])
        self.check_finite, self.sample, self.workers = check_finite, sample, workers
        self.on_bytes = on_bytes
        self.problems: list[Problem] = []
        self.ck: Checkpoint | None = None
        self.result = VerifyResult(False, level, url, None, False)

    def add(self, code, message, *, path=None, entry=None, severity="error"):
        self.problems.append(Problem(code, severity, path, entry, message))

    def add_error(self, e: CkptError):
        self.add(e.code if e.code in PROBLEM_CODES else "MALFORMED_METADATA", e.message,
                 path=e.path)

    # ------------------------------------------------------------ quick
    def quick(self):
        located = locate(self.url, self.opts)
        store, files, single = located
        self.store, self.files = store, files
        for rel in files:
            if is_temp_name(rel):
                self.add("STRAY_TEMP", "leftover temporary file", path=store.display(rel),
                         severity="warning")
        self._orphaned_uploads(store)
        try:
            self.manifest = read_manifest(store, files) if not single else None
        except CkptError as e:
            self.manifest = None
            self.add_error(e)
        self.result.sealed = self.manifest is not None
        if self.manifest is not None:
            mfiles = self.manifest["files"]
            for rel, rec in mfiles.items():
                if rel not in files:
                    self.add("MISSING_FILE", "listed in the manifest but missing",
                             path=store.display(rel))
                elif files[rel] != rec.get("size"):
                    self.add("SIZE_MISMATCH", f"{files[rel]} bytes, manifest says {rec.get('size')}",
                             path=store.display(rel))
            for rel in files:
                if rel not in mfiles and rel != MANIFEST and not is_temp_name(rel):
                    self.add("EXTRA_FILE", "not listed in the manifest", path=store.display(rel),
                             severity="warning")
        try:
            self.ck = open_checkpoint(self.url, self.opts, strict=False, read_step=False,
                                      located=located)
            self.result.format = self.ck.format
            self.result.step = self.ck.step
        except CkptError as e:
            self.add_error(e)
            return
        if self.ck.format == "dcp":
            for rel in sorted(dcp.referenced_files(self.ck)):
                if rel not in files and not (self.manifest and rel in self.manifest["files"]):
                    self.add("MISSING_FILE", "referenced by .metadata but missing",
                             path=store.display(rel))
        self._extents_inside_files()

    def _orphaned_uploads(self, store):
        if store.protocol not in ("s3", "s3a"):
            return
        bucket, _, prefix = store.root.partition("/")
        try:
            resp = store.fs.call_s3("list_multipart_uploads", Bucket=bucket,
                                    Prefix=prefix.rstrip("/") + "/")
        except Exception:  # noqa: BLE001 - servers without the call: nothing to report
            return
        for up in resp.get("Uploads", []) or []:
            self.add("ORPHANED_UPLOAD", f"unfinished multipart upload {up.get('UploadId', '')[:16]}",
                     path=f"s3://{bucket}/{up.get('Key')}", severity="warning")

    def _extents_inside_files(self):
        ck = self.ck
        for t in ck.tensors.values():
            for c in t.chunks:
                self._extent_ok(c.extent, t.name)
        for o in ck.objects.values():
            if o.extent is not None:
                self._extent_ok(o.extent, o.name)

    def _extent_ok(self, ext, name):
        size = self.files.get(ext.file)
        if size is None or ext.encoding == "torch_save":
            return
        if ext.offset + ext.length > size:
            self.add("SIZE_MISMATCH" if ext.offset < size else "OUT_OF_BOUNDS",
                     f"bytes {ext.offset}..{ext.offset + ext.length} lie past the end of the "
                     f"file ({size} bytes)", path=self.store.display(ext.file), entry=name)

    # ------------------------------------------------------------ structure
    def structure(self):
        ck = self.ck
        for t in ck.tensors.values():
            self._tiling(t)
        if ck.format == "dcp":
            self._dcp_zips()
        if self.require:
            present = {classify(n) for n in list(ck.tensors) + list(ck.objects)}
            for part in self.require:
                if part not in present:
                    self.add("MISSING_STATE", f"required state {part!r} is absent")
        if self.manifest is not None:
            fmt = self.manifest.get("format")
            if fmt and fmt != ck.format:
                self.add("MANIFEST_MISMATCH", f"manifest says format {fmt}, files are {ck.format}",
                         path=self.store.display(MANIFEST))
            from ..formats.manifest import logical_digest

            want = (self.manifest.get("summary") or {}).get("logical_digest")
            if want and want != logical_digest(ck):
                self.add("MANIFEST_MISMATCH", "the metadata describes other tensors than when "
                         "sealed", path=self.store.display(MANIFEST))

    def _tiling(self, t: TensorEntry):
        """Chunks must tile the tensor: in bounds, no gap, no overlap.

        Cut the tensor into the grid that all chunk edges define; each grid cell must be
        covered exactly once. DTensor layouts make that grid the mesh, so it stays small.
        """
        nd = len(t.shape)
        for c in t.chunks:
            if any(o + s > d for o, s, d in zip(c.offsets, c.sizes, t.shape)):
                self.add("OUT_OF_BOUNDS", f"chunk at {list(c.offsets)} size {list(c.sizes)} "
                         f"lies outside the tensor's shape {list(t.shape)}", entry=t.name)
                return
        if t.numel == 0:
            return
        if not t.chunks:
            self.add("CHUNK_GAP", "tensor has no chunks", entry=t.name)
            return
        if nd == 0:
            if len(t.chunks) > 1:
                self.add("CHUNK_OVERLAP", "scalar stored more than once", entry=t.name)
            return
        cuts = [sorted({0, d} | {c.offsets[i] for c in t.chunks if c.numel}
                       | {c.offsets[i] + c.sizes[i] for c in t.chunks if c.numel})
                for i, d in enumerate(t.shape)]
        ncells = math.prod(len(x) - 1 for x in cuts)
        if ncells > 4_000_000:
            total = sum(c.numel for c in t.chunks)
            if total != t.numel:
                self.add("CHUNK_GAP" if total < t.numel else "CHUNK_OVERLAP",
                         f"chunks hold {total} elements of {t.numel}", entry=t.name)
            return
        import numpy as np

        cover = np.zeros([len(x) - 1 for x in cuts], dtype=np.int32)
        for c in t.chunks:
            if not c.numel:
                continue
            box = tuple(slice(bisect.bisect_left(cuts[i], c.offsets[i]),
                              bisect.bisect_left(cuts[i], c.offsets[i] + c.sizes[i]))
                        for i in range(nd))
            cover[box] += 1
        if (cover > 1).any():
            self.add("CHUNK_OVERLAP", "chunks cover part of the tensor more than once",
                     entry=t.name)
        if (cover == 0).any():
            self.add("CHUNK_GAP", "part of the tensor is covered by no chunk", entry=t.name)

    def _dcp_zips(self):
        """Each chunk's zip has one stored record of exactly dtype x elements bytes."""
        from ..formats.tensorio import payload_location

        ck = self.ck
        jobs = [(t, c) for t in ck.tensors.values() for c in t.chunks
                if c.extent.encoding == "torch_zip" and c.extent.file in self.files
                and c.extent.offset + c.extent.length <= self.files[c.extent.file]]

        def one(job):
            t, c = job
            try:
                _, length = payload_location(ck, c.extent)
            except CkptError as e:
                return ("MALFORMED_CHUNK", e.message, c.extent.file, t.name)
            want = t.dtype.nbytes(c.numel)
            if length != want:
                return ("DTYPE_SIZE_MISMATCH", f"chunk at {list(c.offsets)} stores {length} "
                        f"bytes, {t.dtype.name} x {c.numel} needs {want}", c.extent.file, t.name)
            return None

        with ThreadPoolExecutor(self.workers) as pool:
            for res in pool.map(one, jobs):
                if res:
                    code, msg, rel, name = res
                    self.add(code, msg, path=self.store.display(rel), entry=name)

    # ------------------------------------------------------------ full
    def full(self, *, hashed: bool = False):
        if self.manifest is not None:
            if not hashed:
                self._hash_files()
        elif not self.check_finite:
            self._decode_all(finite=False)
        if self.check_finite:
            self._decode_all(finite=True)

    def _sampled(self, names: list[str]) -> list[str]:
        if self.sample is None or self.sample >= 1:
            return names
        import xxhash

        key = lambda n: xxhash.xxh64_intdigest(n.encode())  # noqa: E731 - deterministic order
        ranked = sorted(names, key=key)
        return sorted(ranked[:max(1, math.ceil(len(ranked) * self.sample))])

    def _hash_files(self):
        algo = normalize_algo(self.manifest.get("hash", "xxh3-128"))
        self.result.hash = algo
        mfiles = self.manifest["files"]
        todo = [rel for rel in self._sampled(sorted(mfiles))
                if rel in self.files and self.files[rel] == mfiles[rel].get("size")]

        def one(rel):
            try:
                return rel, hash_file(self.store, rel, algo, self.on_bytes)[0], None
            except CkptError as e:
                return rel, None, e

        with ThreadPoolExecutor(max(1, min(self.workers, len(todo) or 1))) as pool:
            for rel, digest, err in pool.map(one, todo):
                self.result.files_checked += 1
                if err is not None:
                    self.add_error(err)
                elif digest != mfiles[rel].get("hash"):
                    self.add("HASH_MISMATCH", f"content hash differs from the manifest ({algo})",
                             path=self.store.display(rel))

    def _decode_all(self, *, finite: bool):
        """Decode every chunk (bounded memory: row blocks of at most 64 MiB where the
        encoding allows), checking sizes and, with ``finite``, counting NaN/Inf."""
        from ..formats.tensorio import chunk_bytes, read_rows
        from .finite import count_non_finite

        ck = self.ck
        names = self._sampled(sorted(ck.tensors))
        bad = {p.path for p in self.problems if p.code in ("MISSING_FILE", "SIZE_MISMATCH")}
        jobs = [(ck.tensors[n], c) for n in names for c in ck.tensors[n].chunks
                if self.store.display(c.extent.file) not in bad]

        def blocks(t, c):
            rows = c.sizes[0] if c.sizes else 1
            row_bytes = t.dtype.nbytes(c.numel // rows) if rows else 0
            step = max(1, (64 << 20) // max(1, row_bytes))
            if c.extent.encoding in ("raw", "torch_zip") and c.sizes and rows > step \
                    and t.dtype.bits % 8 == 0:
                for r in range(0, rows, step):
                    yield read_rows(ck, t, c, r, min(rows, r + step))
            else:
                yield chunk_bytes(ck, t, c)

        def one(job):
            t, c = job
            counts = {"nan": 0, "inf": 0}
            try:
                for data in blocks(t, c):
                    if self.on_bytes:
                        self.on_bytes(len(data))
                    if finite and t.dtype.is_floating and t.dtype.bits % 8 == 0:
                        import numpy as np

                        got = count_non_finite(np.frombuffer(data, dtype=f"V{t.dtype.itemsize}"),
                                               t.dtype)
                        if got:
                            counts["nan"] += got["nan"]
                            counts["inf"] += got["inf"]
            except CkptError as e:
                return t.name, None, e
            return t.name, counts, None

        with ThreadPoolExecutor(self.workers) as pool:
            for name, counts, err in pool.map(one, jobs):
                if err is not None:
                    code = err.code if err.code in PROBLEM_CODES and err.code not in (
                        "MALFORMED_METADATA",) else "MALFORMED_CHUNK"
                    self.add(code, err.message, path=err.path, entry=name)
                elif counts and (counts["nan"] or counts["inf"]):
                    prev = self.result.non_finite.setdefault(name, {"nan": 0, "inf": 0})
                    prev["nan"] += counts["nan"]
                    prev["inf"] += counts["inf"]
        for name, counts in self.result.non_finite.items():
            self.add("NON_FINITE", f"{counts['nan']} NaN, {counts['inf']} Inf", entry=name)
        self.result.tensors_checked = len(names)

    def run(self) -> VerifyResult:
        t0 = time.monotonic()
        self.quick()
        fatal = self.ck is None
        hashing = None
        if not fatal and self.level == "full" and self.manifest is not None:
            # content hashes need only the manifest: stream them while structure runs
            failure: list[BaseException] = []

            def run_hashes():
                try:
                    self._hash_files()
                except BaseException as e:  # noqa: BLE001 - re-raised below, never lost
                    failure.append(e)

            hashing = threading.Thread(target=run_hashes, daemon=True)
            hashing.start()
        if not fatal and self.level in ("structure", "full"):
            self.store.cache_small_files(self.files)  # reading chunks: whole small files
            self.structure()
        if hashing is not None:
            hashing.join()
            if failure:
                raise failure[0]
        if not fatal and self.level == "full":
            self.full(hashed=hashing is not None)
        r = self.result
        if not r.files_checked:
            r.files_checked = len(getattr(self, "files", {}))
        r.problems = self.problems
        r.ok = not self.problems
        r.bytes_read = self.store.stats.bytes_read
        r.seconds = round(time.monotonic() - t0, 3)
        return r


def verify(url: str, storage_options: dict | None = None, *, level: str = "structure",
           require: str | list[str] | None = None, check_finite: bool = False,
           sample: float | None = None, workers: int = 4,
           on_bytes: Callable[[int], None] | None = None) -> VerifyResult:
    """Check the checkpoint at ``url``; problems are collected, not raised.

    Raises only when the place cannot be read at all (exit 3): not found, unreachable.
    """
    if level not in LEVELS:
        raise UsageError(f"unknown level {level!r} (choose from {', '.join(LEVELS)})")
    if sample is not None and not 0 < sample <= 1:
        raise UsageError("--sample takes a fraction in (0, 1]")
    return _Checker(url, storage_options, level, require, check_finite, sample, workers,
                    on_bytes).run()
