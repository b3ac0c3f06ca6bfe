"""A retention count is exact on a pack tier (issue 35, item 1): "a cold tier ``pack =
true, keep = { last = 4 }`` held all 10 checkpoints after 10 hops". gc re-roots a pack
kept for its own sake whose base is kept only for it (a full pack, or a delta against an
older checkpoint the policy keeps), crash-safely, so the tier holds what ``keep`` says;
``max_chain`` is a tier option; ``tiers`` and ``gc --dry-run`` say what a tier holds at
most. Locally and on the rclone S3 server.

The tier is built the way watch builds one: 10 small DCP checkpoints (written by torch)
promoted one by one into the pack tier (``--base auto``: each a delta of the one before,
a full pack past the chain limit). Every claim is proven by restoring: each checkpoint
left unpacks byte for byte to its original, with the original's manifest id. A crash is
a re-root stopped at each of its durable steps (an exception from the step's seam, with
the writer's own cleanup switched off, so nothing is tidied up that a kill would leave;
and once a real SIGKILL of a CLI process); no step depends on timing.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from test_watch import _step

from ckptctl.formats.manifest import MANIFEST, WRITING_MARKER, Manifest
from ckptctl.formats.pack import PACK_INDEX, REROOT_SUFFIX, reroot_stage
from ckptctl.tiering.gc import gc
from ckptctl.tiering.policy import Policy
from ckptctl.tiering.promote import promote
from ckptctl.integrity.verify import verify

ROOT = Path(__file__).resolve().parent.parent
STEPS = list(range(10, 110, 10))
#: the re-root's durable steps (ckptctl.packs.reroot._reached), in order
SEAMS = ["staged", "marked", "cleared", "placed", "committed", "unmarked", "unsealed-stage"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


class Tier:
    """A hot folder of plain DCP checkpoints and a pack tier built from them by promote,
    on the local disk or in one S3 bucket."""

    def __init__(self, tmp_path: Path, bucket=None):
        self.tmp, self.bucket = tmp_path, bucket
        self.hot = tmp_path / "hot"
        self.opts = bucket.storage_options if bucket else None
        self.root = bucket.url("cold") if bucket else str(tmp_path / "cold")

    def url(self, name: str) -> str:
        return f"{self.root}/{name}"

    def config(self, **extra) -> Path:
        """``ckptctl.toml``: hot, then the pack tier with ``keep = {last = 4}``."""
        cold = {"name": "cold", "url": self.root, "pack": True, "keep": "{ last = 4 }",
                **extra}
        if self.bucket:
            o = self.opts
            cold["storage_options"] = "{ " + ", ".join(
                f"{k} = {json.dumps(v)}" for k, v in o.items() if not isinstance(v, dict)) + " }"
        lines = ["[[tier]]", 'name = "hot"', f'url = "{self.hot}"', "", "[[tier]]"]
        lines += [f"{k} = {json.dumps(v) if isinstance(v, str) and not v.startswith('{') else v}"
                  if not isinstance(v, bool) else f"{k} = {'true' if v else 'false'}"
                  for k, v in cold.items()]
        path = self.tmp / "ckptctl.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def build(self, steps=STEPS, **kw) -> dict[int, dict]:
        """Promote a DCP checkpoint per step into the tier (as watch does); the packs'
        depths and bases by step."""
        out = {}
        for s in steps:
            _step(self.hot, s)
            r = promote(str(self.hot / f"step-{s}"), self.url(f"step-{s}"),
                        dst_options=self.opts, pack=True, **kw)
            out[s] = r.pack
        return out

    def names(self) -> list[str]:
        """The checkpoints in the tier (folders holding a manifest), and nothing else."""
        if not self.bucket:
            return sorted(p.name for p in Path(self.root).iterdir())
        fs = self.bucket.fs()
        keys = fs.find(self.bucket.path("cold"))
        return sorted({k.split("/")[2] for k in keys})

    def source_id(self, step: int) -> str:
        return Manifest.parse((self.hot / f"step-{step}" / MANIFEST).read_bytes(), "m").id

    def restores(self, url: str, step: int, out: Path) -> None:
        """The pack at ``url`` unpacks to exactly the original step's files and id."""
        from ckptctl.packs.unpack import unpack

        u = unpack(url, str(out), storage_options=self.opts, workers=1)
        assert u.manifest_id == self.source_id(step), url
        assert _files(out) == _files(self.hot / f"step-{step}"), url

    def all_restore(self, steps, out: Path, *, staged_ok: bool = False) -> None:
        """Every checkpoint of ``steps`` restores, from its pack, or (``staged_ok``: a
        re-root cut short) from the committed copy staged beside it."""
        for s in steps:
            url = self.url(f"step-{s}")
            try:
                self.restores(url, s, out / f"step-{s}")
            except Exception:
                if not staged_ok:
                    raise
                self.restores(reroot_stage(url), s, out / f"staged-{s}")




def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.fixture(params=["local", "s3"])
def tier(request, tmp_path):
    """No ``AWS_*`` variables: every request must carry the tier's storage options."""
    if request.param == "local":
        return Tier(tmp_path)
    return Tier(tmp_path, request.getfixturevalue("s3_bucket"))


def _json(*args: str, code: int = 0) -> dict:
    got, out, err = run_cli(*args, "--json")
    assert got == code, (args, got, out, err)
    return json.loads(out)


# --------------------------------------------------------------------------- the issue


def test_a_pack_tier_keeping_4_holds_4(tier, tmp_path):
    """10 hops: step-10 full, step-20..90 each a delta of the one before (depth 1..8),
    step-100 full (past the chain limit). keep last 4 kept all 10 (the chain of step-70);
    now gc re-roots step-70 as a full pack and the tier holds 4, each restoring byte for
    byte; the dry run said so first, and a rerun has nothing left to do."""
    packs = tier.build()
    assert [packs[s]["depth"] for s in STEPS] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 0]
    cfg = str(tier.config())
    before = tier.names()
    assert before == sorted(f"step-{s}" for s in STEPS)

    plan = _json("--config", cfg, "gc", "cold:", "--dry-run")
    assert [(r["name"], r["base_name"], r["depth"], r["action"]) for r in plan["reroots"]] \
        == [("step-70", None, 0, "would re-root")]
    assert plan["reroots"][0]["base_was"] == ["step-60"]
    gone = [f"step-{s}" for s in (60, 50, 40, 30, 20, 10)]
    assert plan["reroots"][0]["frees"] == gone and plan["remove"] == gone
    assert list(plan["keep"]) == ["step-100", "step-90", "step-80", "step-70"]
    assert plan["max_checkpoints"] == 4 and plan["holds"] == (
        "holds at most 4 checkpoints (keep the last 4; packs kept only as bases are "
        "re-rooted)")
    assert tier.names() == before  # a dry run changes nothing
    code, out, err = run_cli("--config", cfg, "gc", "cold:", "--dry-run")
    assert code == 0, err
    assert "would re-root step-70 as a full pack (its base step-60 is kept only for it)" in out
    assert "holds at most 4 checkpoints" in out

    done = _json("--config", cfg, "gc", "cold:")
    assert [(r["name"], r["action"], r["depth"]) for r in done["reroots"]] == \
        [("step-70", "re-rooted", 0)]
    assert done["keep"] == plan["keep"] and done["remove"] == plan["remove"]
    assert tier.names() == ["step-100", "step-70", "step-80", "step-90"]
    tier.all_restore((70, 80, 90, 100), tmp_path / "out")
    for s in (70, 80, 90, 100):
        v = verify(tier.url(f"step-{s}"), tier.opts, level="full")
        assert v.ok and v.content == "hashes", (s, v.problems)

    again = _json("--config", cfg, "gc", "cold:")
    assert again["reroots"] == [] and again["remove"] == []
    assert tier.names() == ["step-100", "step-70", "step-80", "step-90"]


def test_without_reroot_the_chain_stays(tmp_path):
    """``--no-reroot`` (and gc of a plain folder, its default) keeps the old rail: a kept
    pack keeps its whole chain; the dry run says how much that can be."""
    t = Tier(tmp_path)
    t.build()
    cfg = str(t.config())
    doc = _json("--config", cfg, "gc", "cold:", "--no-reroot", "--dry-run")
    assert doc["remove"] == [] and doc["reroots"] == [] and doc["max_checkpoints"] is None
    assert doc["holds"].startswith("holds at most 36 checkpoints")
    plain = gc(t.root, Policy(last=4))
    assert plain.reroots == [] and len(t.names()) == 10


def test_reroot_against_an_older_kept_checkpoint(tmp_path):
    """keep last 3 and every 40 steps keeps 100, 90, 80 and 40, 10: step-40 (a delta of
    30) is re-rooted against step-10, then step-80 (a delta of 70) against the re-rooted
    step-40, oldest first, each within the chain limit and its own old depth; 70, 60, 50,
    30, 20 go; the five left restore."""
    t = Tier(tmp_path)
    t.build()
    policy = Policy(last=3, every=40)
    plan = gc(t.root, policy, dry_run=True, reroot=True)
    assert [(r.name, r.base, r.depth) for r in plan.reroots] == \
        [("step-40", "step-10", 1), ("step-80", "step-40", 2)]
    assert plan.decision.remove == ["step-70", "step-60", "step-50", "step-30", "step-20"]
    assert plan.max_checkpoints is None  # every N grows with the run
    done = gc(t.root, policy, reroot=True)
    assert [(r.name, r.action, r.depth) for r in done.reroots] == \
        [("step-40", "re-rooted", 1), ("step-80", "re-rooted", 2)]
    assert t.names() == ["step-10", "step-100", "step-40", "step-80", "step-90"]
    t.all_restore((10, 40, 80, 90, 100), tmp_path / "out")


def test_a_reroot_keeps_the_pin_and_the_users_files(tmp_path):
    """Only the pack's own files are replaced: a pin and a user's file in the folder stay
    (so it stays pinned, and gc still names the file)."""
    from ckptctl.tiering.pins import pin

    t = Tier(tmp_path)
    t.build()
    seventy = Path(t.url("step-70"))
    pin(str(seventy), "paper")
    (seventy / "NOTES.md").write_text("lr spike at 65\n")
    r = gc(t.root, Policy(last=4), reroot=True)
    assert [(x.name, x.action) for x in r.reroots] == [("step-70", "re-rooted")]
    assert t.names() == ["step-100", "step-70", "step-80", "step-90"]
    assert (seventy / ".ckptctl-pinned").exists()
    assert (seventy / "NOTES.md").read_text() == "lr spike at 65\n"
    assert r.decision.keep["step-70"][:2] == ["last 4", "pinned"]
    t.all_restore((70, 80, 90, 100), tmp_path / "out")


def test_a_reroot_that_fails_keeps_the_chain(tmp_path, monkeypatch):
    """A re-root refused (here: the pack writer says the checkpoint is damaged) leaves the
    pack and its whole chain; gc says so and exits 1 (the count is not exact)."""
    from ckptctl.errors import Finding

    t = Tier(tmp_path)
    t.build()
    cfg = str(t.config())

    def refuse(url, **kw):
        raise Finding(url, "content hash differs from the source manifest", code="HASH_MISMATCH")

    monkeypatch.setattr(importlib.import_module("ckptctl.packs.reroot"), "reroot", refuse)
    code, out, err = run_cli("--config", cfg, "gc", "cold:", "--json")
    assert code == 1, err
    doc = json.loads(out)
    assert [(x["name"], x["action"]) for x in doc["reroots"]] == [("step-70", "failed")]
    assert doc["remove"] == [] and len(t.names()) == 10
    assert "could not re-root step-70" in err
    t.all_restore(STEPS, tmp_path / "out")


def test_max_chain_is_a_tier_option(tmp_path):
    """``max_chain = 2`` in the tier: a hop past it gets a full pack (promote to the
    tier), ``tiers`` shows it with what the tier holds; a bad value is refused."""
    t = Tier(tmp_path)
    cfg = str(t.config(max_chain=2))
    depths = []
    for s in STEPS[:5]:
        _step(t.hot, s)
        doc = _json("--config", cfg, "promote", str(t.hot / f"step-{s}"), "cold:")
        depths.append(doc["pack"]["depth"])
    assert depths == [0, 1, 2, 0, 1]
    doc = _json("--config", cfg, "tiers", "--no-check")
    cold = doc["tiers"][1]
    assert (cold["max_chain"], cold["max_checkpoints"]) == (2, 4)
    assert cold["holds"] == ("holds at most 4 checkpoints (keep the last 4; packs kept "
                             "only as bases are re-rooted)")
    code, out, err = run_cli("--config", cfg, "tiers", "--no-check")
    assert code == 0 and "cold: holds at most 4 checkpoints" in out, err
    (tmp_path / "bad.toml").write_text(
        f'[[tier]]\nname = "cold"\nurl = "{t.root}"\nmax_chain = 65\n')
    code, out, err = run_cli("--config", str(tmp_path / "bad.toml"), "tiers", "--no-check")
    assert code == 2 and "max_chain must be a whole number from 0 to 64" in err, err


# --------------------------------------------------------------------------- crashes


class Killed(BaseException):
    """A crash: nothing of ckptctl's catches it."""


def _kill(monkeypatch, seam: str) -> None:
    """Stop the next gc at ``seam`` as a kill would: raised from the re-root step's seam,
    with the writers' clean-up switched off (a kill runs no clean-up); ``removing-bases``:
    in the removal of the third base, after its manifest."""
    if seam == "removing-bases":
        remove_mod = importlib.import_module("ckptctl.writing.removal")
        real, calls = remove_mod.remove_checkpoint, []

        def remove_checkpoint(store, *a, **kw):
            if not store.url.rstrip("/").endswith(REROOT_SUFFIX):  # a base, not the stage
                calls.append(store.url)
            if len(calls) == 3:  # two bases gone, the third stopped after its manifest
                store.write_atomic(WRITING_MARKER, b'{"command": "gc"}\n')
                store.remove(MANIFEST)
                raise Killed("removing-bases")
            return real(store, *a, **kw)

        def remove_batched(store, rows):  # S3: in phases across all, manifests first
            for r in rows:
                r.located[0].write_atomic(WRITING_MARKER, b'{"command": "gc"}\n')
                r.located[0].remove(MANIFEST)
            raise Killed("removing-bases")

        monkeypatch.setattr(remove_mod, "remove_checkpoint", remove_checkpoint)
        monkeypatch.setattr(importlib.import_module("ckptctl.tiering.gc"), "remove_batched",
                            remove_batched)
        return
    from ckptctl.writing.output import OutputDir

    pack_mod = importlib.import_module("ckptctl.packs.pack")  # the module, not ops.pack()

    monkeypatch.setattr(OutputDir, "_cleanup", lambda self: None)
    if seam == "writing-stage":  # inside the pack writer: data written, no manifest yet
        def commit(*a, **kw):
            raise Killed("writing-stage")

        monkeypatch.setattr(pack_mod, "commit", commit)
        return

    def reached(step, url):
        if step == seam:
            raise Killed(seam)

    monkeypatch.setattr(importlib.import_module("ckptctl.packs.reroot"), "_reached", reached)


@pytest.mark.parametrize("seam", ["writing-stage", *SEAMS, "removing-bases"])
def test_a_kill_anywhere_in_a_reroot_loses_nothing_and_a_rerun_finishes(tier, tmp_path,
                                                                        seam):
    """Stopped at every step of the re-root (and in the removal of the bases after it):
    each of the 10 checkpoints still restores (step-70 from its pack or from the copy
    staged beside it; the packs made against it through it, or through the staged copy
    while it is being replaced); a rerun of gc ends at 4, each restoring."""
    tier.build()
    with pytest.MonkeyPatch.context() as mp:
        _kill(mp, seam)
        with pytest.raises(Killed):
            gc(tier.root, Policy(last=4), tier.opts, reroot=True)

    left = [s for s in STEPS if f"step-{s}" in tier.names()]
    if seam != "removing-bases":
        assert left == STEPS  # nothing is removed before the re-root is done
    elif tier.bucket:  # the manifests of all six bases gone, nothing else yet
        assert left == STEPS
        left = STEPS[6:]
    else:  # oldest first, after the re-root: 10 and 20 gone, 30 stopped mid-way
        assert left == STEPS[2:]
        left = STEPS[3:]
    tier.all_restore(left, tmp_path / "after-kill", staged_ok=True)

    # (a checkpoint half removed reads as incomplete: gc takes it once its grace is over)
    grace = 0 if seam == "removing-bases" else "24h"
    dry = gc(tier.root, Policy(last=4), tier.opts, reroot=True, grace=grace, dry_run=True)
    r = gc(tier.root, Policy(last=4), tier.opts, reroot=True, grace=grace)
    assert dry.decision == r.decision  # the dry run said what the rerun did
    assert tier.names() == ["step-100", "step-70", "step-80", "step-90"], r.to_dict()
    assert list(r.decision.keep) == ["step-100", "step-90", "step-80", "step-70"]
    assert [(x.name, x.action) for x in r.reroots] == RERUN[seam]
    tier.all_restore((70, 80, 90, 100), tmp_path / "after-rerun")
    assert _index_base(tier, "step-70") is None  # a full pack now: its old chain is gone


#: what the rerun after each kill says it did: the staged copy of an unfinished write is
#: cleared and the re-root done again; a committed one is installed (or, installed
#: already, only cleared away)
RERUN = {"writing-stage": [("step-70", "discarded"), ("step-70", "re-rooted")],
         **{seam: [("step-70", "finished")] for seam in SEAMS},
         "unsealed-stage": [("step-70", "discarded")], "removing-bases": []}


def _index_base(tier: Tier, name: str):
    from ckptctl.packs.unpack import open_pack_url

    ps = open_pack_url(tier.url(name), tier.opts)
    try:
        return ps.index.base
    finally:
        ps.close()


def test_a_real_kill_mid_install_then_gc_finishes(tmp_path):
    """A CLI gc SIGKILLed while it replaces step-70's files (after the old ones went,
    before the new ones are placed): step-70 restores from its staged copy, step-80
    through it; the next gc finishes the re-root and removes the old chain."""
    t = Tier(tmp_path)
    t.build()
    cfg = str(t.config())
    code = ("import os, signal, sys\n"
            "import importlib\n"
            "p = importlib.import_module('ckptctl.packs.reroot')\n"
            "def reached(step, url):\n"
            "    if step == 'cleared':\n"
            "        os.kill(os.getpid(), signal.SIGKILL)\n"
            "p._reached = reached\n"
            "from ckptctl.cli.main import main\n"
            "main(sys.argv[1:])\n")
    proc = subprocess.run([sys.executable, "-c", code, "--config", cfg, "gc", "cold:"],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -9, proc.stderr
    files = set(os.listdir(Path(t.root) / "step-70"))
    assert MANIFEST not in files and PACK_INDEX not in files  # mid-way: not a pack
    assert Path(reroot_stage(t.url("step-70")), MANIFEST).exists()  # the committed copy
    t.restores(reroot_stage(t.url("step-70")), 70, tmp_path / "o70")
    t.restores(t.url("step-80"), 80, tmp_path / "o80")  # its base: the staged copy
    t.all_restore((10, 20, 30, 40, 50, 60, 90, 100), tmp_path / "rest")

    plan = _json("--config", cfg, "gc", "cold:", "--dry-run")  # as if it were finished
    assert [(r["name"], r["action"]) for r in plan["reroots"]] == [("step-70", "would finish")]
    assert plan["keep"]["step-70"] == ["last 4", "base of kept step-80"]
    assert plan["remove"] == [f"step-{s}" for s in (60, 50, 40, 30, 20, 10)]
    done = _json("--config", cfg, "gc", "cold:")
    assert [(r["name"], r["action"]) for r in done["reroots"]] == [("step-70", "finished")]
    assert done["keep"] == plan["keep"] and done["remove"] == plan["remove"]
    assert t.names() == ["step-100", "step-70", "step-80", "step-90"]
    t.all_restore((70, 80, 90, 100), tmp_path / "out")


def test_the_chain_limits_agree():
    """The config's default and bound for ``max_chain`` are the pack format's."""
    from ckptctl.tiering import config
    from ckptctl.formats import pack

    assert (config.DEFAULT_MAX_CHAIN, config.MAX_CHAIN_LIMIT) == \
        (pack.DEFAULT_MAX_CHAIN, pack.MAX_DEPTH)
