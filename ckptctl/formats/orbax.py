"""Orbax (JAX) checkpoints, read into the one logical model without JAX or Orbax.

What Orbax writes (orbax-checkpoint 0.12; tests/fixtures_orbax.py makes them):

- a **step folder** (a ``CheckpointManager`` step, named ``<step>`` or ``<prefix>_<step>``)
  holds ``_CHECKPOINT_METADATA`` and one folder per item (``default/``, ``state/``,
  ``params/``); a bare ``StandardCheckpointer``/``PyTreeCheckpointer`` folder is one item
  with its ``_CHECKPOINT_METADATA`` beside its ``_METADATA``;
- an **item folder** holds ``_METADATA`` (JSON: one record per PyTree leaf, its key path and
  value type; no dtype, no shape), ``_sharding`` and ``array_metadatas/`` (save-time
  information), and the arrays: zarr v2 (``NAME/.zarray``) or zarr v3 (``NAME/zarr.json``)
  arrays, either inside an OCDBT database (``use_ocdbt``: the merged ``manifest.ocdbt`` +
  ``d/`` over ``ocdbt.process_N/``) or one folder per array (``use_ocdbt=False``).

Names are the PyTree path joined with dots (``params.layers.0.mlp.kernel``,
``opt_state.0.mu.embed.embedding``), as Orbax keys its arrays; a step folder of several
items prefixes each name with its item (``state.params...``). Leaves without an array
(``value_type`` ``None``: optax's ``EmptyState``) are left out, said in the notes.

Each zarr chunk (an OCDBT key, or a file of a per-array folder) is one chunk of the
logical tensor, of encoding ``zarr``; its bytes are decoded by tensorstore (imported only
here, only when array metadata or data inside OCDBT is needed: ``pip install
'ckptctl[orbax]'``).

The verbs that need no array data (``ls``, ``latest``, ``gc``, ``verify --level quick``:
:func:`metadata_only`) read a step's commit state from its files alone
(``_CHECKPOINT_METADATA``, ``commit_success.txt``, the temporary suffix, each item's
``_METADATA`` and merged ``manifest.ocdbt``), without tensorstore (its import alone is
0.6 s): locally and on an object store (``s3://``, ``gs://``, ``az://``). On ``s3://``
and ``gs://`` the arrays themselves are read too, through tensorstore's own ``s3`` and
``gcs`` kvstore drivers (:func:`kvstore_spec`: the endpoint, region and keys ckptctl
resolved for the place; Google's default credentials, or the emulator
``STORAGE_EMULATOR_HOST`` names). Elsewhere (``az://``, a pack) anything that reads the
arrays (their zarr metadata included: inside OCDBT they are keys of the database) is
refused by name, one line, exit 3.

Commit: a folder named ``<name>.orbax-checkpoint-tmp`` (Orbax renames it into place when the
save is done), a step whose ``_CHECKPOINT_METADATA`` has no commit time, or an OCDBT item
without its merged ``manifest.ocdbt`` is a save that did not finish (``NOT_COMMITTED``);
on ``gs://``, where Orbax renames nothing (its ``CommitFileTemporaryPath``: the step is
written in place and ``commit_success.txt`` is its last file), so is a step folder without
``commit_success.txt``.

>>> array_name([{"key": "params", "key_type": 2}, {"key": "0", "key_type": 1}], "x/_METADATA")
'params.0'
>>> zarr2_dtype("bfloat16", "w").name, zarr2_dtype("<f4", "w").name, zarr2_dtype("|b1", "w").name
('bfloat16', 'float32', 'bool')
>>> step_of_folder("checkpoint_1200"), step_of_folder("20"), step_of_folder("default")
(1200, 20, None)
"""
from __future__ import annotations

import atexit
import contextlib
import contextvars
import math
import posixpath
import re
import threading
import weakref

from .._deps import MissingDependencyError
from ..errors import (
    CkptError,
    FormatError,
    StorageError,
    UnsafeInputError,
    UnsupportedFormatError,
    layout_refused,
)
from ..model import DTYPES, Checkpoint, Chunk, DType, Extent, TensorEntry
from ..storage import Store
from .limits import MAX_METADATA_BYTES, MAX_NDIM, check_shape, load_json

STEP_METADATA = "_CHECKPOINT_METADATA"
ITEM_METADATA = "_METADATA"
OCDBT_MANIFEST = "manifest.ocdbt"
COMMIT_FILE = "commit_success.txt"
#: Orbax's temporary folder suffix (older releases add ``-<timestamp>``)
TMP_SUFFIX = ".orbax-checkpoint-tmp"
_TMP = re.compile(r"\.orbax-checkpoint-tmp(?:-\d+)?$")
#: Orbax's own step-folder names: ``<step>`` or ``<prefix>_<step>``
_STEP = re.compile(r"^(?:.*_)?(\d+)$")
ORBAX_HINT = "needs tensorstore to read Orbax arrays: pip install 'ckptctl[orbax]'"
#: most zarr chunks one array may declare (a grid past this is no real checkpoint)
MAX_CHUNKS = 1 << 20
#: the zarr metadata of one array (``.zarray`` / ``zarr.json``) is ~1 KB
MAX_ARRAY_METADATA = 1 << 20
#: Orbax's value types that hold an array, and the one that holds none
_ARRAY_TYPES = {"jax.Array", "np.ndarray", "scalar"}
_NO_ARRAY = "None"
ENCODING = "zarr"

#: zarr v2 ``dtype`` strings (numpy's, plus ml_dtypes' names) -> dtype
_ZARR2 = {"|b1": "bool", "|u1": "uint8", "|i1": "int8", "<u2": "uint16", "<i2": "int16",
          "<u4": "uint32", "<i4": "int32", "<u8": "uint64", "<i8": "int64", "<f2": "float16",
          "<f4": "float32", "<f8": "float64", "<c8": "complex64", "<c16": "complex128",
          "bfloat16": "bfloat16", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
          "float8_e4m3fnuz": "float8_e4m3fnuz", "float8_e5m2fnuz": "float8_e5m2fnuz"}
#: zarr v3 ``data_type`` names this reader maps (the same as the model's)
_ZARR3 = {"bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
          "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
          "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}


def is_tmp(name: str) -> bool:
    """Whether a folder name is one of Orbax's unfinished saves.

    >>> is_tmp("30.orbax-checkpoint-tmp"), is_tmp("default.orbax-checkpoint-tmp-1712"), is_tmp("30")
    (True, True, False)
    """
    return bool(_TMP.search(name.rstrip("/")))


def step_of_folder(name: str) -> int | None:
    """The step an Orbax step folder's name carries (``<step>``, ``<prefix>_<step>``, and
    their ``.orbax-checkpoint-tmp`` while in flight), or None."""
    m = _STEP.match(_TMP.sub("", posixpath.basename(name.rstrip("/"))))
    return int(m.group(1)) if m else None


def zarr2_dtype(code, where: str) -> DType:
    """The dtype of a zarr v2 ``dtype`` string; anything else is refused by name."""
    name = _ZARR2.get(code) if isinstance(code, str) else None
    if name is None:
        raise FormatError(where, f"zarr dtype {code!r} is not one this reader reads")
    return DTYPES[name]


def array_name(keys, where: str) -> str:
    """The dotted name of a leaf from its ``key_metadata``, refused when it could name a
    path outside the checkpoint (Orbax uses it as the array's folder or OCDBT key)."""
    if not isinstance(keys, list) or not keys or not all(
            isinstance(k, dict) and isinstance(k.get("key"), str) for k in keys):
        raise FormatError(where, "a leaf's key_metadata is not a list of keys")
    name = ".".join(k["key"] for k in keys)
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise UnsafeInputError(where, f"array name {name!r} is not a plain name inside the "
                               "checkpoint (absolute, '..' or a separator)")
    return name


def _json(store: Store, rel: str, files: dict[str, int], limit: int = MAX_METADATA_BYTES):
    where = store.display(rel)
    if files.get(rel, 0) > limit:
        raise UnsafeInputError(where, f"{files[rel]} bytes: past the {limit}-byte bound")
    return load_json(store.read(rel), where)


#: what an item folder holds beside its arrays: files, and OCDBT's trees (``d/<hash>``,
#: ``ocdbt.process_N/``) and ``array_metadatas/process_N``
_ITEM_FILES = {ITEM_METADATA, "_sharding", OCDBT_MANIFEST, COMMIT_FILE, STEP_METADATA}
_ITEM_TREES = re.compile(r"^(?:d/[0-9a-f]+|ocdbt\.process_\d+/(?:manifest\.ocdbt|d/[0-9a-f]+)"
                         r"|array_metadatas/process_\d+)$")


def layout_files(files: dict[str, int]) -> set[str]:
    """The files an Orbax step or item folder's layout names, from its listing ``files``
    (what the checkpoint owns: :func:`~ckptctl.catalog.ownership.layout_files`); empty for
    any other folder. An array's folder (``NAME/.zarray`` or ``NAME/zarr.json`` beside its
    chunks) is owned whole.

    >>> sorted(layout_files({"_CHECKPOINT_METADATA": 1, "default/_METADATA": 1,
    ...     "default/d/0a1b": 1, "default/w/.zarray": 1, "default/w/0.0": 1, "NOTES.md": 1}))
    ... # doctest: +NORMALIZE_WHITESPACE
    ['_CHECKPOINT_METADATA', 'default/_METADATA', 'default/d/0a1b', 'default/w/.zarray',
     'default/w/0.0']
    """
    top = {f for f in files if "/" not in f}
    if ITEM_METADATA in top:
        items = [""]
    elif STEP_METADATA in top:
        items = sorted({f.split("/", 1)[0] for f in files
                        if f.count("/") == 1 and f.endswith("/" + ITEM_METADATA)})
    else:
        return set()
    out = top & {STEP_METADATA, COMMIT_FILE}
    for item in items:
        pre = f"{item}/" if item else ""
        sub = {f[len(pre):]: f for f in files if f.startswith(pre)}
        arrays = {r.split("/", 1)[0] for r in sub
                  if r.count("/") == 1 and r.endswith(("/.zarray", "/zarr.json"))}
        for r, f in sub.items():
            if r in _ITEM_FILES or _ITEM_TREES.match(r) or r.split("/", 1)[0] in arrays \
                    and "/" in r:
                out.add(f)
    return out


# ------------------------------------------------------------------ tensorstore


#: tensorstore's context: a bounded cache, and on s3:// a bounded retry budget (its own
#: default retries for minutes)
_CONTEXT = {"cache_pool": {"total_bytes_limit": 64 << 20},
            "s3_request_retries": {"max_retries": 2, "initial_delay": "0.5s", "max_delay": "4s"}}


def _ts(where: str):
    try:
        import tensorstore
    except ImportError as e:
        if (e.name or "").split(".")[0] != "tensorstore":
            raise
        raise MissingDependencyError(where, ORBAX_HINT) from None
    return tensorstore




def _s3_credentials(cfg: dict) -> dict:
    """tensorstore's ``aws_credentials`` for obstore-style settings ``cfg``
    (:func:`~ckptctl.storage.s3_native.s3_config`): anonymous; the environment's keys;
    keys given outright in ``-o`` options (a private credentials file, 0600, removed at
    exit: tensorstore takes keys no other way but from the environment, which this
    process does not change); else its own chain."""
    if cfg.get("skip_signature"):
        return {"type": "anonymous"}
    import os

    key, secret = cfg.get("access_key_id"), cfg.get("secret_access_key")
    if not key or not secret:
        return {"type": "default"}
    token = cfg.get("token")
    if (os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY"),
            os.environ.get("AWS_SESSION_TOKEN")) == (key, secret, token):
        return {"type": "environment"}  # the usual case: no file at all
    with _CRED_LOCK:
        path = _CRED_FILES.get((key, secret, token))
        if path is None:
            import shutil
            import tempfile

            # 0700, in memory where there is a tmpfs: a SIGKILL (no atexit) leaves it
            # in RAM until reboot, never on a disk
            shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
                else None
            d = tempfile.mkdtemp(prefix="ckptctl-ts-", dir=shm)
            if not _CRED_FILES:
                atexit.register(lambda: [shutil.rmtree(os.path.dirname(f), ignore_errors=True)
                                         for f in _CRED_FILES.values()])
            text = f"[ckptctl]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n"
            if token:
                text += f"aws_session_token = {token}\n"
            for name, body in (("credentials", text), ("config", "[profile ckptctl]\n")):
                fd = os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(body)
            path = _CRED_FILES[(key, secret, token)] = os.path.join(d, "credentials")
    return {"type": "profile", "profile": "ckptctl", "credentials_file": path,
            "config_file": posixpath.join(posixpath.dirname(path), "config")}


_CRED_FILES: dict[tuple, str] = {}
_CRED_LOCK = threading.Lock()


def kvstore_spec(store: Store, rel: str = "") -> dict | None:
    """tensorstore's kvstore spec of the folder ``rel`` of ``store`` (a trailing ``/``):
    a local path; on ``s3://`` its ``s3`` driver with the endpoint (path-style), region
    and credentials ckptctl resolved for the place; on ``gs://`` its ``gcs`` driver
    (:func:`_gcs_emulator`); None where tensorstore cannot read it.

    >>> from ckptctl.storage import open_store
    >>> kvstore_spec(open_store("/tmp/run"), "20/default")
    {'driver': 'file', 'path': '/tmp/run/20/default/'}
    """
    from .pack import PackStore

    if isinstance(store, PackStore):  # a pack's files are chunks of its data files
        return None
    if store.is_local:
        return {"driver": "file", "path": store.local_path(rel).rstrip("/") + "/"}
    bucket, _, key = store.full(rel).rstrip("/").partition("/")
    path = key + "/" if key else ""
    if store.url.startswith(("gs://", "gcs://")):
        _gcs_emulator()
        return {"driver": "gcs", "bucket": bucket, "path": path}
    if not store.url.startswith(("s3://", "s3a://")):
        return None
    from ..storage.s3_native import s3_config

    options = getattr(store, "_options", None)
    if options is None:  # the fsspec store: the options its filesystem was made with
        options = dict(getattr(getattr(store, "fs", None), "storage_options", None) or {})
    cfg = s3_config(options)
    spec = {"driver": "s3", "bucket": bucket, "path": path,
            "aws_region": cfg.get("region") or "us-east-1",
            "aws_credentials": _s3_credentials(cfg)}
    if cfg.get("endpoint"):
        spec["endpoint"] = cfg["endpoint"]
    return spec


def _gcs_emulator() -> None:
    """Point tensorstore's ``gcs`` driver where ckptctl's GCS place points: with
    ``STORAGE_EMULATOR_HOST`` (an emulator, read anonymously as gcsfs does here) its
    ``TENSORSTORE_GCS_HTTP_URL``, and a placeholder bearer token the emulator does not
    check (tensorstore would otherwise look for Google credentials, up to the metadata
    server). A value the user set is kept; one set here follows the emulator variable
    (tensorstore reads both at each open). Without the emulator variable tensorstore
    finds Google's default credentials (``GOOGLE_APPLICATION_CREDENTIALS``...) itself."""
    import os

    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if not host:
        return
    want = {"TENSORSTORE_GCS_HTTP_URL": (host if "://" in host else f"http://{host}").rstrip("/"),
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "anonymous"}
    for name, value in want.items():
        if os.environ.get(name) in (None, _GCS_SET.get(name)):
            os.environ[name] = _GCS_SET[name] = value


#: the tensorstore variables :func:`_gcs_emulator` set, and to what
_GCS_SET: dict[str, str] = {}


#: every :class:`_Arrays` alive, closed at exit (:func:`_close_all`)
_LIVE: "weakref.WeakSet[_Arrays]" = weakref.WeakSet()


#: reads in flight (a daemon thread may still be in one when an error ends the command)
_BUSY = {"reads": 0, "closing": False}
_BUSY_LOCK = threading.Condition()


def _close_all() -> None:
    """At exit: refuse new reads, wait (a few seconds at most) for those in flight, and drop
    every tensorstore handle. tensorstore work still running when the interpreter tears
    down (a reading thread left behind by an error) aborts the process (``terminate
    called without an active exception``: exit 134 instead of the error's 3)."""
    with _BUSY_LOCK:
        _BUSY["closing"] = True
        _BUSY_LOCK.wait_for(lambda: _BUSY["reads"] == 0, timeout=10)
    for arrays in list(_LIVE):
        arrays.close()


@contextlib.contextmanager
def _busy(where: str, name: str):
    """Count a tensorstore call in flight (:func:`_close_all` waits for it)."""
    with _BUSY_LOCK:
        if _BUSY["closing"]:
            raise FormatError(where, f"{name}: not read: the command is ending")
        _BUSY["reads"] += 1
    try:
        yield
    finally:
        with _BUSY_LOCK:
            _BUSY["reads"] -= 1
            _BUSY_LOCK.notify_all()


class _Arrays:
    """What reading a checkpoint's arrays needs, kept in ``ck.info["orbax_arrays"]``: per
    tensor its item folder (a tensorstore kvstore spec: :func:`kvstore_spec`), zarr driver
    and key; tensorstore handles opened once each."""

    def __init__(self):
        self.where: dict[str, tuple[dict, str, bool, str]] = {}  # name -> (base, driver, ocdbt, key)
        self.handles: dict[str, object] = {}
        self.lock = threading.Lock()
        self.context = None
        if not _LIVE:
            atexit.register(_close_all)
        _LIVE.add(self)

    def close(self) -> None:
        with self.lock:
            self.handles.clear()
            self.context = None

    def spec(self, name: str) -> dict:
        base, driver, ocdbt, key = self.where[name]
        if ocdbt:
            kv = {"driver": "ocdbt", "base": base, "path": f"{key}/"}
        else:
            kv = {**base, "path": f"{base['path']}{key}/"}
        return {"driver": driver, "kvstore": kv, "open": True,
                "recheck_cached_data": False, "recheck_cached_metadata": False}

    def handle(self, name: str, where: str):
        with self.lock:
            h = self.handles.get(name)
            if h is None:
                ts = _ts(where)
                if self.context is None:
                    self.context = ts.Context(_CONTEXT)
                try:
                    with _busy(where, name):
                        h = ts.open(self.spec(name), read=True, context=self.context).result()
                except FormatError:
                    raise
                except Exception as e:  # noqa: BLE001 - tensorstore raises ValueError & co
                    raise _ts_error(e, where, name) from None
                self.handles[name] = h
            return h


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:300]


_RANGE = re.compile(r"Requested byte range \[(\d+), (\d+)\) is not valid for value of size "
                    r"(\d+)")
#: tensorstore's status words that say the place, not the bytes, failed
_IO_STATUS = ("UNAVAILABLE", "PERMISSION_DENIED", "UNAUTHENTICATED", "DEADLINE_EXCEEDED",
              "RESOURCE_EXHAUSTED", "ABORTED")


def _ts_error(e: Exception, where: str, what: str, code: str | None = None) -> CkptError:
    """A tensorstore failure as one line: the server or the connection (exit 3, never a
    finding about the checkpoint), else what the bytes are (``FormatError``, ``code``).
    A ranged read answered with as many bytes as were asked, taken for the whole value,
    is a server that sends HTTP 200 instead of 206 to a Range request (``rclone serve
    s3`` does): tensorstore cannot read through it.

    >>> e = ValueError('OUT_OF_RANGE: Error reading "w/0" in OCDBT database at "r/": '
    ...                "Requested byte range [100, 150) is not valid for value of size 50")
    >>> type(_ts_error(e, "x", "w")).__name__, type(_ts_error(ValueError("DATA_LOSS: x"), "x",
    ...                                                  "w")).__name__
    ('StorageError', 'FormatError')
    """
    line = _first_line(e)
    m = _RANGE.search(line)
    if m and int(m.group(1)) > 0 and int(m.group(3)) == int(m.group(2)) - int(m.group(1)):
        return StorageError(where, f"{what}: the server answered a ranged read with the "
                            "whole-object status (HTTP 200, not 206; rclone serve s3 does), "
                            f"which tensorstore cannot read through: {line}")
    if line.startswith(_IO_STATUS):
        return StorageError(where, f"{what}: {line}")
    return FormatError(where, f"{what}: {line}", code=code)


def read_chunk(ck: Checkpoint, t: TensorEntry, c: Chunk) -> memoryview:
    """The row-major bytes of one zarr chunk of an Orbax array (tensorstore decodes it)."""
    arrays: _Arrays = ck.info["orbax_arrays"]
    where = ck.store.display(c.extent.file)
    h = arrays.handle(t.name, where)
    if tuple(h.shape) != t.shape:
        raise FormatError(where, f"{t.name}: array has shape {list(h.shape)}, its metadata "
                          f"said {list(t.shape)}", code="DTYPE_SIZE_MISMATCH")
    box = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))
    with _busy(where, t.name):
        try:
            a = h[box].read().result() if box else h.read().result()
        except Exception as e:  # noqa: BLE001
            raise _ts_error(e, where, t.name, "MALFORMED_CHUNK") from None
    import numpy as np

    a = np.asarray(a, order="C")  # ascontiguousarray would make a scalar 1-d
    if a.dtype.name != t.dtype.name or a.dtype.byteorder == ">" \
            or tuple(a.shape) != tuple(c.sizes):
        raise FormatError(where, f"{t.name}: chunk decodes to {a.dtype} {list(a.shape)}, "
                          f"not {t.dtype.name} {list(c.sizes)}", code="DTYPE_SIZE_MISMATCH")
    return memoryview(a.reshape(-1).view(np.uint8))


# ------------------------------------------------------------------ reading


def _grid(name: str, dtype: DType, shape, chunks, where: str) -> tuple:
    """Validated (shape, chunk shape) of one array."""
    if not isinstance(shape, list) or not isinstance(chunks, list) or len(shape) > MAX_NDIM \
            or len(shape) != len(chunks) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in shape + chunks):
        raise FormatError(where, f"{name}: shape {shape!r} / chunks {chunks!r} are malformed")
    if any(v < 0 for v in shape) or any(v < 1 for v in chunks):
        raise FormatError(where, f"{name}: negative size or empty chunk in {shape} / {chunks}")
    check_shape(tuple(shape), dtype, where=f"{where}: {name}")
    count = math.prod(-(-s // c) for s, c in zip(shape, chunks))
    if count > MAX_CHUNKS:
        raise UnsafeInputError(where, f"{name}: {count} chunks (shape {shape}, chunks "
                               f"{chunks}) is absurdly many")
    return tuple(shape), tuple(chunks)


def _zarr_meta(doc, name: str, zarr3: bool, where: str) -> tuple[DType, tuple, tuple, str]:
    """(dtype, shape, chunk shape, key format) from a ``.zarray`` / ``zarr.json``; a field
    of the wrong JSON type is one :class:`FormatError`."""
    try:
        return _zarr_fields(doc, name, zarr3, where)
    except (AttributeError, TypeError):
        raise FormatError(where, f"{name}: zarr metadata is malformed") from None


def _zarr_fields(doc, name: str, zarr3: bool, where: str) -> tuple[DType, tuple, tuple, str]:
    if not isinstance(doc, dict):
        raise FormatError(where, f"{name}: zarr metadata is not an object")
    if zarr3:
        code = doc.get("data_type")
        if not isinstance(code, str) or code not in _ZARR3:
            raise FormatError(where, f"{name}: zarr data_type {code!r} is not one this "
                              "reader reads")
        grid = doc.get("chunk_grid") or {}
        chunks = (grid.get("configuration") or {}).get("chunk_shape") \
            if isinstance(grid, dict) and grid.get("name") == "regular" else None
        enc = doc.get("chunk_key_encoding") or {}
        kind = enc.get("name") if isinstance(enc, dict) else None
        sep = ((enc.get("configuration") or {}).get("separator") if isinstance(enc, dict)
               else None) or ("/" if kind == "default" else ".")
        prefix = "c/" if kind == "default" else ""
        dtype = DTYPES[code]
    else:
        dtype = zarr2_dtype(doc.get("dtype"), f"{where}: {name}")
        chunks = doc.get("chunks")
        sep = doc.get("dimension_separator") or "."
        prefix = ""
        if doc.get("order", "C") != "C":
            raise FormatError(where, f"{name}: zarr order {doc.get('order')!r}: only C order "
                              "is read")
    if sep not in (".", "/"):
        raise FormatError(where, f"{name}: zarr key separator {sep!r}")
    shape, chunks = _grid(name, dtype, doc.get("shape"), chunks, where)
    return dtype, shape, chunks, prefix + "|" + sep


def _chunks(shape, chunks, key_fmt: str) -> list[tuple[tuple, tuple, str]]:
    """(offsets, sizes, key) of every chunk of the grid, row-major."""
    prefix, sep = key_fmt.split("|")
    if not shape:
        return [((), (), (prefix.rstrip("/") or "0") if prefix else "0")]
    import itertools

    out = []
    for idx in itertools.product(*(range(-(-s // c)) for s, c in zip(shape, chunks))):
        offs = tuple(i * c for i, c in zip(idx, chunks))
        sizes = tuple(min(c, s - o) for c, s, o in zip(chunks, shape, offs))
        out.append((offs, sizes, prefix + sep.join(map(str, idx))))
    return out


def _item_dirs(store: Store, files: dict[str, int]) -> list[str]:
    """The item folders (relative, "" for the folder itself) of the place's listing."""
    if ITEM_METADATA in files:
        return [""]
    items = sorted({f.split("/", 1)[0] for f in files
                    if f.count("/") == 1 and f.endswith("/" + ITEM_METADATA)})
    if not items:
        if any(is_tmp(f.split("/", 1)[0]) for f in files if "/" in f):
            raise FormatError(store.url, "an Orbax step whose items were never renamed into "
                              "place (the save did not finish)", code="NOT_COMMITTED")
        raise FormatError(store.url, f"an Orbax step folder without items ({ITEM_METADATA})")
    unfinished = [d for d in items if is_tmp(d)]
    if unfinished:
        raise FormatError(store.display(unfinished[0]), "an Orbax item still in its temporary "
                          "folder (the save did not finish)", code="NOT_COMMITTED")
    return items


def _remote(store: Store) -> UnsupportedFormatError:
    """The refusal of reading an Orbax checkpoint's arrays (their zarr metadata or data)
    where tensorstore is not opened (:func:`kvstore_spec`: local folders, ``s3://`` and
    ``gs://`` so far); by name, one line, exit 3. What needs no array (:func:`metadata_only`) is read
    there."""
    from .pack import PackStore

    if isinstance(store, PackStore):  # tensorstore reads files, not a pack's chunks
        return layout_refused(store.url, "Orbax arrays in a pack (tensorstore reads them "
                              "from files: unpack it first)", "Orbax")
    return layout_refused(store.url, "Orbax arrays on an object store (their metadata and "
                          "data are read from local folders, s3:// and gs:// only so far; ls, latest, "
                          "gc and verify --level quick work here)", "Orbax")


#: set by :func:`metadata_only`: read an Orbax checkpoint's commit state, no array
_METADATA_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("orbax_metadata_only",
                                                                      default=False)


@contextlib.contextmanager
def metadata_only(on: bool = True):
    """Within it (in this thread), :func:`read_orbax` reads a checkpoint's step and
    commit state only: no array is listed (``ck.tensors`` stays empty,
    ``ck.info["orbax_arrays_unread"]`` says so), and one on an object store is not
    refused. For the checks that judge a checkpoint by its files (``verify --level
    quick``, and so ``ls``, ``latest`` and ``gc``)."""
    token = _METADATA_ONLY.set(bool(on))
    try:
        yield
    finally:
        _METADATA_ONLY.reset(token)


def read_orbax(store: Store, files: dict[str, int]) -> Checkpoint:
    """Read an Orbax step or item folder: ``_CHECKPOINT_METADATA`` and each item's
    ``_METADATA`` through the store, the zarr metadata of each array (from the files, or
    inside OCDBT through tensorstore); no array data.

    >>> ck = read_orbax(open_store("run/20"), files)          # doctest: +SKIP
    >>> ck.step, ck.tensors["params.embed.embedding"].dtype.name  # doctest: +SKIP
    (20, 'bfloat16')
    """
    base = posixpath.basename(store.url.rstrip("/"))
    if is_tmp(base):
        raise FormatError(store.url, f"an Orbax save still in its temporary folder "
                          f"(*{TMP_SUFFIX}: Orbax renames it into place when done)",
                          code="NOT_COMMITTED")
    for rel in files:  # tensorstore opens them by path: no link may lead out of the root
        store.full(rel)
    ck = Checkpoint(store.url, "orbax", files=dict(files), store=store)
    notes = ck.info.setdefault("notes", [])
    if STEP_METADATA in files:
        meta = _json(store, STEP_METADATA, files, 16 << 20)
        if isinstance(meta, dict) and "commit_timestamp_nsecs" in meta \
                and meta["commit_timestamp_nsecs"] is None:
            raise FormatError(store.display(STEP_METADATA), "no commit time: the Orbax save "
                              "did not finish", code="NOT_COMMITTED")
        ck.info["orbax_step_metadata"] = meta
        if store.url.startswith("gs://") and COMMIT_FILE not in files:
            raise FormatError(store.display(COMMIT_FILE), "missing: on gs:// Orbax writes it "
                              "last, when the save is done (the save did not finish)",
                              code="NOT_COMMITTED")
    items = _item_dirs(store, files)
    others = sorted({f.split("/", 1)[0] for f in files if "/" in f} - set(items)) \
        if items != [""] else []
    if others:  # a CheckpointManager's JSON items (``metadata/``) and the like
        notes.append(f"not read (no {ITEM_METADATA}: not a PyTree item): "
                     + ", ".join(f"{d}/" for d in others[:5]) + (", ..." if len(others) > 5
                                                                 else ""))
    step = step_of_folder(base) if (STEP_METADATA in files or items != [""]) else None
    if items == [""] and STEP_METADATA not in files:  # a manager step's item
        parent = posixpath.basename(posixpath.dirname(store.url.rstrip("/")))
        step = step_of_folder(parent) if step is None else step
        if is_tmp(parent):
            notes.append(f"a finished item inside an unfinished step folder ({parent}): "
                         "the step as a whole was not committed")
    if step is not None:
        ck.step, ck.info["step_source"] = step, "name"
    arrays = _Arrays()
    ck.info["orbax_arrays"] = arrays
    shallow = _METADATA_ONLY.get()
    kinds = set()
    for item in items:
        kinds.add(_read_item(ck, store, files, item, len(items) > 1, arrays, notes,
                             shallow=shallow))
    ck.info["origin"] = ", ".join(sorted(kinds))
    if shallow:
        ck.info["orbax_arrays_unread"] = True
        notes.append("arrays not read (only the commit state is: steps, commit markers, "
                      "_METADATA, the merged manifest.ocdbt)")
    elif ck.tensors and kvstore_spec(store) is None:
        raise _remote(store)
    return ck


def _read_item(ck: Checkpoint, store: Store, files: dict[str, int], item: str, prefix: bool,
               arrays: _Arrays, notes: list[str], *, shallow: bool = False) -> str:
    """Add one item's arrays to ``ck``; returns the item's layout (``OCDBT + zarr3``).
    ``shallow``: check its ``_METADATA`` and commit state only, add no array."""
    join = (lambda r: f"{item}/{r}") if item else (lambda r: r)
    mrel = join(ITEM_METADATA)
    where = store.display(mrel)
    meta = _json(store, mrel, files)
    tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
    if not isinstance(tree, dict):
        raise FormatError(where, "no tree_metadata: not an Orbax PyTree item")
    ocdbt, zarr3 = meta.get("use_ocdbt", True), meta.get("use_zarr3", False)
    if not isinstance(ocdbt, bool) or not isinstance(zarr3, bool):
        raise FormatError(where, "use_ocdbt / use_zarr3 are not booleans")
    if ocdbt and join(OCDBT_MANIFEST) not in files:
        raise FormatError(store.display(join(OCDBT_MANIFEST)), "missing: the OCDBT database "
                          "was never merged (the save did not finish)", code="NOT_COMMITTED")
    names: list[tuple[str, str]] = []  # (array key, entry name)
    skipped = []
    for rec in tree.values():
        if not isinstance(rec, dict) or not isinstance(rec.get("value_metadata"), dict):
            raise FormatError(where, "a tree_metadata record has no value_metadata")
        key = array_name(rec.get("key_metadata"), where)
        vtype = rec["value_metadata"].get("value_type")
        if vtype == _NO_ARRAY or rec["value_metadata"].get("skip_deserialize") is True:
            skipped.append(f"{item}.{key}" if prefix else key)
            continue
        if not isinstance(vtype, str) or vtype not in _ARRAY_TYPES:
            raise layout_refused(where, f"Orbax leaf {key} of value_type {vtype!r} (arrays "
                                 "and scalars are read; this is neither)", "Orbax")
        names.append((key, f"{item}.{key}" if prefix else key))
    layout = ("OCDBT + " if ocdbt else "") + ("zarr3" if zarr3 else "zarr2")
    if shallow:
        ck.info["orbax_leaves"] = ck.info.get("orbax_leaves", 0) + len(names)
        return layout
    if mesh := _saved_mesh(store, files, join("_sharding")):
        notes.append(f"saved from {mesh} (_sharding; for information: ckptctl reads the "
                     "arrays whole, whatever mesh wrote them)")
    if skipped:
        notes.append(f"{len(skipped)} leaf/leaves without an array (value_type None, e.g. "
                     f"optax EmptyState) left out: {', '.join(sorted(skipped)[:5])}"
                     + (", ..." if len(skipped) > 5 else ""))
    mname = "zarr.json" if zarr3 else ".zarray"
    docs = _metadata_docs(store, files, item, [k for k, _ in names], mname, ocdbt)
    base = kvstore_spec(store, item) if names else None
    for key, name in names:
        if name in ck.tensors:
            raise FormatError(where, f"{name}: two leaves of the same name")
        doc = docs[key]
        dtype, shape, chunk, key_fmt = _zarr_meta(doc, key, zarr3, store.display(join(
            f"{key}/{mname}")))
        t = TensorEntry(name, dtype, shape, [])
        for offs, sizes, ckey in _chunks(shape, chunk, key_fmt):
            rel = join(f"{key}/{ckey}")
            n = files.get(rel, dtype.nbytes(math.prod(sizes)))
            t.chunks.append(Chunk(offs, sizes, Extent(rel, 0, n, ENCODING)))
        ck.tensors[name] = t
        arrays.where[name] = (base, "zarr3" if zarr3 else "zarr", ocdbt, key)
    return layout


def _saved_mesh(store: Store, files: dict[str, int], rel: str) -> str | None:
    """What ``_sharding`` says the arrays were saved from, in words: the named meshes
    (axis names and sizes) and single devices, with how many arrays each; None where
    there is no such file or it says nothing readable (it is information only).

    >>> _saved_mesh(None, {}, "_sharding") is None
    True
    """
    import json
    from collections import Counter

    if rel not in files or files[rel] > MAX_METADATA_BYTES:
        return None
    try:
        doc = _json(store, rel, files)
    except (FormatError, UnsafeInputError):
        return None
    seen: Counter = Counter()
    for value in (doc.values() if isinstance(doc, dict) else ()):
        try:
            rec = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        names, shape = rec.get("axis_names"), rec.get("shape")
        if (isinstance(names, list) and isinstance(shape, list) and len(names) == len(shape)
                and all(isinstance(n, str) for n in names)
                and all(isinstance(n, int) for n in shape)):
            seen["mesh " + ",".join(f"{n}={k}" for n, k in zip(names, shape))] += 1
        elif rec.get("sharding_type") == "SingleDeviceSharding":
            seen["one device"] += 1
    return "; ".join(f"{what} ({n} arrays)" for what, n in seen.most_common(4)) or None


def _metadata_docs(store: Store, files: dict[str, int], item: str, keys: list[str],
                   mname: str, ocdbt: bool) -> dict:
    """Each array's parsed zarr metadata: files of the folder, or keys of the OCDBT
    database (read together through tensorstore)."""
    join = (lambda r: f"{item}/{r}") if item else (lambda r: r)
    if not ocdbt:
        out = {}
        for k in keys:
            rel = join(f"{k}/{mname}")
            if rel not in files:
                raise FormatError(store.display(rel), "missing: the array's zarr metadata",
                                  code="MISSING_FILE")
            out[k] = _json(store, rel, files, MAX_ARRAY_METADATA)
        return out
    if not keys:
        return {}
    where = store.display(join(OCDBT_MANIFEST))
    base = kvstore_spec(store, item)
    if base is None:
        raise _remote(store)
    ts = _ts(where)
    try:
        kv = ts.KvStore.open({"driver": "ocdbt", "base": base},
                             context=ts.Context(_CONTEXT)).result()
        futures = {k: kv.read(f"{k}/{mname}") for k in keys}
        results = {k: f.result() for k, f in futures.items()}
    except Exception as e:  # noqa: BLE001 - tensorstore raises ValueError & co
        raise _ts_error(e, where, "the OCDBT database cannot be read") from None
    out = {}
    for k, r in results.items():
        if r.state != "value":
            raise FormatError(where, f"{k}/{mname}: missing from the OCDBT database",
                              code="MISSING_FILE")
        if len(r.value) > MAX_ARRAY_METADATA:
            raise UnsafeInputError(where, f"{k}/{mname}: {len(r.value)} bytes of metadata")
        out[k] = load_json(bytes(r.value), f"{where}: {k}/{mname}")
    return out
