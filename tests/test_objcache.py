"""The persistent object cache (storage/objcache.py): small remote objects kept on local
disk by server, key, size and ETag, for a pack hop's chain walk. A damaged entry is a
miss, an object rewritten in the bucket is read anew, a store whose listing shows no ETag
never uses it, and nothing about the cache can fail a command."""
from __future__ import annotations

import os

import pytest

from ckptctl.storage import open_store
from ckptctl.storage.objcache import MAX_ENTRY, ObjectCache

ID = ("s3:http://h", "b/run/step-1/ckptctl.pack.json", 3, '"e1"')


def test_an_entry_comes_back_as_it_went_in(tmp_path):
    c = ObjectCache(str(tmp_path))
    assert c.get(ID) is None
    c.put(ID, b"abc")
    assert c.get(ID) == b"abc"
    assert c.get(ID[:3] + ('"e2"',)) is None  # another ETag: another object
    assert c.get(("s3:http://other",) + ID[1:]) is None  # another server


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_a_damaged_entry_is_a_miss_and_goes(tmp_path, damage):
    c = ObjectCache(str(tmp_path))
    c.put(ID, b"abc")
    (entry,) = [p for p in tmp_path.iterdir()]
    raw = bytearray(entry.read_bytes())
    if damage == "flip":
        raw[-1] ^= 1
    elif damage == "truncate":
        raw = raw[:-1]
    else:
        raw[0] ^= 1
    entry.write_bytes(bytes(raw))
    assert c.get(ID) is None
    assert not entry.exists()


def test_what_does_not_fit_is_not_kept(tmp_path):
    c = ObjectCache(str(tmp_path), budget=10_000)
    c.put(ID, b"abcd")  # not the size the listing said
    big = ("s", "k", MAX_ENTRY + 1, "e")
    c.put(big, b"x" * (MAX_ENTRY + 1))
    assert c.get(ID) is None and c.get(big) is None
    for i in range(5):  # 5 x 3,000 bytes in a 10,000-byte budget: the oldest go
        ident = ("s", f"k{i}", 3000, "e")
        c.put(ident, bytes([i]) * 3000)
        os.utime(c._path(ident), (1000 + i, 1000 + i))  # in order, whatever the clock does
    c.put(("s", "k5", 3000, "e"), b"5" * 3000)
    kept = [i for i in range(6) if c.get(("s", f"k{i}", 3000, "e")) is not None]
    assert kept == [3, 4, 5]


def test_an_unwritable_cache_is_only_a_miss(tmp_path):
    blocked = tmp_path / "objects"
    blocked.write_bytes(b"")  # a file where the folder should be (root ignores modes)
    c = ObjectCache(str(blocked))
    c.put(ID, b"abc")  # no error
    assert c.get(ID) is None


def _read_listed(bucket, key: str) -> tuple[bytes, int]:
    store = open_store(bucket.url("run"), bucket.storage_options)
    files = store.list_files()
    store.cache_small_files(files, persist=True)
    bucket.server.reset_log()
    data = store.read(key)
    gets = [q for q in bucket.server.request_log() if q.op == "GET"]
    return data, len(gets)


def test_a_listed_object_is_read_once_and_anew_when_rewritten(s3_bucket, tmp_path,
                                                             monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fs = s3_bucket.fs()
    fs.pipe(s3_bucket.path("run/step-1/ckptctl.pack.json"), b"first")
    assert _read_listed(s3_bucket, "step-1/ckptctl.pack.json") == (b"first", 1)
    assert _read_listed(s3_bucket, "step-1/ckptctl.pack.json") == (b"first", 0)
    fs.pipe(s3_bucket.path("run/step-1/ckptctl.pack.json"), b"other")  # same size
    assert _read_listed(s3_bucket, "step-1/ckptctl.pack.json") == (b"other", 1)
    assert _read_listed(s3_bucket, "step-1/ckptctl.pack.json") == (b"other", 0)


def test_without_persist_or_etag_the_cache_is_not_used(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    s3_bucket.fs().pipe(s3_bucket.path("run/a.json"), b"{}")
    for _ in range(2):  # what verify and restores do: every read asks the store
        store = open_store(s3_bucket.url("run"), s3_bucket.storage_options)
        store.cache_small_files(store.list_files())
        s3_bucket.server.reset_log()
        assert store.read("a.json") == b"{}"
        assert len(s3_bucket.server.request_log()) == 1
    mem = open_store("memory://objcache-test/run")  # a listing without ETags
    mem.write_atomic("a.json", b"{}")
    for _ in range(2):
        m = open_store("memory://objcache-test/run")
        m.cache_small_files(m.list_files(), persist=True)
        assert m.read("a.json") == b"{}" and m.stats.cache_hits == 0
    assert not (tmp_path / "cache" / "ckptctl" / "objects").exists()
