"""Planning at scale: the interval index the planner and diff cut boxes with, checked against
the all-pairs scan it replaces; a reshard of a many-rank checkpoint loaded back by torch;
structure checks and diff over files of many small chunks; and the kept file descriptors
that thousands of rank files share between threads.

The checkpoints are written by ``bench/make_scale_dcp.py`` (real torch.save chunk zips and
a ``.metadata`` pickled from torch's own classes; tests/test_scale_generator.py proves them).
Timings at 10,000 ranks are in BENCHMARKS.md ("scale"), not asserted here.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl.boxes import BoxIndex, intersect
from ckptctl.layout import parse_mesh, preset
from ckptctl.convert.planner import make_plan

ROOT = Path(__file__).resolve().parent.parent
CKPTCTL = str(ROOT / ".venv" / "bin" / "ckptctl")


def _generator():
    spec = importlib.util.spec_from_file_location("make_scale_dcp", ROOT / "bench" / "make_scale_dcp.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_scale_dcp", mod)
    spec.loader.exec_module(mod)
    return mod


def _cli(*args, check=True):
    r = subprocess.run([CKPTCTL, *map(str, args)], capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


# --------------------------------------------------------------------------- the index

@st.composite
def tilings(draw):
    """A grid tiling of a random 1-3 dim tensor (cuts per dim), in shuffled order, plus a
    query box anywhere inside the tensor (possibly empty)."""
    nd = draw(st.integers(1, 3))
    shape, cuts = [], []
    for _ in range(nd):
        n = draw(st.integers(1, 40))
        inner = draw(st.sets(st.integers(1, n - 1), max_size=8)) if n > 1 else set()
        shape.append(n)
        cuts.append(sorted({0, n} | inner))
    boxes = [((),())]
    for c in cuts:
        boxes = [(o + (a,), s + (b - a,)) for o, s in boxes for a, b in zip(c, c[1:])]
    boxes = draw(st.permutations(boxes))
    lo = [draw(st.integers(0, n)) for n in shape]
    size = [draw(st.integers(0, n - o)) for o, n in zip(lo, shape)]
    return boxes, (tuple(lo), tuple(size))


@settings(max_examples=300, deadline=None)
@given(tilings())
def test_index_finds_what_the_full_scan_finds(case):
    boxes, query = case
    want = [(i, hit) for i, b in enumerate(boxes) if (hit := intersect(query, b)) is not None]
    assert BoxIndex(boxes).hits(query) == want


def test_index_with_uneven_and_empty_boxes():
    # FSDP2 leaves the last ranks empty; a chunk may span what others split
    boxes = [((0,), (5,)), ((5,), (1,)), ((6,), (0,)), ((6,), (0,)), ((6,), (4,))]
    ix = BoxIndex(boxes)
    assert ix.hits(((4,), (3,))) == [(0, ((4,), (1,))), (1, ((5,), (1,))), (4, ((6,), (1,)))]
    assert ix.hits(((6,), (0,))) == []
    assert BoxIndex([]).hits(((0,), (3,))) == []
    assert BoxIndex([((), ())]).hits(((), ())) == [(0, ((), ()))]


# --------------------------------------------------------------------------- plans

@pytest.fixture(scope="module")
def gen():
    return _generator()


@pytest.fixture(scope="module")
def many_ranks(gen, tmp_path_factory):
    """A 96-rank checkpoint on a dp x tp mesh: uneven shards, replicated tensors, a step."""
    d = tmp_path_factory.mktemp("scale96") / "step-1000"
    gen.make(d, 96, tensors=12, mesh="2d")
    return d


def _brute_pieces(t, offsets, sizes):
    box = (tuple(offsets), tuple(sizes))
    return [(c, hit) for c in t.chunks if (hit := intersect(box, (c.offsets, c.sizes)))]


@pytest.mark.parametrize("mesh,rules", [("dp=40", "fsdp"), ("dp=6,tp=4", "llama")])
def test_plan_equals_the_all_pairs_plan(many_ranks, mesh, rules):
    from ckptctl.formats import open_checkpoint

    ck = open_checkpoint(str(many_ranks))
    plan = make_plan(ck, preset(rules, parse_mesh(mesh)))
    assert plan.chunks
    for tc in plan.chunks:
        t = ck.tensors[tc.name]
        want = _brute_pieces(t, tc.offsets, tc.sizes)
        assert [(p.src, p.sizes) for p in tc.pieces] == [(c, hit[1]) for c, hit in want]


def test_reshard_of_many_ranks_loads_in_torch(gen, many_ranks, tmp_path):
    """96 ranks to 40 (FSDP splits that do not line up): torch reads back every value."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "dp40"
    _cli("reshard", many_ranks, out, "--world-size", 40)
    assert len(list(out.glob("*.distcp"))) == 40
    specs = {s.name: s for s in gen.specs(96, tensors=12, mesh="2d")}
    want = {n: gen.expected(s) for n, s in specs.items()}
    got = {n: torch.empty_like(v) for n, v in want.items()}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, checkpoint_id=str(out), no_dist=True)
    for n, v in want.items():
        assert torch.equal(got[n].view(torch.uint8), v.view(torch.uint8)), n
    r = json.loads(_cli("verify", out, "--level", "full", "--json").stdout)
    assert r["ok"]


# --------------------------------------------------------------------------- structure, diff

def test_structure_check_reads_small_files_whole_and_finds_a_bad_chunk(many_ranks, tmp_path):
    import shutil

    d = tmp_path / "step-1000"
    shutil.copytree(many_ranks, d)
    r = json.loads(_cli("verify", d, "--level", "structure", "--json").stdout)
    assert r["ok"], r["problems"]
    victim = d / "__17_0.distcp"
    data = bytearray(victim.read_bytes())
    at = data.rfind(b"PK\x01\x02")  # the last chunk's last central-directory record
    data[at:at + 4] = b"XX\x01\x02"
    victim.write_bytes(bytes(data))
    r = _cli("verify", d, "--level", "structure", "--json", check=False)
    assert r.returncode == 1
    problems = json.loads(r.stdout)["problems"]
    assert [(p["code"], Path(p["path"]).name) for p in problems] == [
        ("MALFORMED_CHUNK", "__17_0.distcp")], problems


def test_diff_of_many_small_chunks_compares_files_then_chunks(many_ranks, tmp_path):
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(many_ranks, a)
    shutil.copytree(many_ranks, b)
    r = json.loads(_cli("diff", a, b, "--json").stdout)
    assert r["equal"] and all(e["status"] == "identical" for e in r["entries"]), r
    # change one element's bytes in one chunk of B: that tensor differs, nothing else
    from ckptctl.formats import open_checkpoint
    from ckptctl.formats.tensorio import locate_payload

    ck = open_checkpoint(str(b))
    name, t = next((n, t) for n, t in ck.tensors.items() if len(t.chunks) > 8)
    c = t.chunks[5]
    p = locate_payload(ck, c.extent)
    path = b / c.extent.file
    data = bytearray(path.read_bytes())
    data[p.offset] ^= 0x40
    path.write_bytes(bytes(data))
    r = _cli("diff", a, b, "--json", check=False)
    assert r.returncode == 1
    rows = {e["name"]: e["status"] for e in json.loads(r.stdout)["entries"]}
    assert rows.pop(name) == "different"
    assert set(rows.values()) == {"identical"}, rows


# --------------------------------------------------------------------------- descriptors

def test_kept_descriptors_never_serve_another_files_bytes(tmp_path):
    """More files than descriptors kept, read from many threads: a descriptor closed under
    one reader while another opens a file could hand the first reader another file's bytes."""
    from ckptctl.storage import open_store
    from ckptctl.storage.local_store import MAX_OPEN_FILES

    n = MAX_OPEN_FILES * 2 + 7
    open_before = len(os.listdir("/proc/self/fd"))  # what earlier tests' libraries hold
    for i in range(n):
        (tmp_path / f"f{i}").write_bytes(i.to_bytes(4, "little") * 256)
    store = open_store(str(tmp_path))
    bad: list[str] = []

    def reader(k: int):
        for j in range(k, k + 4 * n, 7):
            i = j % n
            got = store.read_range(f"f{i}", 4 * (j % 200), 4 * (j % 200) + 8)
            if got != i.to_bytes(4, "little") * 2:
                bad.append(f"f{i}: {got!r}")

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    store.close()
    assert not bad, bad[:5]
    # closed, none leaked (a leak keeps up to MAX_OPEN_FILES; a library's own thread
    # pool may open a few meanwhile)
    assert len(os.listdir("/proc/self/fd")) - open_before < 16


# --------------------------------------------------------------------------- hostile metadata

@pytest.mark.parametrize("build", [
    b"]q\x00(K\x01e",  # a record whose state is a list, not a dict
    b"N",  # None: no state at all is fine for the unpickler, but no fields for the reader
])
def test_metadata_records_with_odd_state_are_one_line_errors(tmp_path, build):
    """Records are filled by the C unpickler (no __setstate__): a state that is not a dict
    is refused as a malformed pickle, one with no fields as metadata lacking them."""
    from ckptctl.errors import FormatError
    from ckptctl.formats.dcp import parse_metadata, checkpoint_from_metadata

    cls = b"\x80\x04c" + b"torch.distributed.checkpoint.metadata\nMetadata\n"
    data = cls + b")\x81" + build + b"b."
    with pytest.raises(FormatError) as e:
        checkpoint_from_metadata(parse_metadata(data, where="x/.metadata"), "x",
                                 where="x/.metadata")
    assert "\n" not in str(e.value)


def test_torch_size_with_odd_arguments_is_a_one_line_error():
    from ckptctl.errors import FormatError
    from ckptctl.formats.dcp import parse_metadata

    data = b"\x80\x04ctorch\nSize\nK\x05\x85R."  # torch.Size(5): not a list of dims
    with pytest.raises(FormatError, match="malformed pickle"):
        parse_metadata(data, where="x/.metadata")
