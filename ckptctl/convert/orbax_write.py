"""``consolidate --to orbax``: a single-host Orbax PyTree checkpoint (OCDBT + zarr3) from any
checkpoint ckptctl reads, which ``orbax.checkpoint.StandardCheckpointer().restore(DST)``
(orbax-checkpoint 0.12) restores with the same values, bit for bit: the PyTorch -> JAX path.
Written with tensorstore only (``pip install 'ckptctl[orbax]'``); JAX and Orbax are never
imported.

What is written (what orbax 0.12.8's restore reads; see ``formats/orbax.py`` for the layout):

- one OCDBT database at DST's root (``manifest.ocdbt`` + ``d/<hash>``) holding one zarr3
  array per tensor under its dotted name (``NAME/zarr.json``, ``NAME/c/<i>/0/...``), each
  zarr chunk one ``sharding_indexed`` shard (inner chunk = the shard, zstd level 3, a crc32c
  on the shard index), as Orbax writes them; chunks split dim 0 so that one chunk stays
  within a slice of ``--max-memory``;
- ``_METADATA``: the PyTree: each dotted name split at its dots into nested **dict keys**
  (``model.layers.0.weight`` -> ``{"model": {"layers": {"0": {"weight": ...}}}}``; a numeric
  segment stays a string key, never a list index: a list would need every index present
  and the restore to agree on what a gap means), ``use_ocdbt``/``use_zarr3`` true,
  ``store_array_data_equal_to_fill_value`` true; tensors are ``np.ndarray`` leaves (restored
  as host numpy arrays, no save-time sharding), Python ``int``/``float`` objects ``scalar``
  leaves (int64 / float64), ``bool`` a 0-d bool array, ``None`` a ``None`` leaf; any other
  object is refused by name;
- ``_CHECKPOINT_METADATA`` (a bare ``PyTreeCheckpointHandler`` checkpoint, commit time set)
  and ``commit_success.txt``.

Commit: everything goes into ``<DST>.orbax-checkpoint-tmp`` (Orbax's own temporary name:
both Orbax and ckptctl read it as a save in flight), under ckptctl's writing marker; data
first (tensorstore fsyncs its files), then ``_METADATA`` and ``_CHECKPOINT_METADATA``, then
``commit_success.txt``; then the folder is renamed to DST (``--force``: the old checkpoint
there is removed just before, commit markers first) and the manifest is written last.
A run that fails or is killed leaves at most the temporary folder, never something that
looks committed.

>>> tree_keys(["model.w", "model.layers.0.b", "step"])["model.layers.0.b"]
('model', 'layers', '0', 'b')
>>> tree_keys(["a", "a.b"])
Traceback (most recent call last):
ckptctl.errors.UsageError: a: a leaf of the Orbax PyTree, and also a subtree (a.b): an entry cannot be both
>>> chunk_rows((1000, 256), 4, 64 << 10), chunk_rows((), 4, 1), chunk_rows((0, 3), 2, 8)
(64, 1, 1)
"""
from __future__ import annotations

import itertools
import json
import os
import posixpath
import shutil
import time
from collections import deque

from .._deps import MissingDependencyError
from ..errors import UsageError
from ..formats.orbax import COMMIT_FILE, ITEM_METADATA, STEP_METADATA, TMP_SUFFIX
from ..model import DTYPES, Checkpoint
from ..storage import open_store
from ..storage.hashing import hash_file
from ..storage.localio import sync_dir
from ..writing.commit import commit_written
from ..writing.output import OutputDir, overlaps
from .copier import decode_object

ORBAX_WRITE_HINT = "needs tensorstore to write Orbax checkpoints: pip install 'ckptctl[orbax]'"
#: The handler orbax records for a bare PyTree checkpoint (what its zarr3 saves name)
HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
#: largest zarr chunk (one OCDBT value), whatever ``--max-memory`` allows
MAX_CHUNK_BYTES = 128 << 20
_KEY_TYPE_DICT = 2  # orbax ``KeyType.DICT``
_INT64 = (-(1 << 63), (1 << 63) - 1)
#: the dtypes written as zarr3 ``data_type`` (tensorstore's names, the model's too): what
#: ``formats/orbax.py`` reads back; any other is refused by name
ZARR3_TYPES = frozenset({
    "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"})


def check_tensorstore(what: str = "consolidate --to orbax") -> None:
    """Raise :class:`MissingDependencyError` (exit 3) now if tensorstore is missing,
    before a byte is read or written (without importing it)."""
    import importlib.util

    try:
        missing = importlib.util.find_spec("tensorstore") is None
    except (ImportError, ValueError):
        missing = True
    if missing:
        raise MissingDependencyError(what, ORBAX_WRITE_HINT)


def tree_keys(names: list[str]) -> dict[str, tuple[str, ...]]:
    """Each dotted output name's PyTree key path (split at its dots, every segment a dict
    key); a name that cannot be one leaf of a tree of dicts is refused by name: an empty
    segment, a path separator, or a leaf that is also another's subtree."""
    keys: dict[str, tuple[str, ...]] = {}
    for n in names:
        parts = tuple(n.split("."))
        if not all(parts) or any(c in n for c in "/\\\x00"):
            raise UsageError(f"{n}: not a name an Orbax PyTree can hold (an empty segment "
                             "between dots, or a path separator); rename it with "
                             "--strip-prefix or leave it out with --drop")
        keys[n] = parts
    ordered = sorted(names)
    for a, b in itertools.pairwise(ordered):  # a prefix sorts right before its subtree
        if b.startswith(a + "."):
            raise UsageError(f"{a}: a leaf of the Orbax PyTree, and also a subtree ({b}): "
                             "an entry cannot be both")
    # "a" < "a-b" < "a.b": a subtree need not follow its leaf at once; check every prefix
    leaves = set(names)
    for n, parts in keys.items():
        for i in range(1, len(parts)):
            head = ".".join(parts[:i])
            if head in leaves:
                raise UsageError(f"{head}: a leaf of the Orbax PyTree, and also a subtree "
                                 f"({n}): an entry cannot be both")
    return keys


def chunk_rows(shape: tuple, itemsize: int, target: int) -> int:
    """Rows of dim 0 in one zarr chunk: whole rows, about ``target`` bytes (at least one
    row, at most all)."""
    if not shape:
        return 1
    row = itemsize
    for d in shape[1:]:
        row *= d
    return max(1, min(shape[0], target // max(1, row)))


def _scalar(name: str, value):
    """(zarr data type, value_type, 0-d value) of an object entry orbax can restore, else a
    usage error naming it."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool", "np.ndarray", value
    if isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            raise UsageError(f"{name}: the int {value} does not fit int64, which an Orbax "
                             "scalar is; leave it out with --drop")
        return "int64", "scalar", value
    if isinstance(value, float):
        return "float64", "scalar", value
    raise UsageError(f"{name}: a {type(value).__name__} object: an Orbax checkpoint holds "
                     "arrays, Python int/float scalars and None only; leave it out with "
                     f"--drop {name!r} (or --only model)")


def _zarr3_metadata(shape: tuple, dtype: str, rows: int) -> dict:
    """Orbax's zarr3 array metadata: one ``sharding_indexed`` shard per chunk."""
    chunk = [max(1, rows)] + [max(1, d) for d in shape[1:]] if shape else []
    inner = {"name": "bytes"} if DTYPES[dtype].bits <= 8 else \
        {"name": "bytes", "configuration": {"endian": "little"}}
    return {"shape": list(shape), "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            "chunk_key_encoding": {"name": "default"}, "fill_value": _fill(dtype),
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": chunk,
                "codecs": [inner, {"name": "zstd", "configuration": {"level": 3,
                                                                     "checksum": False}}],
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                 {"name": "crc32c"}]}}]}


def _fill(dtype: str):
    """The zarr3 ``fill_value`` of a data type (0 of its kind, as Orbax writes)."""
    d = DTYPES[dtype]
    if d.name == "bool":
        return False
    if d.name.startswith("complex"):
        return [0.0, 0.0]
    return 0.0 if d.kind in ("float", "float8") else 0


def _ts():
    try:
        import tensorstore
    except ImportError as e:
        if (e.name or "").split(".")[0] != "tensorstore":
            raise
        raise MissingDependencyError("consolidate --to orbax", ORBAX_WRITE_HINT) from None
    return tensorstore


class _Arrays:
    """The zarr3 arrays of one OCDBT database being written, chunk writes in flight
    bounded to ``budget`` bytes."""

    def __init__(self, root: str, budget: int, workers: int):
        self.ts = _ts()
        self.ctx = self.ts.Context({"cache_pool": {"total_bytes_limit": 0},
                                    "data_copy_concurrency": {"limit": max(1, workers)}})
        self.root = root
        self.kv = {"driver": "ocdbt", "base": f"file://{root.rstrip('/')}/"}
        self.budget, self.inflight, self.held = budget, deque(), 0

    def create(self, name: str, meta: dict):
        spec = {"driver": "zarr3", "kvstore": {**self.kv, "path": f"{name}/"},
                "metadata": meta, "create": True, "store_data_equal_to_fill_value": True}
        try:
            return self.ts.open(spec, context=self.ctx).result()
        except Exception as e:  # noqa: BLE001 - tensorstore raises ValueError & co
            raise _failed(self.root, name, e) from None

    def np_dtype(self, dtype: str):
        return self.ts.dtype(dtype).numpy_dtype

    def write(self, handle, region, array) -> None:
        """Start writing ``array`` at ``region``; wait for older writes past the budget."""
        fut = handle[region].write(array) if region is not None else handle.write(array)
        self.inflight.append((fut, array.nbytes, handle))
        self.held += array.nbytes
        while self.inflight and self.held > self.budget:
            self._wait_one()

    def _wait_one(self) -> None:
        fut, n, _ = self.inflight.popleft()
        try:
            fut.result()
        except Exception as e:  # noqa: BLE001
            raise _failed(self.root, "a chunk", e) from None
        self.held -= n

    def abandon(self) -> None:
        """Wait for the writes in flight, whatever their outcome (the run is failing)."""
        while self.inflight:
            fut = self.inflight.popleft()[0]
            try:
                fut.result()
            except Exception:  # noqa: BLE001, S110 - the error ending the run matters
                pass
        self.held = 0

    def drain(self) -> None:
        while self.inflight:
            self._wait_one()


def _failed(root: str, what: str, e: Exception):
    """A tensorstore failure as one line: a storage error in words where it carries an
    ``OSError``'s text (a full disk), else its first line."""
    from ..errors import StorageError

    full = str(e)
    text = (full.splitlines() or [type(e).__name__])[0][:300]
    if "No space left" in full or "ENOSPC" in full:
        text = "no space left on device"
    return StorageError(root, f"writing {what}: {text}")


def _write_tensor(arrays: _Arrays, stream, name: str, out: str, dtype: str, shape: tuple,
                  target: int, on_bytes) -> None:
    """Stream one tensor's row-major blocks into zarr3 chunks of whole rows."""
    import numpy as np

    d = DTYPES[dtype]
    rows = chunk_rows(shape, d.nbytes(1), target)
    h = arrays.create(out, _zarr3_metadata(shape, dtype, rows))
    npd = arrays.np_dtype(dtype)
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        for _ in stream.blocks(name):
            pass
        return
    row_elems = numel // shape[0] if shape else 1
    total_rows = shape[0] if shape else 1
    r0, buf, filled = 0, None, 0
    for block in stream.blocks(name):
        mv = memoryview(block).cast("B")
        pos = 0
        while pos < len(mv):
            if buf is None:
                n_rows = min(rows, total_rows - r0)
                buf = np.empty(n_rows * row_elems, dtype=npd)
                raw, filled = buf.view(np.uint8), 0
            take = min(len(mv) - pos, raw.nbytes - filled)
            raw[filled:filled + take] = np.frombuffer(mv[pos:pos + take], dtype=np.uint8)
            filled += take
            pos += take
            if filled == raw.nbytes:
                n_rows = raw.nbytes // (row_elems * buf.itemsize)
                region = np.s_[r0:r0 + n_rows] if shape else None
                arrays.write(h, region, buf.reshape((n_rows, *shape[1:]) if shape else ()))
                if on_bytes:
                    on_bytes(raw.nbytes)
                r0 += n_rows
                buf = None
    if buf is not None or r0 != total_rows:
        raise RuntimeError(f"{name}: the source gave {r0} of {total_rows} rows")


def write_orbax(ck: Checkpoint, dst: str, *, tensors: list[str], objects: list[str],
                renamed: dict[str, str], io, opts, force: bool, max_memory: int,
                workers: int = 4, on_bytes=None) -> tuple[dict[str, tuple[str, int]], str]:
    """Write the selected entries of ``ck`` as an Orbax checkpoint at ``dst`` (a local
    folder; see the module docstring); (file hashes, manifest id). ``io``: the
    consolidation's tensor streams (``--dtype`` casts included); ``renamed``: each entry's
    output name (``--strip-prefix``)."""
    check_tensorstore()
    keys = tree_keys([renamed[n] for n in tensors + objects])
    for n in tensors:
        if io.out_dtype(n) not in ZARR3_TYPES:
            raise UsageError(f"{n}: dtype {io.out_dtype(n)} has no zarr3 data type an Orbax "
                             "checkpoint holds; leave it out with --drop, or cast it with "
                             "--dtype")
    values = {n: _scalar(n, decode_object(ck, n)) for n in objects}  # before a byte is written
    store = open_store(dst, opts)
    if not store.is_local:
        raise UsageError(f"{dst}: --to orbax writes a local folder (tensorstore writes it "
                         "in place); write it locally, then copy it (ckptctl promote)")
    final = store.full().rstrip("/")
    if overlaps(store, None, ck.root):
        raise UsageError(f"destination {dst} overlaps the source {ck.root}; choose another "
                         "place")
    old = store.list_files() if store.exists() else {}
    if old:
        from ..catalog.ownership import why_not_replace

        why = why_not_replace(store, old)
        if not force or why is not None:
            raise UsageError(f"destination {store.url} is not empty"
                             + (f" and {why}; choose a new place" if why else
                                "; choose a new place or pass --force to replace it"))
    tmp = final + TMP_SUFFIX
    od = OutputDir(open_store(tmp, opts), command="consolidate --to orbax", force=force,
                   source=ck.root)
    target = max(1 << 20, min(MAX_CHUNK_BYTES, max_memory // 8))
    entered = False
    try:
        with od:
            entered = True
            _write_item(ck, od, tmp, final, tensors, objects, renamed, keys, values, io,
                        target, max(target, max_memory // 4), workers, on_bytes)
            if old:  # --force: the old checkpoint goes, its commit markers first
                from ..writing.removal import remove_checkpoint

                remove_checkpoint(store, old)
            if os.path.isdir(final) and not os.listdir(final):
                os.rmdir(final)
            os.rename(tmp, final)
            sync_dir(posixpath.dirname(final) or ".")
    except BaseException:
        if entered and os.path.isdir(tmp):  # what tensorstore wrote there is ours too
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        files = store.list_files()
        hashes = {rel: hash_file(store, rel) for rel in files}
        return hashes, commit_written(store, hashes, step=ck.step)
    except BaseException:
        from ..writing.removal import remove_checkpoint

        remove_checkpoint(store)
        raise


def _write_item(ck: Checkpoint, od: OutputDir, tmp: str, final: str, tensors: list[str],
                objects: list[str], renamed: dict[str, str], keys: dict, values: dict, io,
                target: int, budget: int, workers: int, on_bytes) -> None:
    """Everything of the Orbax folder into ``tmp`` (``od``'s), data first,
    ``commit_success.txt`` last; then ``od`` is committed (its writing marker goes)."""
    import numpy as np

    arrays = _Arrays(tmp, budget, workers)
    try:
        s = io.stream(tensors, 1, False)
        for n in tensors:
            _write_tensor(arrays, s, n, renamed[n], io.out_dtype(n), ck.tensors[n].shape,
                          target, on_bytes)
        for n, v in values.items():
            if v is not None:
                h = arrays.create(renamed[n], _zarr3_metadata((), v[0], 1))
                arrays.write(h, None, np.asarray(v[2], dtype=arrays.np_dtype(v[0])))
        arrays.drain()
    except BaseException:
        arrays.abandon()  # no write may land in the folder after it is removed
        raise
    leaves = {}
    for n in tensors + objects:
        if n not in values:
            vt = "np.ndarray"
        else:
            vt = "None" if values[n] is None else values[n][1]
        path = keys[renamed[n]]
        leaves[str(path)] = {
            "key_metadata": [{"key": k, "key_type": _KEY_TYPE_DICT} for k in path],
            "value_metadata": {"value_type": vt, "skip_deserialize": vt == "None"}}
    doc = {"tree_metadata": dict(sorted(leaves.items())), "use_ocdbt": True,
           "use_zarr3": True, "store_array_data_equal_to_fill_value": True,
           "custom_metadata": None}
    _sync_tree(tmp)
    od.write_atomic(ITEM_METADATA, json.dumps(doc).encode())
    now = time.time_ns()
    od.write_atomic(STEP_METADATA, json.dumps({
        "item_handlers": HANDLER, "metrics": {}, "performance_metrics": {},
        "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now,
        "custom_metadata": {}}).encode())
    od.write_atomic(COMMIT_FILE, f"Checkpoint commit was successful to {final}".encode())
    od.commit()  # the writing marker goes; the folder's name still says "in flight"


def _sync_tree(root: str) -> None:
    """Make the folders tensorstore created durable (it fsyncs its files)."""
    for d, _, _ in os.walk(root):
        sync_dir(d)
