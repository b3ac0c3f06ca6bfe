"""Every verb on Google Cloud Storage (``gs://``, fake-gcs-server) and Azure Blob (``az://``,
Azurite), through the real CLI in a subprocess, values proven by the bytes the servers hold:

1. promote local -> cloud -> local is byte-identical; ``ls``/``latest``/``inspect``/``verify
   --level full`` agree on it; one flipped byte in the cloud fails ``verify --level full``
   (exit 1, naming the file) and ``latest --verified``;
2. ``gc --keep-last 1`` on a cloud root leaves only the newest (the listing proves it);
3. ``pin``/``rm`` on a cloud checkpoint: a pinned one is refused by ``rm`` and kept by gc;
4. promote S3 -> gs -> az -> local, identical bytes and one checkpoint id at every hop;
5. a SIGKILLed promote to each cloud (killed by the test once data lands, and at named points
   of the commit by tests/fixtures/promote_kill.py): nothing listed good, ``latest`` and
   ``verify`` refuse it, what is published under a final name is whole, and the rerun
   completes byte-identical;
6. Azure errors (missing container, wrong key in the connection string or in ``-o``): one
   line, exit 3, the account key never printed;
7. ``--json`` of ``ls``/``inspect``/``verify`` on a cloud has a local root's vocabulary;
8. ``consolidate`` and ``reshard`` written straight to a cloud equal the same command
   written locally.
"""
from __future__ import annotations

import filecmp
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cloudservers import AZURE_KEY

from ckptctl.formats.manifest import MANIFEST, PIN_FILE, WRITING_MARKER

ROOT = Path(__file__).resolve().parent.parent
HELPER = ROOT / "tests" / "fixtures" / "promote_kill.py"
BOUND_S = 300  # a hang, never a time a test expects: loaded machines are slow
WRONG_KEY = "d3Jvbmcta2V5LXdyb25nLWtleS1mb3ItY2twdGN0bA=="  # valid base64, not the account's
CLOUDS = ["gs", "az"]


# ------------------------------------------------------------------ helpers


def ckptctl(*args, box=None, env: dict | None = None, unset: tuple[str, ...] = (),
            timeout: float = BOUND_S) -> subprocess.CompletedProcess:
    """``ckptctl ARGS`` in a subprocess with the box's server variables (``box``: one
    bucket/container fixture or a tuple of them) and ``env`` on top of ``os.environ``,
    less the variables whose names start with one of ``unset``."""
    extra: dict = {}
    for b in (box if isinstance(box, tuple) else (box,) if box is not None else ()):
        extra.update(b.env)
    full = {k: v for k, v in {**os.environ, **extra, **(env or {})}.items()
            if not (unset and k.startswith(unset))}
    return subprocess.run([sys.executable, "-m", "ckptctl", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False,
                          env=full)


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, (p.args[3:], p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    return p


def doc(p: subprocess.CompletedProcess) -> dict:
    return json.loads(ok(p).stdout)


def hashes(d: Path) -> dict[str, str]:
    """sha256 of every file under ``d`` (dotfiles included), by relative posix path."""
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def same_tree(a: Path, b: Path) -> bool:
    """``filecmp`` of two trees, byte by byte (shallow=False), recursively."""
    cmp = filecmp.dircmp(a, b)
    if cmp.left_only or cmp.right_only or cmp.funny_files:
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
    return not mismatch and not errors and all(same_tree(a / d, b / d) for d in cmp.common_dirs)


def cloud_hashes(box, prefix: str) -> dict[str, str]:
    """sha256 of every object under ``prefix/`` (read back through the server's own API),
    by the name relative to ``prefix``."""
    prefix = prefix.strip("/") + "/"
    return {k[len(prefix):]: hashlib.sha256(box.get(k)).hexdigest()
            for k in sorted(box.list(prefix))}


def names_under(box, prefix: str) -> set[str]:
    prefix = prefix.strip("/") + "/"
    return {k[len(prefix):] for k in box.list(prefix)}


def one_line(p: subprocess.CompletedProcess) -> str:
    line = p.stderr.strip()
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    return line


def assert_no_key(text: str, *keys: str) -> None:
    """No key, nor any 12 characters of one in a row, appears in ``text``."""
    for key in keys:
        for i in range(len(key) - 11):
            assert key[i:i + 12] not in text, f"12 characters of an account key printed: {text!r}"


def save_dcp(path: Path, sd: dict, threads: int = 1) -> None:
    """``torch.distributed.checkpoint.save`` from one process, ``threads`` writer threads
    (about one data file each)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path), thread_count=threads))


def sealed(path: Path) -> Path:
    from ckptctl.ops import seal

    seal(str(path))  # once here: no CLI run below writes into a source
    return path


# ------------------------------------------------------------------ fixtures


@pytest.fixture(params=CLOUDS)
def box(request):
    """A fresh bucket (``gs``) or container (``az``) on its loopback server."""
    return request.getfixturevalue("gcs_bucket" if request.param == "gs" else "az_container")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Journals of remote destinations go under the test's own cache (children inherit it)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def model_ckpt(tmp_path_factory) -> Path:
    """A sealed DCP checkpoint of a small model with Adam state (~3 MiB in 2 data files)."""
    import torch

    g = torch.Generator().manual_seed(7)
    model = {"tok_embeddings.weight": torch.randn(512, 256, generator=g),
             "layers.0.attention.wq.weight": torch.randn(256, 256, generator=g),
             "layers.0.attention_norm.weight": torch.ones(256, dtype=torch.bfloat16),
             "output.weight": torch.randn(512, 256, generator=g)}
    optim = {"state": {k: {"exp_avg": torch.randn(v.shape, generator=g).to(v.dtype),
                           "step": torch.tensor(7.0)} for k, v in model.items()},
             "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95)}]}
    p = tmp_path_factory.mktemp("model") / "step-7"
    save_dcp(p, {"model": model, "optim": optim, "step": 7}, threads=2)
    return sealed(p)


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> Path:
    """``run/step-1..3``: three small sealed DCP checkpoints whose step entry is their name."""
    import torch

    root = tmp_path_factory.mktemp("steps")
    for s in (1, 2, 3):
        save_dcp(root / f"step-{s}", {"model": {"w": torch.full((64,), float(s)),
                                                "b": torch.arange(8) + s}, "step": s})
        sealed(root / f"step-{s}")
    return root


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> Path:
    """Something worth interrupting: one 10 MiB file (over Azure's one-PUT limit, 8 MiB, so
    a block upload) and six of 1 MiB, sealed (~16 MiB)."""
    import torch

    g = torch.Generator().manual_seed(11)
    model = {"big": torch.randn(10 * 256 * 1024, generator=g)}
    model.update({f"w{i}": torch.randn(256 * 1024, generator=g) for i in range(6)})
    p = tmp_path_factory.mktemp("many") / "step-11"
    save_dcp(p, {"model": model, "step": 11}, threads=7)
    assert len(list(p.glob("*.distcp"))) == 7, sorted(p.iterdir())
    return sealed(p)


# ------------------------------------------------------------------ 1. round trip


def test_round_trip_is_byte_identical_and_every_verb_agrees(box, model_ckpt, tmp_path):
    root, url = box.url("run"), box.url("run/step-7")
    man = json.loads((model_ckpt / MANIFEST).read_bytes())
    p = doc(ckptctl("promote", model_ckpt, url, "--json", box=box))
    assert p["action"] == "promoted" and p["bytes_sent"] == p["bytes"], p
    assert p["manifest_id"] is not None and not p["sealed_source"], p
    # the server holds SRC's files, manifest included, byte for byte (and nothing else)
    assert cloud_hashes(box, "run/step-7") == hashes(model_ckpt)

    rows = doc(ckptctl("ls", root, "--json", box=box))["checkpoints"]
    assert [(r["name"], r["url"], r["step"], r["format"], r["state"]) for r in rows] == \
        [("step-7", url, 7, "dcp", "sealed")], rows
    assert rows[0]["num_files"] == len(man["files"]) >= 3, rows
    assert rows[0]["bytes"] == sum(f["size"] for f in man["files"].values()), rows
    assert ok(ckptctl("latest", root, box=box)).stdout.strip() == url

    ins = doc(ckptctl("inspect", url, "--json", box=box))
    assert (ins["url"], ins["step"], ins["format"], ins["sealed"]) == (url, 7, "dcp", True), ins
    assert ins["manifest_id"] == p["manifest_id"] and ins["num_params"] > 0, ins
    assert ins["closure"]["model"] and ins["closure"]["optim"], ins["closure"]
    v = ckptctl("verify", "--level", "full", url, box=box)
    assert ok(v).stdout.startswith(f"{url}: OK (full; dcp, sealed; content: hashes"), v.stdout

    back = tmp_path / "back" / "step-7"
    r = doc(ckptctl("promote", url, back, "--json", box=box))
    assert r["action"] == "promoted" and r["manifest_id"] == p["manifest_id"], r
    assert same_tree(model_ckpt, back) and hashes(back) == hashes(model_ckpt)

    # one flipped bit in the middle of the largest data file (tensor bytes), in the cloud
    rel = max((f for f in man["files"] if f.endswith(".distcp")),
              key=lambda f: man["files"][f]["size"])
    key = f"run/step-7/{rel}"
    data = bytearray(box.get(key))
    data[len(data) // 2] ^= 0x10
    box.put(key, bytes(data))
    assert box.get(key) == bytes(data) and len(data) == man["files"][rel]["size"]
    v = ckptctl("verify", "--level", "full", url, box=box)
    assert v.returncode == 1, (v.stdout, v.stderr)
    bad = [line.split()[:3] for line in v.stdout.splitlines() if "HASH_MISMATCH" in line]
    assert bad == [["HASH_MISMATCH", "error", rel]], v.stdout  # that file, and only it
    assert v.stdout.splitlines()[-1].startswith(f"{url}: 1 problem (full;"), v.stdout
    lv = ckptctl("latest", "--verified", root, box=box)
    assert lv.returncode == 1 and lv.stdout == "" and "HASH_MISMATCH" in lv.stderr, lv.stderr


# ------------------------------------------------------------------ 2-3. gc, rm, pin


def _promote_steps(box, steps: Path, names=("step-1", "step-2", "step-3")) -> None:
    for name in names:
        ok(ckptctl("promote", "-q", steps / name, box.url(f"run/{name}"), box=box))


def _rows(box, root: str) -> list[tuple[str, int, str, bool]]:
    return [(r["name"], r["step"], r["state"], r["pinned"])
            for r in doc(ckptctl("ls", root, "--json", box=box))["checkpoints"]]


def test_gc_keep_last_one_leaves_only_the_newest(box, steps):
    root = box.url("run")
    _promote_steps(box, steps)
    before = cloud_hashes(box, "run")
    assert {k.split("/")[0] for k in before} == {"step-1", "step-2", "step-3"}, before
    dry = ckptctl("gc", root, "--keep-last", "1", "--dry-run", "--json", box=box)
    plan = doc(dry)
    assert plan["dry_run"] and plan["remove"] == ["step-2", "step-1"], plan
    assert cloud_hashes(box, "run") == before  # a dry run changes nothing

    g = doc(ckptctl("gc", root, "--keep-last", "1", "--json", box=box))
    assert g["remove"] == plan["remove"] and list(g["keep"]) == ["step-3"], g
    assert _rows(box, root) == [("step-3", 3, "sealed", False)]
    # the server holds step-3's objects, unchanged, and not one object of the others
    assert cloud_hashes(box, "run") == {k: v for k, v in before.items()
                                        if k.startswith("step-3/")}
    assert cloud_hashes(box, "run/step-3") == hashes(steps / "step-3")


def test_rm_and_pin_on_a_cloud_checkpoint(box, steps):
    """Checkpoints put by the server's own API (promote is proven above): a pin is an object
    beside the checkpoint, rm refuses a pinned one, gc keeps it past --keep-last, rm takes
    an unpinned one (every object of it) and a pinned one with --force."""
    root, one = box.url("run"), box.url("run/step-1")
    for name in ("step-1", "step-2", "step-3"):
        box.upload(steps / name, f"run/{name}")
    pj = doc(ckptctl("pin", one, "--reason", "paper results", "--json", box=box))
    assert pj["pinned"] and pj["changed"] and pj["reason"] == "paper results", pj
    assert names_under(box, "run/step-1") == set(hashes(steps / "step-1")) | {PIN_FILE}
    rm = ckptctl("rm", one, box=box)
    assert rm.returncode == 1 and "pinned" in one_line(rm) and "paper results" in rm.stderr
    assert names_under(box, "run/step-1") == set(hashes(steps / "step-1")) | {PIN_FILE}

    g = doc(ckptctl("gc", root, "--keep-last", "1", "--json", box=box))
    assert g["remove"] == ["step-2"] and g["keep"] == {"step-3": ["last 1", "newest committed"],
                                                      "step-1": ["pinned"]}, g
    assert names_under(box, "run/step-2") == set()  # every object of it gone
    r = doc(ckptctl("rm", box.url("run/step-3"), "--json", box=box))
    assert (r["was_pinned"], r["num_files"]) == (False, len(hashes(steps / "step-3")) - 1), r
    assert names_under(box, "run/step-3") == set()
    # what is left is step-1, pinned, its content untouched by all of the above
    assert _rows(box, root) == [("step-1", 1, "sealed", True)]
    assert {k: v for k, v in cloud_hashes(box, "run").items() if k != f"step-1/{PIN_FILE}"} \
        == {f"step-1/{k}": v for k, v in hashes(steps / "step-1").items()}
    f = doc(ckptctl("rm", one, "--force", "--json", box=box))
    assert f["was_pinned"], f
    assert names_under(box, "run") == set()


# ------------------------------------------------------------------ 4. between clouds


def test_promote_s3_to_gs_to_az_to_local(model_ckpt, s3_bucket, gcs_bucket, az_container,
                                         tmp_path):
    s3o = s3_bucket.storage_options
    s3_flags = [f"endpoint_url={s3o['endpoint_url']}", f"key={s3o['key']}",
                f"secret={s3o['secret']}"]
    boxes = (gcs_bucket, az_container)
    s3, gs, az = s3_bucket.url("a/step-7"), gcs_bucket.url("b/step-7"), az_container.url("c/step-7")
    back = tmp_path / "back" / "step-7"
    hops = [ckptctl("promote", model_ckpt, s3, "--json",
                    *[x for o in s3_flags for x in ("-o", o)]),
            ckptctl("promote", s3, gs, "--json",
                    *[x for o in s3_flags for x in ("--src-option", o)], box=boxes),
            ckptctl("promote", gs, az, "--json", box=boxes),
            ckptctl("promote", az, back, "--json", box=boxes)]
    ids = [doc(h)["manifest_id"] for h in hops]  # exit 0 each (the first failure first)
    assert len(set(ids)) == 1 and ids[0].startswith("xxh3-128:"), ids
    assert_no_key("".join(h.stdout + h.stderr for h in hops), s3o["secret"])
    want = hashes(model_ckpt)
    assert cloud_hashes(gcs_bucket, "b/step-7") == want
    assert cloud_hashes(az_container, "c/step-7") == want
    assert same_tree(model_ckpt, back) and hashes(back) == want
    for url in (gs, az):
        ok(ckptctl("verify", "--level", "full", url, box=boxes))


# ------------------------------------------------------------------ 5. killed promotes


def _look(box, root: str, url: str) -> str:
    """``ls``, ``latest`` and ``verify`` agree on what is at ``url``: nothing or
    ``incomplete`` (not listed good, no latest, ``verify --level full`` fails), or committed
    (latest names it, ``verify --level full`` passes). Returns the state (``none``: not
    listed)."""
    name = url.rsplit("/", 1)[1]
    p = ckptctl("ls", root, "--json", box=box)
    if p.returncode == 3:  # nothing under the root yet
        assert json.loads(p.stdout)["error"]["code"] == "MISSING_FILE", p.stdout
        rows = {}
    else:
        rows = {r["name"]: r for r in doc(p)["checkpoints"]}
    assert set(rows) <= {name}, rows  # no work object listed as a checkpoint of its own
    state = rows[name]["state"] if name in rows else "none"
    lt = ckptctl("latest", root, box=box)
    committed = state in ("sealed", "complete")
    v = ckptctl("verify", url, "--level", "full", "--json", box=box)
    if committed:
        assert ok(lt).stdout.strip() == url
        assert json.loads(ok(v).stdout)["ok"]
        return state
    assert state in ("none", "incomplete"), rows
    assert lt.returncode in (1, 3) and lt.stdout == "", (lt.stdout, lt.stderr)
    assert v.returncode in (1, 3), v.stdout
    if v.returncode == 1:
        vd = json.loads(v.stdout)
        assert not vd["ok"] and {pr["code"] for pr in vd["problems"]} & {
            "NOT_COMMITTED", "MISSING_FILE"}, vd
    return state


def _published_whole(box, prefix: str, src: Path) -> set[str]:
    """Every object under ``prefix`` is one of SRC's files with SRC's exact bytes, or the
    writing marker: nothing partial is ever listed under a final name. Returns SRC's files
    found there."""
    found = names_under(box, prefix)
    want = hashes(src)
    assert found <= set(want) | {WRITING_MARKER}, found - set(want)
    got = cloud_hashes(box, prefix)
    for rel in found - {WRITING_MARKER}:
        assert got[rel] == want[rel], rel
    return found - {WRITING_MARKER}


def _rerun_completes(box, src: Path, root: str, url: str, prefix: str, published: set[str],
                     *flags: str):
    r = doc(ckptctl("promote", src, url, "--json", *flags, box=box))
    assert r["action"] in ("promoted", "up-to-date"), r
    n = len(hashes(src)) - 1  # the manifest is not one of the files counted
    assert r["files_sent"] + r["files_skipped"] == n or r["action"] == "up-to-date", r
    assert r["files_skipped"] <= len(published - {MANIFEST}), (r, published)
    v = doc(ckptctl("verify", "--level", "full", url, "--json", box=box))
    assert v["ok"] and v["sealed"] and v["content"] == "hashes" and not v["problems"], v
    assert cloud_hashes(box, prefix) == hashes(src)  # marker gone, nothing else there
    journals = list((Path(os.environ["XDG_CACHE_HOME"]) / "ckptctl").rglob("*.jsonl"))
    assert journals == [], journals  # the journal of a finished promote is removed
    return r


#: the 10 MiB file of ``many`` goes as one streamed write (5 MiB blocks), the others as one PUT
STREAMED = ("--part-size", "5MiB")


def test_promote_killed_once_data_lands_then_rerun(box, many):
    """SIGKILL the CLI as soon as the server lists a data file (``--bwlimit`` keeps the rest,
    the streamed 10 MiB file among them, in flight). Whatever moment the kill hit (the
    promote may even have finished), the destination is either committed and verified or
    not listed good, and nothing partial is listed; the rerun completes."""
    root, url, prefix = box.url("run"), box.url("run/step-11"), "run/step-11"
    proc = subprocess.Popen([sys.executable, "-m", "ckptctl", "promote", str(many), url,
                             "--bwlimit", "8MiB/s", "--workers", "4", *STREAMED], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **box.env})
    deadline, landed = time.monotonic() + 120, set()
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            landed = {k for k in box.list(prefix + "/") if k.endswith(".distcp")}
            if landed:
                proc.send_signal(signal.SIGKILL)  # a no-op when it has just exited
                break
            time.sleep(0.005)  # a polling interval; the deadline bounds the wait
    finally:
        if proc.poll() is None and not landed:
            proc.kill()
        _, err = proc.communicate(timeout=60)
    assert landed or proc.returncode == 0, (proc.returncode, err[-2000:])
    published = _published_whole(box, prefix, many)
    state = _look(box, root, url)
    if proc.returncode == 0:  # finished before the kill: it must be whole and committed
        assert state == "sealed" and cloud_hashes(box, prefix) == hashes(many)
    else:
        assert proc.returncode == -signal.SIGKILL, (proc.returncode, err[-2000:])
        assert state in ("incomplete", "sealed"), state
    r = _rerun_completes(box, many, root, url, prefix, published, *STREAMED)
    print(f"\n{box.url()}: killed={proc.returncode == -signal.SIGKILL} state={state} "
          f"published before the rerun={sorted(published)} rerun skipped "
          f"{r['files_skipped']} files, sent {r['bytes_sent']} of {r['bytes']} bytes")


#: points of tests/fixtures/promote_kill.py: half the bytes, all data landed (nothing
#: committed), the journal removed, the manifest written (the marker still there)
KILL_POINTS = [("half", ["--kill-after-bytes", "HALF"]), ("landed", ["--kill-at", "landed"]),
               ("journal-removed", ["--kill-at", "journal-removed"]),
               ("committed", ["--kill-at", "committed"])]


#: every point on Azure; on GCS (whose CLI runs cost 0.7 s each in gcsfs' imports) the two
#: that differ there: the data all landed, and the manifest written by ifGenerationMatch=0
#: (killed mid-data: test_promote_killed_once_data_lands_then_rerun)
NAMED_KILLS = [pytest.param(c, p, id=f"{c}-{p}") for c in CLOUDS for p, _ in KILL_POINTS
               if c == "az" or p in ("landed", "committed")]


@pytest.mark.parametrize("cloud,point", NAMED_KILLS)
def test_promote_killed_at_a_named_point_then_rerun(request, cloud, point, model_ckpt):
    """Killed (by the helper itself, so at exactly that point) half way through the data,
    once every file landed, once the journal is gone, and once the manifest is written:
    never listed good, and the rerun finishes it."""
    box = request.getfixturevalue("gcs_bucket" if cloud == "gs" else "az_container")
    src = model_ckpt
    root, url, prefix = box.url("run"), box.url("run/step-7"), "run/step-7"
    total = sum(f["size"] for f in json.loads((src / MANIFEST).read_bytes())["files"].values())
    flags = [str(total // 2) if a == "HALF" else a for a in dict(KILL_POINTS)[point]]
    proc = subprocess.run([sys.executable, str(HELPER), str(src), url, "--workers", "4",
                           "--part-size", str(32 << 20), *flags], cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=BOUND_S,
                          env={**os.environ, **box.env})
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])
    published = _published_whole(box, prefix, src)
    assert WRITING_MARKER in names_under(box, prefix)  # the marker goes first, leaves last
    if point != "half":
        assert published >= set(hashes(src)) - {MANIFEST}, published  # every data file
    assert (MANIFEST in published) == (point == "committed"), published
    assert _look(box, root, url) == "incomplete"
    _rerun_completes(box, src, root, url, prefix, published)


def test_promote_of_a_file_larger_than_the_part_size(box, many, tmp_path):
    """The 10 MiB file of ``many`` in 5 MiB parts (what a 33 MiB file does at the default
    part size): streamed to a cloud, which has no multipart uploads of ckptctl's own, and
    read back from it in ranged parts. Exited 2 ("az:// stores have no multipart uploads")
    until storage/transfer.py gained ``Transfer._streamed``."""
    url = box.url("run/step-11")
    r = doc(ckptctl("promote", many, url, "--part-size", "5MiB", "--json", box=box))
    assert r["action"] == "promoted" and r["bytes_sent"] == r["bytes"], r
    assert cloud_hashes(box, "run/step-11") == hashes(many)
    back = tmp_path / "back" / "step-11"
    ok(ckptctl("promote", url, back, "--part-size", "5MiB", box=box))
    assert same_tree(many, back)


def test_a_source_changed_since_its_seal_is_never_published(box, many, tmp_path):
    """A file whose bytes no longer match SRC's manifest (same size) is refused and never
    appears under its name at DST: a small one (one write) and the 10 MiB one streamed in
    5 MiB blocks, whose mismatch is known only after its last byte went out."""
    rels = json.loads((many / MANIFEST).read_bytes())["files"]
    big = max(rels, key=lambda f: rels[f]["size"])
    small = min((f for f in rels if f.endswith(".distcp")), key=lambda f: rels[f]["size"])
    for rel, flags in ((small, []), (big, ["--part-size", "5MiB"])):
        src = tmp_path / rel / "step-11"
        src.parent.mkdir()
        shutil.copytree(many, src)
        data = bytearray((src / rel).read_bytes())
        data[len(data) // 2] ^= 0x01
        (src / rel).write_bytes(bytes(data))
        prefix = f"{rel}/step-11"
        p = ckptctl("promote", src, box.url(prefix), "--workers", "1", *flags, box=box)
        assert p.returncode == 1, (p.returncode, p.stderr)
        assert rel in one_line(p) and "nothing was published" in p.stderr, p.stderr
        assert rel not in _published_whole(box, prefix, many)  # what is there is whole
        assert MANIFEST not in names_under(box, prefix)


# ------------------------------------------------------------------ 6. no secret printed


def _az_env(box, key: str) -> dict:
    return {"AZURE_STORAGE_CONNECTION_STRING": box.server.connection_string.replace(
        f"AccountKey={AZURE_KEY};", f"AccountKey={key};")}


def test_azure_errors_are_one_line_and_never_print_the_key(az_container, model_ckpt, tmp_path):
    box = az_container
    assert f"AccountKey={AZURE_KEY};" in box.server.connection_string
    ok(ckptctl("promote", "-q", model_ckpt, box.url("run/step-7"), box=box))
    # a container that does not exist, with the right key
    for args in (["ls", "az://no-such-container-x/run"],
                 ["verify", "az://no-such-container-x/run/step-7"]):
        p = ckptctl(*args, box=box)
        assert p.returncode == 3 and "no such container" in one_line(p), p.stderr
        assert_no_key(p.stdout + p.stderr, AZURE_KEY)
        pj = ckptctl(*args, "--json", box=box)
        assert json.loads(pj.stdout)["error"]["exit_code"] == 3, pj.stdout
        assert_no_key(pj.stdout + pj.stderr, AZURE_KEY)
    # a wrong key in the connection string: every verb (some with --json too)
    wrong = _az_env(box, WRONG_KEY)
    for args, also_json in ((["ls", box.url("run")], True), (["latest", box.url("run")], False),
                            (["inspect", box.url("run/step-7")], False),
                            (["verify", "--level", "full", box.url("run/step-7")], True),
                            (["promote", model_ckpt, box.url("run2/step-7")], True),
                            (["promote", box.url("run/step-7"), tmp_path / "back"], False),
                            (["gc", box.url("run"), "--keep-last", "1"], False),
                            (["rm", box.url("run/step-7")], False),
                            (["pin", box.url("run/step-7")], False)):
        for js in ([], ["--json"]) if also_json else ([],):
            p = ckptctl(*args, *js, box=box, env=wrong)
            assert p.returncode == 3, (args, p.returncode, p.stdout, p.stderr)
            line = one_line(p)
            assert "access denied" in line and "AZURE_STORAGE_CONNECTION_STRING" in line, line
            assert_no_key(p.stdout + p.stderr, AZURE_KEY, WRONG_KEY)
            if js:
                assert json.loads(p.stdout)["error"]["exit_code"] == 3, p.stdout
    # the same key given as options (it shows in ps, but never in what ckptctl prints)
    p = ckptctl("ls", box.url("run"), "-o", "account_name=devstoreaccount1",
                "-o", f"account_key={WRONG_KEY}", "-o", f"endpoint={box.server.endpoint}",
                unset=("AZURE_",))
    assert p.returncode == 3 and "access denied" in one_line(p), p.stderr
    assert_no_key(p.stdout + p.stderr, AZURE_KEY, WRONG_KEY)
    # nothing was written or removed by the refused commands
    assert cloud_hashes(box, "run/step-7") == hashes(model_ckpt)
    assert names_under(box, "run2") == set() and not (tmp_path / "back").exists()


def test_a_malformed_azure_key_names_what_to_set(az_container):
    p = ckptctl("ls", az_container.url("run"), box=az_container,
                env=_az_env(az_container, "not a key"))
    assert p.returncode == 3 and "AZURE_STORAGE_CONNECTION_STRING" in one_line(p), p.stderr


# ------------------------------------------------------------------ 7. one vocabulary


def test_json_of_a_cloud_root_has_the_local_vocabulary(box, steps):
    for name in ("step-1", "step-2"):  # the same bytes as the local ones
        box.upload(steps / name, f"run/{name}")
    local_root = steps
    cloud_root = box.url("run")
    lo = doc(ckptctl("ls", local_root, "--json"))
    cl = doc(ckptctl("ls", cloud_root, "--json", box=box))
    assert cl["root"] == cloud_root and lo["root"] == str(local_root)
    assert list(cl) == list(lo) and cl["schema_version"] == lo["schema_version"] == 3
    lrows = {r["name"]: r for r in lo["checkpoints"]}
    crows = {r["name"]: r for r in cl["checkpoints"]}
    assert list(crows) == ["step-1", "step-2"] and set(crows) <= set(lrows), crows
    for name, c in crows.items():
        loc = lrows[name]
        assert list(c) == list(loc), (list(c), list(loc))
        assert c["url"] == f"{cloud_root}/{name}"
        same = ("name", "step", "format", "state", "reason", "bytes", "num_files", "pinned")
        assert {k: c[k] for k in same} == {k: loc[k] for k in same}, (c, loc)
    for verb in (["inspect"], ["verify", "--level", "full"]):
        ld = doc(ckptctl(*verb, local_root / "step-2", "--json"))
        cd = doc(ckptctl(*verb, box.url("run/step-2"), "--json", box=box))
        assert list(cd) == list(ld), (verb, list(cd), list(ld))
        assert cd["url"] == box.url("run/step-2")
        for k in ("step", "format", "manifest_id", "num_files", "bytes", "sealed", "ok"):
            if k in ld:
                assert cd[k] == ld[k], (verb, k, cd[k], ld[k])
    # latest: the local root's newest is step-3, the cloud's step-2; the same keys
    ld, cd = doc(ckptctl("latest", local_root, "--json")), \
        doc(ckptctl("latest", cloud_root, "--json", box=box))
    assert list(cd) == list(ld), (list(cd), list(ld))
    assert (cd["url"], cd["step"], cd["state"]) == (box.url("run/step-2"), 2, "sealed"), cd


# ------------------------------------------------------------------ 8. outputs to a cloud


def test_consolidate_and_reshard_straight_to_a_cloud(box, model_ckpt, tmp_path):
    jobs = {"hf": ["consolidate", "--to", "safetensors", "--only", "model",
                   "--strip-prefix", "model.", "--dtype", "bf16"],
            "tp2": ["reshard", "--mesh", "dp=1,tp=2", "--rules", "llama"]}
    for name, (verb, *flags) in jobs.items():
        local = tmp_path / name
        ld = doc(ckptctl(verb, model_ckpt, local, *flags, "--json"))
        cd = doc(ckptctl(verb, model_ckpt, box.url(name), *flags, "--json", box=box))
        assert cd["dst"] == box.url(name) and cd["num_files"] == ld["num_files"], (cd, ld)
        got, want = cloud_hashes(box, name), hashes(local)
        assert set(got) == set(want), (sorted(got), sorted(want))
        # every file the command wrote is byte-identical; the manifests differ at most in
        # their creation time, which the checkpoint id leaves out
        assert {k: v for k, v in got.items() if k != MANIFEST} == \
            {k: v for k, v in want.items() if k != MANIFEST}
        cm = json.loads(box.get(f"{name}/{MANIFEST}"))
        lm = json.loads((local / MANIFEST).read_bytes())
        cm.pop("created"), lm.pop("created")
        assert cm == lm and cd["manifest_id"] == ld["manifest_id"], (cm, lm)
        ok(ckptctl("verify", "--level", "full", box.url(name), box=box))


NO_GCSFS = """
import sys
from ckptctl.cli.main import main
for argv in (["ls", sys.argv[1]], ["latest", sys.argv[1]], ["inspect", sys.argv[2]],
             ["verify", sys.argv[2], "--level", "full"], ["diff", sys.argv[2], sys.argv[2]],
             ["promote", sys.argv[2], sys.argv[3]], ["promote", sys.argv[2], sys.argv[3]]):
    try:
        main(argv)
    except SystemExit as e:
        assert not e.code, (argv, e.code)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("gcsfs", "google", "aiohttp"))
assert not heavy, heavy
print("clean")
"""


def test_reading_gs_imports_no_gcsfs(gcs_bucket, model_ckpt, tmp_path):
    """Listing, reading, a full verify and a download (twice: nothing to send the second
    time) of gs:// all go through obstore; gcsfs (0.5-0.6 s of imports) only writes."""
    ok(ckptctl("promote", model_ckpt, gcs_bucket.url("run/step-7"), box=gcs_bucket))
    p = subprocess.run([sys.executable, "-c", NO_GCSFS, gcs_bucket.url("run"),
                        gcs_bucket.url("run/step-7"), str(tmp_path / "down" / "step-7")],
                       capture_output=True, text=True, timeout=BOUND_S, cwd=ROOT,
                       env={**os.environ, **gcs_bucket.env})
    assert p.returncode == 0 and "clean" in p.stdout, p.stderr[-3000:]
    assert same_tree(model_ckpt, tmp_path / "down" / "step-7")


def test_a_missing_gcs_bucket_is_one_line(gcs_bucket):
    p = ckptctl("ls", "gs://no-such-bucket-here/run", "--timeout", "30", box=gcs_bucket)
    assert p.returncode == 3 and one_line(p).endswith("no such bucket"), p.stderr
