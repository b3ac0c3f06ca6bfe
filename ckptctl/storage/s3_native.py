"""S3 natively: :class:`NativeS3Store` lists, stats, reads, PUTs whole objects, streams
writes (packs, consolidate's outputs) and deletes single keys through obstore (Rust's ``object_store``: imported in ~5 ms, a listing
of 1,000 keys in 25-40 ms, the GIL released). What only botocore does stays on
:class:`~ckptctl.storage.s3_store.S3Store`'s s3fs and botocore, made at their first
request: resumable multipart uploads (they need the upload ids obstore does not show),
DeleteObjects batches that name each refused key, CopyObject and If-Match updates. A
command that lists and reads S3 (``ls``, ``latest``, ``inspect``, ``diff``, a promote from
S3) or promotes small files to it imports neither s3fs nor botocore, unless the
credentials come from a profile or another chain only botocore reads.

Where the user asks for something only s3fs carries on reads (``s3_additional_kwargs``:
SSE-C keys, requester pays; ``version_aware``), :func:`wants_fsspec` sends the place down
the s3fs route instead.

>>> cfg = s3_config({"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}, env={})
>>> cfg["endpoint"], cfg["access_key_id"], cfg["virtual_hosted_style_request"]
('http://127.0.0.1:9', 'k', False)
"""
from __future__ import annotations

import contextlib
import os

from ..errors import CkptError
from .native_store import NativeReads, open_write, put_whole, shared_client, unlink
from .s3_store import S3Store
from .store import Store

#: options that change what a GET sends or returns: those places stay on s3fs
FSSPEC_ONLY = ("s3_additional_kwargs", "requester_pays", "version_aware")
#: the storage options an S3 place takes: s3fs's own, fsspec's, botocore's ``profile``
OPTIONS = frozenset((
    "anon", "asynchronous", "cache_regions", "client_kwargs", "config_kwargs",
    "default_block_size", "default_cache_type", "default_fill_cache", "endpoint_url",
    "fixed_upload_size", "key", "local_expiry_check", "max_concurrency", "password",
    "requester_pays", "s3_additional_kwargs", "secret", "session", "token", "use_ssl",
    "username", "version_aware", "profile", "retries", "skip_instance_cache",
    "use_listings_cache", "listings_expiry_time", "max_paths"))
#: servers (``_server()``) that answer a ranged GET with 200 and a Content-Range, which
#: obstore refuses: their ranges go through botocore (:meth:`NativeS3Store._pread`)
_NO_RANGES: set[str] = set()


def check_options(options: dict, shown: str) -> None:
    """Refuse, as s3fs would at its first request, an option no S3 client takes, and a
    nested option given flat (``-o config_kwargs=...``).

    >>> check_options({"endpoint": "http://x"}, "s3://b/r")
    Traceback (most recent call last):
    ckptctl.errors.UsageError: s3://b/r: unknown storage option 'endpoint' (S3: endpoint_url, key, secret, token, profile, client_kwargs...)
    """
    from ..errors import UsageError
    from .filesystems import s3fs_options

    for key in options:
        if key not in OPTIONS and key != "fsspec":
            raise UsageError(f"unknown storage option {key!r} (S3: endpoint_url, key, secret, "
                             "token, profile, client_kwargs...)", shown)
    s3fs_options(dict(options))  # nested options given flat: one line naming the form


def wants_fsspec(options: dict) -> bool:
    """Does ``options`` ask for something only the s3fs route does on reads?

    >>> wants_fsspec({"s3_additional_kwargs": {"SSECustomerKey": "x"}}), wants_fsspec({})
    (True, False)
    """
    return any(options.get(k) for k in FSSPEC_ONLY)


def _endpoint(options: dict, env) -> str | None:
    kw = options.get("client_kwargs") or {}
    return (options.get("endpoint_url") or kw.get("endpoint_url")
            or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"))


def s3_config(options: dict, env=None) -> dict:
    """obstore's ``S3Store`` settings from s3fs-style storage options and the AWS
    variables (options win); credentials only where they are given outright (keys in
    the options or the environment), else :func:`_chain_credentials` fills them."""
    env = os.environ if env is None else env
    kw = options.get("client_kwargs") or {}
    cfg: dict = {"region": kw.get("region_name") or env.get("AWS_REGION")
                 or env.get("AWS_DEFAULT_REGION") or "us-east-1",
                 "unsigned_payload": True}
    endpoint = _endpoint(options, env)
    if endpoint:
        cfg.update(endpoint=endpoint, virtual_hosted_style_request=False)
    if options.get("anon"):
        cfg["skip_signature"] = True
        return cfg
    key = options.get("key") or kw.get("aws_access_key_id")
    secret = options.get("secret") or kw.get("aws_secret_access_key")
    token = options.get("token") or kw.get("aws_session_token")
    if not key and not options.get("profile"):
        key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
        token = token or env.get("AWS_SESSION_TOKEN")
    if key and secret:
        cfg.update(access_key_id=key, secret_access_key=secret)
        if token:
            cfg["token"] = token
    return cfg


def _chain_credentials(options: dict, cfg: dict) -> None:
    """Credentials from botocore's chain (a profile, ``~/.aws``, instance metadata...)
    where none were given outright; none found: unsigned requests, as s3fs would fail
    them (the server says access denied, and the error names what to set)."""
    import botocore.session

    creds = botocore.session.Session(profile=options.get("profile")).get_credentials()
    frozen = creds.get_frozen_credentials() if creds is not None else None
    if frozen is None or not frozen.access_key:
        cfg["skip_signature"] = True
        return
    cfg.update(access_key_id=frozen.access_key, secret_access_key=frozen.secret_key)
    if frozen.token:
        cfg["token"] = frozen.token


def client_factory(options: dict):
    """A function bucket -> its obstore ``S3Store`` (one per bucket and settings in a
    process, shared by its threads), with ckptctl's request budget: each try waits
    ``budget / 3`` for an answer (10 s at most for the connection), two more tries
    within the budget."""
    from datetime import timedelta

    from .filesystems import BOTO_ATTEMPTS, request_timeout

    timeout = request_timeout()
    cfg_kw = options.get("config_kwargs") or {}
    per_try = float(cfg_kw.get("read_timeout") or timeout / BOTO_ATTEMPTS)
    connect = float(cfg_kw.get("connect_timeout") or min(per_try, 10.0))
    cfg = s3_config(options)
    state = {"cfg": cfg, "chained": "access_key_id" in cfg or cfg.get("skip_signature")}
    endpoint = cfg.get("endpoint") or ""
    client_options = {"timeout": f"{per_try:g}s", "connect_timeout": f"{connect:g}s",
                      "allow_http": endpoint.startswith("http://")}
    retry = {"max_retries": BOTO_ATTEMPTS - 1, "retry_timeout": timedelta(seconds=timeout)}

    def for_bucket(bucket: str):
        if not state["chained"]:
            _chain_credentials(options, state["cfg"])
            state["chained"] = True
        def make():
            from obstore.store import S3Store as ObstoreS3

            return ObstoreS3(bucket, config=state["cfg"], client_options=client_options,
                             retry_config=retry)

        return shared_client(repr(("s3", bucket, sorted(state["cfg"].items()),
                                   client_options, os.getpid())), make)

    for_bucket.server = f"s3:{endpoint}"
    for_bucket.access_key = cfg.get("access_key_id")
    for_bucket.secrets = [v for k, v in cfg.items()
                          if k in ("secret_access_key", "token") and isinstance(v, str)]
    return for_bucket


class NativeS3Store(NativeReads, S3Store):
    """A checkpoint root under ``s3://bucket/prefix``, read natively (see the module
    docstring).

    >>> s = NativeS3Store("s3://b/run", None, "s3", "b/run", options={})
    >>> s.key("a.bin"), s.parent().url, s.is_s3
    ('run/a.bin', 's3://b', True)
    """

    def read_into(self, rel: str, start: int, buf: memoryview) -> int:
        """One ranged GET into ``buf``: obstore's buffer copied once (no ``bytes`` in
        between); anything unusual (cached file, a short or refused range) through
        :meth:`read_range`."""
        if len(buf) and not self._cached(rel) and self._server() not in _NO_RANGES:
            import obstore

            try:
                with self._errors(rel):
                    got = memoryview(obstore.get_range(self.client(), self.key(rel),
                                                       start=start, end=start + len(buf)))
            except CkptError as e:
                got = None  # asked again below, where each case has its answer
                if "non-partial response" in e.message:
                    _NO_RANGES.add(self._server())
            if got is not None and got.nbytes == len(buf):
                buf[:] = got
                self._count(reads=1, bytes_read=len(buf))
                return len(buf)
        if len(buf) and not self._cached(rel) and self._server() in _NO_RANGES:
            from . import s3data  # straight into buf: a download's parts copied no more

            return s3data.get_into(self, rel, start, buf)
        data = self.read_range(rel, start, start + len(buf))
        buf[:len(data)] = data
        return len(data)

    def _pread(self, rel: str, start: int, end: int) -> bytes:
        """A ranged GET through obstore; from a server that answers ranges with 200 and a
        Content-Range (``rclone serve s3``), which obstore refuses, through botocore
        (:func:`~ckptctl.storage.s3data.get_into` reads what the header says), from then
        on for this server."""
        server = self._server()
        if server not in _NO_RANGES:
            try:
                return super()._pread(rel, start, end)
            except Exception as e:  # noqa: BLE001 - that one answer, by its words
                if "non-partial response" not in str(e):
                    raise
                _NO_RANGES.add(server)
        from . import s3data

        buf = bytearray(end - start)
        n = s3data.get_into(self, rel, start, memoryview(buf), count=False)
        return bytes(buf[:n])

    # ---------------------------------------------------------------- writes
    def open(self, rel: str, mode: str = "rb", **kw):
        """Reads as :class:`S3Store` (s3fs's buffered file); streamed writes through
        obstore (:func:`~ckptctl.storage.native_store.open_write`)."""
        if "w" in mode or "x" in mode:
            return open_write(self, rel, mode)
        return super().open(rel, mode, **kw)

    def _put(self, rel: str, full: str, data: bytes, exclusive: bool) -> None:
        put_whole(self, rel, data, exclusive)

    def _unlink(self, full: str) -> None:
        unlink(self, full)
        self._forget_listings()

    def _forget_listings(self) -> None:
        """s3fs's cached listings of this root, where s3fs was made (its writes)."""
        if self._fs is not None:
            with contextlib.suppress(Exception):
                self._fs.invalidate_cache(self.root)

    def same_server(self, other: Store) -> bool:
        if not other.is_s3:
            return False
        if isinstance(other, NativeS3Store):
            return (self._server() == other._server() and getattr(
                self._client_factory, "access_key", None) == getattr(
                other._client_factory, "access_key", None))
        return super().same_server(other)

    def _server(self) -> str | None:
        return getattr(self._client_factory, "server", None) or "s3:"

    def _secrets(self) -> list[str]:
        found = list(getattr(self._client_factory, "secrets", []))
        found += [os.environ.get(v) for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                               "AWS_SESSION_TOKEN")]
        found += [self._options.get(k) for k in ("key", "secret", "token")]
        return [x for x in found if isinstance(x, str) and len(x) >= 4]


__all__ = ["NativeS3Store", "client_factory", "s3_config", "wants_fsspec"]
