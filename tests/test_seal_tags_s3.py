"""Concurrent ``seal --tag`` of one checkpoint (issue 17, item 6): tags merge; a seal that
exits 0 has its tags in the stored manifest, on a local folder, on moto (which honours
``If-None-Match``/``If-Match``: compare-and-swap) and on ``rclone serve s3`` (which ignores
both: the intent protocol of :func:`ckptctl.integrity.seal._publish_unconditional`).

Sealers are started together (two processes of the CLI, or threads of the library) and
repeated; no assertion depends on how they interleave: afterwards every caller that
exited 0 finds its tag stored, and either both tags are there or exactly one caller
exited non-zero. Races run locally and on moto; rclone's intent path is tested one
sealer at a time (see ``racing``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from ckptctl.errors import CkptError
from ckptctl.formats.manifest import MANIFEST, Manifest
from ckptctl.integrity.seal import seal

ROOT = Path(__file__).resolve().parents[1]
REPEATS = 5


def _unsealed(path: Path) -> Path:
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    save_file({"w": np.arange(4096, dtype=np.float32)}, str(path / "model.safetensors"))
    return path


class Where:
    """One place to seal at: a local folder, or a prefix on the rclone or moto server."""

    def __init__(self, kind: str, tmp_path: Path, bucket=None):
        self.kind, self.tmp, self.bucket = kind, tmp_path, bucket
        self.opts = bucket.storage_options if bucket else None
        self.env = dict(os.environ, **(bucket.server.env if bucket else {}))

    def fresh(self) -> str:
        """A new unsealed checkpoint; its URL."""
        name = f"step-{uuid.uuid4().hex[:8]}"
        local = _unsealed(self.tmp / "src" / name)
        if not self.bucket:
            return str(local)
        self.bucket.upload(local, name)
        return self.bucket.url(name)

    def files(self, url: str) -> dict[str, bytes]:
        if not self.bucket:
            return {p.name: p.read_bytes() for p in Path(url).iterdir()}
        fs = self.bucket.fs()
        root = url[len("s3://"):]
        return {k[len(root) + 1:]: fs.cat_file(k) for k in fs.find(root)}

    def stored(self, url: str) -> Manifest | None:
        raw = self.files(url).get(MANIFEST)
        return None if raw is None else Manifest.parse(raw, url)


def _where(request, tmp_path):
    if request.param == "local":
        return Where("local", tmp_path)
    bucket = request.getfixturevalue("s3_bucket" if request.param == "rclone" else "moto_bucket")
    return Where(request.param, tmp_path, bucket)


@pytest.fixture(params=["local", "rclone", "moto"])
def where(request, tmp_path):
    return _where(request, tmp_path)


#: Sealers racing at once: locally and on moto (exact AWS semantics). Not on ``rclone serve
#: s3``: with three sealers on one folder it was seen (in CI, on a loaded machine) to leave
#: a request unanswered until the 900 s budget ran out; the intent protocol is tested
#: there one sealer at a time and with a killed sealer's intent.
@pytest.fixture(params=["local", "moto"])
def racing(request, tmp_path):
    return _where(request, tmp_path)


def _check(where: Where, url: str, codes: dict[str, int], why) -> None:
    """The invariant: a caller that exited 0 has its tag stored; both tags are there, or
    exactly one caller failed; no intent or probe object is left behind."""
    man = where.stored(url)
    tags = set(man.tags) if man else set()
    for tag, code in codes.items():
        if code == 0:
            assert tag in tags, (codes, sorted(tags), why)
    failed = [t for t, c in codes.items() if c != 0]
    assert set(codes) <= tags or len(failed) == 1, (codes, sorted(tags), why)
    left = [n for n in where.files(url) if n.endswith(".tmp")]
    assert not left, left


def test_two_processes_started_together(racing):
    """``ckptctl seal URL --tag A`` and ``--tag B`` at once, as two processes."""
    where = racing
    for _ in range(REPEATS):
        url = where.fresh()
        procs = {tag: subprocess.Popen([sys.executable, "-m", "ckptctl", "seal", url,
                                        "--tag", tag], cwd=ROOT, env=where.env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for tag in ("A", "B")}
        out = {tag: p.communicate(timeout=300) for tag, p in procs.items()}
        codes = {tag: p.returncode for tag, p in procs.items()}
        for tag, (o, e) in out.items():
            assert codes[tag] in (0, 1), e  # a finding at worst, never an I/O error
        _check(where, url, codes, out)


def test_three_threads_started_together(racing):
    where = racing
    for _ in range(REPEATS):
        url = where.fresh()
        codes, errors = {}, {}
        go = threading.Barrier(3)

        def one(tag):
            go.wait()
            try:
                r = seal(url, where.opts, tags=[tag])
                codes[tag] = 0
                assert tag in r.tags
            except CkptError as e:
                codes[tag], errors[tag] = e.exit_code, str(e)

        threads = [threading.Thread(target=one, args=(t,)) for t in "ABC"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(c in (0, 1) for c in codes.values()), errors
        man = where.stored(url)
        for tag, code in codes.items():
            if code == 0:
                assert tag in man.tags, (codes, man.tags, errors)
        assert not [n for n in where.files(url) if n.endswith(".tmp")]


def test_a_later_seal_adds_its_tag(where):
    """Sequentially, too: ``seal --tag B`` of a checkpoint sealed with A keeps both
    (before: "already sealed; verified", exit 0, and B was dropped)."""
    url = where.fresh()
    first = seal(url, where.opts, tags=["A"])
    again = seal(url, where.opts, tags=["B"])
    assert (first.action, again.action) == ("sealed", "tagged")
    assert again.manifest_id == first.manifest_id and again.tags == ["A", "B"]
    assert where.stored(url).tags == ["A", "B"]
    assert seal(url, where.opts, tags=["A"]).action == "verified"  # nothing to add


def test_other_steps_still_refuse_the_loser(racing):
    """Only tags merge: two sealers of other steps at once, and exactly one wins."""
    where = racing
    for _ in range(3):
        url = where.fresh()
        codes = {}
        go = threading.Barrier(2)

        def one(step):
            go.wait()
            try:
                seal(url, where.opts, step=step)
                codes[step] = 0
            except CkptError as e:
                codes[step] = e.exit_code
        threads = [threading.Thread(target=one, args=(s,)) for s in (5, 6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(codes.values()) == [0, 1], codes
        winner = next(s for s, c in codes.items() if c == 0)
        assert where.stored(url).step == winner


def test_which_servers_honour_conditional_writes(s3_bucket, moto_bucket):
    """moto refuses a write whose condition fails; rclone writes anyway (hence the intent
    protocol there). The probe leaves nothing behind."""
    from ckptctl.storage import open_store
    from ckptctl.storage.conditional import honours_conditions

    for bucket, expected in ((s3_bucket, False), (moto_bucket, True)):
        store = open_store(bucket.url("probe-here"), bucket.storage_options)
        assert honours_conditions(store, ".ckptctl-probe-x.tmp") is expected
        assert not bucket.fs().find(bucket.path("probe-here"))


def test_a_killed_sealers_intent_does_not_block(s3_bucket, tmp_path):
    """rclone: the intent a killed sealer left (a dead process of this host) is removed,
    and the seal goes on."""
    from ckptctl.integrity.seal import _host

    where = Where("rclone", tmp_path, s3_bucket)
    url = where.fresh()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    name = f".ckptctl-seal-{'0' * 32}-{dead}-{_host()}.tmp"  # the earliest name there is
    s3_bucket.fs().pipe(f"{url[len('s3://'):]}/{name}", b'{"command": "seal"}\n')
    r = seal(url, where.opts, tags=["A"])
    assert r.action == "sealed" and r.tags == ["A"]
    assert name not in where.files(url)
    assert json.loads(where.files(url)[MANIFEST])["tags"] == ["A"]
