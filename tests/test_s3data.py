"""The bulk S3 data path (``ckptctl/storage/s3data.py``) against a real server on loopback:
bodies sent unsigned and uncopied, ranged GETs read into the caller's buffer and checked
against the range the server says it answered, reads in flight while the caller hashes,
and transfers whose parts outnumber the slots in flight (no deadlock between the reading
workers and the hashing thread)."""
from __future__ import annotations

import http.server
import os
import threading

import pytest

from ckptctl.errors import CkptError
from ckptctl.storage import open_store, s3data
from ckptctl.storage.hashing import digest_bytes
from ckptctl.storage.journal import Journal
from ckptctl.storage.transfer import Transfer

MIB = 1 << 20


def s3fs_store(url: str, options: dict):
    """The S3 place on its s3fs route (``-o fsspec=true``), whose reads take the bulk path
    under test here; the default route reads through obstore (tests/test_s3_native.py)."""
    return open_store(url, {**options, "fsspec": True})


def test_parts_and_puts_go_unsigned_and_reads_ranged(s3_bucket):
    from ckptctl.storage import multipart

    st = s3fs_store(s3_bucket.url("d"), s3_bucket.storage_options)
    data = os.urandom(11 * MIB)
    uid = multipart.create_upload(st, "big.bin")
    view = memoryview(data)
    parts = [multipart.upload_part(st, "big.bin", uid, 1, view[:6 * MIB]),
             multipart.upload_part(st, "big.bin", uid, 2, view[6 * MIB:])]
    multipart.complete_upload(st, "big.bin", uid, parts)
    st.write_atomic("small.json", b"{}")
    sent = [r for r in s3_bucket.server.request_log() if r.method == "PUT"]
    assert len(sent) == 3 and {r.payload_hash for r in sent} == {"UNSIGNED-PAYLOAD"}
    s3_bucket.server.reset_log()
    buf = bytearray(3 * MIB)
    assert st.read_into("big.bin", 5 * MIB, memoryview(buf)) == 3 * MIB
    assert bytes(buf) == data[5 * MIB:8 * MIB]
    assert st.read_into("big.bin", len(data) - 10, memoryview(buf)) == 10  # short at the end
    assert bytes(buf[:10]) == data[-10:]
    assert st.read_into("big.bin", len(data), memoryview(buf)) == 0  # past the end
    gets = [r.range for r in s3_bucket.server.request_log() if r.op == "GET"]
    assert gets == [f"bytes={5 * MIB}-{8 * MIB - 1}", f"bytes={len(data) - 10}-{len(data) + 3 * MIB - 11}",
                    f"bytes={len(data)}-{len(data) + 3 * MIB - 1}"]


def test_iter_blocks_reads_ahead_in_order(s3_bucket):
    st = s3fs_store(s3_bucket.url("d"), s3_bucket.storage_options)
    data = os.urandom(5 * MIB + 3)
    st.write_atomic("f.bin", data)
    fresh = s3fs_store(s3_bucket.url("d"), s3_bucket.storage_options)
    got = b"".join(bytes(b) for b in fresh.iter_blocks("f.bin", block=MIB))
    assert got == data
    assert (fresh.stats.reads, fresh.stats.bytes_read) == (1, len(data))
    ranges = sorted((r.range for r in s3_bucket.server.request_log() if r.op == "GET"),
                    key=lambda r: int(r.split("=")[1].split("-")[0]))
    assert len(ranges) == 6 and ranges[0] == f"bytes=0-{MIB - 1}"


def test_an_object_shorter_than_listed_is_refused_not_hashed_short(s3_bucket):
    st = s3fs_store(s3_bucket.url("d"), s3_bucket.storage_options)
    st.write_atomic("f.bin", b"x" * 1000)
    with pytest.raises(CkptError) as e:
        list(s3data.iter_blocks(st, "f.bin", 3000, block=512))
    assert e.value.code == "SIZE_MISMATCH" and "changed while being read" in str(e.value)


class _WholeObjectServer(http.server.ThreadingHTTPServer):
    """Answers every GET with the whole object and no Content-Range (a server or proxy
    that drops Range headers)."""

    def __init__(self):
        body = bytes(range(256)) * 16

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        super().__init__(("127.0.0.1", 0), H)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()


def test_a_server_that_ignores_the_range_is_refused():
    srv = _WholeObjectServer()
    try:
        st = open_store("s3://b/p", {"endpoint_url": f"http://127.0.0.1:{srv.server_port}",
                                    "key": "k", "secret": "s"})
        buf = bytearray(100)
        with pytest.raises(CkptError) as e:
            st.read_into("x.bin", 10, memoryview(buf))
        assert "another byte range than asked (the whole object)" in str(e.value)
        assert st.read_into("x.bin", 0, memoryview(buf)) == 100  # from 0 the prefix is right
        assert bytes(buf) == (bytes(range(256)) * 16)[:100]
    finally:
        srv.shutdown()


def test_body_rewinds_for_a_retry():
    b = s3data._Body(b"abcdef")
    assert bytes(b.read(4)) == b"abcd" and bytes(b.read()) == b"ef"
    assert b.seek(0) == 0 and bytes(b.read(100)) == b"abcdef" and len(b) == 6


@pytest.mark.parametrize("way", ["upload", "download"])
def test_many_parts_through_one_slot_pair(s3_bucket, tmp_path, way):
    """workers=1 keeps two parts in flight; three files of four parts each, copied at once
    from three threads, still finish (the hashing thread frees slots while it waits)."""
    local = tmp_path / "local"
    local.mkdir()
    files = {f"f{i}.bin": os.urandom(4 * 5 * MIB - i) for i in range(3)}
    remote = s3fs_store(s3_bucket.url("t"), s3_bucket.storage_options)
    if way == "upload":
        for rel, data in files.items():
            (local / rel).write_bytes(data)
        src, dst = open_store(str(local)), remote
    else:
        for rel, data in files.items():
            remote.write_atomic(rel, data)
        src, dst = remote, open_store(str(tmp_path / "out"))
    t = Transfer(src, dst, journal=Journal(None, {}), part_size=5 * MIB, workers=1)
    try:
        results = {}
        threads = [threading.Thread(target=lambda r=rel: results.__setitem__(
            r, t.copy(r, len(files[r]), digest_bytes(files[r])))) for rel in files]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not any(th.is_alive() for th in threads), "a copy is stuck"
    finally:
        t.close()
    assert {r: c.parts_sent for r, c in results.items()} == {r: 4 for r in files}
    for rel, data in files.items():
        assert dst.read(rel) == data


class _Counting:
    """Wraps the obstore module: counts the native calls, optionally fails them."""

    def __init__(self, obs, fail=None):
        self.obs, self.fail, self.calls = obs, fail, []

    def __getattr__(self, name):
        real = getattr(self.obs, name)

        def call(*a, **kw):
            self.calls.append(name)
            if self.fail is not None:
                self.fail()
            return real(*a, **kw)
        return call


def _native_counted(st, monkeypatch, fail=None) -> _Counting:
    obs, for_bucket, budget = s3data.native(st)
    counting = _Counting(obs, fail)
    counting.made = (counting, for_bucket, budget)
    monkeypatch.setattr(st.fs, "_ckptctl_native", counting.made)
    return counting


def test_small_whole_objects_go_native_and_come_back_equal(s3_bucket, tmp_path, monkeypatch):
    """Small files of a transfer: one native PUT or GET each (no range), bytes equal,
    bodies unsigned as botocore's are; reads counted once."""
    src = tmp_path / "src"
    src.mkdir()
    files = {f"f{i}.bin": os.urandom(1000 + i) for i in range(5)}
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    remote = s3fs_store(s3_bucket.url("nat"), s3_bucket.storage_options)
    counting = _native_counted(remote, monkeypatch)
    t = Transfer(open_store(str(src)), remote, journal=Journal(None, {}), workers=2)
    try:
        for rel, data in files.items():
            assert t.copy(rel, len(data), digest_bytes(data)).how == "put"
    finally:
        t.close()
    puts = [r for r in s3_bucket.server.request_log() if r.method == "PUT"]
    assert counting.calls == ["put"] * 5 and len(puts) == 5
    assert {r.payload_hash for r in puts} == {"UNSIGNED-PAYLOAD"}
    s3_bucket.server.reset_log()
    back = open_store(str(tmp_path / "back"))
    t = Transfer(remote, back, journal=Journal(None, {}), workers=2)
    try:
        for rel, data in files.items():
            t.copy(rel, len(data), digest_bytes(data))
        t.flush()
    finally:
        t.close()
    assert {rel: back.read(rel) for rel in files} == files
    assert counting.calls == ["put"] * 5 + ["get"] * 5
    gets = [r for r in s3_bucket.server.request_log() if r.op == "GET"]
    assert len(gets) == 5 and {r.range for r in gets} == {None}
    assert remote.stats.reads == 5


def test_a_native_failure_is_answered_by_botocore(s3_bucket, monkeypatch):
    """The native client never decides an outcome: when it fails, botocore asks again,
    and its answer (success here; its error codes otherwise) is the one returned."""
    st = s3fs_store(s3_bucket.url("nat"), s3_bucket.storage_options)

    def boom():
        raise OSError("native client failed")

    counting = _native_counted(st, monkeypatch, fail=boom)
    st.write_atomic("a.bin", b"abc")
    buf = bytearray(3)
    monkeypatch.setattr(st.fs, "_ckptctl_native", counting.made)  # as if made afresh
    assert st.read_whole_into("a.bin", memoryview(buf)) == 3 and bytes(buf) == b"abc"
    assert counting.calls == ["put", "get"]
    monkeypatch.setattr(st.fs, "_ckptctl_native", counting.made)
    with pytest.raises(CkptError, match="not found"):
        st.read_whole_into("missing.bin", memoryview(bytearray(3)))


def test_native_failures_in_a_row_leave_botocore_alone(s3_bucket, monkeypatch):
    """A failed native request makes the next one with a fresh client (credentials may
    have expired); after NATIVE_TRIES failures in a row the filesystem stops trying."""
    st = s3fs_store(s3_bucket.url("nat"), s3_bucket.storage_options)
    fresh = []
    real = s3data._make_native

    def refuse():
        raise OSError("expired credentials")

    def failing_client(store):
        obs, for_bucket, budget = real(store)
        fresh.append(1)
        return _Counting(obs, fail=refuse), for_bucket, budget

    monkeypatch.setattr(s3data, "_make_native", failing_client)
    for i in range(s3data.NATIVE_TRIES + 3):
        st.write_atomic(f"k{i}.bin", b"x")  # botocore writes each one
    assert len(fresh) == s3data.NATIVE_TRIES and s3data.native(st) is None
    assert sorted(st.list_files()) == sorted(f"k{i}.bin" for i in range(s3data.NATIVE_TRIES + 3))


def test_a_whole_object_longer_than_expected_is_seen(s3_bucket):
    """An object that grew since its manifest was written: the size returned is the
    object's, so the transfer refuses it instead of publishing a prefix."""
    st = s3fs_store(s3_bucket.url("nat"), s3_bucket.storage_options)
    st.write_atomic("grown.bin", b"0123456789")
    buf = bytearray(4)
    assert st.read_whole_into("grown.bin", memoryview(buf)) == 10 and bytes(buf) == b"0123"
    dst = s3fs_store(s3_bucket.url("nat-out"), s3_bucket.storage_options)
    t = Transfer(st, dst, journal=Journal(None, {}), workers=1)
    try:
        with pytest.raises(CkptError, match="differs from the manifest"):
            t.copy("grown.bin", 4, digest_bytes(b"0123"))
    finally:
        t.close()
    assert "grown.bin" not in dst.list_files()


def test_a_native_request_that_spends_the_budget_is_a_timeout(s3_bucket, monkeypatch):
    """A native request that ran out the whole budget is not asked again of botocore
    (that would double the wait): it is the same one-line timeout."""
    st = s3fs_store(s3_bucket.url("nat"), s3_bucket.storage_options)
    obs, for_bucket, budget = s3data.native(st)
    clock = [1000.0]
    monkeypatch.setattr(s3data, "_clock", lambda: clock[0])

    def slow():
        clock[0] += budget  # the request "took" the whole budget
        raise OSError("operation timed out")

    counting = _Counting(obs, slow)
    monkeypatch.setattr(st.fs, "_ckptctl_native", (counting, for_bucket, budget))
    with pytest.raises(CkptError, match="timed out") as e:
        st.write_atomic("late.bin", b"x")
    assert e.value.code == "REMOTE_TIMEOUT" and counting.calls == ["put"]
    assert not [r for r in s3_bucket.server.request_log() if r.method == "PUT"]


def test_additional_kwargs_reach_the_bulk_path(moto_bucket, tmp_path):
    """``-o s3_additional_kwargs.ServerSideEncryption=AES256``: objects the bulk path
    writes (whole small files and multipart parts) are encrypted as s3fs's own writes are;
    a GET, which takes no such argument, still works (each call gets what it accepts)."""
    opts = dict(moto_bucket.storage_options, s3_additional_kwargs={"ServerSideEncryption": "AES256"})
    src = tmp_path / "src"
    src.mkdir()
    files = {"small.bin": os.urandom(1000), "large.bin": os.urandom(11 * MIB)}
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    remote = s3fs_store(moto_bucket.url("sse"), opts)
    assert s3data.native(remote) is None  # botocore sends the arguments
    t = Transfer(open_store(str(src)), remote, journal=Journal(None, {}), part_size=5 * MIB,
                 workers=2)
    try:
        how = {rel: t.copy(rel, len(data), digest_bytes(data)).how for rel, data in files.items()}
    finally:
        t.close()
    assert how == {"small.bin": "put", "large.bin": "multipart"}
    s3 = s3data.client(s3fs_store(moto_bucket.url(), moto_bucket.storage_options))
    for rel in files:
        head = s3.head_object(Bucket=moto_bucket.bucket, Key=f"sse/{rel}")
        assert head.get("ServerSideEncryption") == "AES256", rel
    back = open_store(str(tmp_path / "back"))
    t = Transfer(remote, back, journal=Journal(None, {}), part_size=5 * MIB, workers=2)
    try:
        for rel, data in files.items():
            t.copy(rel, len(data), digest_bytes(data))
        t.flush()
    finally:
        t.close()
    assert {rel: back.read(rel) for rel in files} == files
