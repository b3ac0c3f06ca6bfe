"""Conversions and ``verify --level full`` spread over processes by an existing launcher
(issue 12, item 2): the 1-process and the 4-process runs write the same bytes.

Default suite: the torchrun reshard and verify runs, a failing rank, the consolidate split
(file rendezvous), the pack split; ``-m slow`` adds the file-rendezvous reshard (local and
S3) and verify, promote, the pack CLI and the torchrun failure cases (each a few seconds to
~20 s on 2 cores).

Every run here is the real CLI: ``torchrun --no-python ckptctl ...`` (a gloo process group:
torchrun exports ``MASTER_ADDR``/``MASTER_PORT``), or four plain processes given
``RANK``/``WORLD_SIZE`` only (the rendezvous through files in DST's ``.ckptctl-dist/``);
the pack split runs its 4 "processes" as threads, so its data files can be made small. The
source is the FSDP (dp=4) checkpoint torch wrote (``fixtures_torch``). Checked: every output
file byte for byte against a one-process run, the same manifest id, rank 0's ``--json`` being
the whole result and the others' their share, verify's findings gathered on rank 0, and
a failure on one rank leaving nothing that looks committed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptctl.formats.manifest import MANIFEST, WRITING_MARKER
from ckptctl.writing.distributed import DIST_DIR, Group
from fixtures_torch import copy_ckpt

CKPTCTL = Path(sys.executable).parent / "ckptctl"
TIMEOUT_S = 300
#: Launcher variables a test must not inherit (pytest itself may run under a launcher).
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID",
                 "CKPTCTL_DISTRIBUTED", "CKPTCTL_RUN_ID", "CKPTCTL_DIST_DIR")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1", **{k: str(v) for k, v in extra.items()})
    return env


def _tail(text: str, n: int = 40) -> str:
    lines = [x for x in text.splitlines() if "Warning" not in x and "warnings.warn" not in x]
    return "\n".join(lines[-n:])


def run_one(*args: str) -> subprocess.CompletedProcess:
    """``ckptctl ARGS`` as one plain process."""
    return subprocess.run([str(CKPTCTL), *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=_env())


def torchrun(nproc: int, *args: str, logs: Path) -> tuple[subprocess.CompletedProcess, float]:
    """``torchrun --standalone --nproc_per_node=N --no-python ckptctl ARGS``; (result, wall s).
    Each rank's output goes to its own files under ``logs`` (4 processes writing one pipe
    could interleave their JSON): the result's ``stdout`` is ``{rank: text}``, its
    ``stderr`` the launcher's and every rank's together."""
    for attempt in (1, 2):
        log_dir = logs / f"attempt-{attempt}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", "--log-dir", str(log_dir), "--redirects", "3",
               "--no-python", str(CKPTCTL), *args]
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=_env())
        wall = time.monotonic() - t0
        outs = {int(f.parent.name): f.read_text() for f in log_dir.rglob("stdout.log")}
        errs = "".join(f.read_text() for f in sorted(log_dir.rglob("stderr.log")))
        # --standalone picks a free port, closes it and binds it again: a parallel run can
        # take it in between. Retry that once; any other failure is the test's.
        if "address already in use" not in (p.stdout + p.stderr + errs).lower():
            break
    return subprocess.CompletedProcess(cmd, p.returncode, outs, p.stderr + errs), wall


def plain_procs(nproc: int, *args: str, run_id: str, **env) -> list[subprocess.CompletedProcess]:
    """``nproc`` plain ``ckptctl ARGS`` processes told only RANK/WORLD_SIZE (no process group)."""
    procs = [subprocess.Popen([str(CKPTCTL), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=_env(RANK=r, WORLD_SIZE=nproc, CKPTCTL_RUN_ID=run_id, **env))
             for r in range(nproc)]
    out = []
    for r, p in enumerate(procs):
        so, se = p.communicate(timeout=TIMEOUT_S)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    return out


def json_docs(outs: dict[int, str]) -> dict[int, dict]:
    """Each rank's ``--json`` document (it names its rank, and how many processes ran)."""
    docs = {r: json.loads(text) for r, text in outs.items()}
    assert all(d["rank"] == r and d["processes"] == len(outs) for r, d in docs.items())
    return docs


def same_bytes(a: Path, b: Path) -> None:
    """Both folders hold the same files with the same bytes (the manifest: the same id,
    the same files table; its ``created`` time may differ)."""
    fa = sorted(p.name for p in a.iterdir())
    assert fa == sorted(p.name for p in b.iterdir())
    for name in fa:
        if name == MANIFEST:
            ma, mb = (json.loads((x / MANIFEST).read_text()) for x in (a, b))
            assert ma["files"] == mb["files"]
            continue
        assert (a / name).read_bytes() == (b / name).read_bytes(), f"{name} differs"


def manifest_id(path: Path) -> str:
    from ckptctl.formats.manifest import Manifest
    from ckptctl.storage import open_store

    return Manifest.read(open_store(str(path))).id


WORLD = ("--world-size", "6")  # 6 rank files over 4 processes: an uneven share


@pytest.fixture(scope="module")
def fsdp(torch_ckpts) -> Path:
    return torch_ckpts.dcp["fsdp"]


@pytest.fixture(scope="module")
def one_proc(fsdp, tmp_path_factory) -> tuple[Path, dict, float]:
    """The FSDP fixture resharded to 6 ranks by one process: (dst, its --json, wall s)."""
    dst = tmp_path_factory.mktemp("one") / "step-20"
    t0 = time.monotonic()
    p = run_one("reshard", str(fsdp), str(dst), *WORLD, "--json")
    wall = time.monotonic() - t0
    assert p.returncode == 0, _tail(p.stdout + p.stderr)
    return dst, json.loads(p.stdout), wall


# ------------------------------------------------------------------ the Group


@pytest.mark.parametrize("env, expect", [
    ({}, (0, 1, "none")),
    ({"RANK": "0", "WORLD_SIZE": "1"}, (0, 1, "none")),
    ({"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, (3, 4, "gloo")),
    ({"RANK": "3", "WORLD_SIZE": "4"}, (3, 4, "files")),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "7"}, (2, 8, "files")),
    ({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1",
      "CKPTCTL_DISTRIBUTED": "files"}, (1, 4, "files")),
    ({"RANK": "1", "WORLD_SIZE": "4", "CKPTCTL_DISTRIBUTED": "0"}, (0, 1, "none")),
])
def test_group_from_env(env, expect):
    g = Group.from_env(env)
    assert (g.rank, g.world_size, g.backend) == expect


@pytest.mark.parametrize("env", [{"RANK": "4", "WORLD_SIZE": "4"}, {"RANK": "x", "WORLD_SIZE": "4"},
                                 {"RANK": "0", "WORLD_SIZE": "2", "CKPTCTL_DIST_TIMEOUT": "-1"},
                                 {"RANK": "0", "WORLD_SIZE": "2", "CKPTCTL_DISTRIBUTED": "maybe"}])
def test_group_from_env_refuses_nonsense(env):
    from ckptctl.errors import UsageError

    with pytest.raises(UsageError):
        Group.from_env(env)


def test_share_is_deterministic_and_covers_everything():
    items = [f"__{r}_0.distcp" for r in range(10)]
    shares = [Group(r, 4, "files").mine(items) for r in range(4)]
    assert sorted(sum(shares, [])) == sorted(items)
    assert shares[1] == ["__1_0.distcp", "__5_0.distcp", "__9_0.distcp"]


# ------------------------------------------------------------------ reshard


def test_reshard_torchrun_4_matches_1_process(fsdp, one_proc, tmp_path, record_property):
    """The acceptance test: torchrun with 4 processes writes byte for byte what one process
    writes, with the same manifest id; rank 0's --json is the whole result."""
    one, one_doc, one_wall = one_proc
    dst = tmp_path / "step-20"
    p, wall = torchrun(4, "reshard", str(fsdp), str(dst), *WORLD, "--json", logs=tmp_path)
    assert p.returncode == 0, _tail(p.stderr)
    same_bytes(one, dst)
    assert manifest_id(dst) == manifest_id(one) == one_doc["manifest_id"]
    docs = json_docs(p.stdout)
    assert sorted(docs) == [0, 1, 2, 3]
    assert docs[0]["manifest_id"] == one_doc["manifest_id"]
    assert docs[0]["files"] == one_doc["files"] and docs[0]["bytes"] == one_doc["bytes"]
    assert all(d["processes"] == 4 for d in docs.values())
    # file i of the 6 rank files is process i % 4's; .metadata and the manifest rank 0's
    for r in (1, 2, 3):
        assert docs[r]["manifest_id"] is None
        assert docs[r]["files"] == [f"__{i}_0.distcp" for i in range(6) if i % 4 == r]
    record_property("reshard_1proc_s", round(one_wall, 1))
    record_property("reshard_torchrun4_s", round(wall, 1))
    print(f"reshard fsdp -> 6 ranks: 1 process {one_wall:.1f}s, torchrun 4 processes {wall:.1f}s")


@pytest.mark.slow
def test_reshard_file_rendezvous_matches_1_process(fsdp, one_proc, tmp_path):
    """Without MASTER_ADDR (srun) the processes meet through files in DST; the result is the
    same bytes, and no rendezvous file is left."""
    one, one_doc, _ = one_proc
    dst = tmp_path / "step-20"
    ps = plain_procs(4, "reshard", str(fsdp), str(dst), *WORLD, "--json", run_id="t-files")
    for r, p in enumerate(ps):
        assert p.returncode == 0, f"rank {r}: {_tail(p.stdout + p.stderr)}"
    same_bytes(one, dst)
    assert json.loads(ps[0].stdout)["manifest_id"] == one_doc["manifest_id"]
    assert not (dst / DIST_DIR).exists() and not (dst / WRITING_MARKER).exists()


@pytest.mark.slow
def test_reshard_to_s3_file_rendezvous(fsdp, one_proc, s3_bucket, tmp_path):
    """Four plain processes writing to S3 meet through objects under DST's
    ``.ckptctl-dist/``: the objects are the one-process run's bytes, and no rendezvous or
    marker object is left."""
    one, one_doc, _ = one_proc
    url = s3_bucket.url("step-20")
    ps = plain_procs(4, "reshard", str(fsdp), url, *WORLD, "--json", run_id="t-s3",
                     **s3_bucket.server.env)
    for r, p in enumerate(ps):
        assert p.returncode == 0, f"rank {r}: {_tail(p.stdout + p.stderr)}"
    assert json.loads(ps[0].stdout)["manifest_id"] == one_doc["manifest_id"]
    fs = s3_bucket.fs()
    keys = sorted(k.rsplit("/", 1)[-1] for k in fs.find(s3_bucket.path("step-20")))
    assert keys == sorted(p.name for p in one.iterdir())
    for name in keys:
        if name != MANIFEST:
            assert fs.cat(f"{s3_bucket.path('step-20')}/{name}") == (one / name).read_bytes()


def _break_a_chunk_of(src: Path, rel: str) -> str:
    """Zero the zip end record of one FSDP-sharded chunk in ``rel``: a real fault that only
    the process writing that shard's target rank reads. Returns the tensor's name."""
    from ckptctl.formats.detect import open_checkpoint

    ck = open_checkpoint(str(src))
    for t in ck.tensors.values():
        files = {c.extent.file for c in t.chunks}
        if len(t.chunks) == 4 and len(files) == 4:
            ext = next(c.extent for c in t.chunks if c.extent.file == rel)
            with open(src / rel, "r+b") as f:
                f.seek(ext.offset + ext.length - 22)
                f.write(b"\0" * 22)
            return t.name
    raise AssertionError("no sharded tensor in the fixture")


def test_one_rank_fails_nothing_committed(fsdp, tmp_path):
    """A bad source chunk that only process 2 reads (target rank 2 of 4): process 2 reports
    its error and removes its file, rank 0 commits nothing and removes every file of the
    run, DST included (it made it); processes 1 and 3 finished their share."""
    src = copy_ckpt(fsdp, tmp_path / "src")
    _break_a_chunk_of(src, "__2_0.distcp")
    dst = tmp_path / "out"
    ps = plain_procs(4, "reshard", str(src), str(dst), "--world-size", "4", run_id="t-fail",
                     CKPTCTL_DIST_TIMEOUT=120)
    assert ps[2].returncode == 3 and "__2_0.distcp" in ps[2].stderr, ps[2].stderr
    assert ps[0].returncode == 3 and "rank 2 failed" in ps[0].stderr, ps[0].stderr
    assert ps[1].returncode == ps[3].returncode == 0
    assert not dst.exists(), sorted(os.listdir(dst))


@pytest.mark.slow
def test_one_rank_fails_under_torchrun(fsdp, tmp_path):
    """The same fault under torchrun (gloo): torchrun fails, nothing is left in DST."""
    src = copy_ckpt(fsdp, tmp_path / "src")
    _break_a_chunk_of(src, "__2_0.distcp")
    dst = tmp_path / "out"
    p, _ = torchrun(4, "reshard", str(src), str(dst), "--world-size", "4", logs=tmp_path)
    assert p.returncode != 0
    assert "__2_0.distcp" in p.stderr
    assert not dst.exists() or not (set(os.listdir(dst)) & {MANIFEST, ".metadata"}), \
        sorted(os.listdir(dst))
    assert not dst.exists(), sorted(os.listdir(dst))


@pytest.mark.slow
def test_rank_0_refusal_stops_the_others(fsdp, tmp_path):
    """A DST that is not empty: rank 0 refuses (exit 2) and, with a process group, tells the
    others, who stop with the same exit code instead of waiting; nothing is written."""
    dst = tmp_path / "busy"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    p, _ = torchrun(2, "reshard", str(fsdp), str(dst), "--world-size", "2", logs=tmp_path)
    assert p.returncode != 0
    assert p.stderr.count("is not empty") == 2, _tail(p.stderr)
    assert sorted(os.listdir(dst)) == ["keep.txt"]


# ------------------------------------------------------------------ consolidate


def test_consolidate_shards_4_processes_match_1(fsdp, tmp_path):
    """consolidate --to safetensors with 5 shards: shard i is process i % 4's, rank 0
    writes the HF index and the manifest; the same bytes and id as one process."""
    args = ("--only", "model", "--max-shard-size", "1MB", "--json")
    one = tmp_path / "one"
    p = run_one("consolidate", str(fsdp), str(one), *args)
    assert p.returncode == 0, _tail(p.stdout + p.stderr)
    want = json.loads(p.stdout)
    assert len([f for f in want["files"] if f.endswith(".safetensors")]) == 5
    dst = tmp_path / "four"
    ps = plain_procs(4, "consolidate", str(fsdp), str(dst), *args, run_id="t-cons")
    for r, q in enumerate(ps):
        assert q.returncode == 0, f"rank {r}: {_tail(q.stdout + q.stderr)}"
    same_bytes(one, dst)
    docs = [json.loads(q.stdout) for q in ps]
    assert docs[0]["manifest_id"] == want["manifest_id"] == manifest_id(dst)
    assert docs[0]["files"] == want["files"]
    # shard i (model-0000{i+1}) is process i % 4's: rank 0 has the first and the fifth
    assert [d["files"] for d in docs[1:]] == [[f"model-0000{i}-of-00005.safetensors"]
                                              for i in (2, 3, 4)]


@pytest.mark.slow
def test_consolidate_to_torch_is_rank_0s(fsdp, tmp_path):
    """One output file (torch.save): rank 0 writes it, the others have no share."""
    dst = tmp_path / "model.pt"
    ps = plain_procs(2, "consolidate", str(fsdp), str(dst), "--to", "torch", "--only",
                     "model", "--json", run_id="t-torch")
    assert [q.returncode for q in ps] == [0, 0], _tail(ps[0].stderr + ps[1].stderr)
    assert json.loads(ps[1].stdout)["files"] == []
    one = tmp_path / "one.pt"
    assert run_one("consolidate", str(fsdp), str(one), "--to", "torch", "--only",
                   "model").returncode == 0
    assert dst.read_bytes() == one.read_bytes()


# ------------------------------------------------------------------ promote


@pytest.mark.slow
def test_promote_4_processes_then_resume_after_a_failed_rank(one_proc, tmp_path):
    """promote split over 4 processes: a source file that no longer matches its manifest
    (sent by process 2 only) stops the run with nothing committed; a 1-process rerun
    resumes (the files the others published are not sent again) and commits the same id;
    a clean 4-process run writes the same bytes as one process."""
    from ckptctl.writing.commit import is_format_marker, write_order

    one, one_doc, _ = one_proc
    src = copy_ckpt(one, tmp_path / "src")
    sizes = {p.name: p.stat().st_size for p in src.iterdir() if p.name != MANIFEST}
    data = [r for r in write_order(list(sizes), sizes) if not is_format_marker(r)]
    victim = data[2]  # data file i is process i % 4's
    original = (src / victim).read_bytes()
    broken = bytearray(original)
    broken[5000] ^= 1
    (src / victim).write_bytes(bytes(broken))
    dst = tmp_path / "dst"
    ps = plain_procs(4, "promote", str(src), str(dst), "--json", run_id="t-prom")
    assert ps[2].returncode == 1 and "differs from the manifest" in ps[2].stderr, ps[2].stderr
    assert ps[0].returncode == 1 and "rank 2 failed" in ps[0].stderr, ps[0].stderr
    assert not dst.exists()  # POSIX: nothing is renamed into place
    (src / victim).write_bytes(original)
    p = run_one("promote", str(src), str(dst), "--json")
    assert p.returncode == 0, _tail(p.stdout + p.stderr)
    doc = json.loads(p.stdout)
    assert doc["manifest_id"] == one_doc["manifest_id"]
    assert doc["files_skipped"] >= 2  # what processes 0, 1 and 3 published stays
    same_bytes(one, dst)
    dst4 = tmp_path / "dst4"
    ps = plain_procs(4, "promote", str(src), str(dst4), "--json", run_id="t-prom2")
    assert [q.returncode for q in ps] == [0, 0, 0, 0], _tail(ps[0].stderr)
    assert (dst4 / MANIFEST).read_bytes() == (one / MANIFEST).read_bytes()
    same_bytes(one, dst4)
    docs = [json.loads(q.stdout) for q in ps]
    # 6 data files: processes 0 and 1 send two, 2 and 3 one; rank 0 adds .metadata and
    # reports the whole run's count
    assert docs[0]["files_sent"] == len(sizes)
    assert [d["files_sent"] for d in docs[1:]] == [2, 1, 1]
    assert not any(tmp_path.glob(".*ckptctl-promote*"))


# ------------------------------------------------------------------ pack


def _pack_in_threads(src: Path, dst: Path, world: int) -> list:
    """``pack`` as ``world`` processes meeting through files, each in a thread of this
    process (so the data file size can be made small for the test)."""
    import threading

    from ckptctl.ops import pack

    results, errors = [None] * world, []

    def one(r):
        try:
            results[r] = pack(str(src), str(dst), workers=1,
                              group=Group(r, world, "files", timeout=120, run_id="t-pack"))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append((r, e))

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return results


def test_pack_split_matches_1_process(one_proc, tmp_path, monkeypatch):
    """Data files of 2 MiB of source (instead of 256 MiB): 7 source files make several
    units; 4 processes write the bytes, the index and the pack id that one writes, and the
    pack restores the checkpoint (its id)."""
    import importlib

    from ckptctl.ops import pack, unpack

    encode_mod = importlib.import_module("ckptctl.packs.encode")

    one, one_doc, _ = one_proc
    monkeypatch.setattr(encode_mod, "DATA_FILE_SIZE", 2 << 20)
    single = pack(str(one), str(tmp_path / "p1"), workers=1)
    assert single.data_files >= 6
    rs = _pack_in_threads(one, tmp_path / "p4", 4)
    same_bytes(tmp_path / "p1", tmp_path / "p4")
    assert rs[0].pack_id == single.pack_id and rs[0].data_files == single.data_files
    assert sum(r.data_files for r in rs[1:]) > 0 and all(r.pack_id is None for r in rs[1:])
    assert not (tmp_path / "p4" / DIST_DIR).exists()
    assert unpack(str(tmp_path / "p4"), str(tmp_path / "back")).manifest_id == one_doc["manifest_id"]


def test_data_layout_keeps_source_files_whole_per_unit():
    from ckptctl.packs.encode import data_layout

    # a: 6, b: 3 share data file 0; c (10) does not fit: data files 1 and 2, one unit
    jobs = [("a", None, 0, 6), ("b", None, 0, 3), ("c", None, 0, 5), ("c", None, 5, 5)]
    assert data_layout(jobs, [[0], [1], [2], [3]], {"a": 6, "b": 3, "c": 10}, limit=9) \
        == ([0, 0, 1, 2], [0, 1, 1])
    assert data_layout([], [], {}, limit=9) == ([], [0])


@pytest.mark.slow
def test_pack_cli_under_a_launcher(one_proc, tmp_path):
    """The CLI wiring: 2 plain processes; one data file here (256 MiB of source each), so
    rank 1 has no share; the pack is the one a single process writes."""
    one, _, _ = one_proc
    ps = plain_procs(2, "pack", str(one), str(tmp_path / "p2"), "--workers", "1", "--json",
                     run_id="t-pack")
    assert [q.returncode for q in ps] == [0, 0], _tail(ps[0].stderr + ps[1].stderr)
    assert json.loads(ps[1].stdout)["data_files"] == 0
    p = run_one("pack", str(one), str(tmp_path / "p1"), "--workers", "1", "--json")
    assert p.returncode == 0, _tail(p.stderr)
    assert json.loads(ps[0].stdout)["pack_id"] == json.loads(p.stdout)["pack_id"]
    same_bytes(tmp_path / "p1", tmp_path / "p2")


# ------------------------------------------------------------------ verify --level full


def _findings(doc: dict) -> list:
    return sorted((p["code"], p["path"], p["entry"]) for p in doc["problems"])


def test_verify_full_torchrun_gathers_findings(one_proc, tmp_path):
    """A flipped byte in a file process 2 reads (sealed: hashes): rank 0 reports it, with
    every other finding, as one process does; exit code as one process."""
    one, _, _ = one_proc
    ck = copy_ckpt(one, tmp_path / "ck")
    # the files verify reads, in order: .metadata, __0_0 .. __5_0; index 2 is process 2's
    with open(ck / "__1_0.distcp", "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0xFF]))
    single = run_one("verify", str(ck), "--level", "full", "--json")
    assert single.returncode == 1
    want = json.loads(single.stdout)
    p, _ = torchrun(4, "verify", str(ck), "--level", "full", "--json", logs=tmp_path)
    assert p.returncode != 0  # torchrun: a worker (rank 0) exited 1
    docs = json_docs(p.stdout)
    got = docs[0]
    # the entry: what the format's own CRCs say the damaged bytes hold
    assert ("HASH_MISMATCH", str(ck / "__1_0.distcp"), "model.tok_embeddings.weight") \
        in _findings(got)
    assert _findings(got) == _findings(want)
    for key in ("ok", "num_files_read", "num_tensors_checked", "content", "bytes_read", "num_files"):
        assert got[key] == want[key], key
    assert [docs[r]["num_files_read"] for r in (1, 2, 3)] == [2, 2, 1]


@pytest.mark.slow
def test_verify_full_file_rendezvous_unsealed(fsdp, tmp_path):
    """Four plain processes verifying torch's own (unsealed) checkpoint: CRCs of every zip
    record, NaN/Inf counts; they meet in $CKPTCTL_DIST_DIR (verify writes nothing into the
    checkpoint); rank 0's report equals one process's."""
    single = run_one("verify", str(fsdp), "--level", "full", "--check-finite", "--json")
    assert single.returncode == 0, _tail(single.stdout + single.stderr)
    want = json.loads(single.stdout)
    meet = tmp_path / "meet"
    ps = plain_procs(4, "verify", str(fsdp), "--level", "full", "--check-finite", "--json",
                     run_id="t-verify", CKPTCTL_DIST_DIR=meet)
    for r, p in enumerate(ps):
        assert p.returncode == 0, f"rank {r}: {_tail(p.stdout + p.stderr)}"
    got = json.loads(ps[0].stdout)
    for key in ("ok", "num_files_read", "num_tensors_checked", "content", "non_finite", "bytes_read"):
        assert got[key] == want[key], key
    assert got["content"] == "crc"
    assert not any(meet.rglob("*.json"))


def test_verify_file_rendezvous_needs_a_meeting_place(fsdp):
    p = subprocess.run([str(CKPTCTL), "verify", str(fsdp), "--level", "full"],
                       capture_output=True, text=True, timeout=TIMEOUT_S,
                       env=_env(RANK=0, WORLD_SIZE=2))
    assert p.returncode == 2 and "CKPTCTL_DIST_DIR" in p.stderr, p.stderr


def test_shared_promote_over_another_sources_leftovers_marks_its_work(one_proc, tmp_path,
                                                                      monkeypatch):
    """A promote split over 2 processes, into a place where another source's promote was
    killed: rank 0 discards those leftovers and writes its own writing marker before any
    byte is sent (the leftovers' marker went with them), as one process does."""
    import threading

    import ckptctl.tiering.promote as pm
    from conftest import write_tiny_dcp

    one, _, _ = one_proc
    other = tmp_path / "other"
    write_tiny_dcp(other)
    dst = tmp_path / "dst"

    def killed(*a, **k):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(pm, "copy_files", killed)
    with pytest.raises(KeyboardInterrupt):
        pm.promote(str(other), str(dst))
    monkeypatch.undo()
    (work,) = tmp_path.glob(".dst.ckptctl-promote*")
    assert (work / WRITING_MARKER).exists()
    begun, real_begin = [], pm._Destination.begin

    def begin(self, *a, **k):
        begun.append(self)
        return real_begin(self, *a, **k)

    monkeypatch.setattr(pm._Destination, "begin", begin)
    errors = []

    def rank(r):
        try:
            pm.promote(str(one), str(dst), workers=1,
                       group=Group(r, 2, "files", timeout=120, run_id="t-leftovers"))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append((r, e))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert len(begun) == 1  # rank 0 marked its own work
    same_bytes(one, dst)
