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
import time
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


def _extra(store: Store, operation: str) -> dict:
    """The user's ``s3_additional_kwargs`` (``-o s3_additional_kwargs.ServerSideEncryption=aws:kms``)
    that ``operation`` takes, as s3fs adds them to its own calls: the bulk path's objects
    are encrypted (SSE-KMS, SSE-C), or requester-paid, like the rest."""
    extra = getattr(store.fs, "s3_additional_kwargs", None) or {}
    if not extra:
        return {}
    members = client(store).meta.service_model.operation_model(operation).input_shape.members
    return {k: v for k, v in extra.items() if k in members}


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
            resp = client(store).get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end}",
                                            **_extra(store, "GetObject"))
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
                                         PartNumber=number, Body=_Body(data),
                                         **_extra(store, "UploadPart"))
    return str(resp["ETag"])


def put_object(store: Store, rel: str, data, *, exclusive: bool = False) -> None:
    """One PUT of a whole object from ``data`` (bytes or a memoryview, not copied);
    ``exclusive``: ``If-None-Match: *``, so an existing object makes the server refuse
    it (``PreconditionFailed``, an ``ALREADY_EXISTS`` error). Plain PUTs go through the
    native client first (:func:`native`)."""
    bucket, key = _bucket_key(store, rel)
    extra = {"IfNoneMatch": "*"} if exclusive else {}
    with store._errors(rel):
        if not exclusive and _native_call(store, bucket, lambda obs, st: obs.put(
                st, key, memoryview(data).cast("B"))):
            return
        client(store).put_object(Bucket=bucket, Key=key, Body=_Body(data), **extra,
                                 **_extra(store, "PutObject"))


def get_whole_into(store: Store, rel: str, buf: memoryview) -> int:
    """The whole object, expected to be ``len(buf)`` bytes, read into ``buf`` with one GET
    (no range): returns the object's size, which the caller compares with what it
    expected (more than ``len(buf)``: only ``len(buf)`` bytes were copied). The native
    client first (:func:`native`), else botocore.

    >>> get_whole_into(store, "model-00001-of-01000.safetensors", memoryview(buf))  # doctest: +SKIP
    104944
    """
    bucket, key = _bucket_key(store, rel)
    got: list[int] = []

    def fetch(obs, st) -> None:
        data = memoryview(obs.get(st, key).bytes()).cast("B")
        n = min(len(data), len(buf))
        buf[:n] = data[:n]
        got.append(len(data))

    with store._errors(rel):
        if not _native_call(store, bucket, fetch):
            got.append(get_into(store, rel, 0, buf, count=False))
    store._count(reads=1, bytes_read=min(got[0], len(buf)))
    return got[0]


# ---------------------------------------------------------------------- native client
_NO_NATIVE = object()
#: Native requests failing in a row before a filesystem uses botocore alone.
NATIVE_TRIES = 8
_native_lock = threading.Lock()
_clock = time.monotonic  # how long a native request took (tests stand in for it)


def native(store: Store):
    """``(obstore, a function bucket -> its obstore S3Store, the request budget in s)``
    for whole small objects, or None where obstore is not installed. botocore spends ~2 ms of Python per request
    (request building, signing, hooks, parsing), which makes 1,000 objects of 100 kB
    CPU-bound here (1,000 GETs, 4 threads, one ``rclone serve s3``: botocore 2.1 s and
    2.05 CPU s; obstore, Rust's ``object_store``, 0.45 s and 0.34 CPU s, the GIL released
    for each whole request). It gets the credentials, region and endpoint botocore
    resolved (any credential chain), bodies go unsigned as botocore's do, and it never
    decides an outcome: :func:`_native_call` answers a failure by asking botocore."""
    fs = store.fs
    made = getattr(fs, "_ckptctl_native", None)
    if made is None:
        with _native_lock:
            made = getattr(fs, "_ckptctl_native", None)
            if made is None:
                made = fs._ckptctl_native = _make_native(store)
    return None if made is _NO_NATIVE else made


def _make_native(store: Store):
    if getattr(store.fs, "s3_additional_kwargs", None):  # encryption, requester pays...:
        return _NO_NATIVE  # botocore sends them as s3fs does (:func:`_extra`)
    try:
        import obstore
        from obstore.store import S3Store
    except ImportError:
        return _NO_NATIVE
    fs, c = store.fs, client(store)
    creds = getattr(getattr(c, "_request_signer", None), "_credentials", None)
    frozen = creds.get_frozen_credentials() if creds is not None else None
    endpoint = getattr(fs, "endpoint_url", None) or (
        getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
    cfg = dict(getattr(fs, "config_kwargs", None) or {})
    read = float(cfg.get("read_timeout", 15))
    attempts = int((cfg.get("retries") or {}).get("total_max_attempts", 3))
    budget = read * max(1, attempts)
    options = {"timeout": f"{budget:g}s",
               "connect_timeout": f"{float(cfg.get('connect_timeout', 5)):g}s",
               "allow_http": bool(endpoint and endpoint.startswith("http://"))}
    base = {"region": c.meta.region_name or "us-east-1", "unsigned_payload": True,
            "client_options": options, "retry_config": {"max_retries": 0}}
    if endpoint:
        base.update(endpoint=endpoint, virtual_hosted_style_request=False)
    if frozen is None or getattr(fs, "anon", False):
        base["skip_signature"] = True
    else:
        base.update(access_key_id=frozen.access_key, secret_access_key=frozen.secret_key)
        if frozen.token:
            base["token"] = frozen.token
    stores: dict[str, object] = {}
    lock = threading.Lock()

    def for_bucket(bucket: str):
        with lock:
            st = stores.get(bucket)
            if st is None:
                st = stores[bucket] = S3Store(bucket, **base)
            return st

    return obstore, for_bucket, budget


def _native_call(store: Store, bucket: str, call) -> bool:
    """Run ``call(obstore, s3store)``; True if it succeeded. A request that ran out the
    whole budget raises ``TimeoutError`` (asking again would double the wait); any other
    failure returns False and the caller asks botocore, whose answer (its retries, error
    codes and messages: a 404 may be a missing object or a missing bucket) is the one
    ckptctl reports."""
    made = native(store)
    if made is None:
        return False
    obs, for_bucket, budget = made
    fs = store.fs
    t0 = _clock()
    try:
        call(obs, for_bucket(bucket))
        fs._ckptctl_native_failed = 0
        return True
    except Exception:  # noqa: BLE001 - botocore answers instead, or the budget is spent
        if _clock() - t0 >= 0.9 * budget:
            raise TimeoutError(f"no answer within {budget:g} s") from None
        # made afresh for the next request: its credentials may have expired (botocore
        # refreshes them); after NATIVE_TRIES failures in a row, botocore alone
        failed = getattr(fs, "_ckptctl_native_failed", 0) + 1
        fs._ckptctl_native_failed = failed
        with _native_lock:
            fs._ckptctl_native = _NO_NATIVE if failed >= NATIVE_TRIES else None
        return False
