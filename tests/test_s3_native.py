"""S3 read natively (``ckptctl/storage/s3_native.py``): listings, metadata and reads go
through obstore, writes through s3fs and botocore made on the first write.

- a command that lists and reads (ls, latest, inspect, diff) imports neither s3fs nor
  botocore (verify does, for one request: S3's list of unfinished multipart uploads,
  which obstore cannot ask);
- a server that answers ranges with 200 (``rclone serve s3``) is read through botocore
  after one refused try, equal bytes;
- credentials only a profile holds are found through botocore's chain;
- ``-o fsspec=true`` and options only s3fs carries on reads keep the s3fs route.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ckptctl.errors import CkptError
from ckptctl.storage import open_store
from ckptctl.storage.s3_store import S3Store

NO_S3FS = """
import sys
from ckptctl.cli.main import main
for argv in ([\"ls\", sys.argv[1]], [\"latest\", sys.argv[1]], [\"inspect\", sys.argv[2]],
             [\"diff\", sys.argv[2], sys.argv[2]]):
    try:
        main(argv)
    except SystemExit as e:
        assert not e.code, (argv, e.code)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in (\"s3fs\", \"botocore\", \"aiobotocore\", \"boto3\"))
assert not heavy, heavy
print("clean")
"""


def _env(server) -> dict:
    return {**os.environ, **server.env}


def test_listing_and_reading_s3_imports_neither_s3fs_nor_botocore(tiny_dcp, moto_bucket, cli):
    from ckptctl.ops import seal

    seal(str(tiny_dcp))
    moto_bucket.upload(tiny_dcp, "run/step-42")
    p = subprocess.run([sys.executable, "-c", NO_S3FS, moto_bucket.url("run"),
                        moto_bucket.url("run/step-42")], capture_output=True, text=True,
                       env=_env(moto_bucket.server), timeout=300)
    assert p.returncode == 0 and "clean" in p.stdout, p.stderr[-3000:]


NO_S3FS_UP = NO_S3FS.replace(
    "for argv in (", "for argv in ([\"promote\", sys.argv[3], sys.argv[2]], "
    "[\"promote\", sys.argv[3], sys.argv[2]], ")


def test_promoting_small_files_to_s3_imports_neither_s3fs_nor_botocore(tiny_dcp, moto_bucket):
    """A checkpoint of files below S3's smallest part goes up, is found there (nothing
    to send the second time), is listed and read, all through obstore (``rm`` and ``gc``
    send DeleteObjects batches through botocore)."""
    from ckptctl.ops import seal

    seal(str(tiny_dcp))
    p = subprocess.run([sys.executable, "-c", NO_S3FS_UP, moto_bucket.url("run"),
                        moto_bucket.url("run/step-42"), str(tiny_dcp)], capture_output=True,
                       text=True, env=_env(moto_bucket.server), timeout=300)
    assert p.returncode == 0 and "clean" in p.stdout, p.stderr[-3000:]


def test_a_server_that_answers_ranges_whole_is_read_through_botocore(s3_bucket):
    st = open_store(s3_bucket.url("r"), s3_bucket.storage_options)
    data = bytes(range(256)) * 40
    st.write_file("a.bin", [data])
    s3_bucket.server.reset_log()
    fresh = open_store(s3_bucket.url("r"), s3_bucket.storage_options)
    assert fresh.read_range("a.bin", 100, 5000) == data[100:5000]
    assert fresh.read_range("a.bin", 10_000, 20_000) == data[10_000:]
    gets = [q for q in s3_bucket.server.request_log() if q.op == "GET"]
    # one refused native try (obstore wants 206), then botocore, which reads Content-Range
    assert [q.range for q in gets] == ["bytes=100-4999", "bytes=100-4999", "bytes=10000-19999"]


def test_credentials_of_a_profile_are_found(moto_bucket, tmp_path, monkeypatch):
    srv = moto_bucket.server
    creds = tmp_path / "credentials"
    creds.write_text(f"[lab]\naws_access_key_id = {srv.key}\naws_secret_access_key = {srv.secret}\n")
    for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    st = open_store(moto_bucket.url("p"), {"endpoint_url": srv.endpoint_url, "profile": "lab"})
    st.write_file("x.bin", [b"profile"])
    fresh = open_store(moto_bucket.url("p"), {"endpoint_url": srv.endpoint_url, "profile": "lab"})
    assert fresh.list_files() == {"x.bin": 7} and fresh.read("x.bin") == b"profile"


@pytest.mark.parametrize("options", [{"fsspec": True},
                                     {"s3_additional_kwargs": {"RequestPayer": "requester"}}])
def test_the_s3fs_route_stays_where_asked(options):
    st = open_store("s3://bucket/run", options)
    assert type(st) is S3Store


def test_whole_writes_and_deletes_make_no_s3fs_client(moto_bucket):
    """Small whole objects (a promote's files, manifests, markers) and single deletes go
    through obstore too; s3fs is made only for what it alone does (multipart uploads,
    DeleteObjects batches, copies, If-Match updates)."""
    st = open_store(moto_bucket.url("w"), moto_bucket.storage_options)
    assert st.list_files() == {} and st._fs is None  # nothing of s3fs made for a listing
    st.write_atomic("m.json", b"{}", exclusive=True)
    with pytest.raises(CkptError, match="already exists"):
        st.write_atomic("m.json", b"[]", exclusive=True)  # moto honours If-None-Match
    st.remove("m.json")
    st.remove("never-there.json")
    assert st.list_files() == {} and st._fs is None
    st.remove_many(["a", "b"])
    assert st._fs is not None
