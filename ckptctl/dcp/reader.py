"""A torch DCP storage reader over ckptctl's logical model: ``dcp.load`` straight from any
checkpoint ckptctl reads, at any mesh, with no conversion copy.

``read_metadata`` presents the logical tensors (global shape, dtype, the chunks that exist)
as DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata`; DCP's own load planner
decides which box of which chunk each rank needs; ``read_data`` reads only those byte
ranges (a chunk's rows, through :func:`~ckptctl.convert.copier.fill_rows`: straight ranged
reads where the rows are contiguous, a pack decoding only the blocks asked for) into the
destination tensors, on a thread pool.

Names: ``rename`` maps ckptctl's entry names onto the state dict's (a dict, a callable, or
``prefix=(old, new)``); a name mapped to None is left out of the metadata. Safety: every
object entry the load could hand to torch goes through the safe-pickle scan
(:func:`~ckptctl.convert.copier.check_objects`) in ``read_metadata``, on every rank, before
any rank loads anything: DCP's planner unpickles bytes entries with ``weights_only=False``.
Integrity (``verify``, on by default): before a rank loads anything, each file it reads
from is hashed whole against the manifest (a sealed source), or, unsealed, read through
the checks its format carries (every zip record's CRC-32, Megatron's ``integrity.json``,
zstd chunks decoded: :func:`~ckptctl.integrity.verify.check_and_hash`); a mismatch raises
:class:`~ckptctl.errors.Finding` (``HASH_MISMATCH``, ``CRC_MISMATCH``...), never loads.

>>> import torch.distributed.checkpoint as dcp                       # doctest: +SKIP
>>> from ckptctl.dcp import Reader                                   # doctest: +SKIP
>>> dcp.load(state_dict, storage_reader=Reader("s3://runs/ds/global_step100"))  # doctest: +SKIP
"""
from __future__ import annotations

import io
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Mapping

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from ..convert.copier import check_objects, fill_rows, object_payload, row_ranges
from ..convert.planner import Piece, TargetChunk
from ..errors import Finding, ProblemCode, UsageError
from ..formats.detect import locate, open_checkpoint
from ..formats.manifest import read_manifest
from ..formats.pack import pack_view
from ..formats.tensorio import byte_dtype, chunk_bytes
from ..model import Checkpoint, Chunk, TensorEntry
from ..storage import hash_file

#: Bytes one read of rows may stage before it is copied into its destination.
BLOCK = 32 << 20

Rename = Callable[[str], "str | None"] | Mapping[str, "str | None"]


def renamer(rename: Rename | None = None, prefix: tuple[str, str] | None = None
            ) -> Callable[[str], str | None]:
    """ckptctl name -> state dict name (None: leave the entry out), from a mapping, a
    callable and/or ``prefix=(old, new)``: a name starting with ``old`` has it replaced by
    ``new`` (applied first).

    >>> f = renamer({"model.w": "w"}, prefix=("module.", "model."))
    >>> f("module.w"), f("module.b"), f("rng")
    ('w', 'model.b', 'rng')
    """
    def mapped(name: str) -> str | None:
        if prefix and name.startswith(prefix[0]):
            name = prefix[1] + name[len(prefix[0]):]
        if rename is None:
            return name
        if callable(rename):
            return rename(name)
        return rename.get(name, name)

    return mapped


class Reader(StorageReader):
    """``dcp.load(state_dict, storage_reader=Reader(url))`` from any checkpoint ckptctl reads.

    ``url``: a checkpoint (DCP, HF safetensors folder, torch.save file, DeepSpeed ZeRO or
    universal, Megatron, a ckptctl pack) on any place ckptctl reaches; ``storage_options``
    as for every verb. ``rename``/``prefix``: see :func:`renamer`. ``verify``: None (the
    default) checks each file a rank reads with what the source carries (its manifest's
    hashes, else its format's CRCs); True requires a manifest; False checks nothing.
    ``workers``: reads in flight per rank.

    >>> Reader("ckpt/step-100", prefix=("module.", "model."))        # doctest: +SKIP
    """

    def __init__(self, url: str | os.PathLike, storage_options: dict | None = None, *,
                 rename: Rename | None = None, prefix: tuple[str, str] | None = None,
                 verify: bool | None = None, workers: int = 8):
        super().__init__()
        self.url, self.opts = str(url), storage_options
        self.name_of = renamer(rename, prefix)
        self.verify, self.workers = verify, max(1, workers)
        self.ck: Checkpoint | None = None
        self.manifest = None
        self.chunks: dict[tuple[str, tuple[int, ...]], tuple[TensorEntry, Chunk]] = {}
        self.objects: dict[str, str] = {}
        self.verified: dict[str, Future] = {}
        self.lock = threading.Lock()
        #: tensor bytes read into destinations; bytes read to check files first
        self.bytes_read = self.bytes_checked = 0

    # -------------------------------------------------- the StorageReader protocol
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.url = str(checkpoint_id)
        self.ck, self.chunks, self.objects, self.verified = None, {}, {}, {}
        self.bytes_read = self.bytes_checked = 0

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP would retry it per rank
        """The logical tensors and objects, renamed; refuses (``UNSAFE_INPUT``) an object
        entry the safe loader refuses before anything is loaded."""
        ck = self._open()
        state: dict = {}
        self.chunks, self.objects = {}, {}
        for name, t in ck.tensors.items():
            fqn = self.name_of(name)
            if fqn is None:
                continue
            self._claim(state, fqn, name)
            state[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=getattr(torch, t.dtype.name)), torch.Size(t.shape),
                [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
                 for c in t.chunks])
            for c in t.chunks:
                self.chunks[fqn, tuple(c.offsets)] = (t, c)
        for name in ck.objects:
            fqn = self.name_of(name)
            if fqn is None:
                continue
            self._claim(state, fqn, name)
            state[fqn] = BytesStorageMetadata()
            self.objects[fqn] = name
        check_objects(ck, list(self.objects.values()), workers=self.workers)
        return Metadata(state_dict_metadata=state)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args,
                              **kwargs) -> None:
        if self.ck is None:  # a reader given metadata read elsewhere
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        """Read every item of this rank's plan into its destination: tensors ``workers`` at
        a time (each straight into its destination's memory where that is contiguous),
        objects handed to the planner from this thread (a planner need not be thread-safe
        for them; DCP's sets them into the state dict)."""
        items = sorted(plan.items, key=lambda r: r.storage_index.fqn)
        with ThreadPoolExecutor(self.workers) as pool:
            files = sorted({self._file_of(r) for r in items} - {None})
            if self.verify is not False and self.manifest is not None:
                list(pool.map(self._check_file, files))  # before anything loads
            elif self.verify is None and files:
                self._check_format(files)
            tensors = [r for r in items if r.type != LoadItemType.BYTE_IO]
            for f in [pool.submit(self._read_tensor, r, planner) for r in tensors]:
                f.result()
        for r in items:
            if r.type == LoadItemType.BYTE_IO:
                name = self.objects[r.storage_index.fqn]
                planner.load_bytes(r, io.BytesIO(object_payload(self.ck, name)))
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    # -------------------------------------------------- reading
    def _open(self) -> Checkpoint:
        if self.ck is None:
            located = pack_view(locate(self.url, self.opts), self.opts)
            self.ck = open_checkpoint(self.url, self.opts, located=located)
            self.manifest = read_manifest(*located)
            if self.verify and self.manifest is None:
                raise UsageError(f"{self.url}: verify=True needs a sealed checkpoint "
                                 "(`ckptctl seal` it, or pass verify=False)")
        return self.ck

    def _claim(self, state: dict, fqn: str, name: str) -> None:
        if fqn in state:
            raise UsageError(f"{self.url}: two entries are renamed to {fqn!r} ({name!r} is "
                             "one): a rename must keep names apart")

    def _file_of(self, req: ReadItem) -> str | None:
        """The file ``req``'s bytes live in (None: an object held in memory)."""
        if req.type == LoadItemType.BYTE_IO:
            ext = self.ck.objects[self.objects[req.storage_index.fqn]].extent
            return ext.file if ext is not None else None
        return self.chunks[req.storage_index.fqn, tuple(req.storage_index.offset)][1].extent.file

    def _read_tensor(self, req: ReadItem, planner: LoadPlanner) -> None:
        t, c = self.chunks[req.storage_index.fqn, tuple(req.storage_index.offset)]
        dest = planner.resolve_tensor(req).detach()
        self._fill(self.ck, t, c, req, dest)
        planner.commit_tensor(req, dest)

    def _fill(self, ck: Checkpoint, t: TensorEntry, c: Chunk, req: ReadItem,
              dest: torch.Tensor) -> None:
        """The box ``req`` names of chunk ``c``, into ``dest``, in blocks of rows."""
        lengths = tuple(int(x) for x in req.lengths)
        dtype = getattr(torch, t.dtype.name)
        if not lengths or t.dtype.bits % 8:  # 0-dim, or sub-byte: the whole chunk
            raw = bytes(chunk_bytes(ck, t, c))
            src = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(c.sizes)
            dest.copy_(src[tuple(slice(o, o + n) for o, n in
                                 zip(req.storage_offsets, lengths))])
            return
        if 0 in lengths:
            return
        tc = TargetChunk(t.name, t.dtype, 0, tuple(int(x) for x in req.dest_offsets), lengths,
                         (Piece(c, tuple(int(x) for x in req.storage_offsets),
                                (0,) * len(lengths), lengths),))
        inner = int(np.prod(lengths[1:], dtype=np.int64))
        row = max(1, t.dtype.nbytes(max(inner, 1)))
        direct = dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == dtype
        for r0, r1 in row_ranges(lengths[0], row_bytes=row, budget=BLOCK):
            if direct:  # read straight into the destination's own memory
                into = dest[r0:r1].view(torch.uint8).numpy().view(byte_dtype(t.dtype))
                fill_rows(ck, tc, r0, r1, into.reshape(r1 - r0, *lengths[1:]))
            else:  # a strided or non-CPU destination: staged, then copied
                rows = fill_rows(ck, tc, r0, r1)
                src = torch.frombuffer(memoryview(rows.reshape(-1).view(np.uint8)),
                                       dtype=dtype).reshape(r1 - r0, *lengths[1:])
                dest[r0:r1].copy_(src)
            with self.lock:
                self.bytes_read += t.dtype.nbytes((r1 - r0) * inner)

    def _check_format(self, files: list[str]) -> None:
        """An unsealed source: ``files`` through the checks its format carries, as ``verify
        --level full`` runs them; the first error raises."""
        from ..integrity.verify import check_and_hash

        r, _ = check_and_hash(self.url, self.opts, algo="xxh3-128", names=files,
                              workers=self.workers)
        self.bytes_checked += r.bytes_read
        errors = [p for p in r.problems if p.severity == "error"]
        if errors:
            p = errors[0]
            raise Finding(p.path or self.url, f"{p.message}: nothing was loaded",
                          code=p.code)

    def _check_file(self, rel: str) -> None:
        """Hash ``rel`` whole against the manifest, once per reader (the first item that
        needs it hashes; the others wait for the same answer)."""
        with self.lock:
            fut = self.verified.get(rel)
            mine = fut is None
            if mine:
                fut = self.verified[rel] = Future()
        if mine:
            try:
                fut.set_result(self._hash_matches(rel))
            except BaseException as e:  # noqa: BLE001 - handed to every waiter
                fut.set_exception(e)
        fut.result()

    def _hash_matches(self, rel: str) -> None:
        ck, man = self.ck, self.manifest
        rec = man.files.get(rel)
        where = ck.store.display(rel)
        if rec is None:
            raise Finding(where, "not listed in the manifest: its bytes cannot be checked",
                          code=ProblemCode.EXTRA_FILE)
        digest, n = hash_file(ck.store, rel, man.hash)
        with self.lock:
            self.bytes_checked += n
        if digest != rec.hash:
            raise Finding(where, f"content hash differs from the manifest "
                          f"({man.hash}): nothing was loaded from it",
                          code=ProblemCode.HASH_MISMATCH)
