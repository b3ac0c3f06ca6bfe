"""A pack hop's fixed cost does not grow with the delta chain (issue 20): promoting the
next checkpoint of a run into an S3 pack tier reads the newest checkpoint there from
the listing, walks the base's chain by its indexes (no data), and reads the base's
content from the source tier's plain copy of it (same id, every byte proven first)
rather than decoding it level by level; where it has to decode (no plain copy left), every
level below the base is opened at once, from the chain the index records. Counted in
requests and proven by order, not timed."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from ckptctl.errors import FormatError
from ckptctl.formats.pack import PACK_INDEX, PackIndex
from ckptctl.packs.unpack import unpack
from ckptctl.tiering.promote import promote
from test_gc_packs import _ckpt, _files


def _hop_requests(bucket, hot: Path, step: int, **kw) -> tuple[int, dict]:
    bucket.server.reset_log()
    r = promote(str(hot / f"step-{step}"), bucket.url(f"cold/step-{step}"),
                dst_options=bucket.storage_options, pack=True, **kw)
    data_gets = [q for q in bucket.server.request_log()
                 if q.op == "GET" and "/data-" in q.key]
    return len(bucket.server.request_log()), {"pack": r.pack, "data_gets": data_gets,
                                              "log": bucket.server.request_log()}


@pytest.mark.parametrize("delete_source", [False, True], ids=["copies-kept", "delete-source"])
def test_hop_requests_do_not_grow_with_the_chain(s3_bucket, tmp_path, monkeypatch,
                                                 delete_source):
    """Each level of the chain is listed once in the tier's listing (the one ``--base
    auto`` chose from) and its small files come from the object cache after the hop
    that first read them: a hop at depth 6 asks what a hop at depth 2 asks."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    hot = tmp_path / "hot"
    counts, packs = {}, {}
    for step in range(1, 8):
        _ckpt(hot / f"step-{step}", step)
        want = _files(hot / f"step-{step}")
        counts[step], packs[step] = _hop_requests(s3_bucket, hot, step,
                                                  delete_source=delete_source)
    depths = {s: p["pack"]["depth"] for s, p in packs.items()}
    assert depths == {1: 0, 2: 1, 3: 2, 4: 3, 5: 4, 6: 5, 7: 6}
    for s in range(3, 8):
        assert counts[s] == counts[2], counts  # nothing grows with depth
        # of the chain, only the newest level (made by the hop before) is read: its data
        # file, whole (the packed manifest the walk checks the level's id against)
        gets = {q.key.rsplit("/", 2)[-2] for q in packs[s]["log"]
                if q.op == "GET" and "list-type" not in q.path}
        assert gets <= {f"step-{s - 1}", f"step-{s}"}, (s, gets)
        assert all(q.range is None for q in packs[s]["data_gets"])  # no chunk reads
        if not delete_source:  # the base's content came from hot, proven first
            assert packs[s]["pack"]["base_read_from"] == str(hot / f"step-{s - 1}")
    # what was written restores byte for byte, through the whole chain (read from the
    # store: a restore never takes the object cache's word)
    s3_bucket.server.reset_log()
    out = tmp_path / "restored"
    unpack(s3_bucket.url("cold/step-7"), str(out), storage_options=s3_bucket.storage_options)
    assert _files(out) == want
    indexes = {q.key.rsplit("/", 2)[-2] for q in s3_bucket.server.request_log()
               if q.key.endswith(PACK_INDEX)}
    assert indexes == {f"step-{s}" for s in range(1, 8)}, indexes


def test_a_plain_copy_that_no_longer_matches_is_not_used(s3_bucket, tmp_path):
    hot = tmp_path / "hot"
    for step in (1, 2):
        _ckpt(hot / f"step-{step}", step)
    _hop_requests(s3_bucket, hot, 1)
    _hop_requests(s3_bucket, hot, 2)
    _ckpt(hot / "step-3", 3)
    f = hot / "step-2" / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF  # the hot copy rotted after it was sealed
    f.write_bytes(bytes(raw))
    _, got = _hop_requests(s3_bucket, hot, 3)
    assert got["pack"]["base_read_from"] is None and got["pack"]["depth"] == 2
    assert got["data_gets"]  # read through the chain instead
    out = tmp_path / "restored"
    unpack(s3_bucket.url("cold/step-3"), str(out), storage_options=s3_bucket.storage_options)
    assert _files(out) == _files(hot / "step-3")


def test_a_newest_pack_whose_chain_is_broken_gets_a_full_pack_next(s3_bucket, tmp_path):
    hot = tmp_path / "hot"
    for step in (1, 2, 3):
        _ckpt(hot / f"step-{step}", step)
    _hop_requests(s3_bucket, hot, 1)
    _hop_requests(s3_bucket, hot, 2)
    fs = s3_bucket.fs()
    fs.rm(s3_bucket.path("cold/step-1"), recursive=True)  # not by ckptctl: gc would refuse
    _, got = _hop_requests(s3_bucket, hot, 3)
    assert got["pack"]["base"] is None and got["pack"]["depth"] == 0
    assert "was not usable as a base" in got["pack"]["full_reason"]
    out = tmp_path / "restored"
    unpack(s3_bucket.url("cold/step-3"), str(out), storage_options=s3_bucket.storage_options)
    assert _files(out) == _files(hot / "step-3")


def test_a_level_replaced_after_it_was_cached_is_read_anew(s3_bucket, tmp_path, monkeypatch):
    """The object cache holds the chain's levels after a hop; a level then replaced by
    another checkpoint under the same name (new ETags) is read from the store, its id no
    longer matches, and the next hop writes a full pack instead of building on it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    hot = tmp_path / "hot"
    for step in (1, 2, 3):
        _ckpt(hot / f"step-{step}", step)
        _hop_requests(s3_bucket, hot, step)  # step-3's hop cached step-1 and step-2
    s3_bucket.fs().rm(s3_bucket.path("cold/step-2"), recursive=True)  # not by ckptctl
    _ckpt(tmp_path / "other" / "step-2", 7)  # another checkpoint, the same name
    promote(str(tmp_path / "other" / "step-2"), s3_bucket.url("cold/step-2"),
            dst_options=s3_bucket.storage_options, pack=True, base=None)
    _ckpt(hot / "step-4", 4)
    _, got = _hop_requests(s3_bucket, hot, 4)
    assert got["pack"]["base"] is None and got["pack"]["depth"] == 0, got["pack"]
    assert "was not usable as a base" in got["pack"]["full_reason"]
    out = tmp_path / "restored"
    unpack(s3_bucket.url("cold/step-4"), str(out), storage_options=s3_bucket.storage_options)
    assert _files(out) == _files(hot / "step-4")


def test_the_index_records_the_chain_below_its_base(s3_bucket, tmp_path):
    hot = tmp_path / "hot"
    for step in (1, 2, 3, 4):
        _ckpt(hot / f"step-{step}", step)
        _hop_requests(s3_bucket, hot, step)
    fs = s3_bucket.fs()
    base = {s: json.loads(fs.cat_file(s3_bucket.path(f"cold/step-{s}/{PACK_INDEX}")))["base"]
            for s in (2, 3, 4)}
    assert base[2]["url"] == "../step-1" and "chain" not in base[2]
    assert base[3]["url"] == "../step-2" and base[3]["chain"] == ["../step-1"]
    assert base[4]["url"] == "../step-3" and base[4]["chain"] == ["../step-2", "../step-1"]


def test_a_chain_is_opened_at_once_and_read_one_file_a_level(s3_bucket, tmp_path):
    """Restoring the newest of 5 packs decodes through 4 levels. The server holds every
    request for level 3 until one for level 1 has come: a walk that opened level 1 only
    after level 2 (after level 3) would never get there. Then no data file is read twice."""
    hot = tmp_path / "hot"
    for step in range(1, 6):
        _ckpt(hot / f"step-{step}", step)
        _hop_requests(s3_bucket, hot, step)
    srv = s3_bucket.server
    level1_asked, stuck = threading.Event(), []

    def hook(req):
        if "/cold/step-1/" in req.path:
            level1_asked.set()
        elif "/cold/step-3" in req.path and not level1_asked.wait(120):
            stuck.append(req)  # released anyway: the test fails below, it does not hang
            level1_asked.set()
        return None

    srv.reset_log()
    srv._proxy.fault = hook
    try:
        out = tmp_path / "restored"
        unpack(s3_bucket.url("cold/step-5"), str(out),
               storage_options=s3_bucket.storage_options)
    finally:
        srv._proxy.fault = None
    assert not stuck, "level 1 was opened only after level 3"
    assert _files(out) == _files(hot / "step-5")
    data_gets = [q.key for q in srv.request_log() if q.op == "GET" and "/data-" in q.key]
    # each level's data file is read once at most, whole (only those a chunk decodes from:
    # a level's own manifest, packed in its data, is not needed to check its id)
    assert sorted(data_gets) == sorted(set(data_gets)) and data_gets, data_gets


@pytest.mark.parametrize("chain", ["../step-1", [1], ["x" * 5000], ["../a"] * 65])
def test_a_malformed_chain_is_refused(chain):
    doc = {"pack": 1, "source": {"files": {}}, "chunk_size": 4,
           "base": {"id": "xxh3-128:00", "depth": 2, "url": "../step-2", "chain": chain},
           "files": {"ckptctl.manifest.json": {"size": 0, "segments": []}}}
    from ckptctl.formats.manifest import Manifest

    doc["source_id"] = Manifest.parse(json.dumps(doc["source"]).encode(), "m").id
    with pytest.raises(FormatError, match="chain must be a list"):
        PackIndex.parse(json.dumps(doc).encode(), "p", {})


def test_a_chain_naming_other_places_is_not_read_ahead(s3_bucket, tmp_path, monkeypatch):
    """A hostile index's chain may name any URL; only entries relative to the pack (same
    bucket) are opened ahead of need, so nothing is asked of a place the walk never
    follows."""
    from ckptctl.formats import pack as fpack
    from ckptctl.formats.locate import locate

    hot = tmp_path / "hot"
    for step in (1, 2, 3):
        _ckpt(hot / f"step-{step}", step)
        _hop_requests(s3_bucket, hot, step)
    asked = []
    real = fpack._read_ahead
    monkeypatch.setattr(fpack, "_read_ahead",
                        lambda urls, so, walk=None: asked.extend(urls) or real(urls, so, walk))
    ps, _, _ = fpack.pack_view(locate(s3_bucket.url("cold/step-3"), s3_bucket.storage_options),
                               s3_bucket.storage_options)
    ps.index.base["chain"] = ["../step-1", "http://127.0.0.1:9/elsewhere", "/etc"]
    ps._base_store()  # the walk's first step: what it reads ahead
    assert asked == [s3_bucket.url("cold/step-1")]
