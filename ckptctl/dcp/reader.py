"""A torch DCP storage reader over ckptctl's logical model: ``dcp.load`` straight from any
checkpoint ckptctl reads, at any mesh, with no conversion copy.

``read_metadata`` presents the logical tensors (global shape, dtype, the chunks that exist)
as DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata`; DCP's own load planner
decides which box of which chunk each rank needs; ``read_data`` reads only those byte
ranges (a chunk's rows, through :func:`~ckptctl.convert.copier.fill_rows`: straight ranged
reads where the rows are contiguous, a pack decoding only the blocks asked for) into the
destination tensors, on a thread pool.

Names: ``rename`` maps ckptctl's entry names onto the state dict's (a dict, a callable, a
TOML file of regex rules: :func:`rename_rules`), as does ``prefix=(old, new)``; a name
mapped to None is left out of the metadata. Safety: every
object entry the load could hand to torch goes through the safe-pickle scan
(:func:`~ckptctl.convert.copier.check_objects`) in ``read_metadata``, on every rank, before
any rank loads anything: DCP's planner unpickles bytes entries with ``weights_only=False``.
Integrity (``verify``, on by default): before any rank loads anything, each file the
ranks read from is checked once, by one of the ranks that read it (verdicts exchanged over
the default process group when it is DCP's, else each rank checks all it reads): hashed
whole against the manifest (a sealed source), or, unsealed, read through the checks its
format carries (every zip record's CRC-32, Megatron's ``integrity.json``,
zstd chunks decoded: :func:`~ckptctl.integrity.verify.check_and_hash`); a mismatch raises
:class:`~ckptctl.errors.Finding` (``HASH_MISMATCH``, ``CRC_MISMATCH``...), never loads.

>>> import torch.distributed.checkpoint as dcp                       # doctest: +SKIP
>>> from ckptctl.dcp import Reader                                   # doctest: +SKIP
>>> dcp.load(state_dict, storage_reader=Reader("s3://runs/ds/global_step100"))  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
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
from ..errors import Finding, UsageError
from ..formats.detect import locate, open_checkpoint
from ..formats.manifest import read_manifest
from ..formats.pack import pack_view
from ..formats.tensorio import byte_dtype, chunk_bytes
from ..model import Checkpoint, Chunk, TensorEntry
from ..storage import hash_file

#: Bytes one read of rows may stage before it is copied into its destination.
BLOCK = 32 << 20


def default_world_size() -> int:
    """Ranks in torch's default process group (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def assign_checks(needs: list[list[str]], sizes: dict[str, int]) -> list[list[str]]:
    """Each file to check given to one of the ranks that read it: files only one rank
    reads go to it; then the others, largest first, to the rank with the fewest bytes to
    check so far.

    >>> assign_checks([["a", "b"], ["b", "c"]], {"a": 5, "b": 9, "c": 1})
    [['a'], ['b', 'c']]
    """
    load = [0] * len(needs)
    mine: list[list[str]] = [[] for _ in needs]
    readers: dict[str, list[int]] = {}
    for rank, files in enumerate(needs):
        for f in files:
            readers.setdefault(f, []).append(rank)
    for f in sorted(readers, key=lambda f: (len(readers[f]) > 1, -sizes.get(f, 0), f)):
        rank = min(readers[f], key=lambda r: (load[r], r))
        mine[rank].append(f)
        load[rank] += sizes.get(f, 0)
    return [sorted(m) for m in mine]


Rename = Callable[[str], "str | None"] | Mapping[str, "str | None"]


def renamer(rename: Rename | str | os.PathLike | None = None,
            prefix: tuple[str, str] | None = None) -> Callable[[str], str | None]:
    """ckptctl name -> state dict name (None: leave the entry out), from a mapping, a
    callable, a rules file (:func:`rename_rules`) and/or ``prefix=(old, new)``: a name
    starting with ``old`` has it replaced by ``new`` (applied first).

    >>> f = renamer({"model.w": "w"}, prefix=("module.", "model."))
    >>> f("module.w"), f("module.b"), f("rng")
    ('w', 'model.b', 'rng')
    """
    if isinstance(rename, (str, os.PathLike)):
        rename = rename_rules(rename)

    def mapped(name: str) -> str | None:
        if prefix and name.startswith(prefix[0]):
            name = prefix[1] + name[len(prefix[0]):]
        if rename is None:
            return name
        if callable(rename):
            return rename(name)
        return rename.get(name, name)

    return mapped


def rename_rules(path: str | os.PathLike) -> Callable[[str], str | None]:
    """A TOML file of ``[[rename]]`` rules, each ``match`` (a regular expression over the
    whole name) and ``to`` (its replacement, ``\\1`` for groups) or ``drop = true``; the
    first rule that matches wins, a name no rule matches is kept. Refuses (exit 2) a file
    that is not such a list, or a pattern that does not compile.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp(), "names.toml")
    >>> _ = p.write_text("[[rename]]\\nmatch = 'model\\\\.decoder\\\\.(.*)'\\nto = 'model.\\\\1'\\n"
    ...                  "[[rename]]\\nmatch = 'rng.*'\\ndrop = true\\n")
    >>> f = rename_rules(p)
    >>> f("model.decoder.layers.0.w"), f("rng.cpu"), f("step")
    ('model.layers.0.w', None, 'step')
    """
    import re
    import tomllib

    try:
        doc = tomllib.loads(open(path, encoding="utf-8").read())
        rules = [(re.compile(r["match"]), None if r.get("drop") else r["to"])
                 for r in doc["rename"]]
    except (OSError, ValueError, KeyError, TypeError, re.error) as e:
        raise UsageError(f"{path}: not a rename rules file ([[rename]] with match and to, "
                         f"or drop = true): {e}") from None

    def mapped(name: str) -> str | None:
        for pattern, to in rules:
            if pattern.fullmatch(name):
                return None if to is None else pattern.sub(to, name)
        return name

    return mapped


class Reader(StorageReader):
    """``dcp.load(state_dict, storage_reader=Reader(url))`` from any checkpoint ckptctl reads.

    ``url``: a checkpoint (DCP, HF safetensors folder, torch.save file, DeepSpeed ZeRO or
    universal, Megatron, a ckptctl pack) on any place ckptctl reaches; ``storage_options``
    as for every verb. ``rename`` (a dict, a callable or a rules file) and ``prefix``:
    see :func:`renamer`. ``verify``: None (the
    default) checks each file a rank reads with what the source carries (its manifest's
    hashes, else its format's CRCs); True requires a manifest; False checks nothing.
    ``workers``: reads in flight per rank.

    >>> Reader("ckpt/step-100", prefix=("module.", "model."))        # doctest: +SKIP
    """

    def __init__(self, url: str | os.PathLike, storage_options: dict | None = None, *,
                 rename: Rename | str | os.PathLike | None = None,
                 prefix: tuple[str, str] | None = None, verify: bool | None = None,
                 workers: int = 8):
        super().__init__()
        self.url, self.opts = str(url), storage_options
        self.name_of = renamer(rename, prefix)
        self.verify, self.workers = verify, max(1, workers)
        self.ck: Checkpoint | None = None
        self.manifest = None
        self.chunks: dict[tuple[str, tuple[int, ...]], tuple[TensorEntry, Chunk]] = {}
        self.objects: dict[str, str] = {}
        self.lock = threading.Lock()
        #: tensor bytes read into destinations; bytes read to check files first
        self.bytes_read = self.bytes_checked = 0

    # -------------------------------------------------- the StorageReader protocol
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.url = str(checkpoint_id)
        self.ck, self.chunks, self.objects = None, {}, {}
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
        """Give each file to check to one rank among those that read it (the least loaded
        so far, largest files first); ranks exchange their verdicts in ``read_data``, so a
        file is read whole once, not once per rank that reads part of it. The exchange
        needs the default process group to be DCP's (the same ranks): otherwise each rank
        checks every file it reads."""
        if not self.checking():
            return plans
        needs = [self.files_of(p) for p in plans]
        shared = len(plans) > 1 and default_world_size() == len(plans)
        mine = assign_checks(needs, self.ck.files) if shared else needs
        return [dataclasses.replace(p, storage_data={"check": mine[i], "shared": shared})
                for i, p in enumerate(plans)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        """Read every item of this rank's plan into its destination: tensors ``workers`` at
        a time (each straight into its destination's memory where that is contiguous),
        objects handed to the planner from this thread (a planner need not be thread-safe
        for them; DCP's sets them into the state dict)."""
        items = sorted(plan.items, key=lambda r: r.storage_index.fqn)
        with ThreadPoolExecutor(self.workers) as pool:
            if self.checking():  # before anything loads
                self._check_before_loading(plan, pool)
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

    # -------------------------------------------------- checking
    def checking(self) -> bool:
        """Are files checked before they load (a manifest's hashes, else format CRCs)?"""
        self._open()
        return self.verify is not False and (self.manifest is not None or self.verify is None)

    def files_of(self, plan: LoadPlan) -> list[str]:
        """The files ``plan``'s items read from."""
        return sorted({self._file_of(r) for r in plan.items} - {None})

    def _check_before_loading(self, plan: LoadPlan, pool: ThreadPoolExecutor) -> None:
        """Check this rank's share of the files (all it reads, without a shared plan),
        exchange verdicts with the other ranks when the plan says so, and raise the first
        failure among the files this rank reads."""
        sd = plan.storage_data if isinstance(plan.storage_data, dict) else {}
        needed = self.files_of(plan)
        verdicts = self._verdicts(sd.get("check", needed), pool)
        if sd.get("shared"):
            import torch.distributed as dist

            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, verdicts)
            verdicts = {f: v for part in everyone for f, v in part.items()}
        for f in needed:
            if verdicts.get(f):
                code, where, message = verdicts[f]
                raise Finding(where, message, code=code)

    def _verdicts(self, files: list[str], pool: ThreadPoolExecutor) -> dict:
        """file -> None (good) or (code, where, message); never raises for a bad file, so
        every rank reaches the exchange."""
        out: dict = {}
        if not files:
            return out
        try:
            if self.manifest is not None:
                for f, err in zip(files, pool.map(self._check_file, files)):
                    out[f] = err
            else:
                out.update(self._check_format(files))
        except Exception as e:  # noqa: BLE001 - not one file's verdict (an I/O error...):
            # every file of the share fails, and every rank still reaches the exchange
            out.update({f: (getattr(e, "code", None) or "READ_ERROR", getattr(
                e, "path", None) or self.url, getattr(e, "message", None) or str(e))
                for f in files})
        return out

    def _check_format(self, files: list[str]) -> dict:
        """An unsealed source: ``files`` through the checks its format carries, as ``verify
        --level full`` runs them: file -> None or (code, where, message)."""
        from ..integrity.verify import check_and_hash

        r, _ = check_and_hash(self.url, self.opts, algo="xxh3-128", names=files,
                              workers=self.workers)
        self.bytes_checked += r.bytes_read
        shown = {self.ck.store.display(f): f for f in files}
        out: dict = dict.fromkeys(files)
        for p in r.problems:
            if p.severity != "error":
                continue
            hit = [shown[p.path]] if p.path in shown else files  # not one file's: all
            for f in hit:
                out[f] = out[f] or (p.code, p.path or self.url, f"{p.message}: nothing was "
                                    "loaded")
        return out

    def _check_file(self, rel: str) -> tuple | None:
        """Hash ``rel`` whole against the manifest: None, or (code, where, message)."""
        ck, man = self.ck, self.manifest
        rec = man.files.get(rel)
        where = ck.store.display(rel)
        if rec is None:
            return ("EXTRA_FILE", where, "not listed in the manifest: its bytes cannot be "
                    "checked")
        digest, n = hash_file(ck.store, rel, man.hash)
        with self.lock:
            self.bytes_checked += n
        if digest != rec.hash:
            return ("HASH_MISMATCH", where, f"content hash differs from the manifest "
                    f"({man.hash}): nothing was loaded from it")
        return None

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
