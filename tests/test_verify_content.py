"""``verify --level full`` proves what it says (issue 7, items 7-9): unsealed DCP chunks and
torch.save files have the CRC-32 of every zip record checked, the result names what was
proven (``content``), each byte is read once (also with ``--check-finite``, also on S3),
and links or object pickles that leave the rails are found at every level."""
from __future__ import annotations

import pickle
import random
import struct
import warnings

import pytest

from ckptctl.ops import seal, verify
from fixtures_torch import copy_ckpt

torch = pytest.importorskip("torch")


def _records(path):
    """(name, data start, data end) of every stored record of every zip in a file, found
    by walking local headers the way the central directories describe them."""
    import zipfile

    data = path.read_bytes()
    out = []
    i = data.find(b"PK\x03\x04")
    while i >= 0:
        nlen, xlen = struct.unpack_from("<HH", data, i + 26)
        name = data[i + 30:i + 30 + nlen].decode()
        start = i + 30 + nlen + xlen
        nxt = data.find(b"PK\x07\x08", start)  # torch writes data descriptors
        if nxt > start and "/" in name:
            out.append((name, start, nxt))
        i = data.find(b"PK\x03\x04", start)
    assert zipfile  # documents what the walk mirrors
    return out


def _flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


def test_unsealed_dcp_every_flipped_record_byte_is_found(torch_ckpts, tmp_path):
    d = copy_ckpt(torch_ckpts["fsdp"], tmp_path / "step-20")
    f = d / "__1_0.distcp"
    recs = [r for r in _records(f) if r[2] > r[1]]
    kinds = {name.split("/", 1)[1] for name, _, _ in recs}
    assert {"data.pkl", "data/0", "byteorder", "version"} <= kinds, kinds
    rng = random.Random(7)
    picks = rng.sample(recs, 40)
    assert verify(str(d), level="full").content == "crc"
    missed = []
    for name, a, b in picks:
        at = rng.randrange(a, b)
        _flip(f, at)
        r = verify(str(d), level="full")
        _flip(f, at)
        if r.ok:
            missed.append((name, at))
        else:
            assert {p.code for p in r.problems} <= {"CRC_MISMATCH", "MALFORMED_CHUNK",
                                                   "DTYPE_SIZE_MISMATCH", "OUT_OF_BOUNDS",
                                                   "UNSAFE_INPUT"}
    assert not missed, missed
    assert verify(str(d), level="full").ok


@pytest.mark.parametrize("which", ["nested_pt", "bin"])
def test_unsealed_torch_save_flipped_bytes_are_found(torch_ckpts, tmp_path, which):
    src = torch_ckpts[which]
    d = tmp_path / "ck"
    d.mkdir()
    f = copy_ckpt(src, d / src.name)
    assert verify(str(d), level="full").content == "crc"
    rng = random.Random(3)
    for name, a, b in rng.sample([r for r in _records(f) if r[2] > r[1]], 10):
        at = rng.randrange(a, b)
        _flip(f, at)
        r = verify(str(d), level="full")
        _flip(f, at)
        assert not r.ok, (name, at)


def test_content_says_what_was_proven(torch_ckpts, tmp_path):
    d = copy_ckpt(torch_ckpts.hf_sharded, tmp_path / "hf")
    r = verify(str(d), level="full")
    assert r.ok and r.content == "decoded-only"
    seal(str(d))
    assert verify(str(d), level="full").content == "hashes"
    assert verify(str(d), level="structure").content is None
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    torch.save({"w": torch.ones(3)}, legacy / "old.pt", _use_new_zipfile_serialization=False)
    r = verify(str(legacy), level="full")
    assert r.ok and r.content == "decoded-only", r


def test_file_counts_agree_across_levels(torch_ckpts, tmp_path):
    d = copy_ckpt(torch_ckpts["tp"], tmp_path / "step-20")
    counts = {lvl: verify(str(d), level=lvl).files_checked for lvl in ("quick", "structure", "full")}
    assert len(set(counts.values())) == 1, counts
    seal(str(d))
    counts = {lvl: verify(str(d), level=lvl).files_checked for lvl in ("quick", "structure", "full")}
    assert len(set(counts.values())) == 1, counts


@pytest.mark.parametrize("sealed", [False, True])
def test_check_finite_reads_each_byte_once(torch_ckpts, tmp_path, sealed):
    d = copy_ckpt(torch_ckpts["fsdp"], tmp_path / "step-20")
    if sealed:
        seal(str(d))
    total = sum(p.stat().st_size for p in d.iterdir())
    r = verify(str(d), level="full", check_finite=True)
    assert r.ok, r.problems
    chunks = sum(len(t.chunks) for t in __import__("ckptctl").formats.open_checkpoint(str(d))
                 .tensors.values())
    # every byte once, plus each chunk zip's directory and head read by the structure checks
    assert r.bytes_read <= total + chunks * 2600, (r.bytes_read, total, chunks)


def test_full_verify_on_s3_reads_each_byte_once(torch_ckpts, tmp_path, s3_bucket):
    d = copy_ckpt(torch_ckpts["fsdp"], tmp_path / "step-20")
    total = sum(p.stat().st_size for p in d.iterdir())
    s3_bucket.upload(d, "ck")
    r = verify(s3_bucket.url("ck"), s3_bucket.storage_options, level="full", check_finite=True)
    assert r.ok and r.content == "crc", r.problems
    assert r.bytes_read <= total * 1.1, (r.bytes_read, total)


def test_zstd_chunk_corruption_is_found(tmp_path):
    from conftest import dcp_save

    g = torch.Generator().manual_seed(0)
    dcp_save(tmp_path / "z", {"w": torch.randn(64, 64, generator=g),
                              "b": torch.randn(64, generator=g)}, zstd=True)
    r = verify(str(tmp_path / "z"), level="full", check_finite=True)
    assert r.ok and r.content == "crc", r.problems
    f = tmp_path / "z" / "__0_0.distcp"
    _flip(f, f.stat().st_size // 2)
    assert not verify(str(tmp_path / "z"), level="full").ok


class Thing:  # pickled by reference: the weights-only loader refuses it
    def __init__(self):
        self.x = 1


def test_object_the_safe_loader_refuses_is_unsafe_at_structure(tmp_path, cli):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "extra": Thing()}, checkpoint_id=str(tmp_path / "c"))
    r = verify(str(tmp_path / "c"), level="structure")
    assert [(p.code, p.entry) for p in r.problems] == [("UNSAFE_INPUT", "extra")], r.problems
    assert "Thing" in r.problems[0].message
    assert verify(str(tmp_path / "c"), level="quick").ok  # quick reads no object


def test_link_leaving_the_root_is_path_escape_at_every_level(tmp_path):
    from safetensors.torch import save_file

    outside = tmp_path / "outside.safetensors"
    save_file({"w": torch.ones(2)}, outside)
    d = tmp_path / "ck"
    d.mkdir()
    (d / "model.safetensors").symlink_to(outside)
    for level in ("quick", "structure", "full"):
        codes = {p.code for p in verify(str(d), level=level).problems}
        assert "PATH_ESCAPE" in codes, (level, codes)


def test_verify_json_reports_content(torch_ckpts, tmp_path, cli):
    import json

    d = copy_ckpt(torch_ckpts["tp"], tmp_path / "step-20")
    code, out, err = cli("verify", str(d), "--level", "full", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["content"] == "crc" and doc["num_files_read"] == doc["num_files"] - 1
    assert pickle  # the fixtures above pickle through torch


@pytest.mark.parametrize("rival_tags,wins", [([], True), (["other"], False)])
def test_racing_sealer_on_a_server_without_if_none_match(torch_ckpts, tmp_path, s3_bucket,
                                                        rival_tags, wins):
    """rclone ignores If-None-Match, so a rival sealer's manifest can land right after ours
    (issue 7, item 12). The race is played out deterministically: our exclusive PUT, then
    the rival's PUT, then our read-back. The same bytes give the same content-derived id
    (we succeed, whoever's manifest is stored); other tags are a lost race we say."""
    import json

    from ckptctl.errors import Finding
    from ckptctl.formats import open_checkpoint
    from ckptctl.formats.manifest import manifest_id
    from ckptctl.writing.commit import commit, manifest_for

    d = copy_ckpt(torch_ckpts["tp"], tmp_path / "step-20")
    seal(str(d))  # hashes of these bytes, to hand both sealers
    man = json.loads((d / "ckptctl.manifest.json").read_text())
    (d / "ckptctl.manifest.json").unlink()
    hashes = {rel: (rec["hash"], rec["size"]) for rel, rec in man["files"].items()}
    s3_bucket.upload(d, "ck")
    url, opts = s3_bucket.url("ck"), s3_bucket.storage_options
    ours, rival = open_checkpoint(url, opts), open_checkpoint(url, opts)
    plain_write = ours.store.write_atomic

    def write_then_rival(rel, data, *, exclusive=False):
        plain_write(rel, data, exclusive=exclusive)  # rclone: succeeds even when it exists
        commit(rival.store, manifest_for(rival, hashes, step=man["step"], tags=rival_tags))

    ours.store.write_atomic = write_then_rival
    if wins:
        mid = commit(ours.store, manifest_for(ours, hashes, step=man["step"], tags=[]))
        stored = json.loads(s3_bucket.fs().cat_file(s3_bucket.path("ck/ckptctl.manifest.json")))
        assert manifest_id(stored) == mid == manifest_id(man)
    else:
        with pytest.raises(Finding, match="other content, step or tags"):
            commit(ours.store, manifest_for(ours, hashes, step=man["step"], tags=[]))


def test_local_concurrent_seal_of_same_content_is_idempotent(torch_ckpts, tmp_path):
    from ckptctl.errors import Finding
    from ckptctl.writing.commit import commit, manifest_for
    from ckptctl.formats import open_checkpoint

    d = copy_ckpt(torch_ckpts["tp"], tmp_path / "step-20")
    first = seal(str(d)).manifest_id
    ck = open_checkpoint(str(d))
    man = __import__("json").loads((d / "ckptctl.manifest.json").read_text())
    hashes = {rel: (rec["hash"], rec["size"]) for rel, rec in man["files"].items()}
    # a second writer of the same bytes (a later creation time) agrees on the id
    assert commit(ck.store, manifest_for(ck, hashes, step=man["step"], tags=[])) == first
    with pytest.raises(Finding, match="other content"):
        commit(ck.store, manifest_for(ck, hashes, step=man["step"], tags=["other"]))
