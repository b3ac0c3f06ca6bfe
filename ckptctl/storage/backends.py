"""Which store answers a URL: :func:`open_store`.

=================  ===============================================================
URL                store
=================  ===============================================================
a path, file://    :class:`~ckptctl.storage.local_store.LocalStore` (the OS)
s3://, s3a://      :class:`~ckptctl.storage.s3_native.NativeS3Store` (reads: obstore;
                   writes: s3fs and botocore)
az://, abfs://     :class:`~ckptctl.storage.azure.AzureStore` (obstore)
gs://, gcs://      :class:`~ckptctl.storage.gcs.NativeGcsStore` (reads: obstore;
                   writes: gcsfs)
anything else      :class:`Store` on that protocol's fsspec filesystem
=================  ===============================================================

``--storage-option fsspec=true`` opens a remote place through its fsspec filesystem
(s3fs, adlfs, gcsfs) instead: S3 on :class:`~ckptctl.storage.s3_store.S3Store`, any other
with the generic :class:`Store`; S3 options only s3fs carries on reads
(``s3_additional_kwargs``...) do the same.

>>> import tempfile
>>> type(open_store(tempfile.mkdtemp())).__name__, type(open_store("s3://b/run")).__name__
('LocalStore', 'NativeS3Store')
"""
from __future__ import annotations

import os

from ..errors import UsageError
from .filesystems import make_filesystem
from .local_store import LocalStore
from .s3_store import S3Store
from .store import Store
from .urls import split_url


def open_store(url: str, storage_options: dict | None = None) -> "Store":
    """Open the place at ``url`` (a plain path, ``file://``, ``s3://bucket/prefix``,
    ``az://container/prefix``, ``gs://bucket/prefix``, any fsspec URL): see the module
    docstring for which store answers.

    >>> type(open_store("s3://bucket/run")).__name__, type(open_store("memory://x")).__name__
    ('NativeS3Store', 'Store')
    """
    protocol, path = split_url(url)
    options = dict(storage_options or {})
    generic = options.pop("fsspec", False)
    if generic not in (True, False):
        raise UsageError(f"storage option fsspec takes true or false, got {generic!r}")
    url = url.rstrip("/")
    if protocol == "file":
        # no fsspec import unless storage options ask for it (or a call needs it)
        fs = make_filesystem(protocol, options) if options else None
        return LocalStore(path, fs, protocol, path)
    if protocol in ("az", "abfs") and not generic:
        from .azure import AzureStore, client_factory

        path, options = _azure_account(path, options)
        return AzureStore(url, None, protocol, path, client_factory=client_factory(options))
    if protocol in ("az", "abfs"):
        path, options = _azure_account(path, options)
        options = _adlfs_options(options)
    if protocol in ("s3", "s3a") and not generic:
        from .s3_native import NativeS3Store, check_options, client_factory, wants_fsspec

        check_options(options, url)
        if not wants_fsspec(options):
            return NativeS3Store(url, None, protocol, path, options=options,
                                 client_factory=client_factory(options))
    if protocol in ("gs", "gcs") and not generic:
        from .gcs import NativeGcsStore, client_factory, native_options

        if native_options(options):
            return NativeGcsStore(url, None, protocol, path, options=options,
                                  client_factory=client_factory(options))
    fs = make_filesystem(protocol, options)
    if protocol in ("s3", "s3a"):
        return S3Store(url, fs, protocol, path)
    if protocol in ("gs", "gcs") and not generic:
        from .gcs import GcsStore

        return GcsStore(url, fs, protocol, path)
    return Store(url, fs, protocol, path)


def _azure_account(path: str, options: dict) -> tuple[str, dict]:
    """``container@account.blob.core.windows.net/prefix`` (adlfs's spelling) ->
    ``container/prefix`` and the account as a storage option."""
    head, sep, rest = path.partition("/")
    if "@" in head:
        container, _, host = head.partition("@")
        options = {"account_name": host.split(".")[0], **options}
        path = f"{container}{sep}{rest}"
    return path, options


def _adlfs_options(options: dict) -> dict:
    """adlfs's options from the same settings: the connection string whole, else the
    account and its key or SAS token (:func:`~ckptctl.storage.azure.azure_config`)."""
    from .azure import azure_config

    conn = options.get("connection_string") or (
        None if options.get("account_name") else os.environ.get("AZURE_STORAGE_CONNECTION_STRING"))
    if conn:
        return {"connection_string": conn}
    cfg = azure_config(options)
    return {k: cfg[k] for k in ("account_name", "account_key", "sas_token") if cfg.get(k)}
