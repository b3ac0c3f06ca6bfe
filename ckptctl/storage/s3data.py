"""The bulk data path to S3: ranged GETs read straight into the caller's buffer and
upload parts sent from the caller's memory, on the caller's thread.

s3fs stays the URL, listing and metadata layer; the bytes of large transfers take this
path instead, because s3fs runs every request on one event-loop thread and signs every
request body with SHA-256 over plain http (measured here: 287 MB/s for 16 concurrent
ranged GETs through s3fs against 596 MB/s on 4 threads of this path; README, "Design
notes"). Each store's filesystem gets one thread-safe botocore client, built from the
same credentials, endpoint and ``config_kwargs`` as its s3fs client (so timeouts,
retries and ``-o`` options hold unchanged), with two differences that cost nothing in
safety: bodies are sent as ``UNSIGNED-PAYLOAD`` (ckptctl proves every byte with its own
content hash before it publishes a file) and no request checksum is computed where the
server does not require one (``-o config_kwargs.request_checksum_calculation=when_supported``
restores it). Sockets release the GIL, so ``workers`` threads move bytes at once.

>>> buf = bytearray(8 << 20)                                        # doctest: +SKIP
>>> get_into(store, "__0_0.distcp", 0, memoryview(buf))             # doctest: +SKIP
8388608
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Iterator

from ..errors import StorageError

if TYPE_CHECKING:
    from .store import Store

#: Connections kept per client: at least as many as a transfer runs workers.
POOL_CONNECTIONS = 32
# AioConfig keys botocore's own Config does not take
_ASYNC_ONLY = ("connector_args", "http_session_cls")
_lock = threading.Lock()


def client(store: Store):
    """The store's bulk botocore client (made once per filesystem, shared by threads)."""
    fs = store.fs
    c = getattr(fs, "_ckptctl_bulk", None)
    if c is not None:
        return c
    with _lock:
        c = getattr(fs, "_ckptctl_bulk", None)
        if c is None:
            c = _make_client(fs)
            fs._ckptctl_bulk = c
    return c


def _make_client(fs):
    import botocore.session
    from botocore import UNSIGNED
    from botocore.config import Config

    cfg = {k: v for k, v in dict(getattr(fs, "config_kwargs", None) or {}).items()
           if k not in _ASYNC_ONLY}
    cfg.setdefault("connect_timeout", getattr(fs, "connect_timeout", 5))
    cfg.setdefault("read_timeout", getattr(fs, "read_timeout", 15))
    cfg["s3"] = {"payload_signing_enabled": False, **(cfg.get("s3") or {})}
    cfg["max_pool_connections"] = max(POOL_CONNECTIONS, int(cfg.get("max_pool_connections", 0)))
    kw = dict(getattr(fs, "client_kwargs", None) or {})
    creds = {"aws_access_key_id": fs.key, "aws_secret_access_key": fs.secret,
             "aws_session_token": fs.token, "endpoint_url": fs.endpoint_url}
    kw.update({k: v for k, v in creds.items() if v is not None and k not in kw})
    if getattr(fs, "anon", False):
        cfg["signature_version"] = UNSIGNED
        for k in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token"):
            kw.pop(k, None)
    if "use_ssl" not in kw and getattr(fs, "use_ssl", None) is not None:
        kw["use_ssl"] = fs.use_ssl
    session = botocore.session.Session(profile=(getattr(fs, "kwargs", None) or {}).get("profile"))
    loaded = getattr(getattr(fs, "session", None), "get_component", None)
    if loaded is not None:  # s3fs's session has parsed S3's service model already: 90 -> 17 ms
        session.register_component("data_loader", loaded("data_loader"))
    # no response's dates are read here, and parsing them (dateutil, two a GET) was 0.9 ms of
    # a small object's 7 ms in a profile: keep them as the server's strings (as the AWS CLI
    # does for its raw output)
    session.get_component("response_parser_factory").set_parser_defaults(
        timestamp_parser=str)
    return session.create_client("s3", config=Config(**cfg), **kw)


def _bucket_key(store: Store, rel: str) -> tuple[str, str]:
    bucket, _, key = store.full(rel).partition("/")
    return bucket, key


def get_into(store: Store, rel: str, start: int, buf: memoryview, *, count: bool = True) -> int:
    """Fill ``buf`` with the object's bytes from ``start`` (one ranged GET read straight
    into ``buf``: no intermediate copy); returns how many there were (short at the end
    of the object, 0 past it). A server that answers another range is caught, never read
    from the wrong offset. ``count``: add the read to the store's stats."""
    if not len(buf):
        return 0
    bucket, key = _bucket_key(store, rel)
    end = start + len(buf) - 1
    with store._errors(rel):
        try:
            resp = client(store).get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end}")
        except Exception as e:  # noqa: BLE001 - past the end is a short read, not a failure
            if (getattr(e, "response", None) or {}).get("Error", {}).get("Code") == "InvalidRange":
                return 0
            raise
        raw = resp["Body"]._raw_stream  # urllib3's response: read its http.client body
        try:
            # rclone answers a range with 200 and a Content-Range: the header decides
            got = str(resp.get("ContentRange") or "")
            if got and not got.startswith(f"bytes {start}-") or not got and start:
                raise StorageError(store.display(rel), "the server answered another byte "
                                   f"range than asked ({got[:60] or 'the whole object'})")
            fp, n = raw._fp, 0
            while n < len(buf):
                k = fp.readinto(buf[n:])
                if not k:
                    break
                n += k
            whole = fp.isclosed()
        except BaseException:
            raw.close()
            raise
        if whole:
            raw.release_conn()
        else:  # bytes left unread (whole object sent for a range): the connection is spent
            raw.close()
    if count:
        store._count(reads=1, bytes_read=n)
    return n


def iter_blocks(store: Store, rel: str, size: int, *, block: int = 8 << 20,
                depth: int = 4) -> Iterator[memoryview]:
    """The first ``size`` bytes of an object in order, in blocks of ``block``, with
    ``depth`` ranged GETs in flight (each into a buffer of its own, reused): a block is
    valid until the next one is asked for. An object shorter than ``size`` is an error
    (it changed since it was listed), never a short hash. Reads are counted by the
    caller (:meth:`Store.iter_blocks` counts one)."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    spans = deque((s, min(size, s + block)) for s in range(0, size, block))
    if not spans:
        return
    depth = max(1, min(depth, len(spans)))
    free = [bytearray(min(block, size)) for _ in range(min(depth + 1, len(spans)))]
    pending: deque = deque()
    pool = ThreadPoolExecutor(depth, thread_name_prefix="ckptctl-get")

    def submit() -> None:
        start, end = spans.popleft()
        buf = free.pop()
        view = memoryview(buf)[:end - start]
        pending.append((start, end, buf, pool.submit(get_into, store, rel, start, view,
                                                     count=False)))

    try:
        while spans and len(pending) < depth:
            submit()
        while pending:
            start, end, buf, fut = pending.popleft()
            got = fut.result()
            if got != end - start:
                raise StorageError(store.display(rel), f"shorter than when listed ({start + got} "
                                   f"of {size} bytes): it changed while being read",
                                   code="SIZE_MISMATCH")
            if spans:
                submit()
            yield memoryview(buf)[:got]
            free.append(buf)
    finally:
        for *_, fut in pending:
            fut.cancel()
        pool.shutdown(wait=True)

class _Body:
    """A request body over a memoryview: sent in slices, rewound by botocore's retries."""

    def __init__(self, data):
        self._mv = memoryview(data).cast("B")
        self._pos = 0

    def __len__(self) -> int:
        return len(self._mv)

    def read(self, n: int = -1):
        end = len(self._mv) if n is None or n < 0 else min(len(self._mv), self._pos + n)
        chunk = self._mv[self._pos:end]
        self._pos = end
        return chunk

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = {0: pos, 1: self._pos + pos, 2: len(self._mv) + pos}[whence]
        return self._pos

    def tell(self) -> int:
        return self._pos


def put_part(store: Store, rel: str, upload_id: str, number: int, data) -> str:
    """Send part ``number`` of multipart upload ``upload_id`` from ``data`` (bytes or a
    memoryview, not copied); returns the part's ETag."""
    bucket, key = _bucket_key(store, rel)
    with store._errors(rel):
        resp = client(store).upload_part(Bucket=bucket, Key=key, UploadId=upload_id,
                                         PartNumber=number, Body=_Body(data))
    return str(resp["ETag"])


def put_object(store: Store, rel: str, data, *, exclusive: bool = False) -> None:
    """One PUT of a whole object from ``data`` (bytes or a memoryview, not copied);
    ``exclusive``: ``If-None-Match: *``, so an existing object makes the server refuse
    it (``PreconditionFailed``, an ``ALREADY_EXISTS`` error)."""
    bucket, key = _bucket_key(store, rel)
    extra = {"IfNoneMatch": "*"} if exclusive else {}
    with store._errors(rel):
        client(store).put_object(Bucket=bucket, Key=key, Body=_Body(data), **extra)
