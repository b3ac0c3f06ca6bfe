"""One contract for :class:`ckptctl.storage.Store` and :mod:`ckptctl.storage.multipart`,
run unchanged against the local file system, ``rclone serve s3`` and ``moto_server``.

Each backend comes from the one parametrised ``place`` fixture (S3: one bucket per server
for the module, a fresh prefix per test). Where a server lacks a semantic, the test says
so with a strict xfail naming the server and the reason (the test still runs: if the
server starts to honour it, the XPASS fails and the xfail goes); where a case cannot be
set up on a backend at all, ``pytest.xfail`` says why. Nothing is skipped.
"""
from __future__ import annotations

import hashlib
import random
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import xxhash

from ckptctl.errors import CkptError, Finding, NotFoundError, StorageError, UsageError
from ckptctl.storage import Capabilities, Store, hash_file, open_store
from ckptctl.storage import multipart as mp
from ckptctl.storage.failures import forget_dead_servers
from s3server import make_bucket

MIB = 1 << 20
PART = mp.MIN_PART  # S3's minimum for every part but the last


@dataclass
class Place:
    """One backend: ``store`` at a fresh root, ``open(prefix)`` for another store on the same
    server (a fresh filesystem object: nothing cached), the server for its request log."""

    kind: str
    url: str
    options: dict
    server: object | None = None
    disk: Path | None = None  # where the bytes lie on disk (local; rclone's served folder)

    @property
    def server_kind(self) -> str:
        """The server, whichever client route: ``moto-fsspec`` -> ``moto``."""
        return self.kind.split("-")[0]

    def open(self, prefix: str = "root") -> Store:
        return open_store(f"{self.url}/{prefix}", self.options)

    @property
    def store(self) -> Store:
        return self.open()

    def requests(self, op: str | None = None, query: str = "") -> list:
        log = self.server.request_log() if self.server is not None else []
        return [r for r in log if (op is None or r.op == op) and query in r.path]


@pytest.fixture(autouse=True)
def _fresh_breaker():
    forget_dead_servers()
    yield
    forget_dead_servers()


@pytest.fixture(scope="module")
def _buckets():
    """One bucket per server for this module (creating one costs most of a second through
    the logging proxy); each test works under a fresh prefix of its own."""
    made: dict[str, str] = {}
    yield made
    for server, name in made.values():
        if server.root is not None:
            shutil.rmtree(Path(server.root) / name, ignore_errors=True)


#: the places: the local file system, two S3 servers, Azurite and fake-gcs-server, each
#: through the native client (obstore; GCS: obstore reads, gcsfs writes) and through its
#: fsspec filesystem (s3fs, adlfs, gcsfs)
KINDS = ["local", "rclone", "rclone-fsspec", "moto", "moto-fsspec", "azurite",
         "azurite-fsspec", "fakegcs", "fakegcs-fsspec"]


@pytest.fixture(params=KINDS)
def place(request, tmp_path, _buckets) -> Place:
    if request.param == "local":
        return Place("local", str(tmp_path / "local"), {}, disk=tmp_path / "local")
    if request.param.startswith("azurite"):
        box = request.getfixturevalue("az_container")
        opts = {"fsspec": True} if request.param.endswith("fsspec") else {}
        return Place(request.param, box.url(f"t{uuid.uuid4().hex[:10]}"), opts)
    if request.param.startswith("fakegcs"):
        box = request.getfixturevalue("gcs_bucket")
        opts = {"fsspec": True} if request.param.endswith("fsspec") else {}
        return Place(request.param, box.url(f"t{uuid.uuid4().hex[:10]}"), opts)
    kind = request.param.split("-")[0]
    server = request.getfixturevalue("rclone_s3" if kind == "rclone" else "moto_s3")
    if kind not in _buckets:
        _buckets[kind] = (server, f"contract-{uuid.uuid4().hex[:12]}")
        make_bucket(server, _buckets[kind][1])
    bucket = _buckets[kind][1]
    prefix = f"t{uuid.uuid4().hex[:10]}"
    server.reset_log()
    # 5 MiB write parts: fsspec's multipart path is exercised without 50 MiB per test
    opts = {**server.storage_options, "default_block_size": PART}
    if request.param.endswith("-fsspec"):
        opts["fsspec"] = True
    disk = Path(server.root) / bucket / prefix if server.root is not None else None
    return Place(request.param, f"s3://{bucket}/{prefix}", opts, server=server, disk=disk)


def quirk(request, place: Place, kinds: str, reason: str) -> None:
    """Expect this test to fail on the servers named in ``kinds`` (strict xfail)."""
    if place.server_kind in kinds.split():
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"{place.kind}: {reason}"))


def needs(place: Place, cap: str) -> None:
    """A test of a capability the place's store says it lacks (:class:`Capabilities`)
    cannot be set up there: it says so (xfail) rather than pass."""
    if not getattr(place.store.caps, cap):
        pytest.xfail(f"{place.kind}: no {cap} (its store's caps say so; the verbs take "
                     "the other route)")


def one_line(e: BaseException, place: Place) -> str:
    text = str(e)
    assert "\n" not in text and "Traceback" not in text
    secret = place.options.get("secret")
    assert not secret or secret not in text
    return text


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


# ------------------------------------------------------------------ reads and listing
def test_ranged_reads(place):
    st = place.store
    data = payload(3000)
    st.write_file("a/data.bin", [data])
    fresh = place.open()
    assert fresh.read_range("a/data.bin", 10, 20) == data[10:20]
    assert fresh.read_range("a/data.bin", 2990, 4000) == data[2990:]  # short at the end
    assert fresh.read_range("a/data.bin", 5, 5) == b""
    buf = bytearray(100)
    assert fresh.read_into("a/data.bin", 2950, memoryview(buf)) == 50
    assert bytes(buf[:50]) == data[2950:]
    assert fresh.read("a/data.bin") == data
    assert fresh.size("a/data.bin") == 3000 and fresh.exists("a/data.bin")
    assert fresh.stats.bytes_read == 10 + 10 + 50 + 3000


def test_listing(place):
    st = place.store
    names = {"b.bin": 3, "a/x.bin": 1, "a/y/z.bin": 2, ".hidden": 4}
    for rel, n in names.items():
        st.write_file(rel, [b"x" * n])
    fresh = place.open()
    assert fresh.list_files() == dict(sorted(names.items()))
    assert list(fresh.list_files()) == sorted(names)
    assert fresh.list_files("a") == {"a/x.bin": 1, "a/y/z.bin": 2}
    assert fresh.list_files(recursive=False) == {".hidden": 4, "b.bin": 3}
    assert fresh.list_dirs() == ["a"] and fresh.list_dirs("a") == ["a/y"]
    assert fresh.stats.lists == 6


# ------------------------------------------------------------------ atomic writes
def test_write_atomic_replaces(place):
    st = place.store
    st.write_atomic("m.json", b'{"v": 1}')
    st.write_atomic("m.json", b'{"v": 2}')
    assert place.open().read("m.json") == b'{"v": 2}'
    st.write_atomic("new.json", b"{}", exclusive=True)  # a free name: created
    assert place.open().read("new.json") == b"{}"


def test_write_atomic_exclusive_refuses_an_existing_name(place, request):
    quirk(request, place, "rclone", "rclone serve s3 does not enforce If-None-Match: *")
    st = place.store
    st.write_atomic("m.json", b"first")
    with pytest.raises(Finding, match=r"already exists") as e:
        st.write_atomic("m.json", b"second", exclusive=True)
    assert e.value.code == "ALREADY_EXISTS" and e.value.exit_code == 1
    assert one_line(e.value, place).startswith(st.display("m.json") + ": ")
    assert place.open().read("m.json") == b"first"


# ------------------------------------------------------------------ streaming write
def test_write_file_hashes_and_is_there_when_it_returns(place):
    st = place.store
    blocks = [payload(PART - 7, 1), memoryview(payload(4000, 2)), b"", payload(3 * MIB, 3)]
    data = b"".join(bytes(b) for b in blocks)  # > one 5 MiB part: S3 goes multipart
    seen = []
    digest, size = st.write_file("w/big.bin", blocks, on_bytes=seen.append)
    assert (digest, size) == (xxhash.xxh3_128(data).hexdigest(), len(data))
    assert sum(seen) == len(data)
    assert st.stats.writes == 1 and st.stats.bytes_written == len(data)
    fresh = place.open()  # another client: the file is complete and visible now
    assert fresh.read("w/big.bin") == data
    assert fresh.list_files() == {"w/big.bin": len(data)}  # no temp file, no part left over
    assert mp.list_uploads(fresh) == []
    sha, n = st.write_file("w/small.bin", [b"abc"], algo="sha256")
    assert (sha, n) == (hashlib.sha256(b"abc").hexdigest(), 3)
    assert st.write_file("w/empty.bin", [], algo=None) == (None, 0)
    assert place.open().read("w/empty.bin") == b""
    if place.disk is not None:  # the bytes are on disk, under their own name only
        assert sorted(p.name for p in (place.disk / "root" / "w").iterdir()) == [
            "big.bin", "empty.bin", "small.bin"]


@pytest.mark.parametrize("size", [1000, PART + 1000], ids=["one-put", "multipart"])
def test_write_file_abandoned_on_error(place, size):
    st = place.store
    st.write_file("keep.bin", [b"old"])
    st.write_file("w.bin", [b"previous"])

    def blocks():
        yield payload(size)
        raise RuntimeError("producer failed")

    with pytest.raises(RuntimeError, match="producer failed"):  # the producer's own error
        st.write_file("w.bin", blocks())
    fresh = place.open()
    assert fresh.read("w.bin") == b"previous"  # untouched: nothing half-written appeared
    assert fresh.list_files() == {"keep.bin": 3, "w.bin": 8}
    assert mp.list_uploads(fresh) == []


def test_write_file_fails_in_one_line(place):
    if place.kind == "local":  # a file where a folder must be
        place.store.write_file("f", [b"x"])
        st = place.open("root/f")
    else:
        scheme = place.url.partition("://")[0]  # a bucket or container that is not there
        st = open_store(f"{scheme}://no-such-bucket-ckptctl/p", place.options)
    with pytest.raises(CkptError) as e:
        st.write_file("g.bin", [b"data"])
    assert one_line(e.value, place).startswith(st.display("g.bin") + ": ")
    assert e.value.exit_code == 3


# ------------------------------------------------------------------ streamed reads
def test_iter_blocks(place):
    st = place.store
    data = payload(2 * MIB + 123)
    st.write_file("r.bin", [data])
    fresh = place.open()
    counted = []
    blocks = [bytes(b) for b in fresh.iter_blocks("r.bin", block=MIB, on_bytes=counted.append)]
    assert b"".join(blocks) == data and sum(counted) == len(data)
    assert [len(b) for b in blocks] == [MIB, MIB, 123]
    assert fresh.stats.reads == 1 and fresh.stats.bytes_read == len(data)
    assert hash_file(fresh, "r.bin") == (xxhash.xxh3_128(data).hexdigest(), len(data))
    other = payload(3 * MIB, 9)
    st.write_file("s.bin", [other])
    a, b = fresh.iter_blocks("r.bin"), fresh.iter_blocks("s.bin")  # interleaved in one thread
    got_a, got_b = bytearray(), bytearray()
    for x, y in zip(a, b):
        got_a += x
        got_b += y
    assert bytes(got_b) == other and bytes(got_a) == data[:len(got_a)]


def test_small_file_cache_serves_iter_blocks(place):
    st = place.store
    st.write_file("small.bin", [b"0123456789"])
    fresh = place.open()
    fresh.cache_small_files({"small.bin": 10})
    assert fresh.read_range("small.bin", 2, 4) == b"23"
    assert b"".join(bytes(b) for b in fresh.iter_blocks("small.bin")) == b"0123456789"
    if place.server is not None:
        assert len(place.requests("GET", "small.bin")) == 1  # one whole-file GET, cached


# ------------------------------------------------------------------ ordered delete
def test_remove_many_in_order(place):
    st = place.store
    names = [f"d/{i:02d}.bin" for i in range(7)]
    for n in names:
        st.write_file(n, [n.encode()])
    if place.server is not None:
        place.server.reset_log()
    order = ["d/03.bin", "missing.bin"] + [n for n in names if n != "d/03.bin"]
    assert st.remove_many(order) == len(order)
    assert place.open().list_files() == {}
    if place.server is not None:  # one DeleteObjects request, no per-key DELETE
        assert len(place.requests("POST", "?delete")) == 1
        assert place.requests("DELETE") == []
        assert st.stats.deletes == 1
    elif place.kind == "local":
        assert st.stats.deletes == 7
    else:  # Azure and GCS: one DELETE per name, the missing one included
        assert st.stats.deletes == len(order)
    with pytest.raises(CkptError) as e:
        st.remove_many(["ok.bin", "../outside"])  # every name checked before any deletion
    assert e.value.code == "PATH_ESCAPE"


def test_remove_many_over_1000_keys_in_ordered_batches(place, request):
    """2,500 keys: on S3 three DeleteObjects requests, each sent only after the one before
    it finished (checked on the server's disk as each request arrives)."""
    if place.server_kind == "moto":
        pytest.xfail("moto: in memory, 2,500 PUTs would take most of a minute; the keys are "
                     "written straight into rclone's served folder instead (one DeleteObjects "
                     "per call is counted on moto by test_remove_many_in_order)")
    if place.disk is None and place.server is None:
        pytest.xfail(f"{place.kind}: one DELETE per key (no batch API through this client), "
                     "so no batches to order; test_remove_many_in_order counts them")
    if place.server_kind == "rclone":  # a bucket rclone has not listed yet: its directory cache
        b = request.getfixturevalue("s3_bucket")  # would hide files written behind its back
        place = Place(place.kind, b.url("big"), {**b.storage_options, **place.options},
                      server=b.server,
                      disk=Path(b.server.root) / b.bucket / "big")
    root = place.disk / "root"
    names = [f"k/{i:04d}" for i in range(2500)]
    (root / "k").mkdir(parents=True)
    for n in names:
        (root / n).write_bytes(b"")
    order = random.Random(5).sample(names, len(names))
    left_at_each_batch = []

    def snapshot(req):
        if req.method == "POST" and "?delete" in req.path:
            left_at_each_batch.append({n for n in order if (root / n).exists()})

    if place.server is not None:
        place.server.fault_on(lambda r: snapshot(r) and False, "kill")
    if place.server is None:
        assert place.store.remove_many(order) == 2500
        assert not any((root / n).exists() for n in names)
        return
    try:
        assert place.store.remove_many(order) == 2500
    finally:
        place.server.fault_on(None, "")
    assert len(place.requests("POST", "?delete")) == 3
    assert [len(s) for s in left_at_each_batch] == [2500, 1500, 500]
    assert left_at_each_batch[1] == set(order[1000:])  # the first 1,000 given went first
    assert left_at_each_batch[2] == set(order[2000:])
    assert not any((root / n).exists() for n in names)


def test_remove_many_raises_when_the_server_refuses(place, request):
    if place.server_kind in ("moto", "azurite", "fakegcs"):
        pytest.xfail(f"{place.kind}: no way to make it refuse a delete (a folder key is "
                     "rclone's and the local file system's; on Azure and GCS a folder is no "
                     "object, so deleting its name deletes nothing)")
    st = place.store
    st.write_file("x/d/f.bin", [b"x"])
    st.write_file("x/a.bin", [b"a"])
    with pytest.raises(StorageError) as e:
        st.remove_many(["x/a.bin", "x/d"])  # a folder, not a file
    text = one_line(e.value, place)
    assert text.startswith(st.display("x/d") + ": ")
    assert place.open().list_files("x") == {"x/d/f.bin": 1}


# ------------------------------------------------------------------ multipart uploads
def test_multipart_cycle_with_resume_after_forgetting(place):
    needs(place, "multipart")
    st = place.store
    head, tail = payload(PART, 11), payload(1234, 12)
    uid = mp.create_upload(st, "big/model.bin", part_size=PART)
    p2 = mp.upload_part(st, "big/model.bin", uid, 2, memoryview(tail))
    assert (p2.number, p2.size) == (2, 1234)
    assert not place.open().exists("big/model.bin")  # nothing visible before completion

    # a new process: it knows the file it was writing, nothing else
    again = place.open()
    ups = mp.list_uploads(again)
    assert [(u.rel, u.upload_id) for u in ups] == [("big/model.bin", uid)]
    assert mp.list_parts(again, "big/model.bin", uid) == [p2]
    p1 = mp.upload_part(again, "big/model.bin", uid, 1, head)
    assert mp.list_parts(again, "big/model.bin", uid) == [p1, p2]
    mp.complete_upload(again, "big/model.bin", uid, mp.list_parts(again, "big/model.bin", uid))
    fresh = place.open()
    assert fresh.read("big/model.bin") == head + tail
    assert fresh.list_files() == {"big/model.bin": PART + 1234}
    assert mp.list_uploads(fresh) == []
    assert again.stats.writes == 1 and again.stats.bytes_written == PART


def test_parts_sent_from_threads_at_once(place):
    """Four threads send parts of one upload at the same time, out of order: every part
    is listed once, and the file is the parts in number order."""
    needs(place, "multipart")
    from concurrent.futures import ThreadPoolExecutor

    st = place.store
    chunks = [payload(PART, 20 + i) for i in range(3)] + [payload(999, 30)]
    uid = mp.create_upload(st, "t.bin", part_size=PART)
    with ThreadPoolExecutor(4) as pool:
        sent = list(pool.map(lambda i: mp.upload_part(st, "t.bin", uid, i + 1, chunks[i]),
                             [3, 1, 0, 2]))
    listed = mp.list_parts(place.open(), "t.bin", uid)
    assert listed == sorted(sent, key=lambda p: p.number)
    mp.complete_upload(st, "t.bin", uid, listed)
    assert place.open().read("t.bin") == b"".join(chunks)
    assert st.stats.writes == 4 and st.stats.bytes_written == 3 * PART + 999


def test_multipart_part_sent_again_replaces_it(place, request):
    needs(place, "multipart")
    quirk(request, place, "rclone", "rclone serve s3 refuses to replace a part it has streamed "
          "to its backend (NotImplemented)")
    st = place.store
    uid = mp.create_upload(st, "f.bin", part_size=PART)
    mp.upload_part(st, "f.bin", uid, 1, payload(PART, 1))
    good = mp.upload_part(st, "f.bin", uid, 1, payload(PART, 2))
    last = mp.upload_part(st, "f.bin", uid, 2, b"end")
    assert mp.list_parts(st, "f.bin", uid) == [good, last]
    mp.complete_upload(st, "f.bin", uid, [good, last])
    assert place.open().read("f.bin") == payload(PART, 2) + b"end"


def test_list_parts_pages(place):
    needs(place, "multipart")
    st = place.store
    uid = mp.create_upload(st, "p.bin", part_size=PART)
    parts = [mp.upload_part(st, "p.bin", uid, n, b"x") for n in (1, 3, 2)]
    before = st.stats.lists
    assert mp.list_parts(st, "p.bin", uid, page=2) == sorted(parts, key=lambda p: p.number)
    if place.kind != "local":  # local: one sidecar read, no pages
        assert st.stats.lists - before == 2
    mp.abort_upload(st, "p.bin", uid)


def test_abort(place):
    needs(place, "multipart")
    st = place.store
    uid = mp.create_upload(st, "gone.bin", part_size=PART)
    mp.upload_part(st, "gone.bin", uid, 1, payload(PART))
    mp.abort_upload(st, "gone.bin", uid)
    mp.abort_upload(st, "gone.bin", uid)  # already gone: fine
    fresh = place.open()
    assert mp.list_uploads(fresh) == [] and fresh.list_files() == {}
    with pytest.raises(NotFoundError) as e:
        mp.list_parts(fresh, "gone.bin", uid)
    assert one_line(e.value, place).startswith(fresh.display("gone.bin") + ": ")


def test_part_for_an_aborted_upload_is_not_found(place, request):
    needs(place, "multipart")
    quirk(request, place, "moto", "moto answers UploadPart to an aborted upload with HTTP 500, "
          "not NoSuchUpload")
    st = place.store
    uid = mp.create_upload(st, "gone.bin", part_size=PART)
    mp.abort_upload(st, "gone.bin", uid)
    with pytest.raises(NotFoundError) as e:
        mp.upload_part(st, "gone.bin", uid, 1, b"late")
    assert one_line(e.value, place).startswith(st.display("gone.bin") + ": ")


def test_complete_refuses_parts_it_does_not_hold(place):
    needs(place, "multipart")
    st = place.store
    uid = mp.create_upload(st, "c.bin", part_size=PART)
    p1 = mp.upload_part(st, "c.bin", uid, 1, payload(PART))
    with pytest.raises(StorageError) as e:
        mp.complete_upload(st, "c.bin", uid, [p1, mp.Part(2, '"0123"', 10)])
    assert "InvalidPart" in one_line(e.value, place)
    assert not place.open().exists("c.bin")
    mp.abort_upload(st, "c.bin", uid)


def test_list_uploads(place, request):
    needs(place, "multipart")
    st = place.store
    ids = {rel: mp.create_upload(st, rel, part_size=PART)
           for rel in ("a/one.bin", "a/two.bin", "b/three.bin")}
    other = place.open("elsewhere")  # outside this store's root: not listed
    mp.create_upload(other, "a/four.bin", part_size=PART)
    ups = mp.list_uploads(place.open())
    assert [(u.rel, u.upload_id) for u in ups] == sorted(ids.items())
    assert [u.rel for u in mp.list_uploads(st, "a/")] == ["a/one.bin", "a/two.bin"]
    assert [u.rel for u in mp.list_uploads(st, "b/th")] == ["b/three.bin"]
    assert mp.list_uploads(st, "c") == []
    paged = mp.list_uploads(st, page=1)
    assert paged == ups
    for rel, uid in ids.items():
        mp.abort_upload(st, rel, uid)
    assert mp.list_uploads(st) == []


def test_list_uploads_says_when_each_began(place, request):
    needs(place, "multipart")
    quirk(request, place, "moto", "moto reports every upload as initiated on 2010-11-10")
    st = place.store
    before = time.time()
    uid = mp.create_upload(st, "t.bin", part_size=PART)
    (up,) = mp.list_uploads(st)
    assert up.upload_id == uid and before - 5 <= up.initiated <= time.time() + 5
    mp.abort_upload(st, "t.bin", uid)


def test_list_uploads_pages(place, request):
    needs(place, "multipart")
    quirk(request, place, "moto", "moto ignores MaxUploads (one page, never truncated)")
    st = place.store
    ids = [mp.create_upload(st, f"u{i}.bin") for i in range(3)]
    before = st.stats.lists
    assert [u.upload_id for u in mp.list_uploads(st, page=1)] == ids
    if place.kind != "local":  # local: one walk of the folder, no pages
        assert st.stats.lists - before >= 3
    for i, uid in enumerate(ids):
        mp.abort_upload(st, f"u{i}.bin", uid)


# ------------------------------------------------------------------ server-side copy
def test_copy_object_on_the_same_server(place):
    needs(place, "server_side_copy")
    src, dst = place.open("src"), place.open("dst")
    data = payload(3000)
    src.write_file("f.bin", [data])
    assert src.same_server(dst) and dst.same_server(src)
    if place.server is not None:
        place.server.reset_log()
    mp.copy_object(src, "f.bin", dst, "sub/f.bin")
    assert place.open("dst").read("sub/f.bin") == data
    assert place.open("dst").list_files() == {"sub/f.bin": 3000}
    if place.server is not None:  # the bytes did not come through this process
        assert place.requests("GET", "/src/") == [] and src.stats.bytes_read == 0
    with pytest.raises(NotFoundError) as e:
        mp.copy_object(src, "missing.bin", dst, "x.bin")
    assert one_line(e.value, place).startswith(src.display("missing.bin") + ": ")


def test_copy_object_in_parts(place, request):
    needs(place, "server_side_copy")
    needs(place, "multipart")  # UploadPartCopy: S3's; Azure copies any size in one request
    quirk(request, place, "rclone", "rclone serve s3 does not implement UploadPartCopy")
    src, dst = place.open("src"), place.open("dst")
    data = payload(PART + 77)
    src.write_file("big.bin", [data])
    mp.copy_object(src, "big.bin", dst, "big.bin", part_size=PART, max_single=PART)
    assert place.open("dst").read("big.bin") == data
    assert mp.list_uploads(place.open("dst")) == []


def test_copy_object_refuses_another_server(place):
    needs(place, "server_side_copy")
    st = place.store
    if place.kind == "local":
        other = open_store("memory://ckptctl-contract")
    elif place.kind.startswith("azurite"):  # another endpoint (a port with nothing behind it)
        other = open_store(place.url, {**place.options, "endpoint": "http://127.0.0.1:9/x"})
    else:
        other = open_store(place.url, {**place.options, "endpoint_url": "http://127.0.0.1:9"})
    assert not st.same_server(other) and not other.same_server(st)
    with pytest.raises(UsageError, match="not the same server"):
        mp.copy_object(st, "f.bin", other, "f.bin")


# ------------------------------------------------------------------ capabilities, errors
def test_caps(place):
    caps = place.store.caps
    assert isinstance(caps, Capabilities)
    want = {"local": Capabilities(True, True, True, True),
            # Azure and GCS: If-None-Match / ifGenerationMatch=0 creates; whole-object
            # writes (no resumable part API through these clients yet), no server copies
            "azurite": Capabilities(False, True, True, False),  # Copy Blob
            "fakegcs": Capabilities(False, True, False, False),
            "fakegcs-fsspec": Capabilities(False, False, False, False),
            "azurite-fsspec": Capabilities(False, False, False, False)}
    assert caps == want.get(place.kind, Capabilities(False, True, True, True))


def test_missing_file_is_not_found_in_one_line(place):
    st = place.store
    st.write_file("present.bin", [b"x"])
    calls = {"read": lambda: st.read("nope/missing.bin"),
             "read_range": lambda: st.read_range("nope/missing.bin", 0, 10),
             "iter_blocks": lambda: list(st.iter_blocks("nope/missing.bin")),
             "size": lambda: st.size("nope/missing.bin"),
             "hash_file": lambda: hash_file(st, "nope/missing.bin"),
             "copy_object": lambda: mp.copy_object(st, "nope/missing.bin", st, "x.bin")}
    if not st.caps.server_side_copy:
        del calls["copy_object"]
    for name, call in calls.items():
        with pytest.raises(NotFoundError) as e:
            call()
        assert one_line(e.value, place) == f"{st.display('nope/missing.bin')}: not found", name
        assert e.value.exit_code == 3


def test_upload_id_that_is_not_there(place):
    needs(place, "multipart")
    st = place.store
    with pytest.raises(NotFoundError) as e:
        mp.list_parts(st, "x.bin", "0" * 32)
    assert one_line(e.value, place).startswith(st.display("x.bin") + ": ")
    mp.abort_upload(st, "x.bin", "0" * 32)  # nothing to abort: fine


# ------------------------------------------------------------------ local uploads only
def test_local_upload_survives_a_torn_sidecar_line(tmp_path):
    """A crash in the middle of appending a part's line leaves half a line: that part is
    simply not listed (its bytes were fsynced first, so it is sent again), and the
    upload goes on."""
    st = open_store(str(tmp_path))
    uid = mp.create_upload(st, "f.bin", part_size=4)
    p1 = mp.upload_part(st, "f.bin", uid, 1, b"abcd")
    sidecar = tmp_path / f".f.bin.{uid}.parts"
    with open(sidecar, "ab") as f:
        f.write(b'{"n":2,"etag":"12')  # killed mid-write
    assert mp.list_parts(st, "f.bin", uid) == [p1]
    p2 = mp.upload_part(st, "f.bin", uid, 2, b"ef")
    assert mp.list_parts(st, "f.bin", uid) == [p1, p2]
    mp.complete_upload(st, "f.bin", uid, [p1, p2])
    assert (tmp_path / "f.bin").read_bytes() == b"abcdef"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_local_upload_rules(tmp_path):
    st = open_store(str(tmp_path))
    uid = mp.create_upload(st, "f.bin")  # no part size: part 1 fixes it, so it comes first
    with pytest.raises(UsageError, match="part 1 first"):
        mp.upload_part(st, "f.bin", uid, 2, b"xy")
    p1 = mp.upload_part(st, "f.bin", uid, 1, b"abcd")
    with pytest.raises(UsageError, match="5 bytes"):  # would overlap part 3
        mp.upload_part(st, "f.bin", uid, 2, b"12345")
    p3 = mp.upload_part(st, "f.bin", uid, 3, b"zz")
    with pytest.raises(StorageError, match="part 3 was not uploaded as given"):  # a gap
        mp.complete_upload(st, "f.bin", uid, [p1, p3])
    with pytest.raises(NotFoundError):
        mp.list_parts(st, "f.bin", "../../etc/passwd")  # an id is never a path
    assert not (tmp_path / "f.bin").exists()
