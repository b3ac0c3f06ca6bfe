"""``consolidate SRC DST --to orbax`` (ckptctl/convert/orbax_write.py, issue 39): what ckptctl
writes, orbax-checkpoint's own ``StandardCheckpointer().restore`` returns bit for bit (run
in a subprocess on CPU: tests/fixtures/restore_orbax.py), from a DCP checkpoint, an Orbax
one and a chunked safetensors one; ckptctl reads its output back (inspect, verify --level
full); names that make no tree and objects Orbax cannot hold are refused by name; a failed
write leaves nothing that looks committed; without tensorstore: one line, exit 3.

Tests that restore with orbax skip (one line) when jax, orbax-checkpoint, optax or
tensorstore is missing, as the Orbax fixtures do (fixtures_orbax.missing)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import write_tiny_dcp
from fixtures_orbax import GENERATORS, TMP_SUFFIX, missing

RESTORE = GENERATORS / "restore_orbax.py"


@pytest.fixture
def orbax_oracle():
    """``restore(ckpt) -> {dotted name: (dtype name, shape, raw bytes, python type)}``:
    orbax's own restore on CPU, in a subprocess."""
    if lacking := missing():
        pytest.skip(f"restoring with Orbax needs {', '.join(lacking)} (pip install "
                    "jax==0.10.2 orbax-checkpoint==0.12.8 optax==0.2.8 tensorstore==0.1.86)")

    def restore(ckpt: Path) -> dict:
        out = str(ckpt) + ".restored"
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        r = subprocess.run([sys.executable, str(RESTORE), str(ckpt), out], env=env, check=False,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        meta = json.loads(Path(out + ".json").read_text())
        with np.load(out + ".npz") as z:
            raw = {k: z[k].tobytes() for k in z.files}
        return {k: (m.get("dtype"), tuple(m.get("shape", ())), raw.get(k), m["type"])
                for k, m in meta.items()}

    return restore


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def _torch_view(t) -> tuple[str, tuple, bytes]:
    """(dtype name as numpy/ml_dtypes say it, shape, raw bytes) of a torch tensor."""
    import torch

    name = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.int64: "int64",
            torch.float16: "float16"}[t.dtype]
    raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return name, tuple(t.shape), raw


def _consolidate(cli, *args) -> dict:
    code, out, err = cli("consolidate", *map(str, args), "--to", "orbax", "--json")
    assert code == 0, err
    return json.loads(out)


# ------------------------------------------------------------------ DCP -> Orbax


def test_dcp_to_orbax_restores_bit_for_bit(cli, tmp_path, orbax_oracle):
    src, dst = tmp_path / "step-42", tmp_path / "jax"
    sd = write_tiny_dcp(src)
    rep = _consolidate(cli, src, dst, "--drop", "optim.param_groups.0.betas")
    assert rep["to"] == "orbax" and rep["num_tensors"] == 3 and rep["num_objects"] == 2
    assert rep["manifest_id"] and rep["dropped"] == ["optim.param_groups.0.betas"]
    got = orbax_oracle(dst)
    want = {f"model.{k}": _torch_view(v) for k, v in sd["model"].items()}
    assert {k: v[:3] for k, v in got.items() if k.startswith("model.")} == want
    assert got["model.norm.weight"][0] == "bfloat16"  # bf16 stays bf16
    # Python scalars: orbax "scalar" leaves, restored as Python int / float
    assert got["step"] == ("int64", (), np.int64(42).tobytes(), "int")
    assert got["optim.param_groups.0.lr"] == ("float64", (), np.float64(0.01).tobytes(),
                                              "float")
    # the committed layout, and nothing left beside it
    names = set(os.listdir(dst))
    assert {"_METADATA", "_CHECKPOINT_METADATA", "commit_success.txt", "manifest.ocdbt",
            "ckptctl.manifest.json", "d"} <= names and ".ckptctl-writing" not in names
    assert not Path(str(dst) + TMP_SUFFIX).exists()
    meta = json.loads((dst / "_METADATA").read_text())
    assert meta["use_zarr3"] is True and meta["use_ocdbt"] is True
    keys = meta["tree_metadata"]["('model', 'emb', 'weight')"]["key_metadata"]
    assert [k["key"] for k in keys] == ["model", "emb", "weight"]
    assert {k["key_type"] for k in keys} == {2}  # dict keys (numeric segments too)


def test_output_reads_back_inspect_and_verify_full(cli, tmp_path):
    pytest.importorskip("tensorstore")
    src, dst = tmp_path / "step-42", tmp_path / "jax"
    write_tiny_dcp(src)
    _consolidate(cli, src, dst, "--only", "model", "--strip-prefix", "model.",
                 "--dtype", "bf16")
    code, out, err = cli("inspect", str(dst), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["format"] == "orbax"
    code, out, err = cli("verify", str(dst), "--level", "full", "--json")
    assert code == 0, (out, err)
    from ckptctl.formats.detect import open_checkpoint
    from ckptctl.formats.tensorio import tensor_bytes

    ck = open_checkpoint(str(dst))
    assert sorted(ck.tensors) == ["emb.weight", "head.bias", "norm.weight"]
    assert {n: t.dtype.name for n, t in ck.tensors.items()} == {
        "emb.weight": "bfloat16", "head.bias": "int64", "norm.weight": "bfloat16"}
    import torch

    g = torch.Generator().manual_seed(0)
    emb = torch.randn(10, 4, generator=g).to(torch.bfloat16)  # write_tiny_dcp's, cast
    assert tensor_bytes(ck, "emb.weight") == _torch_view(emb)[2]


# ------------------------------------------------------------------ Orbax -> Orbax


@pytest.mark.parametrize("name", ["zarr3", "manager-20"])
def test_orbax_round_trip_equals_orbax_restore(orbax_ckpts, cli, tmp_path, orbax_oracle, name):
    dst = tmp_path / "again"
    _consolidate(cli, orbax_ckpts.item(name), dst)
    got = orbax_oracle(dst)
    oracle = orbax_ckpts.oracle(name)
    assert set(got) == set(oracle)  # list indices come back as the same dotted names
    for k, a in oracle.items():
        a = np.asarray(a)
        assert got[k][:3] == (a.dtype.name, a.shape, a.tobytes()), k
    assert got["params.embed.embedding"][0] == "bfloat16"


# ------------------------------------------------------------------ chunks, bounded memory


def _safetensors(path: Path, tensors: dict) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path))


def test_large_tensor_is_written_in_row_chunks(cli, tmp_path, orbax_oracle):
    src, dst = tmp_path / "m.safetensors", tmp_path / "jax"
    big = np.arange(3 * 256 * 1024, dtype=np.float32).reshape(768, 1024)  # 3 MiB
    odd = np.arange(7 * 5, dtype=np.int32).reshape(7, 5)
    _safetensors(src, {"w.big": big, "w.odd": odd, "w.empty": np.zeros((0, 4), np.float32)})
    _consolidate(cli, src, dst, "--max-memory", "8MiB")  # chunks of 1 MiB: 256 rows
    zarr = json.loads(_ocdbt_value(dst, "w.big/zarr.json"))
    assert zarr["chunk_grid"]["configuration"]["chunk_shape"] == [256, 1024]
    got = orbax_oracle(dst)
    assert got["w.big"][:3] == ("float32", (768, 1024), big.tobytes())
    assert got["w.odd"][:3] == ("int32", (7, 5), odd.tobytes())
    assert got["w.empty"][:2] == ("float32", (0, 4))


def _ocdbt_value(root: Path, key: str) -> bytes:
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{root}/"}).result()
    return kv.read(key).result().value


# ------------------------------------------------------------------ refusals


def test_a_leaf_that_is_also_a_subtree_is_refused_by_name(cli, tmp_path):
    src, dst = tmp_path / "m.safetensors", tmp_path / "jax"
    _safetensors(src, {"a": np.zeros(2, np.float32), "a.b": np.ones(2, np.float32)})
    code, _, err = cli("consolidate", str(src), str(dst), "--to", "orbax")
    assert code == 2 and "a: a leaf of the Orbax PyTree, and also a subtree (a.b)" \
        in _one_line(err)
    assert not dst.exists() and not Path(str(dst) + TMP_SUFFIX).exists()


def test_an_object_orbax_cannot_hold_is_refused_by_name(cli, tmp_path):
    src, dst = tmp_path / "step-42", tmp_path / "jax"
    write_tiny_dcp(src)
    code, _, err = cli("consolidate", str(src), str(dst), "--to", "orbax")
    line = _one_line(err)
    assert code == 2 and "optim.param_groups.0.betas: a tuple object" in line and "--drop" in line
    assert not dst.exists() and not Path(str(dst) + TMP_SUFFIX).exists()


def test_a_file_destination_is_refused(cli, tmp_path):
    src = tmp_path / "m.safetensors"
    _safetensors(src, {"w": np.zeros(2, np.float32)})
    code, _, err = cli("consolidate", str(src), str(tmp_path / "x.safetensors"), "--to", "orbax")
    assert code == 2 and "--to orbax writes a folder" in _one_line(err)


# ------------------------------------------------------------------ commit


def test_a_failed_write_leaves_nothing_that_looks_committed(cli, tmp_path, monkeypatch):
    pytest.importorskip("tensorstore")
    from ckptctl.convert import orbax_write

    src, dst = tmp_path / "m.safetensors", tmp_path / "jax"
    _safetensors(src, {"a.w": np.ones(4, np.float32), "b.w": np.ones(4, np.float32)})
    real = orbax_write._write_tensor
    calls = []

    def fail_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(orbax_write, "_write_tensor", fail_second)
    code, _, err = cli("consolidate", str(src), str(dst), "--to", "orbax")
    assert code != 0 and "Traceback" not in err, err
    assert not dst.exists() and not Path(str(dst) + TMP_SUFFIX).exists()


def test_force_replaces_an_orbax_output_and_a_killed_writes_leftover(cli, tmp_path):
    pytest.importorskip("tensorstore")
    src, dst = tmp_path / "m.safetensors", tmp_path / "jax"
    _safetensors(src, {"w": np.arange(4, dtype=np.float32)})
    _consolidate(cli, src, dst)
    code, _, err = cli("consolidate", str(src), str(dst), "--to", "orbax")
    assert code == 2 and "not empty" in _one_line(err)
    _consolidate(cli, src, dst, "--force")
    dst = tmp_path / "jax2"
    leftover = Path(str(dst) + TMP_SUFFIX)  # what a killed run leaves: in flight to readers
    leftover.mkdir()
    (leftover / ".ckptctl-writing").write_text(json.dumps(
        {"pid": 999999999, "host": "gone", "started": "2026-01-01T00:00:00Z",
         "command": "consolidate --to orbax"}) + "\n")
    (leftover / "_METADATA").write_text("{}")
    code, _, err = cli("consolidate", str(src), str(dst), "--to", "orbax")
    assert code == 2 and TMP_SUFFIX in _one_line(err)
    _consolidate(cli, src, dst, "--force")
    assert not leftover.exists()
    code, _, err = cli("verify", str(dst), "--level", "full")
    assert code == 0, err


def test_without_tensorstore_one_line_exit_3(tmp_path):
    src, dst = tmp_path / "m.safetensors", tmp_path / "jax"
    _safetensors(src, {"w": np.zeros(2, np.float32)})
    code = ("import sys\nsys.modules['tensorstore'] = None\n"
            "from ckptctl.cli.main import main\n"
            f"main(['consolidate', {str(src)!r}, {str(dst)!r}, '--to', 'orbax'])\n")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 3, r.stderr
    assert "pip install 'ckptctl[orbax]'" in _one_line(r.stderr)
    assert not dst.exists()


def test_writing_never_imports_jax_or_orbax(tmp_path):
    pytest.importorskip("tensorstore")
    src, dst = tmp_path / "m.safetensors", tmp_path / "jax"
    _safetensors(src, {"w": np.ones((3, 2), np.float32)})
    code = ("import sys\nfrom ckptctl.cli.main import main\n"
            "try:\n"
            f"    main(['consolidate', {str(src)!r}, {str(dst)!r}, '--to', 'orbax', '-q'])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib', 'orbax', "
            "'flax'}))\n")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)
    assert (dst / "commit_success.txt").exists()


def test_a_full_disk_is_one_line_and_leaves_nothing(cli, tmp_path, small_tmpfs):
    pytest.importorskip("tensorstore")
    mnt = small_tmpfs("2m")
    src, dst = tmp_path / "m.safetensors", mnt / "jax"
    noise = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    _safetensors(src, {"w": noise})  # 4 MiB that zstd cannot shrink below 2 MiB
    code, _, err = cli("consolidate", str(src), str(dst), "--to", "orbax")
    assert code == 3 and "no space left on device" in _one_line(err)
    assert os.listdir(mnt) == []


def test_sharded_dcp_to_orbax_equals_the_reference(torch_ckpts, cli, tmp_path, orbax_oracle):
    """FSDP x TP shards (dim 0 and dim 1) of a DCP checkpoint, written whole per array."""
    import torch

    dst = tmp_path / "jax"
    _consolidate(cli, torch_ckpts["2d"], dst, "--only", "model", "--max-memory", "16MiB")
    got = orbax_oracle(dst)
    ref = torch.load(torch_ckpts.reference["2d"], weights_only=True)["model"]
    assert set(got) == {f"model.{k}" for k in ref}
    for k, t in ref.items():
        assert got[f"model.{k}"][:3] == _torch_view(t), k
