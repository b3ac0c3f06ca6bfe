"""Google Cloud Storage: ``gs://BUCKET/PREFIX`` as a :class:`~ckptctl.storage.store.Store`
on gcsfs (the JSON API: what the loopback fake-gcs-server speaks; obstore's GCS client
speaks the XML API, which it does not).

Credentials the way Google's own tools take them: ``STORAGE_EMULATOR_HOST`` (an emulator:
anonymous), ``GOOGLE_APPLICATION_CREDENTIALS`` (a service-account or user JSON file), else
gcloud's application-default credentials or the metadata server; ``-o token=anon`` for a
public bucket, ``-o token=PATH`` for a JSON key file, ``-o project=...``,
``-o endpoint_url=...``. Exclusive writes (the manifest, commit markers) send
``ifGenerationMatch=0``, which the server enforces. gcsfs's options are
:func:`~ckptctl.storage.filesystems.gcs_options`.

>>> s = GcsStore("gs://b/run", None, "gs", "b/run")
>>> s.caps.exclusive_create, s.parent().url
(True, 'gs://b')
"""
from __future__ import annotations

from .failures import GCS_CREDENTIALS
from .store import Store
from .store_core import Capabilities

SET_THIS = GCS_CREDENTIALS  # what a missing or refused credential names


class GcsStore(Store):
    """A checkpoint root under ``gs://bucket/prefix`` (see the module docstring)."""

    @property
    def caps(self) -> Capabilities:
        return Capabilities(False, True, False, False)

    def _server(self) -> str | None:
        return f"gs:{getattr(self.fs, '_endpoint', None) or getattr(self.fs, 'endpoint_url', '')}"


__all__ = ["GcsStore", "SET_THIS"]
