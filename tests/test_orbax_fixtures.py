"""The Orbax fixtures themselves (tests/fixtures_orbax.py): the files orbax-checkpoint wrote are
there and named as orbax names them, the layouts hold the same state, and tensorstore alone
(no jax, no orbax: what a reader like ckptctl may use) opens every array of every checkpoint
and returns exactly the bytes of orbax's own restore."""

import json
import subprocess
import sys

import numpy as np
import pytest

from fixtures_orbax import NAMES, TMP_SUFFIX

SAME_AS = {"manager-20": ("standard", "zarr3", "plain", "inflight-20"),
           "manager-10": ("inflight-10",)}
DTYPES = {"bfloat16", "float32", "float16", "float64", "int8", "int32", "int64", "uint32",
          "bool"}


def _files(d):
    return sorted(p.name for p in d.iterdir())


def _names_in_metadata(item) -> list[str]:
    """The dotted names of the arrays ``_METADATA`` lists (``None`` leaves have none)."""
    tree = json.loads((item / "_METADATA").read_text())["tree_metadata"]
    return sorted(".".join(k["key"] for k in v["key_metadata"]) for v in tree.values()
                  if v["value_metadata"]["value_type"] != "None")


def test_every_checkpoint_is_there(orbax_ckpts):
    assert sorted(orbax_ckpts.names()) == sorted(NAMES)
    for name in NAMES:
        oracle = orbax_ckpts.oracle(name)
        assert sorted(oracle) == orbax_ckpts.entry(name)["arrays"]
        assert len(oracle) == 43
    dtypes = {m["dtype"] for m in orbax_ckpts.oracle_meta("manager-20").values()}
    assert dtypes == DTYPES
    oracle = orbax_ckpts.oracle("manager-20")
    assert oracle["params.embed.embedding"].dtype.name == "bfloat16"
    assert oracle["params.embed.embedding"].shape == (64, 32)
    assert oracle["opt_state.0.count"].dtype == np.int32 and oracle["opt_state.0.count"] == 20
    assert oracle["step"].dtype == np.int64 and oracle["step"] == 20
    assert orbax_ckpts.oracle("manager-10")["step"] == 10
    assert not oracle["extras.zeros"].any()


def _item_files(item, *, ocdbt=True):
    names = _files(item)
    for f in ("_METADATA", "_sharding", "array_metadatas"):
        assert f in names, (item, names)
    assert _files(item / "array_metadatas") == ["process_0"]
    if ocdbt:
        assert {"manifest.ocdbt", "d", "ocdbt.process_0"} <= set(names), (item, names)
        assert _files(item / "d")  # the merged B-tree nodes
        assert _files(item / "ocdbt.process_0") == ["d", "manifest.ocdbt"]
        assert _files(item / "ocdbt.process_0" / "d")  # the data files
    return names


def test_manager_layout(orbax_ckpts):
    assert _files(orbax_ckpts.manager) == ["10", "20"]
    for step in ("10", "20"):
        d = orbax_ckpts.manager / step
        assert _files(d) == ["_CHECKPOINT_METADATA", "commit_success.txt", "default"]
        meta = json.loads((d / "_CHECKPOINT_METADATA").read_text())
        assert meta["item_handlers"] == {"default": "orbax.checkpoint._src.handlers."
                                         "standard_checkpoint_handler.StandardCheckpointHandler"}
        assert meta["commit_timestamp_nsecs"]
        names = _item_files(d / "default")
        assert "commit_success.txt" in names  # the item's own commit file, too
        meta = json.loads((d / "default" / "_METADATA").read_text())
        assert (meta["use_ocdbt"], meta["use_zarr3"]) == (True, False)


@pytest.mark.parametrize("name", ["standard", "zarr3", "plain"])
def test_single_checkpointer_layouts(orbax_ckpts, name):
    item = orbax_ckpts.item(name)
    assert item == orbax_ckpts.step_dir(name) == getattr(orbax_ckpts, name)
    entry = orbax_ckpts.entry(name)
    names = _item_files(item, ocdbt=entry["use_ocdbt"])
    assert {"_CHECKPOINT_METADATA", "commit_success.txt"} <= set(names)
    meta = json.loads((item / "_METADATA").read_text())
    assert (meta["use_ocdbt"], meta["use_zarr3"]) == (entry["use_ocdbt"], entry["use_zarr3"])
    if name == "plain":  # one zarr2 folder per array, beside the metadata files
        assert "manifest.ocdbt" not in names
        for array in entry["arrays"]:
            assert ".zarray" in _files(item / array)
        assert _files(item / "params.embed.embedding") == [".zarray", "0.0", "1.0"]
        assert _files(item / "params.layers.0.mlp.kernel") == [".zarray", "0.0", "0.1"]
        assert _files(item / "step") == [".zarray", "0"]


def test_inflight_layout(orbax_ckpts):
    root = orbax_ckpts.inflight
    assert _files(root) == ["10", f"20{TMP_SUFFIX}", f"30{TMP_SUFFIX}"]
    assert _files(root / "10") == ["_CHECKPOINT_METADATA", "commit_success.txt", "default"]
    step20 = root / f"20{TMP_SUFFIX}"  # item finalised, step not
    assert _files(step20) == ["_CHECKPOINT_METADATA", "default"]
    assert json.loads((step20 / "_CHECKPOINT_METADATA").read_text())[
        "commit_timestamp_nsecs"] is None
    assert "commit_success.txt" in _item_files(step20 / "default")
    step30 = root / f"30{TMP_SUFFIX}"  # killed before the item's finalisation
    assert _files(step30) == ["_CHECKPOINT_METADATA", f"default{TMP_SUFFIX}"]
    item30 = step30 / f"default{TMP_SUFFIX}"
    assert _files(item30) == ["_METADATA", "_sharding", "array_metadatas", "ocdbt.process_0"]


@pytest.mark.parametrize("name", NAMES)
def test_metadata_names_are_the_oracle_paths(orbax_ckpts, name):
    item = orbax_ckpts.item(name)
    assert _names_in_metadata(item) == sorted(orbax_ckpts.oracle(name))
    listed = json.loads((item / "array_metadatas" / "process_0").read_text())
    # array_metadatas lists the jax.Array leaves only (with their write / chunk shapes)
    jax_arrays = {k for k, m in orbax_ckpts.oracle_meta(name).items() if m["type"] == "ArrayImpl"}
    assert {a["array_metadata"]["param_name"] for a in listed["array_metadatas"]} == jax_arrays


def test_layouts_hold_the_same_state(orbax_ckpts):
    for ref, others in SAME_AS.items():
        want = orbax_ckpts.oracle(ref)
        for other in others:
            got = orbax_ckpts.oracle(other)
            assert sorted(got) == sorted(want), other
            for k in want:
                assert (got[k].dtype, got[k].shape, got[k].tobytes()) == \
                    (want[k].dtype, want[k].shape, want[k].tobytes()), (other, k)
    a, b = orbax_ckpts.oracle("manager-10"), orbax_ckpts.oracle("manager-20")
    assert a["params.head.kernel"].tobytes() != b["params.head.kernel"].tobytes()


# tensorstore alone: run in a fresh interpreter that never imports jax, orbax or optax
READER = r"""
import json, sys
import numpy as np
import tensorstore as ts

jobs = json.loads(sys.argv[1])
report = {}
for job in jobs:
    item, base = job["item"], job.get("base", job["item"])
    tree = json.load(open(item + "/_METADATA"))
    meta = json.load(open(job["oracle_meta"]))["arrays"]
    names = sorted(".".join(k["key"] for k in v["key_metadata"])
                   for v in tree["tree_metadata"].values()
                   if v["value_metadata"]["value_type"] != "None")
    driver = "zarr3" if tree["use_zarr3"] else "zarr"
    if tree["use_ocdbt"]:
        kv = {"driver": "ocdbt", "base": "file://" + base + "/"}
        keys = ts.KvStore.open(kv).result().list().result()
        stored = sorted({k.decode().split("/")[0] for k in keys})
        spec = lambda name: {**kv, "path": name + "/"}
    else:
        spec = lambda name: {"driver": "file", "path": item + "/" + name + "/"}
        stored = names
    out = {"names": names, "stored": stored, "arrays": {}}
    with np.load(job["oracle"]) as oracle:
        for name in names:
            arr = ts.open({"driver": driver, "kvstore": spec(name)},
                          open=True, read=True).result().read().result()
            want = oracle[name]
            out["arrays"][name] = {
                "dtype": arr.dtype.name, "want_dtype": meta[name]["dtype"],
                "shape": list(arr.shape), "want_shape": list(want.shape),
                "equal": arr.tobytes() == want.tobytes(),
            }
    report[job["name"]] = out
report["modules"] = sorted(m for m in sys.modules
                           if m.split(".")[0] in ("jax", "jaxlib", "orbax", "optax", "flax"))
print(json.dumps(report))
"""


def test_tensorstore_alone_reads_every_array_bitwise(orbax_ckpts):
    pytest.importorskip("tensorstore")
    jobs = [{"name": n, "item": str(orbax_ckpts.item(n)),
             "oracle": str(orbax_ckpts.out / orbax_ckpts.entry(n)["oracle"]),
             "oracle_meta": str(orbax_ckpts.out / orbax_ckpts.entry(n)["oracle_meta"])}
            for n in NAMES]
    # the unfinalised item of the interrupted step 30 (state of step 20): no merged
    # manifest, but its per-process OCDBT database opens on its own
    item30 = orbax_ckpts.inflight / f"30{TMP_SUFFIX}" / f"default{TMP_SUFFIX}"
    jobs.append({**next(j for j in jobs if j["name"] == "manager-20"), "name": "inflight-30",
                 "item": str(item30), "base": str(item30 / "ocdbt.process_0")})
    p = subprocess.run([sys.executable, "-c", READER, json.dumps(jobs)], check=False,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    report = json.loads(p.stdout)
    assert report.pop("modules") == []
    assert sorted(report) == sorted(j["name"] for j in jobs)
    for name, r in report.items():
        assert r["stored"] == r["names"], name
        assert len(r["arrays"]) == 43, name
        for array, a in r["arrays"].items():
            assert a["dtype"] == a["want_dtype"], (name, array, a)
            assert a["shape"] == a["want_shape"], (name, array, a)
            assert a["equal"], (name, array)
