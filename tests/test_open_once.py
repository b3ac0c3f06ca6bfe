"""A checkpoint is listed and opened once, then passed on (issue 8, item 9): counted with
the request log of the loopback S3 server (rclone behind the counting proxy).

* ``seal`` of an S3 checkpoint: one object listing and one GET of ``.metadata`` (before:
  three of each: seal located it, verify located and read it again, seal opened it again,
  and hashing fetched every file once more);
* ``ls ROOT``: one listing for the whole root (before: one more per checkpoint, and one
  multipart-upload listing per checkpoint).
"""
from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import xxhash


def _requests(server) -> tuple[int, collections.Counter]:
    """(object listings, GETs per file name) since the last reset."""
    lists, gets = 0, collections.Counter()
    for q in server.request_log():
        if q.op == "LIST" and "uploads" not in q.path:
            lists += 1
        elif q.op == "GET":
            gets[q.key.rsplit("/", 1)[-1]] += 1
    return lists, gets


def _local_hashes(folder: Path) -> dict[str, dict]:
    return {p.relative_to(folder).as_posix(): {"size": p.stat().st_size,
                                               "hash": xxhash.xxh3_128_hexdigest(p.read_bytes())}
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_seal_on_s3_lists_once_and_reads_metadata_once(torch_ckpts, s3_bucket):
    from ckptctl.ops import seal

    src = torch_ckpts["fsdp"]
    s3_bucket.upload(src, "run/step-20")
    server = s3_bucket.server
    server.reset_log()
    r = seal(s3_bucket.url("run/step-20"), s3_bucket.storage_options, tags=["t"])
    lists, gets = _requests(server)
    assert r.action == "sealed" and r.step == 20 and r.num_files == 5
    # one listing opens it; rclone ignores conditional writes, so the commit lists the
    # folder twice more (around its write: ckptctl.integrity.seal._publish_unconditional)
    assert lists == 1 + 2, server.request_log()
    assert gets[".metadata"] == 1, gets
    # every small file is fetched once and shared by the reader, verify and the hashes
    assert all(n == 1 for n in gets.values()), gets
    assert set(gets) == set(_local_hashes(src)) | {"ckptctl.manifest.json"}  # + the read-back
    # the hashes taken from those shared bytes are the files' own, bit for bit
    doc = json.loads(s3_bucket.fs().cat_file(s3_bucket.path("run/step-20/ckptctl.manifest.json")))
    assert {k: {"size": v["size"], "hash": v["hash"]} for k, v in doc["files"].items()} \
        == _local_hashes(src)


def test_seal_of_sealed_s3_checkpoint_lists_once(tiny_dcp, s3_bucket):
    from ckptctl.ops import seal

    first = seal(str(tiny_dcp))
    s3_bucket.upload(tiny_dcp, "step-42")
    server = s3_bucket.server
    server.reset_log()
    r = seal(s3_bucket.url("step-42"), s3_bucket.storage_options)
    lists, gets = _requests(server)
    assert (r.action, r.manifest_id) == ("verified", first.manifest_id)
    assert lists == 1 and gets[".metadata"] == 1 and gets["ckptctl.manifest.json"] == 1, \
        (lists, gets)
    assert not [q for q in server.request_log() if q.method == "PUT"]


def test_seal_on_s3_still_refuses_an_incomplete_checkpoint(tiny_dcp, s3_bucket):
    from ckptctl.errors import Finding
    from ckptctl.ops import seal

    s3_bucket.upload(tiny_dcp, "step-42")
    s3_bucket.fs().rm_file(s3_bucket.path("step-42/__0_0.distcp"))
    s3_bucket.server.reset_log()
    with pytest.raises(Finding, match="MISSING_FILE"):
        seal(s3_bucket.url("step-42"), s3_bucket.storage_options)
    assert _requests(s3_bucket.server)[0] == 1
    assert not s3_bucket.fs().exists(s3_bucket.path("step-42/ckptctl.manifest.json"))


def test_ls_on_s3_is_one_listing_for_the_whole_root(torch_ckpts, tiny_dcp, tmp_path, s3_bucket):
    import torch

    from ckptctl.ops import ls, seal

    seal(str(tiny_dcp))
    lone = tmp_path / "lone"
    lone.mkdir()
    torch.save({"w": torch.arange(6, dtype=torch.float32), "step": 7}, lone / "step-7.pt")
    s3_bucket.upload(torch_ckpts["fsdp"], "run/step-20")
    s3_bucket.upload(torch_ckpts["tp"], "run/step-30")
    s3_bucket.upload(tiny_dcp, "run/step-42")
    s3_bucket.upload(torch_ckpts.hf_sharded, "run/hf")
    s3_bucket.upload(lone, "run/files")
    server = s3_bucket.server
    server.reset_log()
    r = ls(s3_bucket.url("run"), s3_bucket.storage_options)
    lists, gets = _requests(server)
    rows = {c.name: c.state for c in r.checkpoints}
    assert rows == {"step-20": "complete", "step-30": "complete", "step-42": "sealed",
                    "hf": "complete", "files/step-7.pt": "complete"}, rows
    assert lists == 1, [q for q in server.request_log() if q.op == "LIST"]
    assert gets[".metadata"] == 3 and gets["ckptctl.manifest.json"] == 1, gets
    # each checkpoint's time comes from the listing, small files are one GET each, and
    # the lone torch.save zip is read without torch (byte ranges): no HEAD at all
    heads = [q.key for q in server.request_log() if q.op == "HEAD"]
    assert heads == [], heads
    assert all(c.modified for c in r.checkpoints), r.checkpoints
    # the rows are what a checkpoint-by-checkpoint look says
    from ckptctl.ops import checkpoint_state

    for c in r.checkpoints:
        alone = checkpoint_state(c.url, s3_bucket.storage_options)
        assert (alone.state, alone.reason, alone.format) == (c.state, c.reason, c.format), c


def test_ls_local_rows_match_checkpoint_state(torch_ckpts, tiny_dcp, tmp_path):
    """The listing cut per checkpoint gives each the files locate() would."""
    import shutil

    from ckptctl.ops import checkpoint_state, ls, seal

    root = tmp_path / "root"
    shutil.copytree(torch_ckpts["2d"], root / "a" / "step-20")
    shutil.copytree(tiny_dcp, root / "step-42")
    shutil.copytree(torch_ckpts.hf_sharded, root / "hf")
    seal(str(root / "step-42"))
    (root / "a" / "step-20" / "__1_0.distcp").unlink()
    r = ls(str(root))
    got = {c.name: (c.state, c.num_files) for c in r.checkpoints}
    assert got == {"a/step-20": ("incomplete", 4), "step-42": ("sealed", 2),  # manifest aside
                   "hf": ("complete", len(list(torch_ckpts.hf_sharded.iterdir())))}, got
    assert "__1_0.distcp" in next(c.reason for c in r.checkpoints if c.name == "a/step-20")
    for c in r.checkpoints:
        alone = checkpoint_state(c.url)
        assert (alone.state, alone.reason, alone.format) == (c.state, c.reason, c.format), c
