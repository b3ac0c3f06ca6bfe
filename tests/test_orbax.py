"""Orbax checkpoints read without JAX or Orbax (ckptctl/formats/orbax.py, issue 39), against
the fixtures orbax-checkpoint itself wrote and its own restore (tests/fixtures_orbax.py):
inspect lists exactly what orbax restores, consolidate to safetensors and reshard to DCP
give its bytes bit for bit, ls/latest see a CheckpointManager's steps and its saves in
flight, and a hostile ``_METADATA`` is one line, exit 3."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures_orbax import NAMES, TMP_SUFFIX, safetensors_entries


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def _inspect(cli, path) -> dict:
    code, out, err = cli("inspect", str(path), "--json")
    assert code == 0, err
    return json.loads(out)


def _code(a) -> str:
    from ckptctl.model import DTYPES

    return DTYPES[a.dtype.name].safetensors


# ------------------------------------------------------------------ inspect


@pytest.mark.parametrize("name", NAMES)
def test_inspect_lists_what_orbax_restores(orbax_ckpts, cli, name):
    oracle = orbax_ckpts.oracle(name)
    places = {orbax_ckpts.item(name), orbax_ckpts.step_dir(name)}
    if orbax_ckpts.step_dir(name).name.endswith(TMP_SUFFIX):  # its item is finished, it not
        places.remove(orbax_ckpts.step_dir(name))
        code, out, err = cli("inspect", str(orbax_ckpts.step_dir(name)), "--json")
        assert (code, json.loads(out)["error"]["code"]) == (3, "NOT_COMMITTED"), err
    for where in places:
        doc = _inspect(cli, where)
        assert doc["format"] == "orbax"
        got = {t["name"]: (t["dtype"], tuple(t["shape"])) for t in doc["tensors"]}
        assert got == {k: (a.dtype.name, a.shape) for k, a in oracle.items()}, where
        assert doc["num_objects"] == 0
        assert any("opt_state.1" in n for n in doc["notes"]), doc["notes"]  # EmptyState
        if name.startswith(("manager", "inflight")):
            assert (doc["step"], doc["step_source"]) == (int(name.split("-")[1]), "name")
    parts = {t["name"]: t["part"] for t in doc["tensors"]}
    assert parts["params.embed.embedding"] == "model" and parts["step"] == "step"
    assert parts["opt_state.0.mu.embed.embedding"] == "optim" and parts["rng"] == "rng"


def test_inspect_tells_the_layouts_apart(orbax_ckpts, cli):
    want = {"standard": "OCDBT + zarr2", "zarr3": "OCDBT + zarr3", "plain": "zarr2"}
    for name, origin in want.items():
        assert _inspect(cli, orbax_ckpts.item(name))["origin"] == origin
    doc = _inspect(cli, orbax_ckpts.item("manager-20"))
    emb = next(t for t in doc["tensors"] if t["name"] == "params.embed.embedding")
    assert (emb["num_chunks"], emb["sharded_dims"]) == (2, [0])  # one zarr chunk per shard


# a fresh interpreter: inspect and consolidate, then say which modules were imported
NO_JAX = r"""
import json, sys
from ckptctl.cli.main import main

codes = []
for args in json.loads(sys.argv[1]):
    try:
        main(args)
    except SystemExit as e:
        codes.append(e.code)
print(json.dumps({"codes": codes, "mods": sorted(m for m in sys.modules
                  if m.split(".")[0] in ("jax", "jaxlib", "orbax", "optax", "flax",
                                         "tensorstore"))}))
"""


def _run(script: str, *args, env=None) -> tuple[int, dict, str]:
    p = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                       timeout=120, env=env)
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "{}"
    return p.returncode, json.loads(last), p.stderr


def test_inspect_and_consolidate_never_import_jax_or_orbax(orbax_ckpts, tmp_path):
    item = str(orbax_ckpts.item("manager-20"))
    jobs = [["inspect", item, "--json"],
            ["consolidate", item, str(tmp_path / "out"), "--to", "safetensors"]]
    rc, rep, err = _run(NO_JAX, json.dumps(jobs))
    assert rc == 0 and rep["codes"] == [0, 0], err
    assert rep["mods"] and {m.split(".")[0] for m in rep["mods"]} == {"tensorstore"}, rep


def test_ls_latest_and_a_quick_verify_never_import_tensorstore(orbax_ckpts):
    """They judge a step by its files (commit time, markers, _METADATA): tensorstore's
    import alone is 0.6 s."""
    root, step = str(orbax_ckpts.manager), str(orbax_ckpts.step_dir("manager-20"))
    jobs = [["ls", root, "--json"], ["latest", root], ["verify", step, "--level", "quick"]]
    rc, rep, err = _run(NO_JAX, json.dumps(jobs))
    assert rc == 0 and rep["codes"] == [0, 0, 0], err
    assert not rep["mods"], rep


HIDE_TENSORSTORE = r"""
import sys
sys.modules["tensorstore"] = None  # as if it were not installed
""" + NO_JAX


def test_without_tensorstore(orbax_ckpts, tmp_path):
    """OCDBT needs tensorstore even to list the arrays: one line naming the extra, exit 3.
    A per-array folder's metadata are plain files: inspect works without it."""
    jobs = [["inspect", str(orbax_ckpts.item("standard"))],
            ["inspect", str(orbax_ckpts.item("plain"))],
            ["consolidate", str(orbax_ckpts.item("plain")), str(tmp_path / "o"),
             "--to", "safetensors"]]
    rc, rep, err = _run(HIDE_TENSORSTORE, json.dumps(jobs))
    assert rc == 0 and rep["codes"] == [3, 0, 3], (rep, err)
    lines = [ln for ln in err.splitlines() if ln.startswith("ckptctl: error:")]
    assert len(lines) == 2 and all("pip install 'ckptctl[orbax]'" in ln for ln in lines), err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ data, bit for bit


@pytest.mark.parametrize("name", NAMES)
def test_consolidate_to_safetensors_equals_orbax_restore(orbax_ckpts, cli, tmp_path, name):
    out = tmp_path / "hf"
    code, _, err = cli("consolidate", str(orbax_ckpts.item(name)), str(out),
                       "--to", "safetensors")
    assert code == 0, err
    got = safetensors_entries(out / "model.safetensors")
    oracle = orbax_ckpts.oracle(name)
    assert sorted(got) == sorted(oracle)
    for k, a in oracle.items():
        # raw bytes compared: bf16 as its bits, never through a float conversion
        assert got[k] == (_code(a), a.shape, a.tobytes()), k


def test_consolidate_only_the_model(orbax_ckpts, cli, tmp_path):
    code, _, err = cli("consolidate", str(orbax_ckpts.step_dir("manager-10")),
                       str(tmp_path / "m"), "--to", "safetensors", "--only", "model")
    assert code == 0, err
    (f,) = (tmp_path / "m").glob("*.safetensors")
    names = set(safetensors_entries(f))
    assert "params.embed.embedding" in names
    assert not {n for n in names if n.startswith("opt_state") or n in ("step", "rng")}


@pytest.mark.parametrize("name", ["manager-20", "zarr3", "plain"])
def test_reshard_to_dcp_loads_back_as_orbax_restore(orbax_ckpts, cli, tmp_path, name):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "dcp"
    code, _, err = cli("reshard", str(orbax_ckpts.item(name)), str(out), "--world-size", "2")
    assert code == 0, err
    assert sorted(p.name for p in out.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    dcp_to_torch_save(str(out), str(tmp_path / "sd.pt"))
    sd = torch.load(tmp_path / "sd.pt", weights_only=True)
    oracle = orbax_ckpts.oracle(name)
    assert sorted(sd) == sorted(oracle)
    for k, a in oracle.items():
        t = sd[k]
        assert (str(t.dtype).removeprefix("torch."), tuple(t.shape)) == (a.dtype.name, a.shape), k
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert raw == a.tobytes(), k


# ------------------------------------------------------------------ ls / latest


def test_ls_and_latest_of_a_checkpoint_manager(orbax_ckpts, cli):
    code, out, err = cli("ls", str(orbax_ckpts.manager), "--json")
    assert code == 0, err
    rows = [(r["name"], r["step"], r["format"], r["state"])
            for r in json.loads(out)["checkpoints"]]
    assert rows == [("10", 10, "orbax", "complete"), ("20", 20, "orbax", "complete")]
    code, out, err = cli("latest", str(orbax_ckpts.manager))
    assert code == 0, err
    assert out.strip().rstrip("/").endswith("manager/20")


def test_saves_in_flight_are_incomplete_and_never_latest(orbax_ckpts, cli):
    root = orbax_ckpts.inflight
    code, out, err = cli("ls", str(root), "--json")
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)["checkpoints"]}
    assert {n: (r["step"], r["state"]) for n, r in rows.items()} == {
        "10": (10, "complete"), f"20{TMP_SUFFIX}": (20, "incomplete"),
        f"30{TMP_SUFFIX}": (30, "incomplete")}
    assert "NOT_COMMITTED" in rows[f"30{TMP_SUFFIX}"]["reason"]
    code, out, err = cli("latest", str(root))
    assert code == 0, err
    assert out.strip().rstrip("/").endswith("inflight/10")
    code, out, err = cli("inspect", str(root / f"30{TMP_SUFFIX}"))
    assert (code, out) == (3, "") and "temporary folder" in _one_line(err)


def test_a_manager_root_is_several_checkpoints(orbax_ckpts, cli):
    code, out, err = cli("inspect", str(orbax_ckpts.manager))
    assert code == 2 and "holds 2 checkpoints (10, 20)" in _one_line(err)


# ------------------------------------------------------------------ hostile input


def _copy(orbax_ckpts, name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(orbax_ckpts.item(name), dst)
    for p in [dst, *dst.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst


@pytest.mark.parametrize("bad", ["..", "/etc/passwd", "../../outside"])
def test_a_hostile_name_in_metadata_is_one_line(orbax_ckpts, cli, tmp_path, bad):
    item = _copy(orbax_ckpts, "standard", tmp_path)
    meta = json.loads((item / "_METADATA").read_text())
    rec = meta["tree_metadata"]["('step',)"]
    rec["key_metadata"] = [{"key": bad, "key_type": 2}]
    (item / "_METADATA").write_text(json.dumps(meta))
    for args in (("inspect", str(item)),
                 ("consolidate", str(item), str(tmp_path / "out"), "--to", "safetensors")):
        code, out, err = cli(*args)
        assert (code, out) == (3, ""), (args, err)
        line = _one_line(err)
        assert "_METADATA" in line and "not a plain name inside the checkpoint" in line, line
    assert not (tmp_path / "out").exists()


def test_an_absurd_shape_is_one_line(orbax_ckpts, cli, tmp_path):
    item = _copy(orbax_ckpts, "plain", tmp_path)
    za = item / "params.embed.embedding" / ".zarray"
    doc = json.loads(za.read_text())
    doc["shape"] = [2 ** 40, 2 ** 40]
    za.write_text(json.dumps(doc))
    code, out, err = cli("inspect", str(item))
    assert (code, out) == (3, "") and "absurdly large" in _one_line(err), err


def test_a_damaged_chunk_is_one_line_and_a_full_verify_finds_it(orbax_ckpts, cli, tmp_path):
    item = _copy(orbax_ckpts, "plain", tmp_path)
    code, out, err = cli("verify", str(item), "--level", "full", "--json")
    assert code == 0, out  # every chunk decoded; no checksum of Orbax's is checked yet
    assert json.loads(out)["content"] == "decoded-only"
    (item / "params.embed.embedding" / "0.0").write_bytes(b"garbage")
    code, out, err = cli("consolidate", str(item), str(tmp_path / "out"), "--to", "safetensors")
    assert (code, out) == (3, "") and "params.embed.embedding" in _one_line(err), err
    assert cli("verify", str(item), "--level", "structure")[0] == 0  # metadata only
    code, out, err = cli("verify", str(item), "--level", "full", "--json")
    found = [(p["code"], p["entry"]) for p in json.loads(out)["problems"]]
    assert (code, found) == (1, [("MALFORMED_CHUNK", "params.embed.embedding")]), out


def test_a_link_out_of_the_checkpoint_is_refused(orbax_ckpts, cli, tmp_path):
    """tensorstore opens chunk files by path: a link leading out of the root is refused
    before it reads a byte."""
    item = _copy(orbax_ckpts, "plain", tmp_path)
    outside = tmp_path / "outside"
    outside.write_bytes((item / "step" / "0").read_bytes())
    (item / "step" / "0").unlink()
    (item / "step" / "0").symlink_to(outside)
    code, out, err = cli("consolidate", str(item), str(tmp_path / "out"), "--to", "safetensors")
    assert (code, out) == (3, "") and "link points outside" in _one_line(err), err


def test_seal_and_gc_own_every_file_of_a_step(orbax_ckpts, cli, tmp_path):
    """A step owns what Orbax wrote (metadata, OCDBT trees, ``d/`` data files): sealed, its
    manifest lists all of them; gc removes a step whole and keeps the newest."""
    root = tmp_path / "run"
    shutil.copytree(orbax_ckpts.manager, root)
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    on_disk = sorted(str(p.relative_to(root / "20")) for p in (root / "20").rglob("*")
                     if p.is_file())
    code, out, err = cli("seal", str(root / "20"))
    assert code == 0, err
    listed = json.loads((root / "20" / "ckptctl.manifest.json").read_text())["files"]
    assert sorted(listed) == on_disk
    code, out, err = cli("verify", str(root / "20"), "--level", "full", "--json")
    assert code == 0 and json.loads(out)["content"] == "hashes", out
    code, out, err = cli("gc", str(root), "--keep-last", "1")
    assert code == 0, err
    assert sorted(p.name for p in root.iterdir()) == ["20"]


def test_a_flipped_byte_in_a_sealed_steps_data_is_found(orbax_ckpts, cli, tmp_path):
    """Orbax's zstd chunks carry no checksum (OCDBT's crc32c covers its tree nodes only),
    so an unsealed step's flipped data byte may decode to other values: verify says
    ``decoded-only``, never more. Sealed, every file has its hash: the flip is found."""
    step = tmp_path / "20"
    shutil.copytree(orbax_ckpts.step_dir("manager-20"), step)
    for p in [step, *step.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    code, out, err = cli("verify", str(step), "--level", "full", "--json")
    assert code == 0 and json.loads(out)["content"] == "decoded-only", out + err
    assert cli("seal", str(step))[0] == 0
    data = max((p for p in step.rglob("*") if p.is_file() and "/d/" in str(p)),
               key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x10
    data.write_bytes(bytes(raw))
    code, out, err = cli("verify", str(step), "--level", "full", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["content"] == "hashes", out + err
    assert [p["code"] for p in doc["problems"]] == ["HASH_MISMATCH"], out


def test_a_pack_of_a_step_unpacks_byte_for_byte_and_says_why_it_is_not_read_in_place(
        orbax_ckpts, cli, tmp_path):
    """pack stores an Orbax step's files losslessly (they are zstd already: little
    gain); tensorstore reads files, so the pack is unpacked before its arrays are read."""
    step = tmp_path / "20"
    shutil.copytree(orbax_ckpts.step_dir("manager-20"), step)
    for p in [step, *step.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    assert cli("pack", str(step), str(tmp_path / "cold"))[0] == 0
    code, out, err = cli("inspect", str(tmp_path / "cold"))
    assert (code, out) == (3, "") and "unpack it first" in _one_line(err)
    assert cli("unpack", str(tmp_path / "cold"), str(tmp_path / "back"))[0] == 0
    for p in step.rglob("*"):
        if p.is_file():
            assert (tmp_path / "back" / p.relative_to(step)).read_bytes() == p.read_bytes()
    code, out, err = cli("diff", str(step), str(tmp_path / "back"))
    assert code == 0, out + err


def test_diff_against_its_pytorch_export(orbax_ckpts, cli, tmp_path):
    """A step and its safetensors export compare identical; with the export's names
    renamed (an HF-style export without the ``params.`` prefix) through ``--map``."""
    item = orbax_ckpts.item("manager-20")
    hf = tmp_path / "hf"
    assert cli("consolidate", str(item), str(hf), "--to", "safetensors", "--only", "model",
               "--strip-prefix", "params.")[0] == 0
    code, out, err = cli("diff", str(item), str(hf), "--map", "params.=", "--only", "model")
    assert code == 0 and out.startswith("identical"), out + err


@pytest.mark.parametrize("cut", ["manifest", "data"])
def test_a_truncated_ocdbt_file_is_one_line(orbax_ckpts, cli, tmp_path, cut):
    """Half of the merged manifest, or of the largest data file: one line, exit 3 (the
    manifest's own length check, the value past the end of the file); full verify
    reports it as a problem."""
    step = tmp_path / "20"
    shutil.copytree(orbax_ckpts.step_dir("manager-20"), step)
    for p in [step, *step.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    victim = step / "default" / "manifest.ocdbt" if cut == "manifest" else max(
        (step / "default").glob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:victim.stat().st_size // 2])
    code, out, err = cli("consolidate", str(step), str(tmp_path / "out"), "--to", "safetensors")
    assert (code, out) == (3, "") and "OCDBT" in _one_line(err), err
    assert not (tmp_path / "out").exists()
    code, out, err = cli("verify", str(step), "--level", "full", "--json")
    assert code == 1 and json.loads(out)["problems"], out + err


def test_a_zstd_bomb_in_a_chunk_is_one_line_in_bounded_memory(orbax_ckpts, tmp_path):
    """A chunk that inflates to 2 GiB where its array declares 2 KiB: tensorstore decodes
    into the declared chunk and stops there."""
    import zstandard

    item = _copy(orbax_ckpts, "plain", tmp_path)
    z, zeros = zstandard.ZstdCompressor(level=3).compressobj(), bytes(1 << 20)
    bomb = b"".join(z.compress(zeros) for _ in range(2048)) + z.flush()  # 2 GiB of zeros
    (item / "params.embed.embedding" / "0.0").write_bytes(bomb)
    p = subprocess.run([sys.executable, "-c", RSS_OF, "consolidate", str(item),
                        str(tmp_path / "out"), "--to", "safetensors"],
                       capture_output=True, text=True, timeout=300)
    code, peak_kib = (int(x) for x in p.stdout.split())
    assert code == 3 and "params.embed.embedding" in _one_line(p.stderr), p.stderr
    assert peak_kib < 600 << 10, peak_kib  # far below the 2 GiB it would inflate to


RSS_OF = r"""
import resource, subprocess, sys
p = subprocess.run([sys.executable, "-m", "ckptctl", *sys.argv[1:]], stderr=sys.stderr)
print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def test_inspect_says_which_mesh_saved_it(orbax_ckpts, cli):
    """``_sharding`` (the fixture's arrays: a 2-device mesh ``d`` and single devices) is
    shown for information."""
    code, out, err = cli("inspect", str(orbax_ckpts.step_dir("manager-20")), "--json")
    assert code == 0, err
    notes = [n for n in json.loads(out)["notes"] if n.startswith("saved from")]
    assert len(notes) == 1 and "mesh d=2 (" in notes[0] and "one device (" in notes[0], notes
