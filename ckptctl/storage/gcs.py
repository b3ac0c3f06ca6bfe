"""Google Cloud Storage: ``gs://BUCKET/PREFIX`` as a :class:`~ckptctl.storage.store.Store`.

Reads (listings, HEADs, ranged GETs) go through obstore (:class:`NativeGcsStore`): it
starts in milliseconds where gcsfs costs 0.5-0.6 s of imports and sessions, and the
loopback fake-gcs-server answers its XML-style reads. Writes stay on gcsfs (the JSON API:
obstore's XML-API uploads are refused by fake-gcs-server, so they could not be tested
here), made on the first write only.

Credentials the way Google's own tools take them: ``STORAGE_EMULATOR_HOST`` (an emulator:
anonymous), ``GOOGLE_APPLICATION_CREDENTIALS`` (a service-account or user JSON file), else
gcloud's application-default credentials or the metadata server; ``-o token=anon`` for a
public bucket, ``-o token=PATH`` for a JSON key file, ``-o project=...``,
``-o endpoint_url=...``. Other gcsfs options, or ``-o fsspec=true``, take gcsfs for reads
too (:class:`GcsStore`). Exclusive writes (the manifest, commit markers) send
``ifGenerationMatch=0``, which the server enforces. gcsfs's options are
:func:`~ckptctl.storage.filesystems.gcs_options`.

>>> s = GcsStore("gs://b/run", None, "gs", "b/run")
>>> s.caps.exclusive_create, s.parent().url
(True, 'gs://b')
>>> gcs_config({}, env={"STORAGE_EMULATOR_HOST": "127.0.0.1:9"})
{'base_url': 'http://127.0.0.1:9', 'skip_signature': True}
>>> gcs_config({"token": "/keys/sa.json"}, env={})
{'application_credentials': '/keys/sa.json'}
"""
from __future__ import annotations

import os
from datetime import timedelta

from .failures import GCS_CREDENTIALS
from .native_store import NativeReads, shared_client
from .store import Store
from .store_core import Capabilities

#: bytes per resumable-upload request of a streamed write (a multiple of GCS's 256 KiB)
CHUNK = 16 << 20
SET_THIS = GCS_CREDENTIALS  # what a missing or refused credential names


class GcsStore(Store):
    """A checkpoint root under ``gs://bucket/prefix`` (see the module docstring)."""

    @property
    def caps(self) -> Capabilities:
        return Capabilities(False, True, False, False)

    def open(self, rel: str, mode: str = "rb", **kw):
        """As :meth:`Store.open`; a write goes up in resumable chunks of :data:`CHUNK`
        (gcsfs's default, 5 MiB, is a round trip each, and fake-gcs-server spends CPU per
        chunk in proportion to the object so far: 256 MiB cost it 8.4 s in 5 MiB chunks,
        5.0 s in 16 MiB ones)."""
        if ("w" in mode or "x" in mode) and "block_size" not in kw:
            kw["block_size"] = CHUNK
        return super().open(rel, mode, **kw)

    def _server(self) -> str | None:
        return f"gs:{getattr(self.fs, '_endpoint', None) or getattr(self.fs, 'endpoint_url', '')}"


#: the storage options obstore's reads take; any other (a gcsfs option) reads through gcsfs
NATIVE_OPTIONS = ("token", "project", "endpoint_url")


def native_options(options: dict | None) -> bool:
    """Can obstore read with these options (else gcsfs reads too)?

    >>> native_options({"token": "anon"}), native_options({"token": {"a": 1}})
    (True, False)
    >>> native_options({"requester_pays": True})
    False
    """
    options = options or {}
    return set(options) <= set(NATIVE_OPTIONS) and \
        isinstance(options.get("token", ""), str)


def gcs_config(options: dict | None, env=None) -> dict:
    """obstore's GCS configuration from the settings gcsfs takes (the module docstring):
    the endpoint (``-o endpoint_url``, else ``STORAGE_EMULATOR_HOST``) as its base URL; no
    signature for an emulator or ``token=anon``; a key file from ``token=PATH``. Without
    these, obstore finds the credentials itself, as gcloud does
    (``GOOGLE_APPLICATION_CREDENTIALS``, application-default credentials, the metadata
    server)."""
    env = os.environ if env is None else env
    options = options or {}
    cfg: dict = {}
    emulator = env.get("STORAGE_EMULATOR_HOST", "")
    emulator = "" if emulator == "default" else emulator
    endpoint = options.get("endpoint_url") or emulator
    if endpoint:
        cfg["base_url"] = endpoint if "://" in endpoint else f"http://{endpoint}"
    token = options.get("token")
    if token == "anon" or (token is None and emulator and not options.get("endpoint_url")):
        cfg["skip_signature"] = True
    elif token and token not in ("google_default", "cloud", "cache", "browser"):
        cfg["application_credentials"] = os.path.expanduser(token)
    return cfg


def client_factory(options: dict | None):
    """A function bucket -> its obstore ``GCSStore`` (one per bucket and settings in a
    process, shared by its threads), within ckptctl's request budget."""
    from .filesystems import request_timeout

    timeout = request_timeout()
    cfg = gcs_config(options)
    client_options = {"timeout": f"{timeout:g}s", "connect_timeout": f"{min(timeout, 10):g}s",
                      "allow_http": cfg.get("base_url", "").startswith("http://")}
    budget = timedelta(seconds=timeout)

    def for_bucket(bucket: str):
        def make():
            from obstore.store import GCSStore

            return GCSStore(bucket, config=cfg, client_options=client_options,
                            retry_config={"max_retries": 2, "retry_timeout": budget})

        return shared_client(repr(("gs", bucket, sorted(cfg.items()), timeout, os.getpid())),
                             make)

    for_bucket.server = f"gs:{cfg.get('base_url', '')}"
    return for_bucket


class NativeGcsStore(NativeReads, GcsStore):
    """A checkpoint root under ``gs://bucket/prefix``, read through obstore, written
    through gcsfs (see the module docstring).

    >>> s = NativeGcsStore("gs://b/run", None, "gs", "b/run", options={})
    >>> s.key("a.bin"), s.parent().url, s.caps.exclusive_create
    ('run/a.bin', 'gs://b', True)
    """

    def open(self, rel: str, mode: str = "rb", **kw):
        """Writes as :class:`GcsStore` (gcsfs's resumable upload); reads as the base
        store does, through :meth:`read_range`."""
        return GcsStore.open(self, rel, mode, **kw)

    def _server(self) -> str | None:
        return getattr(self._client_factory, "server", None) or "gs:"


__all__ = ["GcsStore", "NativeGcsStore", "SET_THIS", "client_factory", "gcs_config",
           "native_options"]
