"""``promote``: byte-identical round trips local -> S3 -> local and S3 -> S3 on both loopback
servers, verify --level full at every place, request counts, resume, rails."""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from conftest import run_cli, write_tiny_dcp

from ckptctl.formats.manifest import MANIFEST, WRITING_MARKER
from ckptctl.tiering.promote import promote
from ckptctl.integrity.verify import verify

PART = 5 << 20


def big_dcp(path: Path) -> dict:
    """A DCP checkpoint with one ~12 MiB file (three 5 MiB parts) and small ones."""
    import torch

    from conftest import dcp_save

    g = torch.Generator().manual_seed(1)
    sd = {"model": {"big": torch.randn(3 * 1024 * 1024 + 77, generator=g),
                    "small": torch.arange(10, dtype=torch.int32)}, "step": 7}
    dcp_save(path, sd)
    return sd


def tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def s3_op(r) -> str:
    """The S3 API call a logged request was (multipart calls told apart by their query)."""
    q = r.path.partition("?")[2]
    if r.method == "PUT" and "partNumber=" in q:
        return "UploadPart"
    if r.method == "POST" and "uploadId=" in q:
        return "CompleteMultipartUpload"
    if r.method == "POST" and "uploads" in q:
        return "CreateMultipartUpload"
    return {"GET": "GetObject", "PUT": "PutObject", "HEAD": "HeadObject",
            "DELETE": "DeleteObject"}.get(r.op, r.op)


def ops_of(server) -> Counter:
    return Counter(s3_op(r) for r in server.request_log())


def test_local_to_local_is_byte_identical_and_sealed_first(tmp_path):
    src = tmp_path / "hot" / "step-7"
    big_dcp(src)
    r = promote(str(src), str(tmp_path / "warm" / "step-7"), part_size=PART, workers=3)
    assert r.action == "promoted" and r.sealed_source and r.parts_sent == 3
    assert tree(src) == tree(tmp_path / "warm" / "step-7")
    assert verify(str(tmp_path / "warm" / "step-7"), level="full").ok
    # nothing hidden left beside it; a rerun is a no-op that says so
    assert sorted(os.listdir(tmp_path / "warm")) == ["step-7"]
    again = promote(str(src), str(tmp_path / "warm" / "step-7"))
    assert again.action == "up-to-date" and again.bytes_sent == 0


def test_round_trip_local_s3_local_rclone_and_moto(tmp_path, s3_bucket, moto_bucket):
    src = tmp_path / "step-7"
    big_dcp(src)
    for bucket in (s3_bucket, moto_bucket):
        bucket.server.reset_log()
        url, opts = bucket.url("run/step-7"), bucket.storage_options
        r = promote(str(src), url, None, opts, part_size=PART)
        assert r.action == "promoted" and r.parts_sent == 3, r
        ops = ops_of(bucket.server)
        # 3 parts + small files + marker + manifest; the data is never read back
        assert ops["UploadPart"] == 3 and ops["CompleteMultipartUpload"] == 1, ops
        assert ops.get("GetObject", 0) <= 2, ops  # the marker check and the read-back
        assert verify(url, opts, level="full").ok
        back = tmp_path / f"back-{bucket.server.kind}"
        r2 = promote(url, str(back), opts, None, part_size=PART)
        assert r2.action == "promoted" and r2.manifest_id == r.manifest_id
        assert tree(back) == tree(src)
        assert verify(str(back), level="full").ok


def test_s3_to_s3_between_two_endpoints_and_on_one(tmp_path, s3_bucket, moto_bucket):
    src = tmp_path / "step-7"
    big_dcp(src)
    a = s3_bucket.url("a/step-7")
    promote(str(src), a, None, s3_bucket.storage_options, part_size=PART)
    # two endpoints: per-URL options
    b = moto_bucket.url("b/step-7")
    r = promote(a, b, s3_bucket.storage_options, moto_bucket.storage_options, part_size=PART)
    assert r.action == "promoted" and not r.server_copy
    assert verify(b, moto_bucket.storage_options, level="full").ok
    # one endpoint: the server copies, ckptctl proves what landed
    c = s3_bucket.url("c/step-7")
    r = promote(a, c, s3_bucket.storage_options, s3_bucket.storage_options, part_size=PART)
    assert r.action == "promoted" and r.server_copy
    assert verify(c, s3_bucket.storage_options, level="full").ok
    back = tmp_path / "back"
    promote(c, str(back), s3_bucket.storage_options, None)
    assert tree(back) == tree(src)


def test_incomplete_source_is_refused(tmp_path):
    src = tmp_path / "step-7"
    write_tiny_dcp(src)
    (src / ".metadata").unlink()
    code, out, err = run_cli("promote", str(src), str(tmp_path / "dst"))
    assert code == 1 and "refusing to seal" in err, err
    assert not (tmp_path / "dst").exists()


def test_destination_with_other_checkpoint_is_refused(tmp_path):
    a, b = tmp_path / "a" / "step-1", tmp_path / "b" / "step-1"
    write_tiny_dcp(a)
    big_dcp(b)
    promote(str(b), str(tmp_path / "dst"))
    code, out, err = run_cli("promote", str(a), str(tmp_path / "dst"))
    assert code == 1 and "another checkpoint" in err, err


def test_dry_run_writes_nothing_and_lists_what_would_go(tmp_path):
    src = tmp_path / "step-7"
    big_dcp(src)
    code, out, err = run_cli("promote", str(src), str(tmp_path / "dst"), "--dry-run", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["action"] == "dry-run" and doc["to_send"][-1] == ".metadata"
    assert not (tmp_path / "dst").exists() and not (src / MANIFEST).exists()


def test_resume_skips_finished_files_and_parts(tmp_path, s3_bucket):
    """A run stopped after its first part leaves an unfinished upload; the rerun sends
    only what is missing (counted by the server)."""
    from ckptctl.storage.transfer import Transfer

    src = tmp_path / "step-7"
    big_dcp(src)
    url, opts = s3_bucket.url("run/step-7"), s3_bucket.storage_options
    real = Transfer._multipart
    calls = []

    def stop_after_two_parts(self, rel, size, want):
        def count(n):
            calls.append(n)
            if len(calls) == 2:
                raise KeyboardInterrupt
        self.on_bytes = count
        return real(self, rel, size, want)

    Transfer._multipart = stop_after_two_parts
    try:
        with pytest.raises(KeyboardInterrupt):
            promote(str(src), url, None, opts, part_size=PART, workers=1)
    finally:
        Transfer._multipart = real
    fs = s3_bucket.fs()
    assert fs.exists(s3_bucket.path("run/step-7/" + WRITING_MARKER))
    assert not fs.exists(s3_bucket.path("run/step-7/" + MANIFEST))
    code, out, err = run_cli("ls", s3_bucket.url("run"), "--json",
                             "-o", f"endpoint_url={opts['endpoint_url']}",
                             "-o", f"key={opts['key']}", "-o", f"secret={opts['secret']}")
    assert json.loads(out)["checkpoints"][0]["state"] == "incomplete", out
    dry = promote(str(src), url, None, opts, part_size=PART, dry_run=True)
    assert ".metadata" in dry.to_send
    s3_bucket.server.reset_log()
    r = promote(str(src), url, None, opts, part_size=PART, workers=1)
    assert r.parts_resumed >= 1 and r.parts_sent == 3 - r.parts_resumed, r
    # the dry run counted what the rerun sent, not the whole checkpoint
    assert dry.bytes_to_send == r.bytes_sent < r.bytes, (dry.bytes_to_send, r)
    assert ops_of(s3_bucket.server)["UploadPart"] == r.parts_sent
    assert verify(url, opts, level="full").ok


def test_delete_source_after_commit_and_pins_are_respected(tmp_path):
    src, dst = tmp_path / "hot" / "step-7", tmp_path / "warm" / "step-7"
    big_dcp(src)
    want = tree(src)
    code, out, err = run_cli("pin", str(src))
    assert code == 0, err
    code, out, err = run_cli("promote", str(src), str(dst), "--delete-source")
    assert code == 1 and "pinned" in err and not dst.exists(), err
    run_cli("unpin", str(src))
    code, out, err = run_cli("promote", str(src), str(dst), "--delete-source", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["deleted_source"] and not src.exists()
    got = tree(dst)
    assert {k: v for k, v in got.items() if k != MANIFEST} == \
        {k: v for k, v in want.items() if k not in (MANIFEST, ".ckptctl-pinned")}


def test_tier_names_stand_for_urls(tmp_path, monkeypatch):
    hot, warm = tmp_path / "hot", tmp_path / "warm"
    big_dcp(hot / "step-7")
    (tmp_path / "ckptctl.toml").write_text(
        f'[[tier]]\nname = "hot"\nurl = "{hot}"\n\n'
        f'[[tier]]\nname = "warm"\nurl = "{warm}"\nbwlimit = "1GiB/s"\n')
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("promote", "hot:step-7", "warm:", "--json")
    assert code == 0, err
    assert json.loads(out)["dst"] == str(warm / "step-7")
    assert tree(warm / "step-7") == tree(hot / "step-7")


def two_steps(root: Path) -> tuple[Path, Path]:
    """step-1 and step-2 of one run: half the tensors unchanged, half nudged."""
    import torch

    from conftest import dcp_save

    g = torch.Generator().manual_seed(3)
    w = {f"layer{i}": torch.randn(64, 256, generator=g) for i in range(4)}
    dcp_save(root / "step-1", {"model": w, "step": 1})
    w2 = {k: (v + 1e-3 * torch.randn(v.shape, generator=g) if i % 2 else v)
          for i, (k, v) in enumerate(w.items())}
    dcp_save(root / "step-2", {"model": w2, "step": 2})
    return root / "step-1", root / "step-2"


def test_pack_on_the_way_and_unpack_back(tmp_path):
    s1, s2 = two_steps(tmp_path / "hot")
    cold = tmp_path / "cold"
    r1 = promote(str(s1), str(cold / "step-1"), pack=True)
    assert r1.action == "packed" and r1.pack["base"] is None  # nothing beside it yet
    r2 = promote(str(s2), str(cold / "step-2"), pack=True)  # base auto: cold/step-1
    assert r2.action == "packed" and r2.pack["depth"] == 1, r2.pack
    assert r2.pack["base_url"].endswith("step-1") and r2.bytes_sent < r1.bytes_sent
    assert verify(str(cold / "step-2"), level="full").ok
    again = promote(str(s2), str(cold / "step-2"), pack=True)
    assert again.action == "up-to-date"
    back = tmp_path / "restore" / "step-2"
    r3 = promote(str(cold / "step-2"), str(back), pack=False)
    assert r3.action == "unpacked" and r3.manifest_id == r2.manifest_id
    assert tree(back) == tree(s2)


def test_a_pack_tier_packs_and_a_plain_tier_unpacks(tmp_path, monkeypatch):
    s1, s2 = two_steps(tmp_path / "hot")
    (tmp_path / "ckptctl.toml").write_text(
        f'[[tier]]\nname = "hot"\nurl = "{tmp_path / "hot"}"\n\n'
        f'[[tier]]\nname = "cold"\nurl = "{tmp_path / "cold"}"\npack = true\n\n'
        f'[[tier]]\nname = "back"\nurl = "{tmp_path / "back"}"\n')
    monkeypatch.chdir(tmp_path)
    for name in ("step-1", "step-2"):
        code, out, err = run_cli("promote", f"hot:{name}", "cold:", "--json")
        assert code == 0, err
        assert json.loads(out)["action"] == "packed"
    code, out, err = run_cli("ls", "cold:", "--json")
    assert [c["state"] for c in json.loads(out)["checkpoints"]] == ["sealed", "sealed"], out
    code, out, err = run_cli("promote", "cold:step-2", "back:")
    assert code == 0 and "unpacked" in out, err
    assert tree(tmp_path / "back" / "step-2") == tree(s2)


def test_pack_to_s3_with_auto_base(tmp_path, s3_bucket):
    s1, s2 = two_steps(tmp_path / "hot")
    opts = s3_bucket.storage_options
    promote(str(s1), s3_bucket.url("cold/step-1"), None, opts, pack=True)
    r = promote(str(s2), s3_bucket.url("cold/step-2"), None, opts, pack=True)
    assert r.pack["depth"] == 1 and r.pack["base_url"] == s3_bucket.url("cold/step-1")
    assert verify(s3_bucket.url("cold/step-2"), opts, level="full").ok
    back = tmp_path / "back"
    promote(s3_bucket.url("cold/step-2"), str(back), opts, None, pack=False)
    assert tree(back) == tree(s2)
