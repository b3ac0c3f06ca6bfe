"""Multipart uploads with part-level resume, and server-side copies, over a :class:`Store`.

S3 calls go through s3fs's ``call_s3`` inside the store's error mapping (one-line
:class:`~ckptctl.errors.CkptError` naming the file, never a credential). A local store
implements the same contract, so ``promote`` has one code path:

- :func:`create_upload` makes a hidden data file ``.<name>.<upload_id>.upload`` beside the
  target and a sidecar ``.<name>.<upload_id>.parts`` of JSON lines;
- :func:`upload_part` writes the part at ``(number - 1) * part_size`` (its aligned bulk
  with O_DIRECT, past the page cache: :func:`~ckptctl.storage.localio.write_at`), then appends
  the part's line to the sidecar (a part is listed only once its bytes are written); the
  part size is the one given to :func:`create_upload`, else the size of part 1 (then part 1
  must come first); :func:`copy_part` does the same with bytes of a local file, copied in
  the kernel (``copy_file_range``: no pass through Python);
- nothing is fsynced part by part: :func:`complete_upload` fsyncs the file once. A part
  listed survives a killed process (it is in the page cache) but maybe not a power loss,
  so whoever resumes a local upload checks the whole file's hash before completing it
  (:class:`~ckptctl.storage.transfer.Transfer` does);
- :func:`list_parts` reads the sidecar (a torn last line is ignored); :func:`complete_upload`
  checks the parts, truncates, fsyncs and renames the data file into place (atomic);
  :func:`abort_upload` removes both files; :func:`list_uploads` finds them.

>>> import tempfile
>>> from ckptctl.storage import open_store
>>> s = open_store(tempfile.mkdtemp())
>>> uid = create_upload(s, "w/big.bin", part_size=4)
>>> p2 = upload_part(s, "w/big.bin", uid, 2, b"EF")
>>> p1 = upload_part(s, "w/big.bin", uid, 1, b"ABCD")
>>> [p.number for p in list_parts(s, "w/big.bin", uid)], [u.rel for u in list_uploads(s)]
([1, 2], ['w/big.bin'])
>>> complete_upload(s, "w/big.bin", uid, list_parts(s, "w/big.bin", uid))
>>> s.read("w/big.bin"), list_uploads(s), s.list_files()
(b'ABCDEF', [], {'w/big.bin': 6})
"""
from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import dataclass

from ..errors import NotFoundError, StorageError, UsageError
from .localio import kernel_copy, sync_dir, write_at
from .failures import error_code
from .local_store import local_temp
from .store import Store

MIN_PART = 5 << 20
MAX_PART = 5 << 30
MAX_PARTS = 10_000
#: Largest object a single CopyObject may copy; above it, UploadPartCopy.
MAX_SINGLE_COPY = 5 << 30
_LOCAL_ID = re.compile(r"[0-9a-f]{32}")
_LOCAL_NAME = re.compile(r"\.(?P<name>.+)\.(?P<id>[0-9a-f]{32})\.upload")


@dataclass(frozen=True)
class Part:
    """One uploaded part: its number (1-based), the server's ETag, its size in bytes."""

    number: int
    etag: str
    size: int


@dataclass(frozen=True)
class Upload:
    """An unfinished upload: the file it will become (relative to the store root), its id,
    and when it began (seconds since the epoch, None when the store does not say)."""

    rel: str
    upload_id: str
    initiated: float | None


def part_size_for(total: int, wanted: int) -> int:
    """The part size to use for a ``total``-byte file: ``wanted``, raised to S3's minimum
    (5 MiB) and, for huge files, to what keeps the parts within 10,000 (rounded up to MiB).

    >>> part_size_for(1 << 30, 64 << 20) >> 20, part_size_for(10, 1) >> 20
    (64, 5)
    >>> part_size_for(1 << 40, 8 << 20) >> 20  # 1 TiB in 8 MiB parts would be 131,072 parts
    105
    """
    size = max(MIN_PART, int(wanted))
    if total > size * MAX_PARTS:
        size = -(-total // MAX_PARTS)
        size = -(-size // (1 << 20)) << 20
    if size > MAX_PART:
        raise UsageError(f"{total} bytes do not fit in {MAX_PARTS} parts of at most 5 GiB")
    return size


# ------------------------------------------------------------------------------ S3 plumbing
def _bucket_key(store: Store, rel: str) -> tuple[str, str]:
    bucket, _, key = store.full(rel).partition("/")
    return bucket, key


def _call(store: Store, rel: str, method: str, **kw) -> dict:
    with store._errors(rel):
        return store.fs.call_s3(method, **kw)


def _need_multipart(store: Store) -> None:
    if not store.caps.multipart:
        raise UsageError(f"{store.protocol}:// stores have no multipart uploads", store.url)


# ------------------------------------------------------------------------------ local files
def _local_paths(store: Store, rel: str, upload_id: str) -> tuple[str, str, str]:
    """(target, data file, sidecar) of a local upload; an id that is not ours is not found."""
    full = store.full(rel)
    if not _LOCAL_ID.fullmatch(upload_id or ""):
        raise NotFoundError(store.display(rel), f"no such upload {str(upload_id)[:40]!r}")
    folder, name = os.path.split(full)
    stem = os.path.join(folder, f".{name}.{upload_id}")
    return full, stem + ".upload", stem + ".parts"


def upload_data_path(store: Store, rel: str, upload_id: str) -> str:
    """The data file of a local upload (its bytes so far, at their final offsets)."""
    return _local_paths(store, rel, upload_id)[1]


def _read_sidecar(store: Store, rel: str, sidecar: str,
                  head_only: bool = False) -> tuple[dict, dict[int, Part]]:
    """(header with ``part_size``, parts by number; the last line for a number wins).
    ``head_only``: the first 4 KiB, which hold the header and the part size (an upload
    of 10,000 parts does not re-read its whole sidecar for every part)."""
    with store._errors(rel):
        try:
            with open(sidecar, "rb") as f:
                raw = f.read(4096) if head_only else f.read()
        except FileNotFoundError:
            raise NotFoundError(store.display(rel), "no such upload (completed or aborted)") \
                from None
    head: dict = {}
    parts: dict[int, Part] = {}
    for line in raw.split(b"\n"):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn line from a crash mid-append: that part is simply not there
        if not isinstance(rec, dict):
            continue
        if "n" in rec:
            parts[int(rec["n"])] = Part(int(rec["n"]), str(rec["etag"]), int(rec["size"]))
        else:
            head.update(rec)
    return head, parts


def _append_line(path: str, rec: dict, *, sync: bool = True) -> None:
    """Append one JSON line in one write (O_APPEND: lines of parallel writers never mix).
    It starts with a newline too: after a crash tore the last line, the next one is still
    a line of its own (blank lines are skipped)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"\n" + json.dumps(rec, separators=(",", ":")).encode() + b"\n")
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _local_part_size(store: Store, rel: str, sidecar: str, number: int, n: int) -> int:
    """The part size of a local upload (recorded by part 1 when create_upload had none);
    refuses a part of the wrong size."""
    head, _ = _read_sidecar(store, rel, sidecar, head_only=True)
    if head.get("part_size") is None:  # a header longer than 4 KiB (a very long name)
        head, _ = _read_sidecar(store, rel, sidecar)
    size = head.get("part_size")
    if size is None:
        if number != 1:
            raise UsageError("a local upload without a part size must send part 1 "
                             "first (pass part_size to create_upload)", store.display(rel))
        size = n
        _append_line(sidecar, {"part_size": n})
    if n > size or n == 0 and number > 1:
        raise UsageError(f"part {number} has {n} bytes, the upload's parts {size}",
                         store.display(rel))
    return size


def _open_upload(store: Store, rel: str, path: str) -> int:
    try:
        return os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        raise NotFoundError(store.display(rel), "no such upload (completed or aborted)") \
            from None


# ------------------------------------------------------------------------------ the calls
def create_upload(store: Store, rel: str, *, part_size: int | None = None) -> str:
    """Begin a multipart upload of ``rel``; returns its id. Nothing appears at ``rel``
    until :func:`complete_upload`. ``part_size`` fixes a local upload's part offsets
    (S3 ignores it: each part says its size).

    >>> import tempfile
    >>> from ckptctl.storage import open_store
    >>> len(create_upload(open_store(tempfile.mkdtemp()), "x.bin", part_size=5 << 20))
    32
    """
    _need_multipart(store)
    if store.is_local:
        upload_id = uuid.uuid4().hex
        _, data, sidecar = _local_paths(store, rel, upload_id)
        with store._errors(rel):
            os.makedirs(os.path.dirname(data), exist_ok=True)
            os.close(os.open(data, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            fd = os.open(sidecar, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                head = {"rel": rel, "upload_id": upload_id, "part_size": part_size,
                        "initiated": time.time()}
                os.write(fd, json.dumps(head).encode() + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            sync_dir(os.path.dirname(data))
        store._count(requests=1)
        return upload_id
    bucket, key = _bucket_key(store, rel)
    resp = _call(store, rel, "create_multipart_upload", Bucket=bucket, Key=key)
    store._count(requests=1)
    return str(resp["UploadId"])


def upload_part(store: Store, rel: str, upload_id: str, number: int,
                data: bytes | memoryview) -> Part:
    """Send part ``number`` (1..10,000) of an upload. Every part but the last must be at
    least 5 MiB on S3 (and, locally, exactly the upload's part size). Sending a number
    again replaces that part. On S3 the part is durable when this returns; locally, once
    the upload is completed (see the module docstring).

    >>> import tempfile
    >>> from ckptctl.storage import open_store
    >>> s = open_store(tempfile.mkdtemp()); uid = create_upload(s, "x")
    >>> upload_part(s, "x", uid, 1, b"abc").size
    3
    """
    if not 1 <= number <= MAX_PARTS:
        raise UsageError(f"part number {number} is outside 1..{MAX_PARTS}", store.display(rel))
    n = data.nbytes if isinstance(data, memoryview) else len(data)
    if store.is_local:
        import xxhash

        _, path, sidecar = _local_paths(store, rel, upload_id)
        with store._errors(rel):
            size = _local_part_size(store, rel, sidecar, number, n)
            try:
                write_at(path, data, (number - 1) * size)
            except FileNotFoundError:
                raise NotFoundError(store.display(rel), "no such upload (completed or "
                                    "aborted)") from None
            etag = xxhash.xxh3_128(data).hexdigest()
            _append_line(sidecar, {"n": number, "etag": etag, "size": n}, sync=False)
        store._count(writes=1, bytes_written=n)
        return Part(number, etag, n)
    from . import s3data  # off s3fs's event loop, body not copied nor signed

    etag = s3data.put_part(store, rel, upload_id, number, data)
    store._count(writes=1, bytes_written=n)
    return Part(number, etag, n)


def copy_part(src: Store, src_rel: str, dst: Store, rel: str, upload_id: str, number: int,
              start: int, n: int) -> Part:
    """Part ``number`` of a local upload to ``dst``: bytes ``[start, start + n)`` of the
    local file ``src_rel``, copied in the kernel (:func:`kernel_copy`). Its ETag is a
    fresh token (nothing reads the bytes to hash them: the caller hashes the whole file
    before completing it).

    >>> import tempfile, pathlib
    >>> from ckptctl.storage import open_store
    >>> d = tempfile.mkdtemp(); _ = pathlib.Path(d, "a").write_bytes(b"0123456789")
    >>> s = open_store(d); uid = create_upload(s, "b", part_size=4)
    >>> ps = [copy_part(s, "a", s, "b", uid, i + 1, i * 4, min(4, 10 - i * 4)) for i in range(3)]
    >>> complete_upload(s, "b", uid, ps); s.read("b")
    b'0123456789'
    """
    if not (src.is_local and dst.is_local):
        raise UsageError("copy_part copies between local files", dst.display(rel))
    _, path, sidecar = _local_paths(dst, rel, upload_id)
    with dst._errors(rel):
        size = _local_part_size(dst, rel, sidecar, number, n)
        fd = _open_upload(dst, rel, path)
        try:
            with src._errors(src_rel):
                sfd = os.open(src.full(src_rel), os.O_RDONLY)
                try:
                    got = kernel_copy(sfd, fd, start, n, (number - 1) * size)
                finally:
                    os.close(sfd)
        finally:
            os.close(fd)
        if got != n:
            raise StorageError(src.display(src_rel), f"shorter than expected ({start + got} "
                               f"of at least {start + n} bytes)", code="SIZE_MISMATCH")
        etag = uuid.uuid4().hex[:16]
        _append_line(sidecar, {"n": number, "etag": etag, "size": n}, sync=False)
    dst._count(writes=1, bytes_written=n)
    return Part(number, etag, n)


def list_parts(store: Store, rel: str, upload_id: str, *, page: int = 1000) -> list[Part]:
    """The parts an upload holds, sorted by number (S3: ListParts, ``page`` parts per
    request, followed to the end). A missing upload is :class:`NotFoundError`.

    >>> import tempfile
    >>> from ckptctl.storage import open_store
    >>> s = open_store(tempfile.mkdtemp()); uid = create_upload(s, "x")
    >>> list_parts(s, "x", uid)
    []
    """
    if store.is_local:
        _, _, sidecar = _local_paths(store, rel, upload_id)
        _, parts = _read_sidecar(store, rel, sidecar)
        store._count(lists=1)
        return [parts[k] for k in sorted(parts)]
    bucket, key = _bucket_key(store, rel)
    out: list[Part] = []
    marker = 0
    while True:
        resp = _call(store, rel, "list_parts", Bucket=bucket, Key=key, UploadId=upload_id,
                     PartNumberMarker=marker, MaxParts=page)
        store._count(lists=1)
        out += [Part(int(p["PartNumber"]), str(p["ETag"]), int(p["Size"]))
                for p in resp.get("Parts") or []]
        nxt = int(resp.get("NextPartNumberMarker") or 0)
        if not resp.get("IsTruncated") or nxt <= marker:
            break
        marker = nxt
    return sorted({p.number: p for p in out}.values(), key=lambda p: p.number)


def complete_upload(store: Store, rel: str, upload_id: str, parts: list[Part]) -> None:
    """Assemble ``parts`` into the file ``rel``, which appears all at once (replacing any
    file there). Locally the parts must be numbered 1..N, each as listed, all but the last
    of the part size; the file is fsynced, renamed into place and the folder fsynced.

    >>> import tempfile
    >>> from ckptctl.storage import open_store
    >>> s = open_store(tempfile.mkdtemp()); uid = create_upload(s, "x")
    >>> complete_upload(s, "x", uid, [upload_part(s, "x", uid, 1, b"abc")]); s.read("x")
    b'abc'
    """
    parts = sorted(parts, key=lambda p: p.number)
    if not parts:
        raise UsageError("an upload needs at least one part to complete", store.display(rel))
    if store.is_local:
        full, path, sidecar = _local_paths(store, rel, upload_id)
        head, have = _read_sidecar(store, rel, sidecar)
        size = int(head.get("part_size") or 0)
        for i, p in enumerate(parts, 1):
            got = have.get(p.number)
            if p.number != i or got is None or got.etag != p.etag or got.size != p.size:
                raise StorageError(store.display(rel), f"part {p.number} was not uploaded as "
                                   "given (InvalidPart)", code="IO_ERROR")
            if i < len(parts) and p.size != size:
                raise StorageError(store.display(rel), f"part {p.number} has {p.size} bytes, "
                                   f"not the part size {size} (EntityTooSmall)")
        total = size * (len(parts) - 1) + parts[-1].size
        store._uncache(rel)
        store._forget(rel)
        with store._errors(rel):
            fd = os.open(path, os.O_WRONLY)
            try:
                os.ftruncate(fd, total)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(path, full)
            os.unlink(sidecar)
            sync_dir(os.path.dirname(full))
        store._count(requests=1)
        return
    bucket, key = _bucket_key(store, rel)
    store._uncache(rel)
    _call(store, rel, "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
          MultipartUpload={"Parts": [{"PartNumber": p.number, "ETag": p.etag} for p in parts]})
    store._count(requests=1)


def abort_upload(store: Store, rel: str, upload_id: str) -> None:
    """Drop an unfinished upload and its parts; an upload already gone is fine.

    >>> import tempfile
    >>> from ckptctl.storage import open_store
    >>> s = open_store(tempfile.mkdtemp()); uid = create_upload(s, "x")
    >>> abort_upload(s, "x", uid); abort_upload(s, "x", uid); list_uploads(s)
    []
    """
    if store.is_local:
        try:
            _, path, sidecar = _local_paths(store, rel, upload_id)
        except NotFoundError:
            return
        with store._errors(rel):
            for p in (path, sidecar):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
        store._count(requests=1)
        return
    bucket, key = _bucket_key(store, rel)
    try:
        _call(store, rel, "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
    except NotFoundError:
        pass
    store._count(requests=1)


def list_uploads(store: Store, rel_prefix: str = "", *, page: int = 1000) -> list[Upload]:
    """Unfinished uploads under the store root whose path starts with ``rel_prefix``
    (S3: ListMultipartUploads, ``page`` per request, followed to the end), sorted by path.

    >>> import tempfile
    >>> from ckptctl.storage import open_store
    >>> s = open_store(tempfile.mkdtemp()); uid = create_upload(s, "a/x")
    >>> [(u.rel, u.upload_id == uid) for u in list_uploads(s, "a/")], list_uploads(s, "b")
    ([('a/x', True)], [])

    A store with no multipart uploads (``caps.multipart`` false) has none unfinished.
    """
    if not store.caps.multipart:
        return []
    if store.is_local:
        return _local_uploads(store, rel_prefix)
    bucket, _, root_key = store.root.partition("/")
    base = root_key.rstrip("/") + "/" if root_key else ""
    prefix = base + rel_prefix
    out: list[Upload] = []
    kw: dict = {}
    while True:
        with store._errors(rel_prefix):
            try:
                resp = store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix,
                                        MaxUploads=page, **kw)
            except FileNotFoundError as e:  # rclone, in a bucket that never had an upload
                if error_code(e) != "NoSuchUpload":
                    raise
                resp = {}
        store._count(lists=1)
        for u in resp.get("Uploads") or []:
            key = str(u.get("Key", ""))
            if not key.startswith(base) or not key.startswith(prefix):
                continue
            when = u.get("Initiated")
            out.append(Upload(key[len(base):], str(u["UploadId"]),
                              when.timestamp() if hasattr(when, "timestamp") else None))
        nk, nu = resp.get("NextKeyMarker"), resp.get("NextUploadIdMarker")
        if not resp.get("IsTruncated") or not (nk or nu) or (
                kw.get("KeyMarker"), kw.get("UploadIdMarker")) == (nk, nu):
            break
        kw = {"KeyMarker": nk or "", "UploadIdMarker": nu or ""}
    return sorted({u.upload_id: u for u in out}.values(), key=lambda u: (u.rel, u.upload_id))


def _local_uploads(store: Store, rel_prefix: str) -> list[Upload]:
    top = store.full(os.path.dirname(rel_prefix.rstrip("/")) if "/" in rel_prefix else "")
    out: list[Upload] = []
    with store._errors(rel_prefix):
        for folder, _dirs, names in os.walk(top):
            for name in names:
                m = _LOCAL_NAME.fullmatch(name)
                if m is None:
                    continue
                rel = os.path.relpath(os.path.join(folder, m["name"]), store.root)
                if not rel.startswith(rel_prefix):
                    continue
                initiated = None
                try:
                    head, _ = _read_sidecar(store, rel, os.path.join(
                        folder, f".{m['name']}.{m['id']}.parts"))
                    initiated = float(head["initiated"])
                except (NotFoundError, KeyError, TypeError, ValueError):
                    try:  # killed inside create_upload: no sidecar yet
                        initiated = os.stat(os.path.join(folder, name)).st_mtime
                    except FileNotFoundError:
                        continue
                out.append(Upload(rel, m["id"], initiated))
    store._count(lists=1)
    return sorted(out, key=lambda u: (u.rel, u.upload_id))


def copy_object(src: Store, src_rel: str, dst: Store, dst_rel: str, *,
                part_size: int = 1 << 30, max_single: int = MAX_SINGLE_COPY) -> None:
    """Copy a file without its bytes passing through this process: S3 CopyObject (above
    ``max_single`` bytes, 5 GiB by default, UploadPartCopy in ``part_size`` parts, aborted
    if a part fails); locally a kernel copy into a temp file, fsynced and renamed into
    place. Both stores must be on the same server (:meth:`Store.same_server`).

    >>> import tempfile, pathlib
    >>> from ckptctl.storage import open_store
    >>> a, b = open_store(tempfile.mkdtemp()), open_store(tempfile.mkdtemp())
    >>> _ = pathlib.Path(a.root, "f").write_bytes(b"data")
    >>> copy_object(a, "f", b, "g/f"); b.read("g/f")
    b'data'
    """
    if not (src.caps.server_side_copy and src.same_server(dst)):
        raise UsageError(f"no server-side copy from {src.url} to {dst.url} (not the same server)")
    if src.is_local:
        _local_copy(src, src_rel, dst, dst_rel)
        return
    if hasattr(dst, "copy_in"):  # a native object store's own copy (Azure: Copy Blob)
        dst.copy_in(src, src_rel, dst_rel)
        return
    sb, sk = _bucket_key(src, src_rel)
    db, dk = _bucket_key(dst, dst_rel)
    head = _call(src, src_rel, "head_object", Bucket=sb, Key=sk)
    size = int(head["ContentLength"])
    src._count(requests=1)
    dst._uncache(dst_rel)
    if size <= max_single:
        _call(dst, dst_rel, "copy_object", Bucket=db, Key=dk, CopySource={"Bucket": sb, "Key": sk})
        dst._count(requests=1)
        return
    step = part_size_for(size, part_size)
    upload_id = create_upload(dst, dst_rel)
    try:
        parts = []
        for i, start in enumerate(range(0, size, step), 1):
            end = min(size, start + step) - 1
            resp = _call(dst, dst_rel, "upload_part_copy", Bucket=db, Key=dk, UploadId=upload_id,
                         PartNumber=i, CopySource={"Bucket": sb, "Key": sk},
                         CopySourceRange=f"bytes={start}-{end}")
            dst._count(requests=1)
            etag = (resp.get("CopyPartResult") or {}).get("ETag")
            if not etag:  # rclone serve s3 answers 200 with no result: not implemented
                raise StorageError(dst.display(dst_rel), "the server does not support "
                                   "UploadPartCopy (no part ETag in its answer)")
            parts.append(Part(i, str(etag), end - start + 1))
        complete_upload(dst, dst_rel, upload_id, parts)
    except BaseException:
        try:
            abort_upload(dst, dst_rel, upload_id)
        except Exception:  # noqa: BLE001 - the failure that got us here is the one to report
            pass
        raise


def _local_copy(src: Store, src_rel: str, dst: Store, dst_rel: str) -> None:
    import shutil

    source, target = src.full(src_rel), dst.full(dst_rel)
    with src._errors(src_rel):
        if not os.path.isfile(source):
            raise FileNotFoundError(source)
    dst._uncache(dst_rel)
    dst._forget(dst_rel)
    folder = os.path.dirname(target)
    tmp = None
    try:
        with dst._errors(dst_rel):
            fd, tmp = local_temp(target)
            os.close(fd)
            shutil.copyfile(source, tmp)  # sendfile / copy_file_range in the kernel
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, target)
            tmp = None
            sync_dir(folder)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    dst._count(requests=1)
