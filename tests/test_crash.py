"""Writers under faults (issue 7, item 10): kill -9 at random points of `consolidate` (19
shards), `reshard` and `seal`; SIGTERM and SIGINT; a full disk. A killed output is never
listed `complete` or `sealed` unless it truly is (then `verify --level full` passes and
every tensor equals the source), `--force` replaces the leftover, and an interrupted run
leaves nothing behind.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ckptctl.formats.manifest import MANIFEST, WRITING_MARKER
from ckptctl.formats.safetensors_write import write_file

ROOT = Path(__file__).resolve().parent.parent
NTENSORS = 19
SHAPE = (512, 512)  # 1 MiB of float32 each: one shard each at --max-shard-size 1.1MB
SHARD = "1100KB"


def _source(path: Path) -> dict[str, np.ndarray]:
    """An unsealed one-file safetensors checkpoint of 19 random float32 tensors."""
    rng = np.random.default_rng(7)
    ts = {f"model.layers.{i:02d}.weight": rng.standard_normal(SHAPE, dtype=np.float32)
          for i in range(NTENSORS)}
    path.mkdir(parents=True)
    entries = [(n, "F32", SHAPE, a.nbytes) for n, a in sorted(ts.items())]
    with open(path / "model.safetensors", "wb") as f:
        write_file(f, entries, lambda n: [ts[n].tobytes()], {"format": "pt"})
    return ts


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    p = tmp_path_factory.mktemp("crash") / "src"
    return p, _source(p)


def _cmd(*args) -> list[str]:
    return [sys.executable, "-m", "ckptctl", *map(str, args)]


def _popen(args):
    return subprocess.Popen(_cmd(*args), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _files(d: Path) -> list[str]:
    try:
        return os.listdir(d)
    except FileNotFoundError:
        return []


def _kill_when(p: subprocess.Popen, dst: Path, nfiles: int, delay: float, sig, *,
               marker: bool = False) -> bool:
    """Send ``sig`` once ``dst`` holds ``nfiles`` files (the marker counted only with
    ``marker``), after ``delay`` more seconds. False if the process ended first."""
    deadline = time.monotonic() + 60
    while p.poll() is None and time.monotonic() < deadline:
        if len([f for f in _files(dst) if marker or f != WRITING_MARKER]) >= nfiles:
            if delay:
                time.sleep(delay)
            if p.poll() is not None:
                return False
            p.send_signal(sig)
            return True
        time.sleep(0.0005)
    return False


def _state(cli, dst: Path) -> tuple[str | None, dict]:
    """(state ls gives ``dst``, verify --level quick --json) — both through the CLI."""
    code, out, err = cli("ls", str(dst.parent), "--json")
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)["checkpoints"]}
    row = rows.get(dst.name)
    if not dst.exists():
        assert row is None
        return None, {}
    code, out, err = cli("verify", str(dst), "--level", "quick", "--json")
    assert code in (0, 1, 3), err
    doc = json.loads(out) if out.strip() else {}
    return (row["state"] if row else None), doc


def _tensors_equal_source(dst: Path, ts: dict, fmt: str) -> None:
    if fmt == "safetensors":
        from safetensors.numpy import load_file

        got = {}
        for f in sorted(dst.glob("*.safetensors")):
            got.update(load_file(f))
    else:  # DCP, read back by torch's own loader
        import torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        out = dst.parent / (dst.name + ".pt")
        dcp_to_torch_save(str(dst), str(out))
        got = {k: v.numpy() for k, v in torch.load(out, weights_only=True).items()}
        out.unlink()
    assert sorted(got) == sorted(ts)
    for k, v in ts.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        same = got[k].tobytes() == v.tobytes()  # a bool: pytest would diff megabytes
        assert same, k


def _check_killed(cli, dst: Path, ts: dict, fmt: str, stats: dict) -> None:
    """The invariant: listed complete/sealed only if it truly is."""
    state, doc = _state(cli, dst)
    stats[state] = stats.get(state, 0) + 1
    if state in ("complete", "sealed"):
        # a kill inside write_atomic may leave its temp file: a warning, nothing more
        assert {p["code"] for p in doc["problems"]} <= {"STRAY_TEMP"}, doc
        assert doc["sealed"] == (state == "sealed")
        code, out, err = cli("verify", str(dst), "--level", "full", "--json")
        full = json.loads(out)
        assert {p["code"] for p in full["problems"]} <= {"STRAY_TEMP"}, out + err
        assert code == 0 and full["ok"], out + err  # a stray temp file: a warning, exit 0
        stats["stray_temp"] = stats.get("stray_temp", 0) + bool(full["problems"])
        _tensors_equal_source(dst, ts, fmt)
        stats["verified"] = stats.get("verified", 0) + 1
    elif state is not None:
        assert state == "incomplete", (state, doc)
        assert doc["ok"] is False
        assert any(p["code"] == "NOT_COMMITTED" for p in doc["problems"]), doc
    if dst.exists() and state is None:  # nothing ls would list: no format file at all
        assert not (dst / MANIFEST).exists() and not (dst / ".metadata").exists()


WRITERS = {
    # name: (args after SRC DST, output format, files a finished output holds)
    "consolidate": (["consolidate", "--to", "safetensors", "--max-shard-size", SHARD,
                     "--workers", "2"], "safetensors", NTENSORS + 2),
    "reshard": (["reshard", "--world-size", "8", "--workers", "2"], "dcp", 8 + 2),
}


def _campaign(cli, tmp_path, src, writer: str, points: int, seed: int) -> dict:
    srcdir, ts = src
    verb, *flags = WRITERS[writer][0]
    fmt, total = WRITERS[writer][1], WRITERS[writer][2]
    rnd = random.Random(seed)
    stats: dict = {"points": 0, "killed": 0}
    for i in range(points):
        dst = tmp_path / f"{writer}-{i}"
        p = _popen([verb, srcdir, dst, *flags])
        killed = _kill_when(p, dst, rnd.randint(0, total), rnd.choice([0, 0, 0.002, 0.01]),
                            signal.SIGKILL)
        p.communicate(timeout=60)
        stats["points"] += 1
        stats["killed"] += killed
        if not killed:
            assert p.returncode == 0, p.stderr
        _check_killed(cli, dst, ts, fmt, stats)
        # the leftover is replaced by --force; without it, DST is refused as not empty
        if dst.exists() and os.listdir(dst):
            code, _, err = cli(verb, str(srcdir), str(dst), *flags)
            assert code == 2 and "--force" in err, err
        code, _, err = cli(verb, str(srcdir), str(dst), *flags, "--force")
        assert code == 0, err
        assert WRITING_MARKER not in os.listdir(dst)
        code, out, err = cli("verify", str(dst), "--level", "full")
        assert code == 0, out + err
        shutil.rmtree(dst)
    print(f"\n{writer}: {stats}")
    return stats


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_kill9_never_listed_complete(cli, tmp_path, src, writer):
    stats = _campaign(cli, tmp_path, src, writer, points=10, seed=1)
    assert stats["killed"] >= 5, stats  # the campaign really killed writers mid-way


@pytest.mark.slow
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_kill9_campaign_long(cli, tmp_path, src, writer):
    stats = _campaign(cli, tmp_path, src, writer, points=60, seed=2)
    assert stats["killed"] >= 30, stats


def _seal_campaign(cli, tmp_path, src, points, seed) -> dict:
    srcdir, ts = src
    rnd = random.Random(seed)
    stats: dict = {"points": 0}
    # how long a whole seal takes here: kill points spread over it
    probe = tmp_path / "probe"
    shutil.copytree(srcdir, probe)
    t0 = time.monotonic()
    subprocess.run(_cmd("seal", probe), cwd=ROOT, check=True, capture_output=True)
    span = time.monotonic() - t0
    for i in range(points):
        dst = tmp_path / f"seal-{i}"
        shutil.copytree(srcdir, dst)
        p = _popen(["seal", dst])
        time.sleep(rnd.uniform(0.3, 1.1) * span)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.communicate(timeout=60)
        stats["points"] += 1
        state, doc = _state(cli, dst)
        assert state in ("complete", "sealed"), (state, doc)  # the data was never touched
        stats[state] = stats.get(state, 0) + 1
        if state == "sealed":
            code, out, err = cli("verify", str(dst), "--level", "full")
            assert code == 0, out + err
            stats["verified"] = stats.get("verified", 0) + 1
        _tensors_equal_source(dst, ts, "safetensors")
        code, out, err = cli("seal", str(dst))  # a rerun seals, or verifies the seal
        assert code == 0, out + err
        assert _state(cli, dst)[0] == "sealed"
        shutil.rmtree(dst)
    print(f"\nseal: {stats}")
    return stats


def test_kill9_seal(cli, tmp_path, src):
    _seal_campaign(cli, tmp_path, src, 10, seed=3)


@pytest.mark.slow
def test_kill9_seal_long(cli, tmp_path, src):
    _seal_campaign(cli, tmp_path, src, 40, seed=4)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_interrupt_removes_what_was_written(cli, tmp_path, src, writer, sig):
    srcdir, ts = src
    verb, *flags = WRITERS[writer][0]
    rnd = random.Random(5)
    interrupted = 0
    # the signal goes once the marker is there: the CLI's handler is installed by then
    for i, nfiles in enumerate([1, 2, 4, rnd.randint(2, WRITERS[writer][2] - 1)]):
        dst = tmp_path / f"{writer}-{i}"
        p = _popen([verb, srcdir, dst, *flags])
        sent = _kill_when(p, dst, nfiles, 0, sig, marker=True)
        _, err = p.communicate(timeout=60)
        if p.returncode == 0:  # finished before the signal was handled: sealed and right
            assert _state(cli, dst)[0] == "sealed"
            _tensors_equal_source(dst, ts, WRITERS[writer][1])
            continue
        assert sent and p.returncode == 130, (p.returncode, err)
        assert "interrupted" in err and "Traceback" not in err, err
        assert not dst.exists(), os.listdir(dst)  # DST did not exist: it is gone again
        interrupted += 1
    assert interrupted >= 2
    # into an existing empty folder: the folder stays, empty
    dst = tmp_path / f"{writer}-existing"
    dst.mkdir()
    p = _popen([verb, srcdir, dst, *flags])
    assert _kill_when(p, dst, 1, 0, sig, marker=True)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert dst.is_dir() and os.listdir(dst) == []


def test_force_replaces_a_sealed_output(cli, tmp_path, src):
    srcdir, ts = src
    dst = tmp_path / "out"
    assert cli("consolidate", str(srcdir), str(dst), "--max-shard-size", SHARD)[0] == 0
    code, _, err = cli("consolidate", str(srcdir), str(dst))
    assert code == 2 and "not empty" in err and "--force" in err and err.count("\n") == 1
    code, _, err = cli("consolidate", str(srcdir), str(dst), "--force")  # now one file
    assert code == 0, err
    assert sorted(os.listdir(dst)) == [MANIFEST, "model.safetensors"]
    _tensors_equal_source(dst, ts, "safetensors")
    # --to torch into a file name: refused when it exists, replaced with --force
    pt = tmp_path / "model.pt"
    assert cli("consolidate", str(srcdir), str(pt), "--to", "torch")[0] == 0
    code, _, err = cli("consolidate", str(srcdir), str(pt), "--to", "torch")
    assert code == 2 and "--force" in err
    assert cli("consolidate", str(srcdir), str(pt), "--to", "torch", "--force")[0] == 0
    assert sorted(os.listdir(tmp_path)) == ["model.pt", "out"]


# ------------------------------------------------------------------ out of space


@pytest.fixture
def small_fs(small_tmpfs):
    """A 3 MiB tmpfs."""
    return small_tmpfs("3m")


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_out_of_space(cli, src, small_fs, writer):
    srcdir, _ = src
    verb, *flags = WRITERS[writer][0]
    for dst in (small_fs / "new", small_fs / "existing"):
        if dst.name == "existing":
            dst.mkdir()
        p = subprocess.run(_cmd(verb, srcdir, dst, *flags), cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 3, p.stderr
        assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
        assert "space" in p.stderr, p.stderr
        assert _state(cli, dst)[0] is None  # nothing left that looks like a checkpoint
        assert (dst.is_dir() and os.listdir(dst) == []) if dst.name == "existing" \
            else not dst.exists()
    code, out, err = cli("ls", str(small_fs), "--json")
    assert code == 0 and json.loads(out)["checkpoints"] == [], out


# ------------------------------------------------------------------ the marker itself


def test_writing_marker_means_not_committed_at_every_level(cli, tmp_path, src):
    """A finished output plus the marker (a writer killed between its format's markers
    and removing it) is incomplete everywhere, and the marker is no EXTRA_FILE/STRAY_TEMP."""
    srcdir, _ = src
    dst = tmp_path / "out"
    assert cli("consolidate", str(srcdir), str(dst), "--max-shard-size", SHARD)[0] == 0
    (dst / WRITING_MARKER).write_text('{"pid": 1, "host": "h", "started": "t", "command": "c"}')
    for level in ("quick", "structure", "full"):
        code, out, _ = cli("verify", str(dst), "--level", level, "--json")
        doc = json.loads(out)
        assert code == 1 and not doc["ok"], out
        assert [p["code"] for p in doc["problems"]] == ["NOT_COMMITTED"], out
        assert "rerun with --force" in doc["problems"][0]["message"]
    assert _state(cli, dst)[0] == "incomplete"
    code, _, err = cli("seal", str(dst))
    assert code == 1 and "NOT_COMMITTED" in err, err
    # only the marker left (killed right after writing it): still listed, as incomplete
    for f in os.listdir(dst):
        if f != WRITING_MARKER:
            os.unlink(dst / f)
    assert _state(cli, dst)[0] == "incomplete"


def test_failed_write_to_s3_leaves_nothing(torch_ckpts, s3_bucket, tmp_path):
    from ckptctl.errors import CkptError
    from ckptctl.ops import reshard
    from fixtures_torch import copy_ckpt

    bad = copy_ckpt(torch_ckpts["fsdp"], tmp_path / "src")
    with open(bad / "__3_0.distcp", "r+b") as f:
        f.truncate(1000)  # the reader fails mid-way, after other ranks wrote data
    with pytest.raises(CkptError):
        reshard(str(bad), s3_bucket.url("out/step-1"), world_size=4,
                dst_storage_options=s3_bucket.storage_options)
    assert s3_bucket.fs().find(s3_bucket.path("out")) == []


def test_force_never_touches_the_source(cli, tmp_path, src):
    srcdir, ts = src
    work = tmp_path / "ck"
    shutil.copytree(srcdir, work)
    for dst in (work, work / "hf", tmp_path):
        code, _, err = cli("consolidate", str(work), str(dst), "--force")
        assert code == 2 and "overlaps the source" in err, err
        code, _, err = cli("reshard", str(work), str(dst), "--world-size", "2", "--force")
        assert code == 2 and "overlaps the source" in err, err
    code, _, err = cli("consolidate", str(work / "model.safetensors"), str(work / "model.pt"),
                       "--to", "torch", "--force")  # next to a one-file source: fine
    assert code == 0, err
    code, _, err = cli("consolidate", str(work / "model.pt"), str(work / "model.pt"),
                       "--to", "torch", "--force")
    assert code == 2 and "overlaps the source" in err, err
    os.unlink(work / "model.pt")
    assert os.listdir(work) == ["model.safetensors"]
    _tensors_equal_source(work, ts, "safetensors")


def test_seal_after_a_seal_killed_inside_its_manifest_write(cli, tmp_path, src):
    """kill -9 between write_atomic's temp file and its link leaves the temp: a warning,
    never a reason to refuse the next seal."""
    srcdir, _ = src
    ck = tmp_path / "ck"
    shutil.copytree(srcdir, ck)
    (ck / f".{MANIFEST}.k2j3x9.tmp").write_text('{"files": {')
    assert _state(cli, ck)[0] == "complete"
    code, out, err = cli("seal", str(ck))
    assert code == 0, out + err
    assert _state(cli, ck)[0] == "sealed"
    code, out, err = cli("seal", str(ck))  # sealed: verified, the stray temp only warned about
    assert code == 0 and "verified" in out, out + err


def test_force_refuses_a_writer_still_running(cli, tmp_path, src):
    srcdir, _ = src
    for attempt in range(5):  # catch a writer (stopped) while its marker is there
        dst = tmp_path / f"out{attempt}"
        p = _popen(["consolidate", srcdir, dst, "--max-shard-size", SHARD])
        while not (dst / WRITING_MARKER).exists() and p.poll() is None:
            time.sleep(0.0005)
        p.send_signal(signal.SIGSTOP)
        if (dst / WRITING_MARKER).exists():
            break
        p.kill()
        p.communicate()
    try:
        code, _, err = cli("consolidate", str(srcdir), str(dst), "--force")
        assert code == 2 and f"pid {p.pid}" in err and "still writing" in err, err
    finally:
        p.kill()
        p.communicate()
    code, _, err = cli("consolidate", str(srcdir), str(dst), "--force")  # now a leftover
    assert code == 0, err


def test_force_on_s3(src, s3_bucket):
    from ckptctl.errors import UsageError
    from ckptctl.ops import consolidate, verify

    srcdir, _ = src
    url, opts = s3_bucket.url("out/hf"), s3_bucket.storage_options
    consolidate(str(srcdir), url, max_shard_size=SHARD, dst_storage_options=opts)
    with pytest.raises(UsageError, match="--force"):
        consolidate(str(srcdir), url, dst_storage_options=opts)
    r = consolidate(str(srcdir), url, dst_storage_options=opts, force=True)  # one file now
    assert sorted(p.rsplit("/", 1)[1] for p in s3_bucket.fs().find(s3_bucket.path("out/hf"))) \
        == [MANIFEST, "model.safetensors"]
    assert r.files == ["model.safetensors"] and verify(url, opts, level="full").ok


def test_kill9_during_force_replace(cli, tmp_path, src):
    """kill -9 a `--force` run over an older sealed output (of other tensors) at random
    times: what is listed complete or sealed is wholly the old or wholly the new one."""
    srcdir, ts = src
    other = tmp_path / "other"
    old = {k: v * 2 for k, v in ts.items()}
    other.mkdir()
    entries = [(n, "F32", SHAPE, a.nbytes) for n, a in sorted(old.items())]
    with open(other / "model.safetensors", "wb") as f:
        write_file(f, entries, lambda n: [old[n].tobytes()], {"format": "pt"})
    flags = WRITERS["consolidate"][0][1:]
    rnd = random.Random(6)
    seen: dict = {}
    for i in range(8):
        dst = tmp_path / f"out-{i}"
        assert cli("consolidate", str(other), str(dst), *flags)[0] == 0
        p = _popen(["consolidate", srcdir, dst, *flags, "--force"])
        if rnd.random() < 0.25:  # before it started replacing
            time.sleep(rnd.uniform(0.0, 0.4))
        else:  # while replacing: the marker is its first write
            while not (dst / WRITING_MARKER).exists() and p.poll() is None:
                time.sleep(0.0002)
            time.sleep(rnd.choice([0, 0.001, 0.005, 0.02, 0.05]))
        p.kill()
        p.communicate(timeout=60)
        state, doc = _state(cli, dst)
        seen[state] = seen.get(state, 0) + 1
        if state in ("complete", "sealed"):
            assert {p["code"] for p in doc["problems"]} <= {"STRAY_TEMP"}, doc
            try:
                _tensors_equal_source(dst, ts, "safetensors")
            except AssertionError:
                _tensors_equal_source(dst, old, "safetensors")
        else:
            assert state in (None, "incomplete"), state
    print(f"\nforce-replace: {seen}")
