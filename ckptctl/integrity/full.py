"""The full level of ``verify``, on top of the structure one
(:class:`~ckptctl.integrity.structure.StructureCheck`): :class:`FullCheck` reads each data
file once (:func:`~ckptctl.integrity.scan.scan_file`) and proves its content: its hash
against the manifest, or, unsealed, the CRC-32 of every zip record (DCP chunks, torch.save
files) and Megatron's ``integrity.json``; NaN/Inf counts from the same bytes
(``check_finite``); a deterministic sample of the files (``sample``); a seal's hashes in
the same read (:func:`~ckptctl.integrity.verify.check_and_hash`). After a hash mismatch,
:func:`damage_words` says which entries hold the damaged bytes.

>>> c = FullCheck("ckpt/", level="full", check_finite=True)  # doctest: +SKIP
>>> c.quick(); c.structure(); c.full()                       # doctest: +SKIP
>>> c.result.content, c.result.non_finite                    # doctest: +SKIP
('crc', {'model.w': {'nan': 3, 'inf': 0}})
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from ..catalog.checks import verify_code
from ..errors import CkptError, FormatError, StorageError
from ..formats.megatron import INTEGRITY
from ..storage import new_hasher, normalize_algo
from .result import VerifyResult
from .structure import OBJECT_SCAN_LIMIT, StructureCheck


class FullCheck(StructureCheck):
    """The quick and structure levels' checks, then the full level's (:meth:`full`),
    findings in ``problems`` and what was read and proven in ``result`` (a
    :class:`~ckptctl.integrity.result.VerifyResult`). ``on_bytes(n)``: n more bytes read;
    ``on_total(n)``: called once before the reads with the bytes they come to; ``group``:
    an active :class:`~ckptctl.writing.distributed.Group` reads this process's share of
    the files. The other arguments are
    :class:`~ckptctl.integrity.structure.StructureCheck`'s.

    For a seal, ``seal_algo`` and ``seal_names`` name the files to hash (checked as
    unsealed ones); the pass fills ``digests`` with each one's (digest, size).
    """

    def __init__(self, url: str, storage_options: dict | None = None, *,
                 check_finite: bool = False, sample: float | None = None,
                 on_bytes: Callable[[int], None] | None = None,
                 on_total: Callable[[int], None] | None = None, group=None, **structure):
        super().__init__(url, storage_options, **structure)
        self.group = group  # ops.distributed.Group: this process reads its share (full level)
        self.check_finite, self.sample = check_finite, sample
        self.on_bytes, self.on_total = on_bytes, on_total
        self.result = VerifyResult(False, self.level, url, None, False)
        #: sealing (:func:`check_and_hash`): the files to hash with ``seal_algo`` in the
        #: full pass that checks them, and the (digest, size) of each, filled by it
        self.seal_algo: str | None = None
        self.seal_names: list[str] = []
        self.digests: dict[str, tuple[str, int]] = {}

    def full(self):
        """Read every data file once: content hash (sealed) or the CRC-32 of every zip record
        (unsealed DCP and torch.save), NaN/Inf counts on the same bytes; what a format
        cannot carry in a checksum is reported as decoded only."""
        plan = self._plan()
        plan.group, plan.sizes = self.group if self.group is not None and self.group.active \
            else None, self.files
        plan.add_tensors(self.ck, self.check_finite)
        plan.add_objects(self.ck)
        plan.add_torch_files(self.ck, self.files)
        if self.on_total:  # what on_bytes will count: every file read, zstd chunks decoded
            self.on_total(plan.total(self.files))
        with ThreadPoolExecutor(max(1, min(self.workers, len(plan.files) + len(plan.side)
                                           or 1))) as pool:
            scans = list(pool.map(lambda rel: self._scan(plan, rel), plan.files))
            sides = list(pool.map(lambda job: (job, self._decode_side(*job)), plan.side))
        read = self._judge_scans(plan, scans)
        self._judge_sides(sides)
        for name, counts in sorted(self.result.non_finite.items()):
            self.add("NON_FINITE", f"{counts['nan']} NaN, {counts['inf']} Inf", entry=name)
        self.result.files_read = read
        self.result.tensors_checked = len(plan.tensors_seen)
        self._share = {"files": plan.files, "crc_files": plan.crc_files,
                       "tensors": plan.tensors_seen}
        self._report_content(plan)

    def _plan(self) -> "_Plan":
        """The files this process reads and what proves each: the manifest's hashes
        (sealed), a seal's files (hashed, checked as unsealed ones), or the format's own
        checks and Megatron's ``integrity.json`` (unsealed); sampled, then shared out."""
        sealing = self.seal_algo is not None  # the files to seal, checked as unsealed ones
        sealed = self.manifest is not None and not sealing
        algo = normalize_algo(self.manifest.hash) if sealed else None
        self.result.hash = algo
        # Megatron's own SHA-256 manifest: checked when there is no ckptctl one
        integrity = None if sealed else self._integrity()
        if sealing:
            files = list(self.seal_names)
        else:
            files = self._data_files() if integrity is None else \
                sorted(set(self._data_files()) | {rel for rel in integrity if rel in self.files})
            files = self._sampled(files)
        if self.group is not None and self.group.active:  # file i: process i % world size
            files = self.group.mine(files)
        return _Plan(files, self.store, sealed=sealed, sealing=sealing, algo=algo,
                     integrity=integrity)

    def _sampled(self, names: list[str]) -> list[str]:
        if self.sample is None or self.sample >= 1:
            return names
        import xxhash

        key = lambda n: xxhash.xxh64_intdigest(n.encode())  # noqa: E731 - deterministic order
        ranked = sorted(names, key=key)
        return sorted(ranked[:max(1, math.ceil(len(ranked) * self.sample))])

    def _data_files(self) -> list[str]:
        """The files whose content a full verify reads (the manifest's, when sealed)."""
        if self.manifest is not None:
            m = self.manifest.files
            return [rel for rel in sorted(m)
                    if rel in self.files and self.files[rel] == m[rel].size]
        ck = self.ck
        used = {c.extent.file for t in ck.tensors.values() for c in t.chunks}
        used |= {o.extent.file for o in ck.objects.values() if o.extent is not None}
        bad = {p.path for p in self.problems if p.code in ("MISSING_FILE", "SIZE_MISMATCH")}
        return sorted(rel for rel in used if rel in self.files
                      and self.store.display(rel) not in bad)

    def _integrity(self) -> dict[str, str] | None:
        """Megatron's ``integrity.json`` of a ``torch_dist`` checkpoint (``{"algorithm":
        "sha256", "files": {name: hex digest}}``) as name -> digest, or None when there is
        none; a file that says anything else is a finding."""
        from ..formats.limits import load_json

        if not self.ck.info.get("megatron") or INTEGRITY not in self.files:
            return None
        where = self.store.display(INTEGRITY)
        try:
            if self.files[INTEGRITY] > 64 << 20:
                raise FormatError(where, f"{self.files[INTEGRITY]} bytes: no integrity manifest")
            doc = load_json(self.store.read(INTEGRITY), where)
            listed = doc.get("files") if isinstance(doc, dict) else None
            if not isinstance(listed, dict) or doc.get("algorithm", "sha256") != "sha256" or \
                    not all(isinstance(k, str) and "/" not in k and isinstance(v, str)
                            for k, v in listed.items()):
                raise FormatError(where, "not Megatron's integrity manifest ({'algorithm': "
                                  "'sha256', 'files': {name: digest}})")
        except FormatError as e:
            self.add("MALFORMED_METADATA", e.message, path=where)
            return None
        return {k: v.lower() for k, v in listed.items()}

    def _scan(self, plan: "_Plan", rel: str):
        """Read ``rel`` once through its regions and hashers: (rel, its digest for the
        manifest or ``integrity.json``, or None, or "unreadable"; the regions read)."""
        from .scan import scan_file

        store, integrity = self.store, plan.integrity
        hasher = new_hasher(plan.algo) if plan.sealed else \
            new_hasher("sha256") if integrity and rel in integrity else None
        content = new_hasher(self.seal_algo) if plan.sealing else None
        todo = plan.regions[rel]
        if not plan.sealed and not plan.sealing and not todo and rel in plan.torch_files:
            return rel, None, []  # a legacy torch.save file: decoded by torch.load
        try:
            n = scan_file(store, rel, [r for r, _ in todo], on_bytes=self.on_bytes,
                          hasher=_Both(hasher, content) if hasher and content
                          else hasher or content)
        except CkptError as e:
            if isinstance(e, StorageError) or getattr(store, "protocol", None) != "pack":
                raise
            # a pack's chunk that fails its checksum: a finding about the pack
            self.add(verify_code(e.code, "MALFORMED_CHUNK"), e.message, path=e.path)
            return rel, "unreadable", []
        if content is not None:
            self.digests[rel] = (content.hexdigest(), n)
        return rel, hasher.hexdigest() if hasher else None, todo

    def _judge_scans(self, plan: "_Plan", scans: list) -> int:
        """The findings of the file scans (hashes, CRC-32s, NaN/Inf counts); returns how
        many files had their content read."""
        from .scan import Finite, ZipCrc

        store, integrity, read = self.store, plan.integrity, 0
        for rel, digest, todo in scans:
            if digest is None and not todo and not plan.sealed and rel in plan.torch_files \
                    and rel not in self.digests:
                continue
            read += 1
            if plan.sealed and digest != self.manifest.files[rel].hash:
                damaged = self._damaged(rel, rel in plan.torch_files)
                self.add("HASH_MISMATCH", f"content hash differs from the manifest ({plan.algo})"
                         + damage_words(damaged), path=store.display(rel),
                         entry=damaged[0] if damaged and len(damaged) == 1 else None)
            if integrity and rel in integrity and digest != integrity[rel]:
                self.add("HASH_MISMATCH", "SHA-256 differs from the one Megatron's "
                         "integrity.json records", path=store.display(rel))
            for r, name in todo:
                if isinstance(r, ZipCrc) and r.bad:
                    self.add("CRC_MISMATCH", f"CRC-32 of zip record {r.bad[0]} differs from the "
                             f"one its writer recorded" + (f" (+{len(r.bad) - 1} more)"
                                                           if len(r.bad) > 1 else ""),
                             path=store.display(rel), entry=name)
                elif isinstance(r, Finite):
                    self._count(r.name, r.counts)
        return read

    def _judge_sides(self, sides: list) -> None:
        """The findings of what was decoded apart from the file scans (:meth:`_decode_side`)."""
        store = self.store
        for (kind, e, c), (counts, bad, err) in sides:
            if err is not None:
                self.add("MALFORMED_CHUNK" if err.code == "MALFORMED_METADATA"
                         else verify_code(err.code, "MALFORMED_CHUNK"), err.message,
                         path=err.path, entry=e.name)
            if bad:
                self.add("CRC_MISMATCH", f"CRC-32 of zip record {bad[0]} differs from the one "
                         "its writer recorded", path=store.display((c or e).extent.file)
                         if c else store.display(e.extent.file), entry=e.name)
            if counts:
                self._count(e.name, counts)

    def _report_content(self, plan: "_Plan") -> None:
        """What the pass proved about the bytes (``result.content``); with Megatron's
        ``integrity.json``, the files it lists that are missing or it does not list."""
        store, integrity = self.store, plan.integrity
        if plan.sealed:
            self.result.content = "hashes"
        elif integrity is not None:
            self.result.content = "integrity.json"
            for rel in sorted(set(integrity) - set(self.files)):
                self.add("MISSING_FILE", "listed in Megatron's integrity.json but missing",
                         path=store.display(rel))
            unlisted = [rel for rel in self._data_files() if rel not in integrity]
            if unlisted:
                self.add("MANIFEST_MISMATCH", "not listed in Megatron's integrity.json",
                         path=store.display(unlisted[0]))
        else:
            plain = [rel for rel in plan.files if rel not in plan.crc_files]
            plain += ["(decoded chunks)"] if plan.decoded else []
            self.result.content = ("crc" if not plain else "decoded-only" if not plan.crc_files
                                   else "crc+decoded-only")

    def _damaged(self, rel: str, torch_file: bool) -> list[str] | None:
        """After ``rel`` failed its content hash: the entries whose bytes are damaged, by
        the format's own checks, as an unsealed full verify runs them (the CRC-32 of every
        zip record of its DCP chunks and objects, of a torch.save file's records, zstd
        chunks decoded). A second read, of this file alone; None when nothing in it
        carries a checksum (safetensors, a file the format does not name)."""
        from ..formats.tensorio import zip_entries
        from ..model import Extent
        from .scan import ZipCrc, scan_file

        ck, where = self.ck, self.store.display(rel)
        regions, bad = [], []
        for e, ext in [(t, c.extent) for t in ck.tensors.values() for c in t.chunks] \
                + [(o, o.extent) for o in ck.objects.values() if o.extent is not None]:
            if ext.file == rel and ext.encoding == "torch_zip":
                entries = _or_none(zip_entries, ck, ext)
                if entries is None:  # its zip's directory is what no longer parses
                    bad.append(f"{e.name} (its zip directory)")
                else:
                    regions.append((ZipCrc(ext.offset, ext.offset + ext.length, entries,
                                           where), e.name))
        zstd = [(t, c) for t in ck.tensors.values() for c in t.chunks
                if c.extent.file == rel and c.extent.encoding == "torch_zip+zstd"]
        if torch_file:  # a whole torch.save zip: its records name no entry
            entries = _or_none(zip_entries, ck, Extent(rel, 0, self.files[rel]))
            if entries is not None:
                regions.append((ZipCrc(0, self.files[rel], entries, where), None))
        if not regions and not zstd and not bad:
            return None
        try:
            if regions:
                scan_file(self.store, rel, [r for r, _ in regions])
        except StorageError:
            raise
        except CkptError:  # a pack's chunk that no longer decodes: what was found so far
            return list(dict.fromkeys(bad)) or None
        bad += [x for r, name in regions if r.bad
                for x in ([name] if name else [f"zip record {b}" for b in r.bad])]
        bad += [t.name for t, c in zstd if _zstd_damaged(ck, t, c)]
        return list(dict.fromkeys(bad))

    def _count(self, name: str, counts: dict) -> None:
        if counts["nan"] or counts["inf"]:
            prev = self.result.non_finite.setdefault(name, {"nan": 0, "inf": 0})
            prev["nan"] += counts["nan"]
            prev["inf"] += counts["inf"]

    def _decode_side(self, kind, e, c):
        """Decode what the file scan cannot see: zstd chunks (streamed, CRC-checked when
        unsealed), torch.save tensors and views of larger storages (for NaN/Inf)."""
        from ..formats.tensorio import open_zstd_chunk, chunk_bytes
        from .scan import Finite, ZipCrc

        counts, bad = None, []
        finite = (self.check_finite and kind != "zstd-object" and e.dtype.is_floating
                  and e.dtype.bits % 8 == 0)
        try:
            if kind == "zstd":
                z = open_zstd_chunk(self.ck, e, c, crc=self.manifest is None)
                try:
                    f = Finite(0, z.nbytes, e.dtype, e.name) if finite else None
                    while block := z.read(4 << 20):
                        if f is not None:
                            f.feed(memoryview(block))
                        if self.on_bytes:
                            self.on_bytes(len(block))
                    z.finish()
                    bad = z.bad_records
                finally:
                    z.close()
                counts = f.counts if f is not None else None
            elif kind == "zstd-object":
                from ..formats.tensorio import decompress_bounded

                ext = e.extent
                blob = self.store.read_range(ext.file, ext.offset, ext.offset + ext.length)
                zipped = decompress_bounded(blob, self.store.display(ext.file), OBJECT_SCAN_LIMIT)
                from ..formats.torchzip import central_directory

                entries, _ = central_directory(zipped, len(zipped),
                                               where=self.store.display(ext.file))
                r = ZipCrc(0, len(zipped), entries, self.store.display(ext.file))
                r.feed(memoryview(zipped))
                r.finish(True)
                bad = r.bad
            elif kind == "zarr":  # an Orbax chunk: decoded whole (tensorstore)
                data = chunk_bytes(self.ck, e, c)
                if finite:
                    f = Finite(0, 0, e.dtype, e.name)
                    f.feed(memoryview(data))
                    counts = f.counts
                if self.on_bytes:
                    self.on_bytes(len(data))
            elif finite:
                f = Finite(0, 0, e.dtype, e.name)
                f.feed(memoryview(chunk_bytes(self.ck, e, c)))
                counts = f.counts
        except StorageError:
            raise
        except CkptError as err:
            return None, [], err
        return counts, bad, None


class _Plan:
    """One full pass's reads: this process's ``files``, how they are proven (``sealed``:
    against the manifest's ``algo`` hashes; ``sealing``: hashed for a seal; ``integrity``:
    Megatron's name -> SHA-256), each file's ``regions`` for the scan ((region, entry
    name)), the ``side`` jobs decoded apart from it ((kind, entry, chunk)), the files
    whose zip records' CRC-32s are checked, the tensors seen and the whole torch.save
    files."""

    def __init__(self, files: list[str], store, *, sealed: bool, sealing: bool,
                 algo: str | None, integrity: dict[str, str] | None):
        self.files, self.store, self.chosen = files, store, set(files)
        self.sealed, self.sealing, self.algo, self.integrity = sealed, sealing, algo, integrity
        self.regions: dict[str, list] = {rel: [] for rel in files}
        self.side: list = []  # (kind, entry, chunk): decoded apart from the file scan
        self.crc_files: set[str] = set()
        self.tensors_seen: set[str] = set()
        self.torch_files: set[str] = set()
        #: chunks decoded apart whose format carries no checksum ckptctl checks (Orbax)
        self.decoded = False
        self.group, self.sizes = None, {}

    def add_tensors(self, ck, check_finite: bool) -> None:
        """Each tensor chunk in the chosen files: its zip record's CRC-32 (unsealed), its
        NaN/Inf count (``check_finite``) in the scan where its bytes lie plain, else
        decoded apart (zstd, torch.save, a view of a larger storage)."""
        from ..formats.tensorio import locate_payload
        from .scan import Finite, ZipCrc

        sealed, regions, side = self.sealed, self.regions, self.side
        for t in ck.tensors.values():
            for c in t.chunks:
                ext = c.extent
                if ext.encoding == "zarr":  # Orbax: every chunk decoded (its key is no file)
                    if (not sealed or check_finite) and (
                            self.group is None or ext.file in self.chosen
                            or ext.file not in self.sizes):
                        side.append(("zarr", t, c))
                        self.tensors_seen.add(t.name)
                        self.decoded = True
                    continue
                if ext.file not in self.chosen:
                    continue
                self.tensors_seen.add(t.name)
                if ext.encoding == "torch_zip+zstd":
                    if not sealed or check_finite:
                        side.append(("zstd", t, c))
                    if not sealed:
                        self.crc_files.add(ext.file)
                    continue
                if ext.encoding == "torch_save":
                    if check_finite:
                        side.append(("torch", t, c))
                    continue
                if ext.encoding == "torch_zip":
                    p = _or_none(locate_payload, ck, ext)
                    if p is None:
                        continue
                    if not sealed:
                        regions[ext.file].append(
                            (ZipCrc(ext.offset, ext.offset + ext.length, list(p.entries),
                                    self.store.display(ext.file)), t.name))
                        self.crc_files.add(ext.file)
                    if check_finite and t.dtype.is_floating and t.dtype.bits % 8 == 0:
                        if p.stored.storage_numel == p.stored.numel:  # a permutation: same counts
                            regions[ext.file].append(
                                (Finite(p.offset, p.offset + p.length, t.dtype, t.name), t.name))
                        else:
                            side.append(("chunk", t, c))
                elif check_finite and t.dtype.is_floating and t.dtype.bits % 8 == 0:
                    regions[ext.file].append(
                        (Finite(ext.offset, ext.offset + ext.length, t.dtype, t.name), t.name))

    def add_objects(self, ck) -> None:
        """Each object entry in the chosen files, unsealed: its zip's CRC-32s (zstd ones
        decoded apart)."""
        from .scan import ZipCrc

        for o in ck.objects.values():
            ext = o.extent
            if self.sealed or ext is None or ext.file not in self.chosen:
                continue
            if ext.encoding == "torch_zip":
                from ..formats.tensorio import zip_entries

                entries = _or_none(zip_entries, ck, ext)
                if entries is None:
                    continue
                self.regions[ext.file].append(
                    (ZipCrc(ext.offset, ext.offset + ext.length, entries,
                            self.store.display(ext.file)), o.name))
            elif ext.encoding == "torch_zip+zstd":
                self.side.append(("zstd-object", o, None))

    def add_torch_files(self, ck, sizes: dict[str, int]) -> None:
        """The whole torch.save files (and DeepSpeed's rank files), unsealed: the CRC-32
        of every record of those that are zips (``sizes``: the files' sizes)."""
        torch_files = {c.extent.file for t in ck.tensors.values() for c in t.chunks
                       if c.extent.encoding == "torch_save"}
        torch_files |= {o.extent.file for o in ck.objects.values()
                        if o.extent is not None and o.extent.encoding == "torch_save"}
        torch_files |= set(ck.info.get("zip_files", ()))  # DeepSpeed's rank files
        self.torch_files = torch_files
        if not self.sealed and torch_files:
            from ..formats.tensorio import zip_entries
            from ..model import Extent
            from .scan import ZipCrc

            for rel in sorted(torch_files & self.chosen):
                entries = _or_none(zip_entries, ck, Extent(rel, 0, sizes[rel]))
                if entries is None:  # a legacy (non-zip) torch.save file: no CRCs to check
                    continue
                self.regions[rel].append(
                    (ZipCrc(0, sizes[rel], entries, self.store.display(rel)), None))
                self.crc_files.add(rel)

    def total(self, sizes: dict[str, int]) -> int:
        """The bytes the pass reads: every file read (``sizes``), zstd and zarr chunks
        decoded."""
        return (sum(sizes[rel] for rel in self.files
                    if self.sealed or self.sealing or self.regions[rel]
                    or rel not in self.torch_files)
                + sum(e.dtype.nbytes(c.numel) for kind, e, c in self.side
                      if kind in ("zstd", "zarr")))


def _zstd_damaged(ck, t, c) -> bool:
    """Does a zstd chunk fail to decode, or one of its zip records its CRC-32?"""
    from ..formats.tensorio import open_zstd_chunk

    try:
        z = open_zstd_chunk(ck, t, c, crc=True)
        try:
            while z.read(4 << 20):
                pass
            z.finish()
            return bool(z.bad_records)
        finally:
            z.close()
    except StorageError:
        raise
    except CkptError:
        return True


def damage_words(damaged: list[str] | None, shown: int = 3) -> str:
    """HASH_MISMATCH's tail: which entries the damaged bytes are in (``damaged``, from the
    format's own CRC-32s), or that every record still matches; "" when the file carries
    no checksum (None).

    >>> damage_words(["model.w"])
    '; the damaged bytes are in model.w (CRC-32 of its zip record)'
    >>> damage_words(["a", "b", "c", "d"])
    '; the damaged bytes are in a, b, c (+1 more) (CRC-32 of their zip records)'
    >>> damage_words(None), damage_words([])[:52]
    ('', '; the CRC-32 of every zip record in it still matches')
    """
    if damaged is None:
        return ""
    if not damaged:
        return ("; the CRC-32 of every zip record in it still matches: the damage is "
                "outside the entries' data (zip headers), or the manifest was changed")
    names = ", ".join(damaged[:shown]) + (f" (+{len(damaged) - shown} more)"
                                          if len(damaged) > shown else "")
    return (f"; the damaged bytes are in {names} (CRC-32 of "
            + ("its zip record)" if len(damaged) == 1 else "their zip records)"))


class _Both:
    """Two hashers fed the same bytes (a file's content hash for its manifest and the
    SHA-256 Megatron's ``integrity.json`` records)."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def update(self, data) -> None:
        self.a.update(data)
        self.b.update(data)

    def hexdigest(self) -> str:
        return self.a.hexdigest()


def _or_none(fn, *args):
    """``fn(*args)``, or None when it finds the input malformed: the structure level reports
    that; an I/O error still stops the command (exit 3)."""
    try:
        return fn(*args)
    except StorageError:
        raise
    except CkptError:
        return None
