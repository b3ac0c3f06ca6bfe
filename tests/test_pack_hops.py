"""A pack hop's fixed cost does not grow with the delta chain (issue 20): promoting the
next checkpoint of a run into an S3 pack tier reads the newest checkpoint there from
the listing, walks the base's chain by its indexes (no data), and reads the base's
content from the source tier's plain copy of it (same id, every byte proven first)
rather than decoding it level by level. Counted in requests, not timed."""
from __future__ import annotations

from pathlib import Path

from ckptctl.ops.pack import unpack
from ckptctl.ops.promote import promote
from test_gc_packs import _ckpt, _files


def _hop_requests(bucket, hot: Path, step: int) -> tuple[int, dict]:
    bucket.server.reset_log()
    r = promote(str(hot / f"step-{step}"), bucket.url(f"cold/step-{step}"),
                dst_options=bucket.storage_options, pack=True)
    data_gets = [q for q in bucket.server.request_log()
                 if q.op == "GET" and "/data-" in q.key]
    return len(bucket.server.request_log()), {"pack": r.pack, "data_gets": data_gets}


def test_hop_requests_do_not_grow_with_the_chain(s3_bucket, tmp_path):
    hot = tmp_path / "hot"
    counts, packs = {}, {}
    for step in range(1, 8):
        _ckpt(hot / f"step-{step}", step)
        counts[step], packs[step] = _hop_requests(s3_bucket, hot, step)
    depths = {s: p["pack"]["depth"] for s, p in packs.items()}
    assert depths == {1: 0, 2: 1, 3: 2, 4: 3, 5: 4, 6: 5, 7: 6}
    for s in range(2, 8):  # the base's content came from hot, proven: of the packs' data
        # only each level's packed manifest is read (the walk checks every level's id)
        assert packs[s]["pack"]["base_read_from"] == str(hot / f"step-{s - 1}")
        spans = [tuple(map(int, q.range.split("=")[1].split("-"))) for q in packs[s]["data_gets"]]
        assert len(spans) <= s - 1 and all(b - a < 4096 for a, b in spans), (s, spans)
    # the chain walk costs a few small reads a level, nothing else grows with depth
    per_level = (counts[7] - counts[2]) / 5
    assert per_level <= 4, counts
    # what was written restores byte for byte, through the whole chain
    out = tmp_path / "restored"
    unpack(s3_bucket.url("cold/step-7"), str(out), storage_options=s3_bucket.storage_options)
    assert _files(out) == _files(hot / "step-7")


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
