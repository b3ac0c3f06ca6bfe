"""Tests of the S3 test infrastructure itself (``s3server.py``, ``fixtures_s3.py``)."""

from __future__ import annotations

import errno
import hashlib
import http.client
import os
import socket
import subprocess
import sys
import uuid

import pytest

import s3server
from s3server import Request, fresh_fs, make_bucket, upload_dir


@pytest.fixture(params=["rclone", "moto"])
def server(request):
    return request.getfixturevalue(f"{request.param}_s3")


@pytest.fixture
def bucket(server):
    name = f"t-{uuid.uuid4().hex[:16]}"
    make_bucket(server, name)
    server.reset_log()
    return name


def test_put_get_ranged_roundtrip(server, bucket, tmp_path):
    fs = fresh_fs(server)
    data = os.urandom(100_000)
    fs.pipe_file(f"{bucket}/a/blob.bin", data)
    assert fs.cat_file(f"{bucket}/a/blob.bin") == data
    assert fs.cat_file(f"{bucket}/a/blob.bin", start=1000, end=1100) == data[1000:1100]
    assert fs.cat_file(f"{bucket}/a/blob.bin", start=-10) == data[-10:]
    fs.get_file(f"{bucket}/a/blob.bin", str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == data


def test_upload_dir_keeps_relative_paths_and_dotfiles(server, bucket, tmp_path):
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / ".metadata").write_bytes(b"meta")
    (src / "__0_0.distcp").write_bytes(b"x" * 10)
    (src / "sub" / "deep.bin").write_bytes(b"deep")
    written = upload_dir(server, src, f"{bucket}/run/step1")
    assert sorted(written) == sorted(f"{bucket}/run/step1/{p}" for p in (".metadata", "__0_0.distcp", "sub/deep.bin"))
    fs = fresh_fs(server)
    assert sorted(fs.find(f"{bucket}/run/step1")) == sorted(written)
    assert fs.cat_file(f"{bucket}/run/step1/.metadata") == b"meta"


def test_request_log_counts_one_ranged_get(server, bucket):
    fs = fresh_fs(server)
    fs.pipe_file(f"{bucket}/x/shard.distcp", os.urandom(4096))
    server.reset_log()
    assert fs.cat_file(f"{bucket}/x/shard.distcp", start=100, end=200) is not None
    assert [r[:3] for r in server.request_log()] == [
        Request("GET", f"/{bucket}/x/shard.distcp", "bytes=100-199")[:3]]
    (req,) = server.request_log()
    assert (req.op, req.key) == ("GET", f"{bucket}/x/shard.distcp")

    server.reset_log()
    fs.info(f"{bucket}/x/shard.distcp")
    fs.ls(f"{bucket}/x")
    ops = [r.op for r in server.request_log()]
    assert ops[0] == "HEAD" and "LIST" in ops and "GET" not in ops
    assert all(r.range is None for r in server.request_log())
    server.reset_log()
    assert server.request_log() == []


def test_env_reaches_a_subprocess_and_is_logged(server, bucket):
    """The CLI runs as a subprocess configured only by ``server.env``; its requests count too."""
    fresh_fs(server).pipe_file(f"{bucket}/k", b"hello")
    server.reset_log()
    code = f"import s3fs; print(s3fs.S3FileSystem().cat_file('{bucket}/k', start=1, end=3).decode())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | server.env
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "el"
    assert [(r.op, r.range) for r in server.request_log()] == [("GET", "bytes=1-2")]


def test_conditional_put_enforced_by_moto_only(server, bucket):
    fs = fresh_fs(server)
    path = f"{bucket}/commit"
    fs.pipe_file(path, b"first", mode="create")  # sends If-None-Match: *
    if server.kind == "moto":
        with pytest.raises(FileExistsError):
            fs.pipe_file(path, b"second", mode="create")
        with pytest.raises(FileExistsError):  # the raw API call maps the same way
            fs.call_s3("put_object", Bucket=bucket, Key="commit", Body=b"third", IfNoneMatch="*")
        with pytest.raises(FileExistsError):
            with fs.open(path, "xb") as f:
                f.write(b"fourth")
        assert fs.cat_file(path) == b"first"
    else:  # rclone ignores the header: last writer wins
        fs.pipe_file(path, b"second", mode="create")
        assert fs.cat_file(path) == b"second"
    assert [r.op for r in server.request_log()].count("PUT") >= 2


def test_multipart_etag(server, bucket):
    fs = fresh_fs(server)
    data = os.urandom(11 << 20)
    fs.pipe_file(f"{bucket}/mpu", data, chunksize=5 << 20)  # 3 parts
    ops = [r.op for r in server.request_log()]
    assert ops.count("POST") == 2 and ops.count("PUT") == 3  # create, 3 x part, complete
    etag = fs.info(f"{bucket}/mpu")["ETag"].strip('"')
    if server.kind == "moto":  # AWS style: md5 of the parts' md5s, then -<parts>
        parts = b"".join(hashlib.md5(data[i:i + (5 << 20)]).digest() for i in range(0, len(data), 5 << 20))
        assert etag == f"{hashlib.md5(parts).hexdigest()}-3"
    else:  # rclone: md5 of the whole object
        assert etag == hashlib.md5(data).hexdigest()
    assert fs.cat_file(f"{bucket}/mpu", start=(5 << 20) - 10, end=(5 << 20) + 10) == data[(5 << 20) - 10:(5 << 20) + 10]


def test_proxy_relays_chunked_bodies(server, bucket):
    fs = fresh_fs(server)
    keys = {f"{bucket}/many/{i:04d}-{'k' * 60}": b"v" for i in range(200)}
    fs.pipe(keys)  # rclone sends this listing (> 4 KiB) chunked; the proxy re-chunks it
    assert sorted(fs.ls(f"{bucket}/many")) == sorted(keys)
    if server.kind == "moto":  # a chunked request body (moto takes unsigned requests)
        conn = http.client.HTTPConnection(server.endpoint_url.removeprefix("http://"), timeout=30)
        conn.request("PUT", f"/{bucket}/chunked", body=iter([b"abc", b"defg"]))
        assert conn.getresponse().status == 200
        conn.close()
        assert fs.cat_file(f"{bucket}/chunked") == b"abcdefg"


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as any server would
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.mark.parametrize("kind", ["rclone", "moto"])
def test_stop_kills_by_pid_and_frees_ports(kind, tmp_path):
    srv = s3server.start_rclone(tmp_path) if kind == "rclone" else s3server.start_moto()
    ports = [int(u.rsplit(":", 1)[1]) for u in (srv.endpoint_url, srv.direct_endpoint_url)]
    make_bucket(srv, "bkt")  # leaves a keep-alive connection to the proxy open
    assert not any(_port_free(p) for p in ports)
    srv.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(srv.pid, 0)
    assert all(_port_free(p) for p in ports)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", ports[0]), timeout=2)
    srv.stop()  # idempotent


def test_start_failure_reports_server_output():
    rclone = s3server._binary("rclone")
    with pytest.raises(RuntimeError, match="unknown flag"):
        s3server._start("rclone", lambda port: [rclone, "serve", "s3", "--no-such-flag"], None, 10)


def test_s3_bucket_fixture(s3_bucket, tmp_path):
    assert s3_bucket.url("run/step1") == f"s3://{s3_bucket.bucket}/run/step1"
    assert s3_bucket.url() == f"s3://{s3_bucket.bucket}"
    assert s3_bucket.server.request_log() == []  # reset after the bucket was made
    (tmp_path / ".metadata").write_bytes(b"m")
    assert s3_bucket.upload(tmp_path, "run/step1") == [f"{s3_bucket.bucket}/run/step1/.metadata"]
    assert s3_bucket.fs().cat_file(s3_bucket.url("run/step1/.metadata")) == b"m"
    assert (s3_bucket.server.root / s3_bucket.bucket / "run/step1/.metadata").read_bytes() == b"m"


def test_moto_bucket_fixture_is_fresh(moto_bucket):
    assert moto_bucket.fs().ls(moto_bucket.bucket) == []
    with pytest.raises(OSError) as e:
        moto_bucket.fs().cat_file(moto_bucket.path("missing"))
    assert isinstance(e.value, FileNotFoundError) or e.value.errno == errno.ENOENT
