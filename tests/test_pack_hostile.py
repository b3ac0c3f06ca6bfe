"""Hostile and damaged packs (issue 10, item 3): a corrupt chunk fails ``unpack`` naming
the chunk and leaves nothing at DST that looks complete; an index that lies (sizes,
overlaps, names leaving the root, a decompression bomb, absurd counts) is refused with
one line before memory or disk is spent; a missing or wrong base is a clear error."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ckptctl.errors import CkptError, FormatError, NotFoundError, UnsafeInputError
from ckptctl.formats.manifest import MANIFEST, WRITING_MARKER, Manifest
from ckptctl.formats.pack import PACK_INDEX
from ckptctl.packs.pack import pack
from ckptctl.packs.unpack import unpack
from ckptctl.storage import digest_bytes
from test_pack import CHANGED, write_dcp


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path]:
    """(source, its pack), written once; tests copy the pack before damaging it."""
    root = tmp_path_factory.mktemp("hostile")
    src = write_dcp(root / "src")
    pack(str(src), str(root / "pack"), workers=2)
    return src, root / "pack"


@pytest.fixture
def p(packed, tmp_path) -> Path:
    import shutil

    shutil.copytree(packed[1], tmp_path / "pack")
    return tmp_path / "pack"


def _reseal(p: Path) -> None:
    """What an attacker does after editing a pack: make its manifest match again."""
    man = Manifest.parse((p / MANIFEST).read_bytes(), "m")
    for rel in list(man.files):
        data = (p / rel).read_bytes()
        man.files[rel] = type(man.files[rel])(len(data), digest_bytes(data))
    (p / MANIFEST).write_bytes(man.to_bytes())


def tamper(p: Path, fn) -> None:
    doc = json.loads((p / PACK_INDEX).read_bytes())
    fn(doc)
    (p / PACK_INDEX).write_bytes(json.dumps(doc).encode())
    _reseal(p)


def _tensor_seg(doc: dict, min_chunks: int = 1) -> dict:
    return next(s for s in doc["files"]["__0_0.distcp"]["segments"]
                if s["kind"] == "tensor" and len(s["chunks"]) >= min_chunks)


def refused(p: Path, tmp_path: Path, cli, *words: str, code: int = 3) -> str:
    """unpack, inspect and verify refuse the pack with one line naming what is wrong,
    and unpack writes nothing."""
    out = tmp_path / "out"
    rc, so, err = cli("unpack", str(p), str(out))
    assert rc == code and so == "", (rc, so, err)
    line = err.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in line, (w, line)
    assert not out.exists()
    rc2, _, err2 = cli("inspect", str(p))
    assert rc2 == code and err2.strip() == line, (err2, line)
    return line


# --------------------------------------------------------------------------- damage


def test_corrupt_chunk_unpack_names_it_and_leaves_nothing(p, tmp_path, cli):
    doc = json.loads((p / PACK_INDEX).read_bytes())
    seg = _tensor_seg(doc, 2)
    c = seg["chunks"][1]
    data = p / c["data"]
    blob = bytearray(data.read_bytes())
    blob[c["at"] + c["clen"] // 3] ^= 0x10
    data.write_bytes(bytes(blob))
    with pytest.raises(FormatError) as ei:
        unpack(str(p), str(tmp_path / "out"), workers=2)
    msg = str(ei.value)
    assert "data-00000.bin: chunk " in msg and "of __0_0.distcp" in msg, msg
    assert ei.value.code == "MALFORMED_CHUNK"
    assert not (tmp_path / "out").exists()
    # into an existing empty folder: it stays, empty
    (tmp_path / "out2").mkdir()
    rc, so, err = cli("unpack", str(p), str(tmp_path / "out2"))
    assert rc == 3 and "chunk " in err and len(err.strip().splitlines()) == 1, err
    assert list((tmp_path / "out2").iterdir()) == []


def test_truncated_data_file(p, tmp_path, cli):
    data = p / "data-00000.bin"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size - 100)
    refused(p, tmp_path, cli, "data-00000.bin", f"{size - 100} bytes, manifest says {size}")
    _reseal(p)  # the manifest made to agree: the index still places chunks past the end
    refused(p, tmp_path, cli, "lies past the end of data-00000.bin", f"the file has {size - 100}")


def test_index_with_lying_file_size(p, tmp_path, cli):
    tamper(p, lambda d: d["files"]["__0_0.distcp"].__setitem__(
        "size", d["files"]["__0_0.distcp"]["size"] + 10))
    refused(p, tmp_path, cli, "__0_0.distcp: segments cover")


def test_index_with_lying_chunk_size(p, tmp_path, cli):
    def lie(d):
        seg = next(s for s in d["files"]["__0_0.distcp"]["segments"] if s["length"] < 1 << 20)
        seg["chunks"][0]["size"] += 8
    tamper(p, lie)
    refused(p, tmp_path, cli, "chunk ", "the segment's chunking says")


def test_index_with_overlapping_segments(p, tmp_path, cli):
    def overlap(d):
        segs = d["files"]["__0_0.distcp"]["segments"]
        segs[1]["offset"] -= 4
        segs[1]["length"] += 4
    tamper(p, overlap)
    line = refused(p, tmp_path, cli, "segments do not tile the file")
    assert "previous ends at" in line


@pytest.mark.parametrize("where", ["file", "base", "data"])
def test_index_names_escaping_the_root(p, tmp_path, cli, where):
    def escape(d):
        if where == "file":
            d["files"]["../../evil"] = d["files"].pop("__0_0.distcp")
            d["source"]["files"]["../../evil"] = d["source"]["files"].pop("__0_0.distcp")
        elif where == "base":
            d["base"] = {"id": "xxh3-128:00", "depth": 1}
            _tensor_seg(d)["base"] = {"file": "../../../etc/passwd", "offset": 0}
        else:
            _tensor_seg(d)["chunks"][0]["data"] = "../data-00000.bin"
    tamper(p, escape)
    if where == "data":
        refused(p, tmp_path, cli, "bad mode, check or data file")
    else:
        refused(p, tmp_path, cli, "escapes the checkpoint root")


def test_decompression_bomb_chunk(p, tmp_path, cli):
    """A payload that inflates far past the chunk's declared size is refused while
    decoding, after at most the declared size (the index bounds every size first)."""
    from ckptctl.formats import packcodec

    _, bomb = packcodec.encode(bytes(16 << 20), itemsize=1)
    assert len(bomb) < 4096
    data = p / "data-00000.bin"
    at = data.stat().st_size
    with open(data, "ab") as f:
        f.write(bomb)

    def point(d):
        seg = next(s for s in d["files"]["__0_0.distcp"]["segments"] if s["kind"] == "raw")
        c = seg["chunks"][0]
        c.update(at=at, clen=len(bomb), mode="zstd")
    tamper(p, point)
    t0 = time.monotonic()
    with pytest.raises(FormatError) as ei:
        unpack(str(p), str(tmp_path / "out"), workers=1)
    assert time.monotonic() - t0 < 10
    assert "chunk 0 of __0_0.distcp" in str(ei.value), ei.value
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("lie, words", [
    (lambda d: d.__setitem__("chunk_size", 1 << 40), "chunk_size must be an integer"),
    (lambda d: _tensor_seg(d)["chunks"][0].__setitem__("size", 1 << 40), "size must be"),
    (lambda d: _tensor_seg(d)["chunks"].pop(), "chunks, expected 2"),
    (lambda d: d["files"]["__0_0.distcp"].__setitem__("size", 1 << 62), "size must be"),
    (lambda d: _tensor_seg(d)["chunks"].extend(_tensor_seg(d)["chunks"] * 100_000),
     "chunks, expected 2"),
    (lambda d: d.__setitem__("pack", 99), "not a version-1 pack index"),
])
def test_absurd_counts_and_sizes(p, tmp_path, cli, lie, words):
    tamper(p, lie)
    refused(p, tmp_path, cli, words)


def _many_files(doc: dict, n: int) -> dict:
    """``doc`` (a real pack's index) made to restore ``n`` more files, named like a
    rank's DCP file, each a copy of ``.metadata``'s record (one raw segment, one chunk):
    a valid index once its source_id is recomputed."""
    rec, entry = doc["files"][".metadata"], doc["source"]["files"][".metadata"]
    for i in range(n):
        doc["files"][f"__{i + 1}_0.distcp"] = rec
        doc["source"]["files"][f"__{i + 1}_0.distcp"] = entry
    return doc


def test_index_of_200k_files_is_refused_before_it_is_parsed(p, tmp_path, cli):
    """The count comes first, in the bytes: no JSON is built for an index of 200,000
    files (a cut-off index gets the count's error, not the JSON's), and next to nothing
    is allocated; through the CLI it is one line."""
    import tracemalloc

    from ckptctl.formats.pack import MAX_FILES, PackIndex

    doc = _many_files(json.loads((p / PACK_INDEX).read_bytes()), 200_000)
    data = json.dumps(doc).encode()
    cut = data[:-1]  # not even valid JSON: it is never parsed
    del doc
    tracemalloc.start()
    try:
        with pytest.raises(UnsafeInputError) as ei:
            PackIndex.parse(cut, "x", None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(ei.value) == (f"x: pack index lists 200003 files, over the limit of "
                             f"{MAX_FILES} files a pack may hold"), ei.value
    assert peak < len(data) // 100, (peak, len(data))  # the JSON would be several times it
    (p / PACK_INDEX).write_bytes(data)
    _reseal(p)
    refused(p, tmp_path, cli, "ckptctl.pack.json", "200003 files",
            f"over the limit of {MAX_FILES} files")


def test_counts_the_parsed_index_before_any_record():
    """Keys spelled with escapes hide the records from the count in the bytes: the parsed
    index is counted again before the source manifest or any file record is read (its
    wrong source_id and malformed first record are not what the error says)."""
    from ckptctl.formats.pack import PackIndex

    doc = {"pack": 1, "source": {"files": {}}, "source_id": "wrong", "chunk_size": 4,
           "base": None, "files": {"bad": {"segments": "not a list"}}}
    doc["files"].update({f"__{i}_0.distcp": {"size": 1, "segments": [{"kind": "raw"}]}
                         for i in range(150_000)})
    data = json.dumps(doc).encode().replace(b'"segments"', b'"\\u0073egments"')
    assert b'"segments"' not in data
    with pytest.raises(UnsafeInputError) as ei:
        PackIndex.parse(data, "x", None)
    assert "lists 150001 files, over the limit of 100000 files" in str(ei.value), ei.value


def test_absurd_segment_count_is_refused_in_the_bytes():
    from ckptctl.formats.pack import MAX_SEGMENTS, PackIndex

    data = b"[" + b'"kind",' * (MAX_SEGMENTS + 1) + b"0]"
    with pytest.raises(UnsafeInputError) as ei:
        PackIndex.parse(data, "x", None)
    assert f"lists {MAX_SEGMENTS + 1} segments, over the limit of {MAX_SEGMENTS}" \
        in str(ei.value), ei.value


def test_index_of_10k_files_still_parses(p):
    """A pack of a 10,000-rank DCP checkpoint (~10,000 files) is far below the limits."""
    from ckptctl.formats.pack import PackIndex

    doc = _many_files(json.loads((p / PACK_INDEX).read_bytes()), 10_000)
    doc["source_id"] = Manifest.parse(json.dumps(doc["source"]).encode(), "m").id
    listing = {x.name: x.stat().st_size for x in p.iterdir()}
    idx = PackIndex.parse(json.dumps(doc).encode(), "x", listing)
    assert len(idx.files) == 10_003 and idx.files["__10000_0.distcp"].size \
        == idx.files[".metadata"].size


def test_deeply_nested_index(p, tmp_path, cli):
    (p / PACK_INDEX).write_bytes(b"[" * 200_000 + b"]" * 200_000)
    _reseal(p)
    refused(p, tmp_path, cli, "pack index nests too deeply")


def test_unfinished_pack_write(p, tmp_path, cli):
    (p / WRITING_MARKER).write_text("{}")
    rc, _, err = cli("inspect", str(p))
    assert rc == 3 and "a ckptctl writer or remover holds this folder" in err, err
    rc, out, err = cli("verify", str(p), "--json")
    assert rc == 1 and json.loads(out)["problems"][0]["code"] == "NOT_COMMITTED", out
    (p / WRITING_MARKER).unlink()
    (p / MANIFEST).unlink()
    refused(p, tmp_path, cli, "pack is not committed")


def test_damaged_source_is_not_packed(tmp_path):
    from ckptctl.ops import seal

    src = write_dcp(tmp_path / "s")
    seal(str(src))
    f = src / "__0_0.distcp"
    blob = bytearray(f.read_bytes())
    blob[len(blob) // 2] ^= 1
    f.write_bytes(bytes(blob))
    with pytest.raises(CkptError) as ei:
        pack(str(src), str(tmp_path / "p"), workers=2)
    assert ei.value.code == "HASH_MISMATCH" and "__0_0.distcp" in str(ei.value)
    assert not (tmp_path / "p").exists()


# --------------------------------------------------------------------------- bases


@pytest.fixture
def delta(tmp_path):
    from ckptctl.ops import seal

    a = write_dcp(tmp_path / "a")
    b = write_dcp(tmp_path / "b", CHANGED)
    seal(str(a))
    seal(str(b))
    r = pack(str(b), str(tmp_path / "pb"), base=str(a), workers=2)
    return a, b, tmp_path / "pb", r


def test_missing_base(delta, tmp_path, cli):
    import shutil

    a, b, pb, r = delta
    shutil.move(str(a), tmp_path / "elsewhere")
    with pytest.raises(NotFoundError) as ei:
        unpack(str(pb), str(tmp_path / "out"))
    assert r.base in str(ei.value) and "--base" in str(ei.value)
    assert not (tmp_path / "out").exists()
    rc, _, err = cli("unpack", str(pb), str(tmp_path / "out"))
    assert rc == 3 and r.base in err and len(err.strip().splitlines()) == 1, err
    # reading what needs no base still works: inspect reads raw segments only
    rc, out, err = cli("inspect", str(pb))
    assert rc == 0 and f"base {r.base}" in out, err
    # told where it went, it unpacks
    unpack(str(pb), str(tmp_path / "out"), base=str(tmp_path / "elsewhere"))
    assert (tmp_path / "out" / MANIFEST).read_bytes() == (b / MANIFEST).read_bytes()


def test_wrong_base(delta, tmp_path, cli):
    a, b, pb, r = delta
    other = write_dcp(tmp_path / "other", ("l2.w",))
    rc, _, err = cli("unpack", str(pb), str(tmp_path / "out"), "--base", str(other))
    assert rc == 3 and "not sealed" in err and r.base in err, err
    from ckptctl.ops import seal

    seal(str(other))
    with pytest.raises(FormatError) as ei:
        unpack(str(pb), str(tmp_path / "out"), base=str(other))
    msg = str(ei.value)
    assert "wrong base" in msg and f"needs {r.base}" in msg, msg
    assert not (tmp_path / "out").exists()
    with pytest.raises(UnsafeInputError):  # and a base named in the index is checked too
        from ckptctl.formats.pack import PackIndex

        doc = json.loads((pb / PACK_INDEX).read_bytes())
        _tensor_seg(doc)["base"]["file"] = "/etc/passwd"
        PackIndex.parse(json.dumps(doc).encode(), "x", None)


def test_a_cycle_of_bases_is_refused(tmp_path):
    """Two packs that name each other as base (each id checks out) would recurse for
    ever: a base must be a shorter chain than the pack that needs it."""
    from ckptctl.ops import seal

    a = write_dcp(tmp_path / "a")
    b = write_dcp(tmp_path / "b", CHANGED)
    seal(str(a))
    seal(str(b))
    pack(str(b), str(tmp_path / "pb0"), workers=2)
    pa = pack(str(a), str(tmp_path / "pa"), base=str(tmp_path / "pb0"), workers=2)
    pack(str(b), str(tmp_path / "pb"), base=str(tmp_path / "pa"), workers=2)
    assert pa.depth == 1
    with pytest.raises(FormatError) as ei:
        unpack(str(tmp_path / "pa"), str(tmp_path / "out"), base=str(tmp_path / "pb"))
    assert "must get shorter" in str(ei.value) and not (tmp_path / "out").exists()


def test_interrupted_pack_and_unpack_leave_nothing(packed, tmp_path):
    src, p = packed

    def stop(n):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pack(str(src), str(tmp_path / "p2"), workers=2, on_bytes=stop)
    assert not (tmp_path / "p2").exists()
    with pytest.raises(KeyboardInterrupt):
        unpack(str(p), str(tmp_path / "out"), workers=2, on_bytes=stop)
    assert not (tmp_path / "out").exists()
