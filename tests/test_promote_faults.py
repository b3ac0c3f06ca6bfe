"""``promote`` under faults (issue 9, "Fault injection"): SIGKILL at 20 random points and at
every step of the commit, local -> local and local -> S3; the S3 server killed or frozen
mid-transfer; a destination that fills up; SIGTERM.

After every kill: no committed-but-incomplete checkpoint is visible at the destination
(`ls`, `verify`, `latest` agree: nothing / incomplete, or committed and `verify --level
full` passes), and the rerun completes sending exactly what was not finished: every byte
of a file already published or of a part the journal vouches for is not sent again
(PromoteResult.bytes_sent, and on S3 the bodies of the PUT/UploadPart requests the server
received).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from conftest import run_cli
from s3server import fresh_fs
from test_promote import s3_op

from ckptctl.errors import CkptError
from ckptctl.formats.manifest import MANIFEST, Manifest
from ckptctl.tiering.promote import JOURNAL, WORK_SUFFIX, promote
from ckptctl.storage.journal import Journal, journal_path_for

ROOT = Path(__file__).resolve().parent.parent
HELPER = ROOT / "tests" / "fixtures" / "promote_kill.py"
PART = 5 << 20
NAME = "step-11"
#: kill points named by tests/fixtures/promote_kill.py: each step of the commit, then two
#: windows of the data phase that a kill by byte count rarely hits
STAGES = ("landed", "journal-removed", "marker-removed", "committed", "published",
          "mid-put", "upload-unjournaled")
LOCAL_ONLY = {"published", "mid-put"}  # the rename of the work folder; a local temp file


# ------------------------------------------------------------------ the source


@dataclass
class Source:
    path: Path
    man: Manifest
    files: dict[str, bytes]

    @property
    def total(self) -> int:
        return self.man.total_bytes


def _write_source(path: Path) -> None:
    """DCP from one process, 4 writer threads: one ~16 MiB file (four 5 MiB parts, the
    last one short) and three small ones, plus .metadata."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(3)
    sd = {"model": {"big": torch.randn(4 * 1024 * 1024 + 333, generator=g),
                    "a": torch.randn(20000, generator=g), "b": torch.randn(50000, generator=g),
                    "c": torch.arange(1000, dtype=torch.int64)}, "step": 11}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path), thread_count=4))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Source:
    from ckptctl.integrity.seal import seal
    from ckptctl.storage import open_store

    p = tmp_path_factory.mktemp("promote-faults") / NAME
    _write_source(p)
    seal(str(p))  # sealed once here: the killed children never seal (nor import torch)
    man = Manifest.read(open_store(str(p)))
    files = {rel: (p / rel).read_bytes() for rel in man.files}
    big = [rel for rel, f in man.files.items() if f.size > 3 * PART]
    assert len(big) == 1 and len(man.files) >= 4, man.files
    return Source(p, man, files)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Journals of remote destinations go under the test's own cache (children inherit it)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


# ------------------------------------------------------------------ helpers


def _opt_flags(opts: dict | None) -> list[str]:
    if not opts:
        return []
    return [x for k in ("endpoint_url", "key", "secret") for x in ("-o", f"{k}={opts[k]}")]


def _kill_run(src: Path, dst: str, opts: dict | None, *, after_bytes: int | None = None,
              stage: str | None = None, workers: int = 4) -> subprocess.CompletedProcess:
    args = [sys.executable, str(HELPER), str(src), dst, "--part-size", str(PART),
            "--workers", str(workers), "--dst-options", json.dumps(opts)]
    if after_bytes is not None:
        args += ["--kill-after-bytes", str(after_bytes)]
    if stage is not None:
        args += ["--kill-at", stage]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)


def _read_journal(path: str, man: Manifest) -> tuple[dict[str, int], dict[str, dict[int, int]]]:
    """(files done -> size, upload rel -> {part number: size}) as a rerun will read them."""
    if not os.path.exists(path):  # Journal() would create it
        return {}, {}
    j = Journal(path, {"source": man.id})
    j.close()
    return ({rel: size for rel, (_, size) in j.files.items()},
            {rel: {n: p.size for n, p in up.parts.items()} for rel, up in j.uploads.items()})


@dataclass
class Place:
    """One destination of the campaign: where it is and how to look at it."""

    url: str
    parent: str
    opts: dict | None = None
    server: object = None  # the S3Server of a remote place
    fs: object = None

    @property
    def local(self) -> bool:
        return self.opts is None

    def journal(self) -> str:
        if self.local:
            parent, name = os.path.split(self.url)
            return os.path.join(parent, f".{name}{WORK_SUFFIX}", JOURNAL)
        return journal_path_for(self.url)

    def published(self, man: Manifest) -> dict[str, int]:
        """Files of the manifest already at the destination under their own name, at
        their size (local: in the work folder or the final one)."""
        found: dict[str, int] = {}
        if self.local:
            parent, name = os.path.split(self.url)
            for d in (os.path.join(parent, f".{name}{WORK_SUFFIX}"), self.url):
                for rel, f in man.files.items():
                    p = os.path.join(d, rel)
                    if os.path.isfile(p) and os.path.getsize(p) == f.size:
                        found[rel] = f.size
            return found
        prefix = self.url[len("s3://"):]
        listed = {k[len(prefix) + 1:]: v for k, v in
                  self.fs.find(prefix, detail=True).items()}
        return {rel: f.size for rel, f in man.files.items()
                if int((listed.get(rel) or {}).get("size", -1)) == f.size}

    def cli(self, *args: str) -> tuple[int, str, str]:
        return run_cli(*args, *_opt_flags(self.opts))


def _look(place: Place, src: Source) -> str:
    """`ls`, `verify` and `latest` through the CLI must agree on what is at the destination;
    returns the state (``none``, ``incomplete``, ``complete`` or ``sealed``)."""
    name = place.url.rstrip("/").rsplit("/", 1)[1]
    code, out, err = place.cli("ls", place.parent, "--json")
    if code == 3 and "no such" in err:  # the parent folder is not even there yet
        rows = {}
    else:
        assert code == 0, err
        rows = {r["name"]: r for r in json.loads(out)["checkpoints"]}
    # nothing else under the parent may look committed (a work folder listed as a checkpoint)
    others = {n: r["state"] for n, r in rows.items() if n != name}
    assert not {n: s for n, s in others.items() if s in ("sealed", "complete")}, others
    row = rows.get(name)
    state = row["state"] if row else "none"
    code, out, err = place.cli("latest", place.parent)
    assert code in (0, 1), err
    latest = out.strip() if code == 0 else None
    assert (latest is None) == (code == 1) and (code == 0 or "no committed" in err), (out, err)
    committed = state in ("sealed", "complete")  # complete: by the format's own marker
    level = "full" if committed else "quick"  # quick: whatever is there, it is not committed
    code, vout, verr = place.cli("verify", place.url, "--level", level, "--json")
    if committed:
        assert code == 0, vout + verr
        assert latest is not None and latest.rstrip("/") == place.url.rstrip("/"), latest
        return state
    assert state in ("none", "incomplete"), (state, row)
    assert latest is None, latest
    assert code != 0, vout  # not committed: verify says so (1) or finds nothing (3)
    if code == 1:
        doc = json.loads(vout)
        assert not doc["ok"] and any(p["code"] in ("NOT_COMMITTED", "MISSING_FILE")
                                     for p in doc["problems"]), doc
    return state


def _s3_sent(log, src: Source, key_prefix: str) -> tuple[int, Counter]:
    """Bytes of checkpoint data the server received (UploadPart and PutObject bodies of the
    manifest's files; sizes from the manifest and the part size) and the ops by name."""
    sent, ops = 0, Counter()
    for r in log:
        op = s3_op(r)
        ops[op] += 1
        key = r.key
        if not key.startswith(key_prefix + "/"):
            continue
        rel = key[len(key_prefix) + 1:]
        if rel not in src.man.files:
            continue
        size = src.man.files[rel].size
        if op == "UploadPart":
            n = int(parse_qs(urlsplit(r.path).query)["partNumber"][0])
            sent += min(size, n * PART) - (n - 1) * PART
        elif op == "PutObject":
            sent += size
    return sent, ops


@dataclass
class Stats:
    kills: int = 0
    states: Counter = field(default_factory=Counter)
    resent: int = 0  # bytes a rerun sent again of what was finished before the kill
    rerun_sent: int = 0
    skipped_files: int = 0
    resumed_parts: int = 0
    resends: list = field(default_factory=list)  # (bytes sent again, kill point, ...)


def _after_kill(place: Place, src: Source, stats: Stats, proc) -> tuple[int, list, dict]:
    """After one kill: look; (bytes finished: files published at the destination and
    parts the journal vouches for, those files, those parts)."""
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])
    stats.kills += 1
    stats.states[_look(place, src)] += 1
    jfiles, jparts = _read_journal(place.journal(), src.man)
    published = place.published(src.man)
    assert set(jfiles) <= set(published), (jfiles, published)  # journal follows the data
    done = sum(published.values()) + sum(sum(p.values()) for rel, p in jparts.items()
                                         if rel not in published)
    # --dry-run names exactly the files a rerun still sends (and writes nothing)
    dry = promote(str(src.path), place.url, None, place.opts, part_size=PART, dry_run=True)
    assert sorted(dry.to_send) == sorted(set(src.man.files) - set(published)), dry
    # ...and counts only the bytes it sends: parts the journal vouches for are not
    assert dry.bytes_to_send == src.man.total_bytes - done, (dry, done)
    return done, sorted(published), jparts


def _check_point(place: Place, src: Source, stats: Stats, proc, point: str) -> None:
    """After one kill: look, then rerun and count what it sends."""
    done, published, jparts = _after_kill(place, src, stats, proc)
    _rerun(place, src, stats, done, (point, published, jparts))


def _rerun(place: Place, src: Source, stats: Stats, done: int, why: tuple) -> None:
    """Rerun to the end: it sends exactly what was not ``done``, and the result is
    committed, verified and (local) byte-identical, with nothing left beside it."""
    if place.server is not None:
        place.server.reset_log()
    r = promote(str(src.path), place.url, None, place.opts, part_size=PART, workers=4)
    assert r.action in ("promoted", "up-to-date"), r
    want = src.total - done
    stats.rerun_sent += r.bytes_sent
    stats.skipped_files += r.files_skipped
    stats.resumed_parts += r.parts_resumed
    if r.bytes_sent != want:  # reported for the whole campaign at its end
        stats.resent += r.bytes_sent - want
        stats.resends.append((r.bytes_sent - want, *why))
    if place.server is not None:
        key_prefix = place.url[len("s3://"):]
        wire, ops = _s3_sent(place.server.request_log(), src, key_prefix)
        assert wire == r.bytes_sent, (wire, r.bytes_sent, ops)  # the server's own count
        assert ops["UploadPart"] == r.parts_sent, (ops, r)
    assert _look(place, src) == "sealed"
    if not place.local:  # no multipart upload left behind (billable), finished or not
        from ckptctl.storage import multipart, open_store

        assert multipart.list_uploads(open_store(place.url, place.opts)) == []
    if place.local:
        got = {rel: (Path(place.url) / rel).read_bytes() for rel in src.man.files}
        same = got == src.files  # a bool: pytest would diff megabytes
        assert same
        assert sorted(os.listdir(place.url)) == sorted([*src.man.files, MANIFEST])
        assert os.listdir(place.parent) == [NAME]  # no work folder left beside it


def _random_points(src: Source, n: int, seed: int) -> list[tuple[int | None, str | None]]:
    """``n`` random byte counts over the whole transfer (reproducible)."""
    rnd = random.Random(seed)
    return [(rnd.randint(1, src.total), None) for _ in range(n)]


def _commit_points(src: Source) -> list[tuple[int | None, str | None]]:
    """After all data (before the commit), then each named point (``STAGES``)."""
    return [(src.total, None)] + [(None, s) for s in STAGES]


def _campaign(src: Source, make_place, points) -> Stats:
    stats, failures = Stats(), []
    t0 = time.monotonic()
    for i, (nbytes, stage) in enumerate(points):
        place = make_place(i)
        if stage in LOCAL_ONLY and not place.local:
            continue
        proc = _kill_run(src.path, place.url, place.opts, after_bytes=nbytes, stage=stage)
        try:
            _check_point(place, src, stats, proc, f"{nbytes or stage}")
        except (AssertionError, CkptError) as e:  # every point runs; all failures are told
            failures.append(f"kill point {i} ({nbytes=}, {stage=}): {type(e).__name__}: "
                            f"{str(e)[:1500]}")
    print(f"\n{stats} in {time.monotonic() - t0:.1f}s")
    assert not failures, "\n".join(failures)
    assert stats.resent == 0, stats.resends
    return stats


# ------------------------------------------------------------------ 1. SIGKILL campaigns


def test_sigkill_campaign_local(tmp_path, source):
    def place(i: int) -> Place:
        parent = tmp_path / f"dst-{i}"
        return Place(str(parent / NAME), str(parent))

    stats = _campaign(source, place, _random_points(source, 20, seed=9) + _commit_points(source))
    assert stats.kills == 20 + 1 + len(STAGES), stats
    assert stats.skipped_files and stats.resumed_parts, stats  # resume really happened


def test_sigkill_the_reruns_too(tmp_path, source):
    """Six kills in a row on one destination, each rerun killed further on (the journal
    of a resumed run resumed again), then the last run: nothing finished is sent twice."""
    place = Place(str(tmp_path / "warm" / NAME), str(tmp_path / "warm"))
    stats = Stats()
    rnd = random.Random(11)
    # progress counts what a rerun finds done, so each kill point lies beyond the last
    for nbytes in sorted(rnd.sample(range(1, source.total), 6)):
        proc = _kill_run(source.path, place.url, None, after_bytes=nbytes)
        done, published, jparts = _after_kill(place, source, stats, proc)
    _rerun(place, source, stats, done, ("last", published, jparts))
    print(f"\n{stats}")
    assert stats.kills == 6 and stats.resent == 0, stats.resends


def _s3_place(bucket, fs):
    def place(i: int) -> Place:
        return Place(bucket.url(f"run-{i}/{NAME}"), bucket.url(f"run-{i}"),
                     bucket.storage_options, bucket.server, fs)
    return place


def test_sigkill_commit_steps_s3(source, s3_bucket):
    stats = _campaign(source, _s3_place(s3_bucket, s3_bucket.fs()), _commit_points(source))
    assert stats.kills == 1 + len(STAGES) - len(LOCAL_ONLY), stats


@pytest.mark.slow
def test_sigkill_campaign_s3(source, s3_bucket):
    stats = _campaign(source, _s3_place(s3_bucket, s3_bucket.fs()),
                      _random_points(source, 20, seed=10))
    assert stats.kills == 20, stats
    assert stats.skipped_files and stats.resumed_parts, stats


# ------------------------------------------------------------------ 2. the S3 server dies


def _cli_proc(*args: str, env: dict | None = None, timeout: float = 180):
    return subprocess.run([sys.executable, "-m", "ckptctl", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, check=False)


def _part(n: int):
    return lambda r: s3_op(r) == "UploadPart" and f"partNumber={n}" in r.path


def _one_line_exit_3(p) -> None:
    assert p.returncode == 3, (p.returncode, p.stderr[-3000:])
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr


def test_server_killed_mid_transfer_then_restarted(tmp_path, source):
    """The server dies at the 2nd part of the big file: one line, exit 3, nothing
    committed. A new server on the same data (a new endpoint: the journal is keyed by the
    destination URL) takes the rerun, which completes and verifies."""
    from s3server import make_bucket, start_rclone

    root = tmp_path / "s3root"
    srv = start_rclone(root)
    try:
        make_bucket(srv, "bkt")
        url = "s3://bkt/run/" + NAME
        fired = srv.fault_on(_part(2), "kill")
        t0 = time.monotonic()
        p = _cli_proc("--timeout", "10", "promote", str(source.path), url, "--part-size", "5MiB",
                      "--workers", "2", *_opt_flags(srv.storage_options))
        took = time.monotonic() - t0
        assert fired.is_set()
        _one_line_exit_3(p)
        assert "s3://bkt/run/" in p.stderr, p.stderr  # names the place
    finally:
        srv.stop()
    assert not (root / "bkt" / "run" / NAME / MANIFEST).exists()
    srv2 = start_rclone(root)
    try:
        place = Place(url, "s3://bkt/run", srv2.storage_options, srv2, fresh_fs(srv2))
        assert _look(place, source) == "incomplete"
        published = place.published(source.man)
        srv2.reset_log()
        r = promote(str(source.path), url, None, srv2.storage_options, part_size=PART,
                    workers=2)
        assert r.action == "promoted" and r.files_skipped == len(published), (r, published)
        assert r.bytes_sent <= source.total - sum(published.values()), r
        wire, ops = _s3_sent(srv2.request_log(), source, "bkt/run/" + NAME)
        assert wire == r.bytes_sent, (wire, ops)
        assert _look(place, source) == "sealed"
    finally:
        srv2.stop()
    print(f"\nserver killed: {p.stderr.strip()}")
    print(f"server killed: failed in {took:.1f}s; rerun sent {r.bytes_sent} of "
          f"{source.total} bytes, {r.files_skipped} files and {r.parts_resumed} parts kept")


def test_server_frozen_mid_transfer_then_thawed(tmp_path, source, s3_bucket):
    """A server that stops answering at the 3rd part: the request budget (--timeout) runs
    out, one line, exit 3, nothing committed; once it answers again the rerun resumes
    the parts it finished and sends only the rest."""
    srv, url = s3_bucket.server, s3_bucket.url(NAME)
    place = Place(url, s3_bucket.url(), s3_bucket.storage_options, srv, s3_bucket.fs())
    fired = srv.fault_on(_part(3), "freeze")
    try:
        t0 = time.monotonic()
        p = _cli_proc("--timeout", "3", "promote", str(source.path), url, "--part-size", "5MiB",
                      "--workers", "1", *_opt_flags(srv.storage_options))
        took = time.monotonic() - t0
    finally:
        srv.fault_on(None, "")
        srv.thaw()
    assert fired.is_set()
    _one_line_exit_3(p)
    assert _look(place, source) == "incomplete"
    _, jparts = _read_journal(place.journal(), source.man)
    published = place.published(source.man)
    done = sum(published.values()) + sum(sum(v.values()) for k, v in jparts.items()
                                         if k not in published)
    srv.reset_log()
    r = promote(str(source.path), url, None, s3_bucket.storage_options, part_size=PART,
                workers=1)
    assert r.action == "promoted" and r.parts_resumed == 2, r  # parts 1 and 2 kept
    assert r.bytes_sent == source.total - done, (r, published, jparts)
    wire, ops = _s3_sent(srv.request_log(), source, s3_bucket.path(NAME))
    assert wire == r.bytes_sent and ops["UploadPart"] == r.parts_sent == 2, ops
    assert _look(place, source) == "sealed"
    print(f"\nserver frozen: {p.stderr.strip()}")
    print(f"server frozen: failed in {took:.1f}s; rerun sent {r.bytes_sent} of "
          f"{source.total} bytes, {r.parts_resumed} parts kept")


# ------------------------------------------------------------------ 3. a full destination


@pytest.mark.parametrize("size", ["8m", "16m"], ids=["mid-file", "at-the-last-part"])
def test_destination_fills_up(source, small_tmpfs, size):
    """ENOSPC in the big file (8 MiB: at its 2nd part; 16 MiB: the small files fit, the
    big one not): one line naming the file and the cause, exit 3, nothing committed."""
    mnt = small_tmpfs(size)
    dst = mnt / NAME
    # one worker: with two, which file meets the full disk first depends on timing
    p = _cli_proc("promote", str(source.path), str(dst), "--part-size", "5MiB",
                  "--workers", "1", timeout=120)
    _one_line_exit_3(p)
    assert "no space left on device" in p.stderr.lower(), p.stderr
    assert "__0_0.distcp" in p.stderr, p.stderr  # the file that did not fit
    assert not dst.exists()  # the work folder is hidden; nothing at the destination's name
    assert not any(f.name == MANIFEST for f in mnt.rglob("*")), list(mnt.rglob("*"))
    place = Place(str(dst), str(mnt))
    assert _look(place, source) == "none"
    code, out, err = run_cli("ls", str(mnt), "--json")
    assert code == 0, err
    assert {r["state"] for r in json.loads(out)["checkpoints"]} <= {"incomplete"}, out
    print(f"\nfull destination ({size}): {p.stderr.strip()}")


# ------------------------------------------------------------------ 4. SIGTERM


def test_sigterm_exits_130_and_the_rerun_resumes(tmp_path, source):
    """SIGTERM once the first part is journaled: exit 130 within a couple of seconds, the
    work folder and its journal stay, and the rerun sends only what is missing."""
    dst = tmp_path / "warm" / NAME
    place = Place(str(dst), str(dst.parent))
    journal = Path(place.journal())
    proc = subprocess.Popen([sys.executable, "-m", "ckptctl", "promote", str(source.path),
                             str(dst), "--part-size", "5MiB", "--workers", "2",
                             "--bwlimit", "10MiB/s"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if journal.exists() and b'"e":"part"' in journal.read_bytes():
            break
        time.sleep(0.005)
    assert proc.poll() is None, proc.communicate()
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 130, (proc.returncode, err)
    assert "interrupted" in err and "Traceback" not in err, err
    assert took < 10, took  # generous: the parts in flight stop at their next step
    assert _look(place, source) == "none"
    _, jparts = _read_journal(str(journal), source.man)
    assert jparts.get("__0_0.distcp"), jparts  # resumable: the journal kept its parts
    published = place.published(source.man)
    done = sum(published.values()) + sum(sum(v.values()) for k, v in jparts.items()
                                         if k not in published)
    r = promote(str(source.path), str(dst), part_size=PART, workers=2)
    assert r.action == "promoted" and r.parts_resumed >= 1, r
    assert r.bytes_sent == source.total - done, (r, published, jparts)
    assert _look(place, source) == "sealed"
    assert os.listdir(dst.parent) == [NAME]
    print(f"\nSIGTERM: exit 130 after {took:.2f}s; rerun sent {r.bytes_sent} of "
          f"{source.total} bytes, {r.files_skipped} files and {r.parts_resumed} parts kept")
