"""pytest plugin: Google Cloud Storage and Azure Blob servers on loopback (see
``cloudservers.py``).

Load with ``pytest_plugins = ["fixtures_cloud"]`` in the root conftest (or ``-p fixtures_cloud``).

- ``fake_gcs`` / ``azurite``: one server per session (per xdist worker), stopped at the end.
- ``gcs_bucket`` / ``az_container``: a fresh, uniquely named bucket / container per test, with
  the server's variables (``STORAGE_EMULATOR_HOST`` / ``AZURE_STORAGE_CONNECTION_STRING``)
  set in ``os.environ`` for the test's duration, so in-process clients find the emulator;
  a CLI run in a subprocess gets them with ``env={**os.environ, **bucket.env}``.  Its objects
  and itself are deleted after the test (the servers keep everything in memory).

A server that cannot start fails the test with the reason; nothing here ever skips.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from cloudservers import AzureServer, CloudServerError, GcsServer, start_azurite, start_fake_gcs


def _files(local_dir) -> list[tuple[Path, str]]:
    """Every file under ``local_dir`` (dotfiles included): (path, relative posix path)."""
    local_dir = Path(local_dir)
    return [(p, p.relative_to(local_dir).as_posix())
            for p in sorted(local_dir.rglob("*")) if p.is_file()]


def _key(prefix: str, rel: str) -> str:
    prefix = prefix.strip("/")
    return f"{prefix}/{rel}" if prefix else rel


@dataclass
class GcsBucket:
    server: GcsServer
    bucket: str

    @property
    def name(self) -> str:
        return self.bucket

    def url(self, prefix: str = "") -> str:
        return f"gs://{self.bucket}/{prefix.strip('/')}".rstrip("/")

    @property
    def env(self) -> dict:
        return self.server.env

    def upload(self, local_dir, prefix: str = "") -> list[str]:
        """Upload a local tree under ``prefix``; returns the object keys written."""
        keys = []
        for path, rel in _files(local_dir):
            keys.append(_key(prefix, rel))
            self.server.put(self.bucket, keys[-1], path.read_bytes())
        return keys

    def list(self, prefix: str = "") -> dict[str, int]:
        """``{key: size}`` under ``prefix``."""
        return self.server.list(self.bucket, prefix)

    def get(self, key: str) -> bytes:
        return self.server.get(self.bucket, key)

    def put(self, key: str, data: bytes) -> dict:
        return self.server.put(self.bucket, key, data)

    def delete(self, key: str) -> None:
        self.server.delete(self.bucket, key)


@dataclass
class AzContainer:
    server: AzureServer
    container: str

    @property
    def name(self) -> str:
        return self.container

    def url(self, prefix: str = "") -> str:
        return f"az://{self.container}/{prefix.strip('/')}".rstrip("/")

    @property
    def env(self) -> dict:
        return self.server.env

    def upload(self, local_dir, prefix: str = "") -> list[str]:
        """Upload a local tree under ``prefix``; returns the blob names written."""
        names = []
        for path, rel in _files(local_dir):
            names.append(_key(prefix, rel))
            self.server.put(self.container, names[-1], path.read_bytes())
        return names

    def list(self, prefix: str = "") -> dict[str, int]:
        """``{blob name: size}`` under ``prefix``."""
        return self.server.list(self.container, prefix)

    def get(self, key: str) -> bytes:
        return self.server.get(self.container, key)

    def put(self, key: str, data: bytes) -> str:
        return self.server.put(self.container, key, data)

    def delete(self, key: str) -> None:
        self.server.delete(self.container, key)


def _server(what: str, start):
    try:
        return start()
    except Exception as e:  # fail (never skip) with the server's own words
        pytest.fail(f"cannot start {what}: {e}", pytrace=False)


@pytest.fixture(scope="session")
def fake_gcs():
    srv = _server("fake-gcs-server", start_fake_gcs)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def azurite():
    srv = _server("Azurite", start_azurite)
    yield srv
    srv.stop()


def _name() -> str:
    """Unique, valid as a GCS bucket and an Azure container (lowercase, digits, hyphens)."""
    return f"t-{uuid.uuid4().hex[:16]}"


@pytest.fixture
def gcs_bucket(fake_gcs, monkeypatch):
    name = _name()
    fake_gcs.make_bucket(name)
    for k, v in fake_gcs.env.items():
        monkeypatch.setenv(k, v)
    yield GcsBucket(fake_gcs, name)
    with contextlib.suppress(OSError, CloudServerError):  # free the memory; names are never reused
        fake_gcs.delete_bucket(name)


@pytest.fixture
def az_container(azurite, monkeypatch):
    name = _name()
    azurite.make_container(name)
    for k, v in azurite.env.items():
        monkeypatch.setenv(k, v)
    yield AzContainer(azurite, name)
    with contextlib.suppress(OSError, CloudServerError):  # free the memory; names are never reused
        azurite.delete_container(name)
