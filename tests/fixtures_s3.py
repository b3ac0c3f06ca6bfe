"""pytest plugin: S3 servers on loopback (see ``s3server.py``).

Load with ``pytest_plugins = ["fixtures_s3"]`` in the root conftest (or ``-p fixtures_s3``).

- ``rclone_s3`` / ``moto_s3``: one server per session (per xdist worker), stopped at the end;
  ``rclone_s3_readonly``: a read-only server over ``rclone_s3``'s data.
- ``s3_bucket`` / ``moto_bucket``: a fresh, uniquely named bucket per test, with the server's
  request log reset once the bucket exists.
- every test starts and ends with s3fs's instance cache cleared, and no server marked
  dead (unanswering) by an earlier test.

A server that cannot start fails the test with the reason; nothing here ever skips.
"""

from __future__ import annotations

import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from s3server import S3Server, fresh_fs, make_bucket, start_moto, start_rclone, upload_dir


@dataclass
class S3Bucket:
    server: S3Server
    bucket: str

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix.strip('/')}".rstrip("/")

    def path(self, prefix: str = "") -> str:
        """``bucket/prefix``, the form s3fs methods take."""
        return self.url(prefix)[len("s3://"):]

    def upload(self, local_dir, prefix: str = "") -> list[str]:
        """Upload a local tree under ``prefix``; returns the object paths written."""
        return upload_dir(self.server, local_dir, self.path(prefix))

    def fs(self):
        """A new uncached ``s3fs.S3FileSystem`` for this server."""
        return fresh_fs(self.server)

    @property
    def storage_options(self) -> dict:
        return self.server.storage_options


def _clear_s3fs_cache():
    if "s3fs" in sys.modules:
        sys.modules["s3fs"].S3FileSystem.clear_instance_cache()
    if "ckptctl.storage.failures" in sys.modules:  # one test's timeout never fails the next
        sys.modules["ckptctl.storage.failures"].forget_dead_servers()
    if "ckptctl.storage.s3_native" in sys.modules:  # which servers refuse ranges: relearnt
        sys.modules["ckptctl.storage.s3_native"]._NO_RANGES.clear()
    if "ckptctl.storage.filesystems" in sys.modules:
        sys.modules["ckptctl.storage.filesystems"].forget_filesystems()  # fresh clients per test


@pytest.fixture(autouse=True)
def _fresh_s3fs_instances():
    _clear_s3fs_cache()
    yield
    _clear_s3fs_cache()


def _server(start):
    try:
        return start()
    except Exception as e:  # fail (never skip) with the server's own words
        pytest.fail(f"cannot start S3 server: {e}", pytrace=False)


@pytest.fixture(scope="session")
def rclone_s3(tmp_path_factory):
    srv = _server(lambda: start_rclone(tmp_path_factory.mktemp("rclone-s3")))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def rclone_s3_readonly(rclone_s3):
    """A second, read-only ``rclone serve s3`` over the same root as ``rclone_s3``: what a
    test uploads to an ``s3_bucket`` is readable here, and every write here fails."""
    srv = _server(lambda: start_rclone(rclone_s3.root, read_only=True))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def moto_s3():
    srv = _server(start_moto)
    yield srv
    srv.stop()


def _bucket(server: S3Server):
    name = f"t-{uuid.uuid4().hex[:16]}"
    make_bucket(server, name)
    server.reset_log()
    yield S3Bucket(server, name)
    _clear_s3fs_cache()
    if server.root is not None:  # rclone: drop the data; names are never reused
        shutil.rmtree(Path(server.root) / name, ignore_errors=True)


@pytest.fixture
def s3_bucket(rclone_s3):
    yield from _bucket(rclone_s3)


@pytest.fixture
def moto_bucket(moto_s3):
    yield from _bucket(moto_s3)
