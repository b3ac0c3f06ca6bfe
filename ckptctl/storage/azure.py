"""Azure Blob Storage: ``az://CONTAINER/PREFIX`` (and ``abfs://``, as adlfs spells it) as a
:class:`~ckptctl.storage.native_store.NativeStore` on obstore's ``AzureStore``.

Credentials the way Azure's own tools take them, first found wins:

1. ``--storage-option`` keys (``-o account_name=... -o account_key=...``; also
   ``sas_token``, ``endpoint``, ``connection_string``, ``use_emulator``, ``anon``);
2. ``AZURE_STORAGE_CONNECTION_STRING`` (``AccountName``, ``AccountKey``,
   ``SharedAccessSignature``, ``BlobEndpoint``: Azurite's development string works);
3. ``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_ACCOUNT_KEY`` or
   ``AZURE_STORAGE_SAS_TOKEN``, else obstore's own chain (Azure CLI, managed identity...).

With no account name anywhere, opening the store fails with one line naming the
variables to set (exit 3).

>>> azure_config({"connection_string": "AccountName=a;AccountKey=k;"
...               "BlobEndpoint=http://127.0.0.1:1/a"}, env={})
{'account_name': 'a', 'account_key': 'k', 'endpoint': 'http://127.0.0.1:1/a'}
"""
from __future__ import annotations

import os
from datetime import timedelta

from ..errors import StorageError, UsageError
from .failures import AZURE_CREDENTIALS
from .native_store import NativeStore, shared_client
from .store import Store
from .store_core import Capabilities

#: ``--storage-option`` keys this backend takes (anything else: a usage error)
OPTIONS = ("account_name", "account_key", "sas_token", "endpoint", "connection_string",
           "use_emulator", "anon", "timeout")
SET_THIS = AZURE_CREDENTIALS  # what a missing or refused credential names
#: Azurite's documented development account (its key is public, in Azure's docs)
EMULATOR_ACCOUNT = "devstoreaccount1"
_CONN_KEYS = {"accountname": "account_name", "accountkey": "account_key",
              "sharedaccesssignature": "sas_token", "blobendpoint": "endpoint"}


def parse_connection_string(text: str) -> dict:
    """An Azure connection string's parts as obstore's config keys.

    >>> parse_connection_string("DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=K==;")
    {'account_name': 'acct', 'account_key': 'K=='}
    """
    out = {}
    for part in text.split(";"):
        name, sep, value = part.partition("=")
        key = _CONN_KEYS.get(name.strip().lower())
        if sep and key and value:
            out[key] = value.strip()
    return out


def azure_config(options: dict | None, env=None) -> dict:
    """obstore's ``AzureStore`` config from ``--storage-option`` keys and the environment
    (see the module docstring for the order)."""
    env = os.environ if env is None else env
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise UsageError(f"unknown storage option {unknown[0]!r} for az:// "
                         f"(Azure: {', '.join(OPTIONS)})")
    cfg: dict = {}
    conn = options.pop("connection_string", None) or (
        None if options.get("account_name") else env.get("AZURE_STORAGE_CONNECTION_STRING"))
    if conn:
        cfg.update(parse_connection_string(conn))
    elif not options.get("account_name"):
        for var, key in (("AZURE_STORAGE_ACCOUNT_NAME", "account_name"),
                         ("AZURE_STORAGE_ACCOUNT_KEY", "account_key"),
                         ("AZURE_STORAGE_SAS_TOKEN", "sas_token"),
                         ("AZURE_STORAGE_ENDPOINT", "endpoint")):
            if env.get(var):
                cfg[key] = env[var]
    for key in ("account_name", "account_key", "sas_token", "endpoint"):
        if options.get(key):
            cfg[key] = str(options[key])
    if options.get("use_emulator") and not cfg.get("endpoint"):
        # obstore's emulator mode goes to 127.0.0.1:10000 whatever the endpoint says
        cfg.update(use_emulator=True, account_name=cfg.get("account_name") or EMULATOR_ACCOUNT)
    if options.get("anon"):
        cfg["skip_signature"] = True
    return cfg


def client_factory(options: dict | None):
    """A function container -> its obstore ``AzureStore`` (one per container and
    settings in a process, shared by its threads)."""
    from .filesystems import request_timeout

    timeout = float((options or {}).get("timeout") or request_timeout())
    cfg = azure_config({k: v for k, v in (options or {}).items() if k != "timeout"})
    if not cfg.get("account_name"):
        raise StorageError(None, f"no Azure account: {SET_THIS}")
    endpoint = cfg.get("endpoint", "")
    client_options = {"timeout": f"{timeout:g}s", "connect_timeout": f"{min(timeout, 10):g}s",
                      "allow_http": endpoint.startswith("http://") or bool(cfg.get("use_emulator"))}

    budget = timedelta(seconds=timeout)

    def for_container(container: str):
        def make():
            from obstore.store import AzureStore

            return AzureStore(container, config=cfg, client_options=client_options,
                              retry_config={"max_retries": 2, "retry_timeout": budget})

        return shared_client(repr(("az", container, sorted(cfg.items()), timeout,
                                   os.getpid())), make)

    for_container.secrets = [v for k, v in cfg.items()
                             if k in ("account_key", "sas_token") and isinstance(v, str)]
    for_container.server = f"az:{endpoint or cfg['account_name']}"
    return for_container


class AzureStore(NativeStore):
    """A checkpoint root under ``az://container/prefix`` (see the module docstring).

    >>> s = AzureStore("az://c/run", None, "az", "c/run")
    >>> s.key("a.bin"), s.parent().url
    ('run/a.bin', 'az://c')
    """

    @property
    def caps(self) -> Capabilities:
        # Copy Blob within the container: the bytes never pass through this process
        return Capabilities(False, True, True, False)

    def same_server(self, other: Store) -> bool:
        """Same account, endpoint, credentials and container (one obstore client copies
        within its container only)."""
        return (isinstance(other, AzureStore) and self._server() == other._server()
                and self._secrets() == other._secrets()
                and self.root.partition("/")[0] == other.root.partition("/")[0])

    def copy_in(self, src: "AzureStore", src_rel: str, rel: str) -> None:
        """Copy ``src_rel`` of ``src`` (:meth:`same_server`) to ``rel`` on the server."""
        import obstore

        self._uncache(rel)
        with src._errors(src_rel):
            obstore.head(src.client(), src.key(src_rel))  # a missing source names itself
        with self._errors(rel):
            obstore.copy(self.client(), src.key(src_rel), self.key(rel))
        self._count(requests=1)

    def _server(self) -> str | None:
        return getattr(self._client_factory, "server", None) or "az:"

    def _secrets(self) -> list[str]:
        return list(getattr(self._client_factory, "secrets", []))


__all__ = ["AzureStore", "azure_config", "client_factory", "parse_connection_string"]
