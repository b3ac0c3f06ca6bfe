"""The :class:`ckptctl.storage.Store` base class on its own: what a protocol without a
backend module of its own gets (fsspec for every call), checked on fsspec's in-memory
filesystem. The local and S3 subclasses are checked by ``test_store_contract.py``; this is
the same contract where it applies to a filesystem that has no rename, no conditional
write, no multipart and no server-side copy (``caps`` says so)."""
from __future__ import annotations

import uuid

import pytest

from ckptctl.errors import Finding, NotFoundError, UnsafeInputError, UsageError
from ckptctl.storage import Capabilities, Store, open_store
from ckptctl.storage import multipart as mp


@pytest.fixture
def store() -> Store:
    st = open_store(f"memory://ckptctl-generic-{uuid.uuid4().hex[:8]}/root")
    yield st
    if st.fs.exists(st.root):
        st.fs.rm(st.root, recursive=True)


def test_it_is_the_base_class_with_no_promises(store):
    assert type(store) is Store and not store.is_local and not store.is_s3
    assert store.caps == Capabilities(False, False, False, False)
    assert store.local_path("a") is None and not store.same_server(store)


def test_writes_reads_and_listings(store):
    store.write_atomic("a/x.bin", b"0123456789")
    digest, n = store.write_file("a/b/y.bin", [b"abc", memoryview(b"def")], algo="sha256")
    assert n == 6 and len(digest) == 64
    assert store.read("a/x.bin") == b"0123456789"
    assert store.read_range("a/x.bin", 2, 5) == b"234"
    buf = memoryview(bytearray(4))
    assert store.read_into("a/x.bin", 8, buf) == 2 and bytes(buf[:2]) == b"89"
    assert store.read_whole_into("a/b/y.bin", memoryview(bytearray(6))) == 6
    assert b"".join(bytes(b) for b in store.iter_blocks("a/x.bin", block=4)) == b"0123456789"
    assert store.list_files() == {"a/b/y.bin": 6, "a/x.bin": 10}
    assert store.list_files("a", recursive=False) == {"a/x.bin": 10}
    assert store.list_dirs("a") == ["a/b"]
    assert store.size("a/x.bin") == 10 and store.exists("a/x.bin") and store.isdir("a")
    assert not store.exists("nope")
    assert store.stats.writes == 2 and store.stats.reads >= 5


def test_child_parent_and_paths(store):
    store.write_atomic("run/step-1/f", b"1")
    child = store.child("run/step-1")
    assert type(child) is Store and child.read("f") == b"1"
    assert child.parent().url == store.url + "/run"
    with pytest.raises(UnsafeInputError):
        store.full("../escape")


def test_streaming_open(store):
    with store.open("s/f.bin", "wb") as f:
        f.write(b"hello")
    with store.open("s/f.bin") as f:
        assert f.read() == b"hello"


def test_exclusive_write_refuses_an_existing_name(store):
    store.write_atomic("m", b"1", exclusive=True)
    with pytest.raises(Finding, match="already exists") as e:
        store.write_atomic("m", b"2", exclusive=True)
    assert e.value.code == "ALREADY_EXISTS" and store.read("m") == b"1"


def test_removes(store):
    for n in "abc":
        store.write_atomic(n, b"x")
    assert store.remove_many(["a", "b", "missing"]) == 3
    store.remove("c")
    store.remove("c")  # missing is fine
    assert store.list_files() == {} and store.stats.deletes >= 3


def test_missing_file_is_one_line_not_found(store):
    with pytest.raises(NotFoundError) as e:
        store.read("nope.bin")
    assert "\n" not in str(e.value) and "nope.bin" in str(e.value)


def test_what_it_cannot_do_is_refused_by_name(store):
    with pytest.raises(UsageError, match="staged writes are for local stores"):
        store.stage("x", b"1")
    with pytest.raises(UsageError):
        mp.create_upload(store, "x")
