"""Write PyTorch DCP checkpoints: one ``__<rank>_0.distcp`` file per rank, each chunk a
``torch.save`` zip, and ``.metadata`` (real torch classes, pickled) written last.

>>> w = DcpWriter(open_store("out/"))                       # doctest: +SKIP
>>> w.add_tensor_chunk(0, "model.w", "float32", (4, 2), (0, 0), (2, 2), blocks)  # doctest: +SKIP
>>> w.commit(planner_data)                                  # doctest: +SKIP
"""
from __future__ import annotations

import pickle
import sys
import threading
from dataclasses import dataclass, field
from typing import Iterable

from ..storage import HashingWriter, Store, digest_bytes
from .dcp import METADATA
from .torchwrite import TensorRef, TorchZipWriter, pickle_state


def _interned(x):
    """``x`` (dicts, lists, tuples of str and numbers) rebuilt with every string interned.

    >>> _interned({"a": ("b", 1)})
    {'a': ('b', 1)}
    """
    if isinstance(x, str):
        return sys.intern(x)
    if isinstance(x, dict):
        return {_interned(k): _interned(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_interned(v) for v in x)
    return x


def rank_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


@dataclass
class _Meta:
    tensors: dict = field(default_factory=dict)  # fqn -> (dtype, shape, [(offsets, sizes)])
    objects: set = field(default_factory=set)
    storage: dict = field(default_factory=dict)  # (fqn, offsets|None) -> (file, off, len)


class DcpWriter:
    """Collects what each rank file holds; ``commit`` writes ``.metadata``.

    Rank files are written by :meth:`write_rank`, each in one sequential stream (so S3
    gets one multipart upload per file); different ranks may be written in parallel.
    """

    def __init__(self, store: Store, *, algo: str = "xxh3-128", on_bytes=None, sink=None):
        self.store = store
        # where files are created: ``store`` itself, or anything with the same ``open`` and
        # ``write_atomic`` (ops.output.OutputDir: fsync, cleanup, cancellation)
        self.sink = sink if sink is not None else store
        self.meta = _Meta()
        self.algo = algo
        self.on_bytes = on_bytes
        self.hashes: dict[str, tuple[str, int]] = {}  # file -> (digest, size), for the manifest
        self._lock = threading.Lock()

    def write_rank(self, rank: int, items: Iterable[tuple]) -> int:
        """Write rank ``rank``'s file from ``items``: ``("tensor", fqn, dtype, shape,
        offsets, sizes, blocks)`` or ``("object", fqn, payload_bytes)``. Returns its size."""
        rel = rank_file(rank)
        with self.sink.open(rel, "wb") as f:
            out = HashingWriter(f, self.algo, self.on_bytes)
            for item in items:
                start = out.pos
                if item[0] == "tensor":
                    _, fqn, dtype, shape, offsets, sizes, blocks = item
                    zw = TorchZipWriter(out, pickle_state(TensorRef("0", dtype, tuple(sizes))))
                    zw.write_record("0", blocks)
                    zw.close()
                    key = (fqn, tuple(offsets))
                    with self._lock:
                        entry = self.meta.tensors.setdefault(fqn, (dtype, tuple(shape), []))
                        entry[2].append((tuple(offsets), tuple(sizes)))
                else:
                    _, fqn, payload = item
                    out.write(payload)
                    key = (fqn, None)
                    with self._lock:
                        self.meta.objects.add(fqn)
                with self._lock:
                    self.meta.storage[key] = (rel, start, out.pos - start)
        with self._lock:
            self.hashes[rel] = out.result()
        return out.pos

    def _save_id(self) -> str:
        """DCP's ``save_id``, derived from the data files' hashes (torch uses a random
        uuid; nothing reads it back but as an identifier of this save)."""
        data = "\n".join(f"{rel} {d} {n}" for rel, (d, n) in sorted(self.hashes.items())
                         if rel != METADATA)
        return digest_bytes(data.encode(), "xxh3-128")[:32]

    def commit(self, planner_data: dict | None = None) -> bytes:
        """Write ``.metadata`` (atomically): the DCP commit marker. Returns its bytes."""
        import torch
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (BytesStorageMetadata,
                                                           ChunkStorageMetadata, Metadata,
                                                           MetadataIndex, StorageMeta,
                                                           TensorProperties,
                                                           TensorStorageMetadata)

        # pickle shares repeated objects by identity: interned names give the same bytes
        # whether this process wrote every rank file or merged others' reports
        fqn_ = sys.intern
        sdm: dict = {}
        for fqn, (dtype, shape, chunks) in sorted(self.meta.tensors.items()):
            sdm[fqn_(fqn)] = TensorStorageMetadata(
                properties=TensorProperties(dtype=getattr(torch, dtype)), size=torch.Size(shape),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                        for o, s in sorted(chunks)])
        for fqn in sorted(self.meta.objects):
            sdm[fqn_(fqn)] = BytesStorageMetadata()
        storage = {}
        # sorted, and save_id from the data's hashes: the same output gives the same bytes
        # whichever threads or processes wrote which rank file, in whatever order
        for (fqn, offsets), (rel, off, length) in sorted(
                self.meta.storage.items(), key=lambda kv: (kv[0][0], kv[0][1] is not None,
                                                           kv[0][1] or ())):
            idx = MetadataIndex(fqn_(fqn), torch.Size(offsets) if offsets is not None else None)
            storage[idx] = _StorageInfo(fqn_(rel), off, length)
        md = Metadata(state_dict_metadata=sdm, planner_data=_interned(planner_data or {}),
                      storage_data=storage,
                      storage_meta=StorageMeta(checkpoint_id=None, save_id=self._save_id()),
                      version="1.0.0")
        data = pickle.dumps(md)
        self.sink.write_atomic(METADATA, data)
        self.hashes[METADATA] = (digest_bytes(data, self.algo), len(data))
        return data
