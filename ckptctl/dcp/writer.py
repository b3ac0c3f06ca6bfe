"""A torch DCP storage writer that seals the checkpoint as it saves it.

:class:`SealingWriter` is torch's ``FileSystemWriter`` (and, for a URL, its fsspec
writer) with every file hashed while DCP writes it: no byte is read back. Each rank
hashes its own files and hands the hashes to the coordinator inside the write results
DCP gathers; there, right after ``.metadata``, the ckptctl manifest is committed
(:func:`~ckptctl.writing.commit.commit`), the same one ``ckptctl seal`` would write.

Nothing ``seal`` would refuse is sealed: each rank scans the object entries it writes
with the safe-pickle scan ``seal`` and ``verify`` make
(:func:`~ckptctl.formats.tensorio.scan_object`) from the bytes in memory, and a refusal
travels to the coordinator like a hash; there the save is finished as torch finishes it
(``.metadata``: a checkpoint torch loads) but no manifest is written, and ``dcp.save``
raises (a Finding, ``UNSAFE_INPUT``, inside torch's ``CheckpointException``). Shard
files of an older save in the same folder that the new ``.metadata`` does not name
(``__3_0.distcp`` after a save on fewer ranks) are removed before the commit: they are
DCP's own files, of a checkpoint the new save replaced, and ``verify`` would call the
sealed folder's extra files a problem.

>>> import torch, torch.distributed.checkpoint as dcp          # doctest: +SKIP
>>> dcp.save({"w": torch.ones(4)}, storage_writer=SealingWriter("ckpt/step-10"))  # doctest: +SKIP
>>> SealingWriter("s3://bucket/run/step-20", storage_options={"anon": False})      # doctest: +SKIP
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from .._deps import require_torch

require_torch("ckptctl.dcp")

from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.filesystem import FileSystem as LocalFileSystem  # noqa: E402
from torch.distributed.checkpoint.metadata import MetadataIndex  # noqa: E402
from torch.distributed.checkpoint.planner import WriteItemType  # noqa: E402
from torch.distributed.checkpoint.storage import WriteResult  # noqa: E402

from ..errors import CkptError, Finding, UnsafeInputError, UsageError  # noqa: E402
from ..formats.detect import open_checkpoint  # noqa: E402
from ..formats.manifest import MANIFEST  # noqa: E402
from ..writing.commit import commit, manifest_for  # noqa: E402
from ..storage import HashingWriter, normalize_algo, open_store  # noqa: E402

#: The fqn prefix of the extra write results that carry one file's (digest, size) from
#: its rank to the coordinator; ``finish`` takes them out before ``.metadata`` is written.
HASH_TAG = "\x00ckptctl-file-hash:"
#: Likewise for an object entry the safe-pickle scan refused: its fqn, and why.
REFUSED_TAG = "\x00ckptctl-refused:"
#: The names DCP gives its shard files (``__{rank}_{n}.distcp``): the only files of an
#: older save a re-save removes.
_SHARD = re.compile(r"^__\d+_\d+\.distcp$")


#: A buffer at least this large is hashed on a helper thread while it is being written
#: (xxhash and the write both release the GIL), within the one ``write`` call: the
#: caller's buffer is only valid until it returns.
OVERLAP = 4 << 20
_pool: ThreadPoolExecutor | None = None


def _hash_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(4, thread_name_prefix="ckptctl-dcp-hash")
    return _pool


class HashingStream(HashingWriter):
    """The stream DCP writes one file through: hashed on the way, otherwise the file.

    >>> import io
    >>> s = HashingStream(io.BytesIO(), "sha256"); _ = s.write(b"abc" * (3 << 20)); s.tell()
    9437184
    >>> from ckptctl.storage import digest_bytes
    >>> s.result() == (digest_bytes(b"abc" * (3 << 20), "sha256"), 9437184)
    True
    """

    def write(self, b) -> int:
        n = memoryview(b).nbytes
        if n < OVERLAP:
            return super().write(b)
        hashed = _hash_pool().submit(self.h.update, b)
        try:
            self.f.write(b)
        finally:
            hashed.result()
        self.pos += n
        return n

    def tell(self) -> int:
        return self.f.tell()

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()  # for DCP's fsync; io.UnsupportedOperation on a remote file

    def close(self) -> None:
        self.f.close()


class HashingFileSystem:
    """A DCP ``FileSystem`` whose written files are hashed as they stream: ``hashes``
    maps each file closed whole (its full path) to ``(digest, size)``; a rename carries
    its hash along (``.metadata.tmp`` -> ``.metadata``).

    >>> from torch.distributed.checkpoint.filesystem import FileSystem
    >>> import tempfile; d = tempfile.mkdtemp()
    >>> fs = HashingFileSystem(FileSystem(), "sha256")
    >>> with fs.create_stream(d + "/f", "wb") as s: _ = s.write(b"abc")
    >>> fs.hashes[d + "/f"][0][:8], fs.hashes[d + "/f"][1]
    ('ba7816bf', 3)
    """

    def __init__(self, inner, algo: str):
        self.inner = inner
        self.algo = algo
        self.hashes: dict[str, tuple[str, int]] = {}

    def __getattr__(self, name):
        if name in ("inner", "algo", "hashes"):  # unpickling: not set yet
            raise AttributeError(name)
        return getattr(self.inner, name)

    @contextmanager
    def create_stream(self, path, mode: str):
        with self.inner.create_stream(path, mode) as raw:
            if "r" in mode or "+" in mode or "a" in mode:
                yield raw
                return
            stream = HashingStream(raw, self.algo)
            yield stream
        # only a file written to its end (no exception) gets a hash
        self.hashes[os.fspath(path)] = stream.result()

    def rename(self, path, new_path) -> None:
        self.inner.rename(path, new_path)
        got = self.hashes.pop(os.fspath(path), None)
        if got is not None:
            self.hashes[os.fspath(new_path)] = got


def refusal(fqn: str, data: bytes) -> str | None:
    """Why ``seal`` would refuse the object entry ``fqn`` whose ``torch.save`` bytes DCP
    writes are ``data`` (the scan of :func:`~ckptctl.formats.tensorio.scan_object`, on the
    bytes in memory), or None when it passes.

    >>> import io, torch
    >>> b = io.BytesIO(); torch.save({"lr": 0.1}, b); refusal("optim.x", b.getvalue()) is None
    True
    >>> b = io.BytesIO(); torch.save(os.system, b); refusal("optim.x", b.getvalue())
    "object entry 'optim.x' names posix.system (the safe loader refuses it)"
    """
    from types import SimpleNamespace

    from ..formats.tensorio import scan_object
    from ..model import Extent, ObjectEntry

    here = SimpleNamespace(store=SimpleNamespace(display=lambda rel: fqn))
    try:
        scan_object(here, ObjectEntry(fqn, Extent(fqn, 0, len(data), "torch_zip")),
                    zipped=data)
    except UnsafeInputError as e:
        what = f"names {e.global_name}" if getattr(e, "global_name", None) else e.message
        return f"object entry {fqn!r} {what} (the safe loader refuses it)"
    except CkptError as e:  # not a torch.save zip: what verify calls MALFORMED_CHUNK
        return f"object entry {fqn!r}: {e.message}"
    return None


class _Scanning:
    """The planner DCP resolves write items through, with every object entry it hands
    out scanned by :func:`refusal` (from DCP's writer threads); ``refused``: (fqn, why)."""

    def __init__(self, inner, refused: list[tuple[str, str]]):
        self._inner, self._refused = inner, refused

    def __getattr__(self, name):
        if name in ("_inner", "_refused"):  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self._inner, name)

    def resolve_data(self, item):
        data = self._inner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            why = refusal(item.index.fqn, data.getvalue())
            if why is not None:
                self._refused.append((item.index.fqn, why))
        return data


class SealingWriter(FileSystemWriter):
    """``FileSystemWriter`` that commits ``ckptctl.manifest.json`` right after DCP's
    ``.metadata``: the checkpoint is sealed when ``dcp.save`` returns (or an
    ``dcp.async_save`` future completes), with no second read of its files.

    ``path``: a folder, or an fsspec URL (``s3://``, ``memory://``...) with
    ``storage_options``. ``step`` (None: as ``ckptctl seal`` finds it: a ``step`` entry,
    else the folder's name), ``tags`` and ``hash`` are the manifest's. Other keyword
    arguments are ``FileSystemWriter``'s. A manifest (and ``.metadata``) already in the
    folder is removed before any data is written, so a save that fails leaves nothing
    that looks sealed. An object entry the safe loader refuses is never sealed (the save
    ends unsealed and raises); an older save's shard files the new one does not name
    are removed before the commit (see the module docstring).

    >>> import torch, torch.distributed.checkpoint as dcp          # doctest: +SKIP
    >>> w = SealingWriter("ckpt/step-10", tags=["nightly"])        # doctest: +SKIP
    >>> dcp.save({"w": torch.ones(4), "step": 10}, storage_writer=w)    # doctest: +SKIP
    >>> w.manifest_id                                              # doctest: +SKIP
    'xxh3-128:5c1f...'
    """

    def __init__(self, path, *, step: int | None = None, tags: list[str] | None = None,
                 hash: str = "xxh3-128", storage_options: dict | None = None, **kwargs):
        super().__init__(os.fspath(path), **kwargs)
        self.url = os.fspath(path)
        self.step = step
        self.tags = list(tags or [])
        self.storage_options = storage_options
        self.manifest_id: str | None = None
        self.fs = HashingFileSystem(self._inner_fs(self.url), normalize_algo(hash))
        self.path = self.fs.init_path(self.url) if "://" in self.url else self.path

    def _inner_fs(self, url: str):
        """torch's local FileSystem, or for a URL its fsspec one on ckptctl's filesystem
        (the same options, timeouts and retries as every ckptctl request)."""
        if "://" not in url:
            return LocalFileSystem()
        from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

        class OnStore(FileSystem):
            def init_path(inner, path, **kw):
                inner.fs = open_store(url, self.storage_options).fs
                return path

        return OnStore()

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self.url = os.fspath(checkpoint_id)
            self.fs = HashingFileSystem(self._inner_fs(self.url), self.fs.algo)
            self.path = self.fs.init_path(self.url) if "://" in self.url else self.path
        self.fs.hashes.clear()  # what a failed save before this one left
        self.manifest_id = None

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if not self.use_collectives:  # no coordinator sees every rank's files
            raise UsageError("SealingWriter needs dcp.save with use_collectives=True (one "
                             ".metadata and one manifest for all ranks)", self.url)

    def prepare_global_plan(self, plans):
        # the coordinator, before any rank writes: what said "committed" goes first
        store = open_store(self.url, self.storage_options)
        store.remove(MANIFEST)
        store.remove(".metadata")
        return super().prepare_global_plan(plans)

    def write_data(self, plan, planner):
        refused: list[tuple[str, str]] = []
        # a done future: torch wrote in this call
        fut = super().write_data(plan, _Scanning(planner, refused))
        prefix = plan.storage_data.prefix
        mine = [full for full in self.fs.hashes if self._rel(full).startswith(prefix)]
        fut.value().extend(
            WriteResult(index=MetadataIndex(HASH_TAG + self._rel(full)), size_in_bytes=size,
                        storage_data=digest)
            for full, (digest, size) in ((f, self.fs.hashes.pop(f)) for f in mine))
        fut.value().extend(WriteResult(index=MetadataIndex(REFUSED_TAG + fqn), size_in_bytes=0,
                                       storage_data=why) for fqn, why in sorted(refused))
        return fut

    def finish(self, metadata, results) -> None:
        hashes, refused = {}, []
        kept = []
        for rank_results in results:
            kept.append([r for r in rank_results if not _is_ours(r)])
            hashes.update({r.index.fqn[len(HASH_TAG):]: (r.storage_data, r.size_in_bytes)
                           for r in rank_results if _is_hash(r)})
            refused += [r.storage_data for r in rank_results if _is_ours(r, REFUSED_TAG)]
        super().finish(metadata, kept)
        hashes[".metadata"] = self.fs.hashes.pop(self._full(".metadata"))
        store = open_store(self.url, self.storage_options)
        _remove_stale_shards(store, hashes)
        if refused:
            more = f" (+{len(refused) - 1} more)" if len(refused) > 1 else ""
            raise Finding(self.url, f"saved, not sealed: {sorted(refused)[0]}{more}; "
                          "`ckptctl seal` refuses it too", code="UNSAFE_INPUT")
        self.manifest_id = self._commit(hashes)

    def _commit(self, hashes: dict[str, tuple[str, int]]) -> str:
        """Commit the manifest of the files DCP just wrote, as ``seal`` builds it (only
        ``.metadata``, and the step entry when no step is given, are read)."""
        store = open_store(self.url, self.storage_options)
        files = {rel: size for rel, (_, size) in hashes.items()}
        ck = open_checkpoint(self.url, self.storage_options, read_step=self.step is None,
                             located=(store, files, None))
        step = ck.step if self.step is None else self.step
        return commit(store, manifest_for(ck, hashes, algo=self.fs.algo, step=step,
                                          tags=self.tags))

    def _full(self, rel: str) -> str:
        return os.fspath(self.fs.concat_path(self.path, rel))

    def _rel(self, full: str) -> str:
        return full[len(os.fspath(self.path)):].lstrip("/")


def _is_ours(r, tag: str | None = None) -> bool:
    """Is write result ``r`` one of ours (``tag``: of that kind), not DCP's?"""
    fqn = r.index.fqn
    return isinstance(fqn, str) and (fqn.startswith(tag) if tag else
                                     fqn.startswith((HASH_TAG, REFUSED_TAG)))


def _is_hash(r) -> bool:
    return _is_ours(r, HASH_TAG)


def _remove_stale_shards(store, hashes: dict) -> list[str]:
    """Remove the shard files (DCP's own names, top level) that this save did not write
    (``hashes``: the files it wrote): an older save's, on more ranks or threads, which the
    new ``.metadata`` does not name. One listing; returns what went.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> for n in ("__0_0.distcp", "__3_0.distcp", "notes__1_0.distcp", "x.txt"):
    ...     _ = (d / n).write_bytes(b"x")
    >>> _remove_stale_shards(open_store(str(d)), {"__0_0.distcp": ("h", 1)})
    ['__3_0.distcp']
    """
    stale = sorted(rel for rel in store.list_files(recursive=False)
                   if _SHARD.match(rel) and rel not in hashes)
    if stale:
        store.remove_many(stale)
    return stale
