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


__all__ = ["GcsStore", "SET_THIS"]
