"""A torch DCP storage writer that seals the checkpoint as it saves it.

:class:`SealingWriter` is torch's ``FileSystemWriter`` (and, for a URL, its fsspec
writer) with every file hashed while DCP writes it: no byte is read back. Each rank
hashes its own files and hands the hashes to the coordinator inside the write results
DCP gathers; there, right after ``.metadata``, the ckptctl manifest is committed
(:func:`~ckptctl.ops.commit.commit`), the same one ``ckptctl seal`` would write.

>>> import torch, torch.distributed.checkpoint as dcp          # doctest: +SKIP
>>> dcp.save({"w": torch.ones(4)}, storage_writer=SealingWriter("ckpt/step-10"))  # doctest: +SKIP
>>> SealingWriter("s3://bucket/run/step-20", storage_options={"anon": False})      # doctest: +SKIP
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from ._deps import require_torch

require_torch("ckptctl.dcp")

from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.filesystem import FileSystem as LocalFileSystem  # noqa: E402
from torch.distributed.checkpoint.metadata import MetadataIndex  # noqa: E402
from torch.distributed.checkpoint.storage import WriteResult  # noqa: E402

from .errors import UsageError  # noqa: E402
from .formats.detect import open_checkpoint  # noqa: E402
from .formats.manifest import MANIFEST  # noqa: E402
from .ops.commit import commit, manifest_for  # noqa: E402
from .storage import HashingWriter, normalize_algo, open_store  # noqa: E402

#: The fqn prefix of the extra write results that carry one file's (digest, size) from
#: its rank to the coordinator; ``finish`` takes them out before ``.metadata`` is written.
HASH_TAG = "\x00ckptctl-file-hash:"


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


class SealingWriter(FileSystemWriter):
    """``FileSystemWriter`` that commits ``ckptctl.manifest.json`` right after DCP's
    ``.metadata``: the checkpoint is sealed when ``dcp.save`` returns (or an
    ``dcp.async_save`` future completes), with no second read of its files.

    ``path``: a folder, or an fsspec URL (``s3://``, ``memory://``...) with
    ``storage_options``. ``step`` (None: as ``ckptctl seal`` finds it: a ``step`` entry,
    else the folder's name), ``tags`` and ``hash`` are the manifest's. Other keyword
    arguments are ``FileSystemWriter``'s. A manifest (and ``.metadata``) already in the
    folder is removed before any data is written, so a save that fails leaves nothing
    that looks sealed.

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
        fut = super().write_data(plan, planner)  # a done future: torch wrote in this call
        prefix = plan.storage_data.prefix
        mine = [full for full in self.fs.hashes if self._rel(full).startswith(prefix)]
        fut.value().extend(
            WriteResult(index=MetadataIndex(HASH_TAG + self._rel(full)), size_in_bytes=size,
                        storage_data=digest)
            for full, (digest, size) in ((f, self.fs.hashes.pop(f)) for f in mine))
        return fut

    def finish(self, metadata, results) -> None:
        hashes = {}
        kept = []
        for rank_results in results:
            kept.append([r for r in rank_results if not _is_hash(r)])
            hashes.update({r.index.fqn[len(HASH_TAG):]: (r.storage_data, r.size_in_bytes)
                           for r in rank_results if _is_hash(r)})
        super().finish(metadata, kept)
        hashes[".metadata"] = self.fs.hashes.pop(self._full(".metadata"))
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


def _is_hash(r) -> bool:
    return isinstance(r.index.fqn, str) and r.index.fqn.startswith(HASH_TAG)
