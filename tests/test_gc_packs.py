"""``gc`` over chains of real delta packs (issue 10: "gc never removes the base of a pack
it keeps"), locally and on the rclone S3 server.

Every pack here is written by :func:`ckptctl.packs.pack.pack` from a small sealed
safetensors checkpoint (written by ``safetensors.numpy``); ``gc`` reads each pack's id
(``packs``) and base (``Manifest.base``) from the pack's own manifest. After every gc,
each kept pack still unpacks byte for byte to its source and passes ``verify --level
full``: the rail is proven by restoring, not by reading the plan alone.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from ckptctl.formats.manifest import MANIFEST, Manifest
from ckptctl.tiering.gc import gc
from ckptctl.tiering.latest import latest
from ckptctl.catalog.ls import ls
from ckptctl.packs.pack import pack
from ckptctl.packs.unpack import unpack
from ckptctl.tiering.pins import pin
from ckptctl.tiering.policy import Policy
from ckptctl.integrity.seal import seal
from ckptctl.integrity.verify import verify

DAY = 86400.0


# --------------------------------------------------------------------------- helpers


def _weights(step: int) -> dict[str, np.ndarray]:
    """A frozen embedding, a trained layer that moves with ``step``, an int buffer."""
    g = np.random.default_rng(0)
    emb = g.standard_normal((64, 32)).astype(np.float32)
    layer = g.standard_normal((32, 32)).astype(np.float16)
    moved = (layer.astype(np.float32) + 1e-2 * np.random.default_rng(step).standard_normal(
        layer.shape)).astype(np.float16)
    return {"emb.weight": emb, "layer.weight": moved,
            "pos": np.arange(16, dtype=np.int64) + step}


def _ckpt(path: Path, step: int) -> Path:
    """A sealed safetensors checkpoint for ``step`` at ``path``."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    save_file(_weights(step), str(path / "model.safetensors"))
    seal(str(path))
    return path


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _names(root: Path) -> list[str]:
    return sorted(str(p.parent.relative_to(root)) for p in root.rglob(MANIFEST))


def _chain(src: Path, run: Path, steps=(100, 200, 300), *, max_chain: int = 8) -> dict:
    """Sources ``src/step-N`` and packs ``run/step-N``, each a delta on the one before
    (the first a full pack); the pack results by step."""
    out, prev = {}, None
    for s in steps:
        _ckpt(src / f"step-{s}", s)
        out[s] = pack(str(src / f"step-{s}"), str(run / f"step-{s}"), workers=1,
                      base=None if prev is None else str(run / f"step-{prev}"),
                      max_chain=max_chain)
        prev = s
    return out


def _restores(pack_url: str, source: Path, out: Path, opts: dict | None = None) -> None:
    """The pack unpacks to exactly the source's files, and verifies at level full."""
    u = unpack(pack_url, str(out), storage_options=opts, workers=1)
    assert _files(out) == _files(source), pack_url
    assert u.manifest_id == Manifest.parse((source / MANIFEST).read_bytes(), "m").id
    v = verify(pack_url, opts, level="full")
    assert v.ok and v.content == "hashes", (pack_url, v.problems)


def _base_id(p: Path) -> str | None:
    return Manifest.parse((p / MANIFEST).read_bytes(), "m").base


# --------------------------------------------------------------------------- local


def test_keep_last_keeps_the_whole_chain_of_the_kept_pack(tmp_path, cli):
    """step-100 (full) <- step-200 <- step-300, plain checkpoints between them: keeping
    the last 1 keeps the pack and, by the rail, its bases down the chain; the plan of a
    dry run is what the real run (through the CLI) then does."""
    src, run = tmp_path / "src", tmp_path / "run"
    packs = _chain(src, run)
    assert [packs[s].depth for s in (100, 200, 300)] == [0, 1, 2]
    assert _base_id(run / "step-300") == packs[200].source_id  # the pack's source, not its files
    assert _base_id(run / "step-200") == packs[100].source_id and _base_id(run / "step-100") is None
    for s in (150, 250):
        _ckpt(run / f"step-{s}", s)
    (run / "step-50").mkdir()  # complete, never sealed: no id, no base
    from safetensors.numpy import save_file

    save_file(_weights(50), str(run / "step-50" / "model.safetensors"))
    before = {n: _files(run / n) for n in _names(run)}

    plan = gc(str(run), Policy(last=1), dry_run=True)
    keep = {"step-300": ["last 1", "newest committed"],
            "step-200": ["base of kept step-300"],
            "step-100": ["base of kept step-200"]}
    assert plan.decision.keep == keep
    assert plan.decision.remove == ["step-250", "step-150", "step-50"]
    assert {n: _files(run / n) for n in _names(run)} == before  # a dry run touches nothing

    code, out, err = cli("gc", str(run), "--keep-last", "1", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["keep"] == keep and doc["remove"] == plan.decision.remove
    assert doc["checkpoints"] == plan.to_dict()["checkpoints"]
    by = {c["name"]: c for c in doc["checkpoints"]}
    assert by["step-100"]["reasons"] == ["base of kept step-200"] and by["step-100"]["action"] == "keep"
    assert by["step-150"]["action"] == "remove" and by["step-150"]["reasons"] == []
    assert sorted(p.name for p in run.iterdir()) == ["step-100", "step-200", "step-300"]
    for n in ("step-100", "step-200", "step-300"):  # kept ones untouched, byte for byte
        assert _files(run / n) == before[n]
        _restores(str(run / n), src / n, tmp_path / "out" / n)
    code, out, err = cli("gc", str(run), "--keep-last", "1")
    assert code == 0 and "0 removed" in out and "base of kept step-200" in out, (out, err)


def test_a_plain_sealed_base_is_kept_for_its_pack(tmp_path):
    run = tmp_path / "run"
    base = _ckpt(run / "step-100", 100)  # a plain checkpoint, the base of a pack
    _ckpt(tmp_path / "src" / "step-200", 200)
    r = pack(str(tmp_path / "src" / "step-200"), str(run / "step-200"), base=str(base),
             workers=1)
    assert r.depth == 1 and r.base == Manifest.parse((base / MANIFEST).read_bytes(), "m").id
    _ckpt(run / "step-150", 150)
    d = gc(str(run), Policy(last=1))
    assert d.decision.keep == {"step-200": ["last 1", "newest committed"],
                               "step-100": ["base of kept step-200"]}
    assert d.decision.remove == ["step-150"] and _names(run) == ["step-100", "step-200"]
    _restores(str(run / "step-200"), tmp_path / "src" / "step-200", tmp_path / "out")


def test_a_base_in_another_series_is_kept(tmp_path):
    """runs/a holds the base, runs/b the pack: each run keeps its own newest, and the
    base in run a is kept for run b's pack (pack bases are followed across series)."""
    root = tmp_path / "runs"
    _ckpt(root / "a" / "step-100", 100)
    _ckpt(root / "a" / "step-150", 150)
    _ckpt(root / "a" / "step-120", 120)
    _ckpt(tmp_path / "src" / "step-200", 200)
    pack(str(tmp_path / "src" / "step-200"), str(root / "b" / "step-200"),
         base=str(root / "a" / "step-100"), workers=1)
    d = gc(str(root), Policy(last=1))
    assert d.decision.keep == {"b/step-200": ["last 1", "newest committed"],
                               "a/step-150": ["last 1", "newest committed"],
                               "a/step-100": ["base of kept b/step-200"]}
    assert d.decision.remove == ["a/step-120"]
    _restores(str(root / "b" / "step-200"), tmp_path / "src" / "step-200", tmp_path / "out")
    # gc of run b alone does not see its base (outside the root): nothing to keep there,
    # nothing to crash on
    d = gc(str(root / "b"), Policy(last=1))
    assert d.decision.keep == {"step-200": ["last 1", "newest committed"]}
    assert d.decision.remove == [] and _names(root / "a") == ["step-100", "step-150"]


MISSING = "its base is missing (restore with unpack --base, or rm)"


def test_a_chain_broken_by_hand(tmp_path, cli):
    """step-200 (the middle of the chain) deleted by hand: step-300 cannot be restored
    from here, so it is incomplete (MISSING_BASE, naming the base) for ls, latest, verify
    and gc; the newest restorable checkpoint (step-250) is the newest committed. gc keeps
    the broken pack (its own files are whole: it restores once its base is named) and
    removes what nothing kept needs."""
    src, run = tmp_path / "src", tmp_path / "run"
    _chain(src, run)
    _ckpt(run / "step-250", 250)
    shutil.rmtree(run / "step-200")
    for now in (None, time.time() + 2 * DAY):  # also once the grace period is long past
        d = gc(str(run), Policy(last=1), dry_run=True, now=now)
        assert d.decision.keep == {"step-300": [MISSING],
                                   "step-250": ["last 1", "newest committed"]}, d.decision
        assert d.decision.remove == ["step-100"]
    row = {r.name: r for r in ls(str(run)).checkpoints}["step-300"]
    assert row.state == "incomplete" and row.reason.startswith("MISSING_BASE"), row
    assert "step-200" in row.reason
    assert latest(str(run)).name == "step-250"
    for level in ("quick", "structure", "full"):
        code, out, err = cli("verify", str(run / "step-300"), "--level", level, "--json")
        assert code == 1 and "MISSING_BASE" in out, (level, code, out, err)
    code, out, err = cli("gc", str(run), "--keep-last", "1", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["remove"] == ["step-100"] and _names(run) == ["step-250", "step-300"]
    # the pack itself says what it needs
    code, out, err = cli("unpack", str(run / "step-300"), str(tmp_path / "out"))
    assert code != 0 and "base" in err and "not found" in err, (code, err)
    # with its base restored elsewhere and named, it still restores
    pack(str(src / "step-200"), str(tmp_path / "elsewhere" / "step-200"), workers=1)
    unpack(str(run / "step-300"), str(tmp_path / "out2"), base=str(tmp_path / "elsewhere" /
                                                                    "step-200"), workers=1)
    assert _files(tmp_path / "out2") == _files(src / "step-300")


def test_a_chain_broken_at_its_root_keeps_the_rest(tmp_path):
    """step-100 (the full pack at the root of the chain) deleted by hand: neither
    step-200 nor step-300 restores from here, so both are incomplete and there is no
    newest committed; gc keeps both (their own files are whole), also long after the
    grace period."""
    src, run = tmp_path / "src", tmp_path / "run"
    _chain(src, run)
    shutil.rmtree(run / "step-100")
    for now in (None, time.time() + 2 * DAY):
        d = gc(str(run), Policy(last=1), dry_run=True, now=now)
        assert d.decision.keep == {"step-300": [MISSING], "step-200": [MISSING]}, d.decision
        assert d.decision.remove == []
    assert latest(str(run)).url is None
    # put the root back elsewhere: the chain restores through --base on the middle
    pack(str(src / "step-100"), str(tmp_path / "elsewhere" / "step-100"), workers=1)
    unpack(str(run / "step-200"), str(tmp_path / "out"), base=str(tmp_path / "elsewhere" /
                                                                   "step-100"), workers=1)
    assert _files(tmp_path / "out") == _files(src / "step-200")


def test_removing_the_newest_pack_frees_its_bases(tmp_path):
    src, run = tmp_path / "src", tmp_path / "run"
    _chain(src, run)
    for s in (400, 500):
        _ckpt(run / f"step-{s}", s)
    plan = gc(str(run), Policy(last=2), dry_run=True)
    done = gc(str(run), Policy(last=2), now=plan.now)
    assert plan.decision == done.decision
    assert done.decision.keep == {"step-500": ["last 2", "newest committed"],
                                  "step-400": ["last 2"]}
    assert done.decision.remove == ["step-300", "step-200", "step-100"]
    assert _names(run) == ["step-400", "step-500"]


def test_pinned_packs_and_bases(tmp_path):
    """A pinned base alone keeps only itself; a pinned pack keeps its chain."""
    src, run = tmp_path / "src", tmp_path / "run"
    _chain(src, run)
    _ckpt(run / "step-400", 400)
    pin(str(run / "step-200"), "paper")
    d = gc(str(run), Policy(last=1))
    assert d.decision.keep == {"step-400": ["last 1", "newest committed"],
                               "step-200": ["pinned"],
                               "step-100": ["base of kept step-200"]}
    assert d.decision.remove == ["step-300"]
    _restores(str(run / "step-200"), src / "step-200", tmp_path / "out")

    run2 = tmp_path / "run2"
    _chain(tmp_path / "src2", run2)
    _ckpt(run2 / "step-400", 400)
    pin(str(run2 / "step-300"), "best")
    pin(str(run2 / "step-100"), "first")
    d = gc(str(run2), Policy(last=1))
    assert d.decision.keep == {"step-400": ["last 1", "newest committed"],
                               "step-300": ["pinned"],
                               "step-200": ["base of kept step-300"],
                               "step-100": ["pinned", "base of kept step-200"]}
    assert d.decision.remove == [] and len(_names(run2)) == 4


def test_max_chain_full_pack_frees_its_predecessors(tmp_path):
    """--max-chain 1 makes step-300 a full pack: step-400 (a delta on it) needs it, but
    nothing needs step-200 or step-100 any more."""
    src, run = tmp_path / "src", tmp_path / "run"
    packs = _chain(src, run, (100, 200, 300), max_chain=1)
    assert packs[300].base is None and "max-chain 1" in packs[300].full_reason
    _ckpt(src / "step-400", 400)
    r = pack(str(src / "step-400"), str(run / "step-400"), base=str(run / "step-300"),
             workers=1, max_chain=1)
    assert r.depth == 1 and _base_id(run / "step-300") is None
    d = gc(str(run), Policy(last=1))
    assert d.decision.keep == {"step-400": ["last 1", "newest committed"],
                               "step-300": ["base of kept step-400"]}
    assert d.decision.remove == ["step-200", "step-100"]
    for n in ("step-300", "step-400"):
        _restores(str(run / n), src / n, tmp_path / "out" / n)


def test_a_pack_and_a_plain_copy_of_one_checkpoint(tmp_path):
    """A restored copy has the pack's checkpoint id: a kept delta on that id keeps every
    committed copy of its base it can see (never fewer than one)."""
    src, run = tmp_path / "src", tmp_path / "run"
    _chain(src, run, (100, 200))
    shutil.copytree(src / "step-100", run / "copy" / "step-100")
    _ckpt(run / "copy" / "step-150", 150)
    d = gc(str(run), Policy(last=1))
    assert d.decision.keep["step-100"] == ["base of kept step-200"]
    assert d.decision.keep["copy/step-100"] == ["base of kept step-200"]


# --------------------------------------------------------------------------------- S3


def _o(bucket) -> list[str]:
    o = bucket.storage_options
    return [f"--storage-option=endpoint_url={o['endpoint_url']}",
            f"--storage-option=key={o['key']}", f"--storage-option=secret={o['secret']}"]


def test_chain_on_s3(tmp_path, s3_bucket, cli):
    opts = s3_bucket.storage_options
    src = tmp_path / "src"
    prev = None
    for s in (100, 200, 300):
        _ckpt(src / f"step-{s}", s)
        pack(str(src / f"step-{s}"), s3_bucket.url(f"run/step-{s}"), workers=1,
             base=prev, base_storage_options=opts, dst_storage_options=opts)
        prev = s3_bucket.url(f"run/step-{s}")
    for s in (150, 250):
        _ckpt(tmp_path / "plain" / f"step-{s}", s)
    s3_bucket.upload(tmp_path / "plain", "run")
    url = s3_bucket.url("run")
    code, out, err = cli("gc", url, "--keep-last", "1", "--dry-run", "--json", *_o(s3_bucket))
    assert code == 0, err
    plan = json.loads(out)
    code, out, err = cli("gc", url, "--keep-last", "1", "--json", *_o(s3_bucket))
    assert code == 0, err
    doc = json.loads(out)
    assert doc["keep"] == plan["keep"] == {"step-300": ["last 1", "newest committed"],
                                           "step-200": ["base of kept step-300"],
                                           "step-100": ["base of kept step-200"]}
    assert doc["remove"] == plan["remove"] == ["step-250", "step-150"]
    left = {p.split("/run/")[1].split("/")[0] for p in s3_bucket.fs().find(s3_bucket.path("run"))}
    assert left == {"step-100", "step-200", "step-300"}
    _restores(s3_bucket.url("run/step-300"), src / "step-300", tmp_path / "out", opts)
