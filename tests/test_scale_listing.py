"""Issue 12, item 3: ``ls``, ``latest`` and ``gc`` over thousands of checkpoints on S3.

The trees are :func:`bench.listing_bench.make_tree` copies of one small real sealed DCP
checkpoint (and a pack of it), written straight into the folder ``rclone serve s3`` serves
*before* the server starts (rclone's directory cache would hide files written behind its
back for minutes). The same folder, read as a local path, is the reference: every answer
on S3 (names, steps, formats, states, sizes, keep/remove decisions and their reasons)
must equal the local one, which reads every checkpoint; the S3 run must do it with about
one LIST per 1,000 keys, a few GETs whatever the number of checkpoints, no HEAD, and
delete in DeleteObjects batches of up to 1,000 keys.
"""
from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from listing_bench import count, make_template, make_tree  # noqa: E402
from s3server import start_rclone  # noqa: E402

from ckptctl.formats.manifest import MANIFEST  # noqa: E402
from ckptctl.writing.removal import COMMIT_MARKERS, deletion_order  # noqa: E402

#: ~3,900 keys: four listing pages
N = 1000
#: the real gc's tree: ~580 removed, so the data phase (2 files each) takes two batches
N_GC = 600
#: GETs any command may send whatever N: the packs (read whole: 3 x ~4) and a few newest
GET_BOUND = 40


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return make_template(tmp_path_factory.mktemp("template"))


class World:
    """Buckets of one tree each in a folder served by its own rclone (started after the
    trees were written); ``local(bucket)`` is the same tree read as a local path."""

    def __init__(self, root: Path, server, n: int):
        self.root, self.server, self.n = root, server, n

    def url(self, bucket: str) -> str:
        return f"s3://{bucket}/run"

    def local(self, bucket: str) -> str:
        return str(self.root / bucket / "run")

    def keys(self, bucket: str) -> int:
        return sum(1 for p in (self.root / bucket).rglob("*") if p.is_file())

    @property
    def opts(self) -> list[str]:
        o = self.server.storage_options
        return [f"--storage-option=endpoint_url={o['endpoint_url']}",
                f"--storage-option=key={o['key']}", f"--storage-option=secret={o['secret']}"]


def _world(tmp_path_factory, template, n: int, buckets: dict[str, int]):
    """``buckets``: name -> number of checkpoints in its tree."""
    root = tmp_path_factory.mktemp(f"served-{n}")
    now = time.time()
    for b, k in buckets.items():
        make_tree(root / b, k, template, now=now)
    srv = start_rclone(root)
    return World(root, srv, n)


@pytest.fixture(scope="module")
def world(tmp_path_factory, template):
    w = _world(tmp_path_factory, template, N, {"ro": N, "gc": N_GC})
    yield w
    w.server.stop()


def _run(cli, world, *args) -> tuple[dict, dict]:
    """``ckptctl ARGS --json`` on S3: (its JSON, requests by kind)."""
    world.server.reset_log()
    code, out, err = cli(*args, "--json", *world.opts)
    assert code == 0, err
    return json.loads(out), count(world.server.request_log())


def _pages(world, bucket: str) -> int:
    return math.ceil(world.keys(bucket) / 1000)


def _rows(doc: dict) -> list[tuple]:
    return [(c["name"], c["step"], c["format"], c["state"], c["bytes"], c["num_files"],
             c["pinned"], c["modified"]) for c in doc["checkpoints"]]


def test_ls_states_come_from_one_paginated_listing(world, cli):
    doc, n = _run(cli, world, "ls", world.url("ro"))
    assert len(doc["checkpoints"]) == world.n
    assert n.get("LIST", 0) <= _pages(world, "ro") + 1 and _pages(world, "ro") >= 3, n
    assert n.get("GET", 0) <= GET_BOUND and n.get("HEAD", 0) == 0, n
    assert set(n) <= {"LIST", "GET"}, n
    code, out, err = cli("ls", world.local("ro"), "--json")  # reads every checkpoint
    assert code == 0, err
    assert _rows(doc) == _rows(json.loads(out))
    states = {c["state"] for c in doc["checkpoints"]}
    assert states == {"sealed", "complete", "incomplete"}


def _latest(cli, world, root: str, *extra) -> tuple[str, dict]:
    """``ckptctl latest`` (it prints the URL alone): (the name, requests by kind)."""
    world.server.reset_log()
    code, out, err = cli("latest", root, *extra, *world.opts)
    assert code == 0, err
    return out.strip().rsplit("/", 1)[-1], count(world.server.request_log())


def test_latest_reads_only_the_newest(world, cli):
    for extra in ((), ("--verified",)):
        name, n = _latest(cli, world, world.url("ro"), *extra)
        assert name == f"step-{100 * world.n}", name
        assert n.get("LIST", 0) <= _pages(world, "ro") + 1, n
        assert n.get("GET", 0) <= GET_BOUND and n.get("HEAD", 0) == 0, n
        assert _latest(cli, world, world.local("ro"), *extra)[0] == name


def _decision(doc: dict) -> tuple:
    return doc["keep"], doc["remove"], [(c["name"], c["action"], c["reasons"])
                                        for c in doc["checkpoints"]]


def test_gc_dry_run_decides_as_a_full_read_does(world, cli):
    doc, n = _run(cli, world, "gc", world.url("ro"), "--keep-last", "10", "--keep-every",
                  "50000", "--dry-run")
    assert n.get("LIST", 0) <= _pages(world, "ro") + 2, n  # + the unfinished uploads
    assert n.get("GET", 0) <= GET_BOUND and n.get("HEAD", 0) == 0, n
    assert set(n) <= {"LIST", "GET"}, n
    code, out, err = cli("gc", world.local("ro"), "--keep-last", "10", "--keep-every",
                         "50000", "--dry-run", "--json")
    assert code == 0, err
    assert _decision(doc) == _decision(json.loads(out))
    assert len(doc["remove"]) > world.n * 0.9


def _phases(root: Path, names: list[str]) -> tuple[list[int], int]:
    """Keys per deletion phase of gc's batched removal of ``names`` (see
    :func:`ckptctl.tiering.gc.remove_batched`): each commit-marker rank, the data, the writing
    markers; and how many writing markers are PUT (only where no format marker of the
    checkpoint's own goes first and more than one data file follows)."""
    from ckptctl.writing.commit import is_format_marker

    plans = []
    for name in names:
        folder = root / name
        files = {str(p.relative_to(folder)): 1 for p in folder.rglob("*") if p.is_file()}
        order = deletion_order(files)
        markers = [f for f in order if f.rsplit("/", 1)[-1] in COMMIT_MARKERS]
        rest = order[len(markers):]
        plans.append((markers, rest, not (any(is_format_marker(m) and "/" not in m
                                              for m in markers) or len(rest) <= 1)))
    depth = max(len(m) for m, _, _ in plans)
    puts = sum(need for _, _, need in plans)
    return ([sum(1 for m, _, _ in plans if k < len(m)) for k in range(depth)]
            + [sum(len(rest) for _, rest, _ in plans)] + ([puts] if puts else [])), puts


def test_real_gc_deletes_in_batches_and_leaves_what_a_local_gc_decides(world, cli):
    before = {p.name for p in (world.root / "gc" / "run").iterdir()}
    pages = _pages(world, "gc")
    code, out, err = cli("gc", world.local("gc"), "--keep-last", "10", "--dry-run", "--json")
    assert code == 0, err
    local = json.loads(out)
    phases, puts = _phases(world.root / "gc" / "run", local["remove"])
    assert max(phases) > 1000 and puts < len(local["remove"]) / 2, (phases, puts)
    doc, n = _run(cli, world, "gc", world.url("gc"), "--keep-last", "10")
    assert _decision(doc) == _decision(local)
    assert n.get("PUT", 0) == puts, n  # writing markers only where needed: no batch PUT
    assert n.get("BATCH", 0) == sum(math.ceil(k / 1000) for k in phases), (n, phases)
    assert n.get("DELETE", 0) == 0 and n.get("HEAD", 0) == 0, n
    assert n.get("GET", 0) <= GET_BOUND and n.get("LIST", 0) <= pages + 2, n
    left = {p.name for p in (world.root / "gc" / "run").iterdir()}
    assert left == set(doc["keep"]) and before - left == set(doc["remove"])
    listed, n = _run(cli, world, "ls", world.url("gc"))
    assert sorted(c["name"] for c in listed["checkpoints"]) == sorted(doc["keep"])


def test_a_damaged_newest_is_found_by_reading_it(tmp_path, template, cli):
    """150 checkpoints (listed from the listing, past QUICK_LIMIT): the newest sealed one
    has lost a data file, the next has a manifest that does not parse. ``latest`` and
    ``gc`` read them (the listing alone calls them sealed) and answer as a full read."""
    from ckptctl.catalog.ls import QUICK_LIMIT

    n = QUICK_LIMIT + 50
    make_tree(tmp_path / "dmg", n, template)
    run = tmp_path / "dmg" / "run"
    (run / f"step-{100 * n}" / "__0_1.distcp").unlink()
    (run / f"step-{100 * (n - 1)}" / MANIFEST).write_text("{not json")
    srv = start_rclone(tmp_path)
    try:
        world = World(tmp_path, srv, n)
        for extra in ((), ("--verified",)):
            name, counts = _latest(cli, world, world.url("dmg"), *extra)
            assert name == f"step-{100 * (n - 2)}" and counts.get("GET", 0) <= GET_BOUND, counts
            assert _latest(cli, world, world.local("dmg"), *extra)[0] == name
        doc, counts = _run(cli, world, "gc", world.url("dmg"), "--keep-last", "2", "--dry-run")
        code, out, err = cli("gc", world.local("dmg"), "--keep-last", "2", "--dry-run",
                             "--json")
        assert code == 0, err
        assert _decision(doc) == _decision(json.loads(out))
        assert doc["keep"][f"step-{100 * (n - 2)}"] == ["last 2", "newest committed"]
    finally:
        srv.stop()


def test_batched_gc_on_moto(tmp_path, template, moto_bucket, cli):
    """moto answers DeleteObjects as AWS does (errors per key, MalformedXML on an empty
    batch): gc's phases across checkpoints (a writing marker PUT where needed, then one
    batch per marker rank, the data, the markers) leave exactly the kept checkpoints."""
    make_tree(tmp_path / "t", 30, template)
    moto_bucket.upload(tmp_path / "t" / "run", "run")
    o = moto_bucket.storage_options
    opts = [f"--storage-option=endpoint_url={o['endpoint_url']}",
            f"--storage-option=key={o['key']}", f"--storage-option=secret={o['secret']}"]
    url = moto_bucket.url("run")
    code, out, err = cli("gc", url, "--keep-last", "3", "--dry-run", "--json", *opts)
    assert code == 0, err
    dry = json.loads(out)
    phases, puts = _phases(tmp_path / "t" / "run", dry["remove"])
    moto_bucket.server.reset_log()
    code, out, err = cli("gc", url, "--keep-last", "3", "--json", *opts)
    assert code == 0, err
    doc = json.loads(out)
    assert _decision(doc)[:2] == _decision(dry)[:2] and len(doc["remove"]) > 20
    n = count(moto_bucket.server.request_log())
    assert n.get("PUT", 0) == puts and n.get("BATCH", 0) == len(phases), n
    left = {p.split("/run/")[1].split("/")[0] for p in moto_bucket.fs().find(moto_bucket.path("run"))}
    assert left == set(doc["keep"])


@pytest.mark.slow
def test_ten_thousand_checkpoints(tmp_path_factory, template, cli):
    """The issue's size: ls, latest and a gc dry run of 10,000 checkpoints on S3."""
    w = _world(tmp_path_factory, template, 10_000, {"big": 10_000})
    try:
        doc, n = _run(cli, w, "ls", w.url("big"))
        assert len(doc["checkpoints"]) == 10_000
        assert n.get("LIST", 0) <= _pages(w, "big") + 1 and n.get("GET", 0) <= GET_BOUND, n
        name, n = _latest(cli, w, w.url("big"))
        assert name == "step-1000000" and n.get("GET", 0) <= GET_BOUND, n
        dry, n = _run(cli, w, "gc", w.url("big"), "--keep-last", "10", "--dry-run")
        assert n.get("GET", 0) <= GET_BOUND and n.get("HEAD", 0) == 0, n
        code, out, err = cli("gc", w.local("big"), "--keep-last", "10", "--dry-run", "--json")
        assert code == 0 and _decision(json.loads(out)) == _decision(dry), err
        phases, puts = _phases(w.root / "big" / "run", dry["remove"])
        doc, n = _run(cli, w, "gc", w.url("big"), "--keep-last", "10")
        assert n.get("BATCH", 0) == sum(math.ceil(k / 1000) for k in phases), n
        assert n.get("PUT", 0) == puts < len(doc["remove"]) / 2, (n, puts)
        assert {p.name for p in (w.root / "big" / "run").iterdir()} == set(doc["keep"])
    finally:
        w.server.stop()
        shutil.rmtree(w.root, ignore_errors=True)
