"""``gc``, ``latest``, ``rm``, ``pin``/``unpin`` end to end (issue 9, items 3 and 4), on
real DCP checkpoints that torch wrote, locally and on the rclone S3 server:

* gc removes what the policy does not keep and nothing else, commit markers first; a
  deletion that fails half way leaves a checkpoint that ``ls`` calls incomplete and
  ``latest`` skips; ``--dry-run`` plans exactly what the real run then does (also as a
  hypothesis property over small safetensors runs);
* the rails through the CLI: empty policy exit 2, pinned and young incomplete ones kept;
* ``latest`` exit codes, ``--verified`` walking back past a damaged checkpoint;
* ``rm`` refusing a pinned checkpoint, ``pin`` files that ``verify`` and ``seal`` ignore;
* on S3: one LIST for the root, batched deletes, stale multipart uploads aborted.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import dcp_save
from ckptctl.formats.manifest import MANIFEST, PIN_FILE, WRITING_MARKER
from ckptctl.tiering.gc import gc
from ckptctl.tiering.latest import latest
from ckptctl.catalog.ls import ls
from ckptctl.tiering.pins import pin
from ckptctl.tiering.policy import Policy
from ckptctl.writing.removal import remove_checkpoint
from ckptctl.integrity.seal import seal

DAY = 86400.0


def _save(path: Path, step: int) -> None:
    """A small DCP checkpoint whose ``step`` entry (and name) is ``step``."""
    import torch

    dcp_save(path, {"model": {"w": torch.full((16,), float(step)),
                              "b": torch.arange(4, dtype=torch.int64) + step},
                    "step": step})


def _age(path: Path, seconds: float) -> None:
    """Make every file of ``path`` look last modified ``seconds`` ago."""
    t = time.time() - seconds
    for p in path.rglob("*"):
        os.utime(p, (t, t))


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.fixture
def run(tmp_path) -> Path:
    """``run/step-1000..6000``: 2000 sealed with tag ``release``, 1000 pinned, 6000 an
    incomplete write (no ``.metadata``) untouched for two days, the rest complete."""
    root = tmp_path / "run"
    for s in range(1000, 7000, 1000):
        _save(root / f"step-{s}", s)
    seal(str(root / "step-2000"), tags=["release"])
    seal(str(root / "step-4000"))
    pin(str(root / "step-1000"), "paper")
    (root / "step-6000" / ".metadata").unlink()
    _age(root / "step-6000", 2 * DAY)
    return root


# ---------------------------------------------------------------------------- gc, local

def test_gc_removes_what_the_policy_does_not_keep(run, cli):
    before = {n: _snapshot(run / n) for n in _names(run)}
    code, out, err = cli("gc", str(run), "--keep-last", "2", "--keep-tag", "release", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert next(iter(doc)) == "schema_version" and doc["dry_run"] is False
    assert doc["keep"] == {"step-5000": ["last 2", "newest committed"],
                           "step-4000": ["last 2"], "step-2000": ["tag release"],
                           "step-1000": ["pinned"]}
    assert doc["remove"] == ["step-6000", "step-3000"]
    by_name = {c["name"]: c for c in doc["checkpoints"]}
    assert [c["name"] for c in doc["checkpoints"]] == [f"step-{s}" for s in range(6000, 0, -1000)]
    assert by_name["step-6000"]["state"] == "incomplete" and by_name["step-1000"]["pinned"]
    assert doc["bytes"] == sum(len(b) for n in doc["remove"] for b in before[n].values())
    assert isinstance(doc["bytes"], int) and doc["uploads_checked"] is True
    assert _names(run) == ["step-1000", "step-2000", "step-4000", "step-5000"]
    for n in _names(run):  # what is kept is untouched, byte for byte
        assert _snapshot(run / n) == before[n]
    code, out, err = cli("gc", str(run), "--keep-last", "2", "--keep-tag", "release")
    assert code == 0 and "0 removed" in out, (out, err)  # a second run has nothing to do


def test_dry_run_plans_exactly_what_the_real_run_does(run, cli):
    before = {n: _snapshot(run / n) for n in _names(run)}
    code, out, err = cli("gc", str(run), "--keep-last", "1", "--dry-run")
    assert code == 0, err
    assert "would remove" in out and "pinned" in out and "4 to remove" in out, out
    assert {n: _snapshot(run / n) for n in _names(run)} == before  # nothing touched
    now = time.time()
    plan = gc(str(run), Policy(last=1), dry_run=True, now=now)
    done = gc(str(run), Policy(last=1), now=now)
    assert plan.decision == done.decision and plan.to_dict()["checkpoints"] == \
        done.to_dict()["checkpoints"]
    assert _names(run) == sorted(plan.decision.keep) == ["step-1000", "step-5000"]


def test_each_run_under_a_root_keeps_its_newest(tmp_path, cli):
    """gc of a folder of runs: a short run's only checkpoint is not ranked against the
    long run's steps."""
    for s in (1000, 2000, 3000):
        _save(tmp_path / "long" / f"step-{s}", s)
    _save(tmp_path / "short" / "step-10", 10)
    code, out, err = cli("gc", str(tmp_path), "--keep-last", "1", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert set(doc["keep"]) == {"long/step-3000", "short/step-10"}
    assert sorted(doc["remove"]) == ["long/step-1000", "long/step-2000"]
    assert _names(tmp_path / "long") == ["step-3000"] and _names(tmp_path / "short") == ["step-10"]


def test_empty_policy_is_refused(run, cli):
    code, out, err = cli("gc", str(run), "--json")
    assert code == 2 and "empty policy" in err
    assert json.loads(out)["error"]["code"] == "USAGE"
    for bad in (["--keep-last", "0"], ["--keep-within", "3 days"], ["--keep-within", "0s"],
                ["--keep-every", "-5"], ["--incomplete-grace", "soon"]):
        code, _, err = cli("gc", str(run), "--keep-daily", "1", *bad)
        assert code == 2 and f"Invalid value for '{bad[0]}'" in err, (bad, err)
    assert len(_names(run)) == 6


def test_young_incomplete_is_kept_old_one_removed(run, cli):
    _save(run / "step-7000", 7000)
    (run / "step-7000" / ".metadata").unlink()  # being written right now
    code, out, err = cli("gc", str(run), "--keep-last", "1", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["keep"]["step-7000"] == ["incomplete, younger than grace"]
    assert "step-6000" in doc["remove"] and (run / "step-7000").is_dir()
    code, out, err = cli("gc", str(run), "--keep-last", "1", "--incomplete-grace", "0s", "--json")
    assert code == 0 and "step-7000" in json.loads(out)["remove"], err


def test_an_old_marker_does_not_hide_a_fresh_write(run):
    """The grace clock is the newest file of an uncommitted checkpoint, not its oldest."""
    _age(run / "step-6000", 2 * DAY)
    (run / "step-6000" / "__0_0.distcp").touch()  # a writer still appends here
    r = gc(str(run), Policy(last=1), dry_run=True)
    assert r.decision.keep["step-6000"] == ["incomplete, younger than grace"]


def test_failed_delete_leaves_it_incomplete_and_latest_skips_it(run, cli):
    """Markers go first: a deletion that dies half way leaves something incomplete."""
    code, out, err = cli("latest", str(run))
    assert (code, out.strip()) == (0, str(run / "step-5000"))
    (row,) = [r for r in ls(str(run)).checkpoints if r.name == "step-5000"]
    store, files, _ = row.located
    last = max(f for f in files if f.endswith(".distcp"))
    (run / "step-5000" / last).unlink()  # the OS now refuses to unlink it (a directory)
    (run / "step-5000" / last).mkdir()
    (run / "step-5000" / last / "x").write_bytes(b"x")
    from ckptctl.errors import StorageError

    with pytest.raises(StorageError):
        remove_checkpoint(store, files)
    left = set(os.listdir(run / "step-5000"))
    assert ".metadata" not in left and WRITING_MARKER in left
    rows = {r.name: r.state for r in ls(str(run)).checkpoints}
    assert rows["step-5000"] == "incomplete"
    code, out, err = cli("latest", str(run))
    assert (code, out.strip()) == (0, str(run / "step-4000")), err
    code, out, _ = cli("verify", str(run / "step-5000"), "--level", "quick")
    assert code == 1


def test_sealed_markers_go_in_order(tmp_path):
    """Removing only the markers (the first steps of a deletion) already uncommits it:
    without the manifest it is still a valid DCP checkpoint, without .metadata it is not."""
    from ckptctl.writing.removal import deletion_order

    ck = tmp_path / "step-9"
    _save(ck, 9)
    seal(str(ck))
    order = deletion_order({p.name: p.stat().st_size for p in ck.iterdir()})
    assert order[:2] == [MANIFEST, ".metadata"]
    (ck / MANIFEST).unlink()
    assert ls(str(tmp_path)).checkpoints[0].state == "complete"
    (ck / ".metadata").unlink()
    assert ls(str(tmp_path)).checkpoints[0].state == "incomplete"
    assert latest(str(tmp_path)).url is None


def test_gc_aborts_stale_local_uploads(run, cli):
    """ckptctl's own unfinished uploads (hidden ``.upload`` files) count as uploads too."""
    from ckptctl.storage import open_store
    from ckptctl.storage.multipart import create_upload, list_uploads, upload_part

    store = open_store(str(run))
    uid = create_upload(store, "step-7000/__0_0.distcp", part_size=8)
    upload_part(store, "step-7000/__0_0.distcp", uid, 1, b"12345678")
    code, out, err = cli("gc", str(run), "--keep-last", "9", "--json")
    assert [(u["upload_id"], u["action"]) for u in json.loads(out)["uploads"]] == [(uid, "keep")]
    code, out, err = cli("gc", str(run), "--keep-last", "9", "--incomplete-grace", "0s")
    assert code == 0 and "aborted" in out, (out, err)
    assert list_uploads(store) == [] and not list((run / "step-7000").glob(".*upload*"))


# ---------------------------------------------------------------- latest, rm, pin, unpin

def test_latest(run, cli, tmp_path):
    code, out, err = cli("latest", str(run))
    assert (code, out, err) == (0, f"{run / 'step-5000'}\n", "")
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = cli("latest", str(empty))
    assert (code, out) == (1, "") and "no committed checkpoint" in err
    code, out, err = cli("latest", str(tmp_path / "missing"))
    assert (code, out) == (3, "") and "no such file" in err
    only_incomplete = tmp_path / "half"
    shutil.copytree(run / "step-6000", only_incomplete / "step-6000")
    assert cli("latest", str(only_incomplete))[0] == 1


def test_latest_verified_walks_back_past_a_damaged_checkpoint(run, cli):
    seal(str(run / "step-5000"))
    data = run / "step-5000" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF  # same size: ls still says sealed, only the content hash can tell
    data.write_bytes(bytes(raw))
    assert cli("latest", str(run))[1].strip() == str(run / "step-5000")
    code, out, err = cli("latest", str(run), "--verified")
    assert (code, out) == (0, f"{run / 'step-4000'}\n"), err
    assert err.startswith(f"ckptctl: skipped {run / 'step-5000'}: HASH_MISMATCH")
    r = latest(str(run), verified=True)
    assert [x["url"] for x in r.rejected] == [str(run / "step-5000")]
    assert r.rejected[0]["code"] == "HASH_MISMATCH"


def test_pin_rm_unpin(run, cli):
    ck = run / "step-3000"
    code, out, err = cli("pin", str(ck), "--reason", "eval baseline")
    assert code == 0 and "pinned" in out, err
    doc = json.loads((ck / PIN_FILE).read_text())
    assert doc["reason"] == "eval baseline" and "@" in doc["by"] and doc["pinned_at"].endswith("Z")
    rows = {c["name"]: c for c in json.loads(cli("ls", str(run), "--json")[1])["checkpoints"]}
    assert rows["step-3000"]["pinned"] and not rows["step-5000"]["pinned"]
    assert rows["step-3000"]["num_files"] == len(os.listdir(ck)) - 1  # the pin is not content
    before = _snapshot(ck)
    code, out, err = cli("rm", str(ck))
    assert code == 1 and "eval baseline" in err and "unpin" in err, err
    assert _snapshot(ck) == before
    code, out, err = cli("unpin", str(ck))
    assert code == 0 and not (ck / PIN_FILE).exists()
    code, out, err = cli("unpin", str(ck))
    assert code == 0 and "was not pinned" in out
    code, out, err = cli("rm", str(ck))
    assert code == 0 and "removed" in out and not ck.exists(), err


def test_rm_force_and_refusals(run, cli):
    code, out, err = cli("rm", str(run / "step-1000"), "--force")
    assert code == 0 and "was pinned" in out and not (run / "step-1000").exists(), err
    code, _, err = cli("rm", str(run))  # a run root, not a checkpoint
    assert code == 2 and "not a checkpoint folder" in err
    code, _, err = cli("rm", str(run / "nope"))
    assert code == 3
    code, _, err = cli("pin", str(run))
    assert code == 2 and "not a checkpoint folder" in err
    assert len(_names(run)) == 5


def test_a_pin_is_not_content(run, cli):
    """verify does not call the pin an extra file; seal --update does not list it."""
    ck = run / "step-4000"  # sealed
    pin(str(ck), "x")
    code, out, err = cli("verify", str(ck), "--level", "full", "--json")
    assert code == 0 and json.loads(out)["problems"] == [], out
    pin(str(run / "step-3000"))
    seal(str(run / "step-3000"))
    assert PIN_FILE not in json.loads((run / "step-3000" / MANIFEST).read_text())["files"]


def test_help_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys; from ckptctl.cli.main import main\n"
            "for v in ('gc', 'latest', 'rm', 'pin', 'unpin'):\n"
            "    try: main([v, '--help'])\n"
            "    except SystemExit: pass\n"
            "assert 'torch' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "EXAMPLES" in r.stdout and "--keep-every" in r.stdout


# --------------------------------------------------------------------------------- S3

def _o(bucket) -> list[str]:
    o = bucket.storage_options
    return [f"--storage-option=endpoint_url={o['endpoint_url']}", f"--storage-option=key={o['key']}",
            f"--storage-option=secret={o['secret']}"]


def test_gc_on_s3(run, s3_bucket, cli):
    for i in range(40):  # more objects than markers: the data goes in one batch
        (run / "step-3000" / "extra" / f"f{i}").parent.mkdir(exist_ok=True)
        (run / "step-3000" / "extra" / f"f{i}").write_bytes(b"x" * i)
    seal(str(run / "step-3000"))  # listed in its manifest: the checkpoint's own files
    s3_bucket.upload(run, "run")
    url = s3_bucket.url("run")
    fs = s3_bucket.fs()
    s3_bucket.server.reset_log()
    code, out, err = cli("gc", url, "--keep-last", "2", "--keep-tag", "release", "--json",
                         *_o(s3_bucket))
    assert code == 0, err
    doc = json.loads(out)
    # the S3 listing shows every object as created by the upload: the incomplete one is young
    assert doc["keep"]["step-6000"] == ["incomplete, younger than grace"]
    assert doc["remove"] == ["step-3000"]
    log = s3_bucket.server.request_log()
    lists = [r for r in log if r.op == "LIST"]
    deletes = [r for r in log if r.method in ("POST", "DELETE")]
    assert len(lists) == 2, lists  # the root once, and its unfinished uploads once
    # step-3000 (sealed DCP, 43 files): the manifest alone first, then .metadata, then the
    # data in one DeleteObjects batch, then the writing marker put there before them
    # (a single delete too: obstore sends every delete as DeleteObjects)
    assert [(r.method, r.path.rsplit("/", 1)[-1]) for r in deletes] == [
        ("POST", s3_bucket.bucket + "?delete")] * 4
    assert [r.key.rsplit("/", 1)[-1] for r in log if r.method == "PUT"] == [WRITING_MARKER]
    left = {p.split("/run/")[1].split("/")[0] for p in fs.find(s3_bucket.path("run"))}
    assert left == {"step-1000", "step-2000", "step-4000", "step-5000", "step-6000"}
    code, out, err = cli("latest", url, *_o(s3_bucket))
    assert (code, out.strip()) == (0, f"{url}/step-5000"), err
    code, out, err = cli("rm", f"{url}/step-1000", *_o(s3_bucket))
    assert code == 1 and "paper" in err
    code, out, err = cli("rm", f"{url}/step-5000", *_o(s3_bucket))
    assert code == 0, err
    assert not fs.find(s3_bucket.path("run/step-5000"))
    assert cli("latest", url, *_o(s3_bucket))[1].strip() == f"{url}/step-4000"
    code, out, err = cli("pin", f"{url}/step-4000", "--reason", "best", *_o(s3_bucket))
    assert code == 0, err
    rows = {c["name"]: c for c in json.loads(cli("ls", url, "--json", *_o(s3_bucket))[1])[
        "checkpoints"]}
    assert rows["step-4000"]["pinned"] and rows["step-4000"]["state"] == "sealed"
    assert cli("verify", f"{url}/step-4000", "--level", "quick", *_o(s3_bucket))[0] == 0
    assert cli("unpin", f"{url}/step-4000", *_o(s3_bucket))[0] == 0
    assert not fs.exists(s3_bucket.path(f"run/step-4000/{PIN_FILE}"))


def test_gc_lists_by_the_thousand_and_deletes_in_batches_on_s3(tmp_path, s3_bucket, cli):
    """1,100 objects and more: the root is listed in 2 pages, the doomed checkpoint's
    1,103 files go in 2 DeleteObjects batches (after its manifest and .metadata alone)."""
    root = tmp_path / "run"
    for s in (1, 2):
        _save(root / f"step-{s}", s)
    shards = root / "step-1" / "shards"
    shards.mkdir()
    for i in range(1100):
        (shards / f"{i:04d}").write_bytes(b"")
    seal(str(root / "step-1"))  # listed in its manifest: the checkpoint's own files
    s3_bucket.upload(root, "run")
    s3_bucket.server.reset_log()
    code, out, err = cli("gc", s3_bucket.url("run"), "--keep-last", "1", "--json", *_o(s3_bucket))
    assert code == 0 and json.loads(out)["remove"] == ["step-1"], err
    log = s3_bucket.server.request_log()
    pages = [r for r in log if r.op == "LIST" and "list-type=2" in r.path]
    batches = [r for r in log if r.method == "POST" and "delete" in r.path]
    # the manifest, then .metadata, then the data in 2 batches, then the writing marker
    assert len(pages) == 2 and len(batches) == 1 + 1 + 2 + 1, (pages, batches)
    assert not s3_bucket.fs().find(s3_bucket.path("run/step-1"))


def test_gc_aborts_stale_multipart_uploads_on_s3(run, s3_bucket, cli):
    from ckptctl.storage import open_store
    from ckptctl.storage.multipart import create_upload, list_uploads

    s3_bucket.upload(run / "step-5000", "run/step-5000")
    url = s3_bucket.url("run")
    store = open_store(url, s3_bucket.storage_options)
    uid = create_upload(store, "step-7000/__0_0.distcp")
    code, out, err = cli("gc", url, "--keep-last", "1", "--json", *_o(s3_bucket))
    assert code == 0, err
    (up,) = json.loads(out)["uploads"]
    assert (up["upload_id"], up["action"]) == (uid, "keep")  # just started: may be running
    assert [u.upload_id for u in list_uploads(store)] == [uid]
    code, out, err = cli("gc", url, "--keep-last", "1", "--incomplete-grace", "0s", "--dry-run",
                         "--json", *_o(s3_bucket))
    assert json.loads(out)["uploads"][0]["action"] == "abort"
    assert [u.upload_id for u in list_uploads(store)] == [uid]  # dry run: still there
    code, out, err = cli("gc", url, "--keep-last", "1", "--incomplete-grace", "0s",
                         *_o(s3_bucket))
    assert code == 0 and "aborted" in out, (out, err)
    assert list_uploads(store) == []


def test_gc_crash_mid_delete_on_s3(run, s3_bucket, cli):
    """The data's delete batch is never answered (the proxy holds it; a frozen server would
    still delete once thawed): the checkpoint is left incomplete (markers already gone),
    ``latest`` moves back, a rerun finishes it."""
    s3_bucket.upload(run / "step-4000", "run/step-4000")  # sealed
    s3_bucket.upload(run / "step-5000", "run/step-5000")
    url = s3_bucket.url("run")
    srv = s3_bucket.server
    deletes = []

    def data_delete(req):
        if req.method == "DELETE" or (req.method == "POST" and "delete" in req.path):
            deletes.append(req)
            return len(deletes) == 2  # .metadata's went through; the data's is held
        return False

    # rm step-5000 (complete DCP): PUT writing marker, delete .metadata, delete data
    srv.fault_on(data_delete, "hold")
    try:
        code, out, err = cli("--timeout", "3", "rm", f"{url}/step-5000", *_o(s3_bucket))
    finally:
        srv.fault_on(None, "")
    assert code == 3 and "timed out" in err, (code, err)
    rows = {c["name"]: c["state"] for c in
            json.loads(cli("ls", url, "--json", *_o(s3_bucket))[1])["checkpoints"]}
    assert rows == {"step-4000": "sealed", "step-5000": "incomplete"}
    assert cli("latest", url, *_o(s3_bucket))[1].strip() == f"{url}/step-4000"
    code, out, err = cli("gc", url, "--keep-last", "1", "--incomplete-grace", "0s",
                         *_o(s3_bucket))
    assert code == 0, err
    assert [c["name"] for c in json.loads(cli("ls", url, "--json", *_o(s3_bucket))[1])[
        "checkpoints"]] == ["step-4000"]


# ----------------------------------------------------- property: dry run = real run

def _st_checkpoint(folder: Path, step: int, state: str, pinned: bool, age: float) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    save_file({"w": np.full(4, step, dtype=np.float32)}, str(folder / "model.safetensors"))
    if state == "incomplete":
        (folder / WRITING_MARKER).write_text('{"pid": 1, "host": "elsewhere"}\n')
    if pinned:
        (folder / PIN_FILE).write_text('{"reason": "p"}\n')
    t = time.time() - age
    for p in folder.iterdir():
        os.utime(p, (t, t))


checkpoints = st.lists(st.tuples(st.integers(1, 60), st.sampled_from(["complete", "incomplete"]),
                                 st.booleans(), st.sampled_from([60.0, 3 * DAY])),
                       max_size=6, unique_by=lambda c: c[0])
small_policies = st.builds(Policy, last=st.none() | st.integers(1, 3),
                           every=st.none() | st.sampled_from([10, 25])).filter(
                               lambda p: not p.is_empty)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(checkpoints, small_policies)
def test_property_dry_run_equals_real_run(cks, policy):
    root = Path(tempfile.mkdtemp(prefix="gc-prop-"))
    try:
        for step, state, pinned, age in cks:
            _st_checkpoint(root / f"step-{step}", step, state, pinned, age)
        now = time.time()
        plan = gc(str(root), policy, dry_run=True, now=now, grace=DAY)
        done = gc(str(root), policy, now=now, grace=DAY)
        assert plan.decision == done.decision
        assert sorted(os.listdir(root)) == sorted(plan.decision.keep)
        for step, state, pinned, age in cks:
            name = f"step-{step}"
            if pinned or (state == "incomplete" and age < DAY):
                assert name in plan.decision.keep
        committed = [s for s, state, _, _ in cks if state == "complete"]
        if committed:
            assert f"step-{max(committed)}" in plan.decision.keep
    finally:
        shutil.rmtree(root)


def test_gc_of_a_tier_uses_its_keep_table(run, cli, tmp_path):
    cfg = tmp_path / "ckptctl.toml"
    cfg.write_text(f'[[tier]]\nname = "warm"\nurl = "{run}"\nkeep = {{ last = 1 }}\n'
                   f'[[tier]]\nname = "cold"\nurl = "{tmp_path}"\n')
    code, out, err = cli("--config", str(cfg), "gc", "warm:", "--dry-run", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["policy"] == "keep the last 1" and doc["root"] == str(run)
    assert doc["remove"] == ["step-6000", "step-4000", "step-3000", "step-2000"]
    code, out, err = cli("--config", str(cfg), "gc", "warm:", "--keep-tag", "release",
                         "--dry-run", "--json")  # flags replace the table
    assert json.loads(out)["policy"] == "keep tags release", err
    code, out, err = cli("--config", str(cfg), "gc", "cold:")  # no keep: keeps everything
    assert code == 2 and "empty policy" in err and "tier cold has no keep table" in err
    code, out, err = cli("--config", str(cfg), "latest", "warm:")
    assert out.strip() == str(run / "step-5000"), err
