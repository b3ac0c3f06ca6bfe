"""Formats ckptctl does not read are refused by name, never read in part (issue 17,
items 7 and 8): DeepSpeed pipeline and MoE layouts, one rank's file of a DeepSpeed
checkpoint, an HF Trainer folder holding a DeepSpeed tag, Megatron-core ``torch_dist``
and legacy folders. (DeepSpeed ZeRO tag folders, save folders and
universal checkpoints are read since issue 18: tests/test_deepspeed.py; the synthetic
ones here lack what real ones hold and read as corrupt, by name. Orbax step and item
folders are read since issue 39: tests/test_orbax.py; the zoo's, an empty PyTree, reads
as a checkpoint of no tensors.) A run folder given where
one checkpoint is expected says how many it holds; ``verify ROOT --all`` verifies each;
an empty S3 prefix is an empty place.

The layouts are built with real ``torch.save`` files holding what FACTS.md says the
frameworks put in them (ZeRO-3 model states: 0-element placeholders and ``param_shapes``;
a Megatron ``.metadata``: a DCP pickle carrying ``all_local_plans``).
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from conftest import write_tiny_dcp

FOREIGN = "not a format ckptctl reads: looks like "


# ------------------------------------------------------------------ layouts


def _save(path: Path, obj) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)


def deepspeed_zero3(root: Path, tags=("global_step10", "global_step20"), world=2) -> Path:
    """``engine.save_checkpoint(root)`` under ZeRO-3: ``latest``, ``zero_to_fp32.py`` and
    per tag one model-states and one optimizer-states file per rank."""
    import torch

    shapes = {"lin.weight": torch.Size([4, 4]), "lin.bias": torch.Size([4])}
    for step, tag in enumerate(tags, 1):
        for r in range(world):
            _save(root / tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",
                  {"module": {k: torch.empty(0) for k in shapes},  # ZeRO-3 placeholders
                   "param_shapes": [shapes], "buffer_names": [], "shared_params": {},
                   "frozen_param_shapes": None, "global_steps": 10 * step, "ds_config": {}})
            _save(root / tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
                  {"optimizer_state_dict": {"zero_stage": 3, "partition_count": world,
                                            "fp32_flat_groups": [torch.zeros(10)]}})
    (root / "latest").write_text(tags[-1])
    (root / "zero_to_fp32.py").write_text("# DeepSpeed's recovery script\n")
    return root


def deepspeed_zero12(tag: Path, world=2) -> Path:
    """A ZeRO-1/2 tag folder: the whole module in ``mp_rank_00_model_states.pt``, the
    optimizer partitioned over the ranks."""
    import torch

    _save(tag / "mp_rank_00_model_states.pt",
          {"module": {"lin.weight": torch.ones(4, 4)}, "param_shapes": [{"lin.weight": (4, 4)}],
           "global_steps": 5})
    for r in range(world):
        _save(tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
              {"optimizer_state_dict": {"zero_stage": 2,
                                        "single_partition_of_fp32_groups": [torch.zeros(8)]}})
    return tag


def deepspeed_universal(tag: Path, params=("lin.weight", "lin.bias", "emb.weight")) -> Path:
    """``ds_to_universal``'s output: ``zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt``,
    ``zero/optimizer_state.pt`` and the copied model states."""
    import torch

    _save(tag / "mp_rank_00_model_states.pt",
          {"module": {}, "param_shapes": [{p: (4,) for p in params}]})  # the zero/ tree's index
    for p in params:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            _save(tag / "zero" / p / f"{state}.pt", {"param": torch.zeros(4)})
        _save(tag / "zero" / p / "step.pt", torch.tensor(10.0))
    _save(tag / "zero" / "optimizer_state.pt", {"param_groups": [{"lr": 1e-3}]})
    (tag.parent / "latest_universal").write_text(tag.name)
    return tag


def megatron_dist(it: Path, *, config: dict | None = None, common=True) -> Path:
    """A Megatron-core ``torch_dist`` iteration folder: DCP files whose ``.metadata``
    carries ``all_local_plans``, ``metadata.json`` and ``common.pt``."""
    import torch
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties)
    from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                      WriteItemType)

    from conftest import dcp_save

    dcp_save(it, {"decoder.layers.0.mlp.weight": torch.randn(4, 4)})
    meta = it / ".metadata"
    md = pickle.loads(meta.read_bytes())
    md.all_local_plans = [SavePlan(items=[WriteItem(
        index=MetadataIndex("decoder.layers.0.mlp.weight", (0, 0)), type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata((0, 0), (4, 4)),
                                    properties=TensorProperties(dtype=torch.float32),
                                    size=torch.Size([4, 4])))])]
    meta.write_bytes(pickle.dumps(md))
    if config is not False:
        (it / "metadata.json").write_text(json.dumps(config or {
            "sharded_backend": "torch_dist", "sharded_backend_version": 1,
            "common_backend": "torch", "common_backend_version": 1}))
    if common:
        _save(it / "common.pt", {"iteration": 10, "checkpoint_version": 3.0})
    return it


def megatron_legacy(it: Path) -> Path:
    import torch

    for rank in ("mp_rank_00_000", "mp_rank_01_000"):
        _save(it / rank / "model_optim_rng.pt", {"model": {"w": torch.zeros(2)}, "iteration": 10})
    return it


def orbax_ocdbt(step: Path) -> Path:
    """An Orbax step folder: ``_CHECKPOINT_METADATA`` and an OCDBT item folder."""
    item = step / "default"
    (item / "d").mkdir(parents=True)
    (item / "ocdbt.process_0" / "d").mkdir(parents=True)
    (step / "_CHECKPOINT_METADATA").write_text('{"item_handlers": {}}')
    (item / "_METADATA").write_text('{"tree_metadata": {}}')
    (item / "_sharding").write_text("{}")
    (item / "manifest.ocdbt").write_bytes(b"OCDBT\x00")
    (item / "d" / "0123456789abcdef").write_bytes(b"\x00" * 64)
    (item / "ocdbt.process_0" / "manifest.ocdbt").write_bytes(b"OCDBT\x00")
    return step


def deepspeed_pipeline(tag: Path) -> Path:
    """A pipeline-parallel tag folder: per-layer model states beside the rank's."""
    _save(tag / "mp_rank_00_model_states.pt", {"module": None, "global_steps": 5})
    _save(tag / "layer_01-model_00-model_states.pt", {"weight": [1.0]})
    return tag


def deepspeed_moe(tag: Path) -> Path:
    """A MoE tag folder: expert model states beside the ZeRO files."""
    deepspeed_zero12(tag)
    _save(tag / "expert_0_mp_rank_00_model_states.pt", {"w": [1.0]})
    return tag


def hf_trainer_with_deepspeed(ck: Path) -> Path:
    """The HF Trainer under DeepSpeed: the model and trainer files at the top, the
    optimizer in DeepSpeed's tag folder beside ``latest`` (reading the top alone would
    drop it)."""
    import torch
    from safetensors.torch import save_file

    ck.mkdir(parents=True)
    save_file({"lin.weight": torch.ones(4, 4)}, str(ck / "model.safetensors"))
    (ck / "trainer_state.json").write_text('{"global_step": 500}')
    _save(ck / "scheduler.pt", {"last_epoch": 500})
    deepspeed_zero3(ck, tags=("global_step500",), world=1)
    return ck


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    """One folder holding every layout, and one ckptctl-readable checkpoint beside them."""
    root = tmp_path_factory.mktemp("zoo")
    deepspeed_zero3(root / "ds3")
    deepspeed_zero12(root / "ds12" / "global_step5")
    deepspeed_universal(root / "uni" / "global_step10_universal")
    deepspeed_pipeline(root / "pipe" / "global_step5")
    deepspeed_moe(root / "moe" / "global_step5")
    megatron_dist(root / "meg" / "iter_0000010")
    (root / "meg" / "latest_checkpointed_iteration.txt").write_text("10")
    megatron_legacy(root / "legacy" / "iter_0000010")
    orbax_ocdbt(root / "orbax" / "10")
    hf_trainer_with_deepspeed(root / "hf" / "checkpoint-500")
    write_tiny_dcp(root / "plain" / "step-42")
    return root


# (path under the zoo, words the refusal names)
REFUSED = [
    ("ds3/global_step10/zero_pp_rank_0_mp_rank_00_model_states.pt", "DeepSpeed ZeRO-3"),
    ("ds3/global_step10/zero_pp_rank_1_mp_rank_00_optim_states.pt", "DeepSpeed ZeRO"),
    ("ds12/global_step5/mp_rank_00_model_states.pt", "DeepSpeed (model states)"),
    ("uni/global_step10_universal/zero/lin.weight/fp32.pt", "DeepSpeed universal checkpoint"),
    ("pipe/global_step5", "DeepSpeed pipeline (per-layer model states)"),
    ("moe/global_step5", "DeepSpeed MoE (expert model states)"),
    ("legacy/iter_0000010/mp_rank_00_000/model_optim_rng.pt", "Megatron legacy"),
    ("hf/checkpoint-500", "DeepSpeed ZeRO-3 (model and optimizer partitions), a save folder of 1 "
                          "checkpoint (global_step500)"),
]


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


# ------------------------------------------------------------------ refusals by name


@pytest.mark.parametrize("rel,words", REFUSED, ids=[r for r, _ in REFUSED])
def test_verbs_refuse_by_name(zoo, cli, tmp_path, rel, words):
    url = str(zoo / rel)
    for args in (("verify", url), ("verify", url, "--level", "quick"), ("inspect", url),
                 ("consolidate", url, str(tmp_path / "out"))):
        code, out, err = cli(*args)
        assert (code, out) == (3, ""), (args, code, out, err)
        line = _one_line(err)
        assert line.startswith(f"ckptctl: error: {url}: {FOREIGN}"), (args, line)
        assert words in line, (args, line)
    assert not (tmp_path / "out").exists()


def test_verify_json_names_the_framework(zoo, cli):
    code, out, err = cli("verify", str(zoo / "pipe" / "global_step5"), "--json")
    assert code == 3
    e = json.loads(out)["error"]
    assert e["code"] == "UNSUPPORTED_FORMAT" and e["exit_code"] == 3
    assert FOREIGN + "DeepSpeed pipeline" in e["message"]


@pytest.mark.parametrize("verb", ["seal", "pack", "reshard", "diff"])
def test_writers_refuse_by_name(zoo, cli, tmp_path, verb):
    src = str(zoo / "pipe" / "global_step5")
    args = {"seal": (src,), "pack": (src, str(tmp_path / "p")),
            "reshard": (src, str(tmp_path / "r"), "--world-size", "2"),
            "diff": (src, str(zoo / "plain" / "step-42"))}[verb]
    code, out, err = cli(verb, *args)
    assert (code, out) == (3, ""), (verb, err)
    assert FOREIGN + "DeepSpeed pipeline" in _one_line(err)
    assert not list(Path(src).glob("ckptctl.*")) and not list(tmp_path.iterdir())


def test_library_raises_unsupported_format(zoo):
    from ckptctl.errors import UnsupportedFormatError
    from ckptctl.formats import open_checkpoint
    from ckptctl.ops import verify

    with pytest.raises(UnsupportedFormatError, match="DeepSpeed MoE"):
        open_checkpoint(str(zoo / "moe" / "global_step5"))
    with pytest.raises(UnsupportedFormatError, match="DeepSpeed pipeline"):
        verify(str(zoo / "pipe" / "global_step5"), level="quick")


def test_orbax_folders_are_read_not_refused(zoo, cli):
    """Orbax was refused by name until issue 39; now its step and item folders open (the
    zoo's is an empty PyTree: no tensors), and its manager root holds checkpoints."""
    for rel in ("orbax/10", "orbax/10/default"):
        code, out, err = cli("inspect", str(zoo / rel), "--json")
        assert code == 0, err
        doc = json.loads(out)
        assert (doc["format"], doc["num_tensors"]) == ("orbax", 0), doc
    code, out, err = cli("inspect", str(zoo / "orbax"))
    assert code == 2 and "holds 1 checkpoint (10)" in _one_line(err), err


def test_megatron_metadata_without_its_config_is_not_committed(tmp_path, cli):
    """The ``.metadata`` pickle alone (no metadata.json, which Megatron writes last): known
    by its ``all_local_plans``, reported as a save that did not finish, not as an unsafe
    pickle."""
    it = megatron_dist(tmp_path / "iter_0000010", config=False, common=False)
    code, out, err = cli("inspect", str(it), "--json")
    e = json.loads(out)["error"]
    assert (code, e["code"]) == (3, "NOT_COMMITTED") and "without metadata.json" in e["message"], e


def test_megatron_backend_is_read_from_its_config(tmp_path, cli):
    it = megatron_dist(tmp_path / "iter_0000010", config={"sharded_backend": "zarr"})
    code, out, err = cli("inspect", str(it))
    assert code == 3 and _one_line(err).endswith(FOREIGN + "Megatron-core zarr"), err


def test_a_stray_metadata_json_beside_dcp_is_still_dcp(tmp_path, cli):
    """A ``metadata.json`` that is no Megatron config (no ``sharded_backend``) next to a
    plain DCP checkpoint: read as DCP, as before."""
    ck = tmp_path / "step-42"
    write_tiny_dcp(ck)
    (ck / "metadata.json").write_text('{"note": "my run"}')
    code, out, err = cli("verify", str(ck), "--json")
    assert code == 0, err
    assert json.loads(out)["format"] == "dcp"


# ------------------------------------------------------------------ ls


def test_ls_lists_each_foreign_checkpoint_as_one_unknown_row(zoo, cli):
    code, out, err = cli("ls", str(zoo), "--json")
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)["checkpoints"]}
    assert set(rows) == {"ds3/global_step10", "ds3/global_step20", "ds12/global_step5",
                         "uni/global_step10_universal", "pipe/global_step5", "moe/global_step5",
                         "meg/iter_0000010", "legacy/iter_0000010", "orbax/10",
                         "hf/checkpoint-500", "plain/step-42"}
    assert rows["plain/step-42"]["state"] == "complete"
    # a legacy iteration folder is read (tests/test_megatron_legacy.py); this one's parameter
    # "w" is no GPT name: refused by name
    leg = rows["legacy/iter_0000010"]
    assert leg["state"] == "unknown" and "Megatron legacy parameter w: no rule" in leg["reason"], leg
    # Megatron-core torch_dist is read (tests/test_megatron.py): DCP with Megatron's files
    assert (rows["meg/iter_0000010"]["format"], rows["meg/iter_0000010"]["state"]) == \
        ("dcp", "complete"), rows["meg/iter_0000010"]
    for name in ("ds3/global_step10", "ds12/global_step5"):  # lack what real ones hold
        assert (rows[name]["format"], rows[name]["state"]) == ("deepspeed", "corrupt"), rows[name]
    assert (rows["orbax/10"]["format"], rows["orbax/10"]["state"]) == ("orbax", "complete")
    uni = rows["uni/global_step10_universal"]
    assert (uni["format"], uni["state"]) == ("deepspeed-universal", "complete"), uni
    want = {"pipe/global_step5": ("deepspeed", "DeepSpeed pipeline"),
            "moe/global_step5": ("deepspeed", "DeepSpeed MoE"),
            "hf/checkpoint-500": ("deepspeed", "DeepSpeed ZeRO-3")}
    for name, (fmt, words) in want.items():
        r = rows[name]
        assert (r["format"], r["state"]) == (fmt, "unknown"), r
        assert r["reason"].startswith(FOREIGN + words), r
    assert uni["num_files"] == 1 + 3 * 4 + 1  # every file of the tree, none dropped
    code, out, _ = cli("ls", str(zoo))
    assert "torch" not in out


def test_ls_of_one_foreign_checkpoint_or_file(zoo, cli):
    code, out, err = cli("ls", str(zoo / "pipe" / "global_step5"), "--json")
    assert code == 0, err
    (row,) = json.loads(out)["checkpoints"]
    assert (row["format"], row["state"], row["num_files"]) == ("deepspeed", "unknown", 2)
    f = zoo / "ds3" / "global_step10" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    code, out, err = cli("ls", str(f), "--json")
    assert code == 0, err
    (row,) = json.loads(out)["checkpoints"]
    assert row["state"] == "unknown" and "DeepSpeed ZeRO-3" in row["reason"]


def test_ls_from_the_listing_alone_does_not_call_them_complete(zoo):
    """``check="listing"`` (big remote roots) reads what the names say is another
    framework's layout instead of calling it a provisional ``complete``."""
    from ckptctl.ops import ls

    rows = {r.name: r for r in ls(str(zoo), check="listing").checkpoints}
    assert rows["pipe/global_step5"].state == "unknown" and rows["pipe/global_step5"].exact
    assert (rows["orbax/10"].format, rows["orbax/10"].state) == ("orbax", "complete")  # read


def test_gc_keeps_what_it_cannot_read(tmp_path, cli):
    """Rows of state unknown are kept whatever the policy (gc's rail)."""
    run = tmp_path / "run"
    deepspeed_pipeline(run / "global_step10")
    write_tiny_dcp(run / "step-20")
    write_tiny_dcp(run / "step-30")
    code, out, err = cli("gc", str(run), "--keep-last", "1", "--json")
    assert code == 0, err
    assert (run / "global_step10" / "layer_01-model_00-model_states.pt").exists()
    assert not (run / "step-20").exists() and (run / "step-30").exists()


# ------------------------------------------------------------------ a run folder


@pytest.fixture
def run(tmp_path) -> Path:
    root = tmp_path / "run1"
    for s in (10, 20, 30):
        write_tiny_dcp(root / f"step-{s}")
    return root


def test_verify_of_a_run_folder_says_how_many_it_holds(run, cli):
    code, out, err = cli("verify", f"{run}/")
    assert (code, out) == (2, "")
    assert _one_line(err) == (f"ckptctl: error: {run}/: holds 3 checkpoints (step-10, "
                              f"step-20, step-30), not one; name one, or `ckptctl verify "
                              f"{run}/ --all`")


@pytest.mark.parametrize("verb", ["inspect", "consolidate", "reshard", "seal", "pack"])
def test_other_verbs_on_a_run_folder(run, cli, tmp_path, verb):
    extra = {"consolidate": [str(tmp_path / "o")], "reshard": [str(tmp_path / "o"),
             "--world-size", "2"], "pack": [str(tmp_path / "o")]}.get(verb, [])
    code, out, err = cli(verb, str(run), *extra)
    assert (code, out) == (2, ""), (verb, err)
    line = _one_line(err)
    assert f"{run}/: holds 3 checkpoints (step-10, step-20, step-30), not one" in line, line
    assert f"`ckptctl ls {run}/` lists them" in line
    assert not (tmp_path / "o").exists() and not (run / "ckptctl.manifest.json").exists()


def test_promote_of_a_tier_root(run, cli, tmp_path, monkeypatch):
    (tmp_path / "ckptctl.toml").write_text(
        f'[[tier]]\nname = "hot"\nurl = "{run}"\n\n[[tier]]\nname = "warm"\n'
        f'url = "{tmp_path / "warm"}"\n')
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("promote", "hot:", "warm:")
    assert code == 2 and "holds 3 checkpoints" in _one_line(err), err
    assert not (tmp_path / "warm").exists()


def test_verify_all(run, cli):
    code, out, err = cli("verify", str(run), "--all")
    assert code == 0, err
    assert out.splitlines()[-1].startswith(f"{run}: 3 checkpoints: 3 OK (structure;")
    code, out, err = cli("verify", str(run), "--all", "--json", "--level", "full")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["ok"], doc["level"], doc["url"], doc["num_checkpoints"], doc["num_ok"]) == \
        (True, "full", str(run), 3, 3)
    assert [(c["name"], c["url"], c["ok"], c["step"], c["error"]) for c in doc["checkpoints"]] \
        == [(f"step-{s}", str(run / f"step-{s}"), True, 42, None) for s in (10, 20, 30)]
    assert all(c["content"] == "crc" and c["problems"] == [] for c in doc["checkpoints"])


def test_verify_all_with_a_bad_one(run, cli):
    next((run / "step-20").glob("*.distcp")).unlink()
    code, out, err = cli("verify", str(run), "--all", "--json")
    assert code == 1, err
    doc = json.loads(out)
    assert (doc["ok"], doc["num_ok"]) == (False, 2)
    bad = {c["name"]: c for c in doc["checkpoints"]}["step-20"]
    assert not bad["ok"] and {p["code"] for p in bad["problems"]} == {"MISSING_FILE"}
    code, out, err = cli("verify", str(run), "--all")
    assert code == 1
    assert "MISSING_FILE" in out and f"{run}: 3 checkpoints: 2 OK, 1 with problems" in out


def test_verify_all_reports_what_it_cannot_read(run, cli):
    deepspeed_pipeline(run / "global_step5")
    code, out, err = cli("verify", str(run), "--all", "--json")
    assert code == 1, err
    doc = json.loads(out)
    ds = {c["name"]: c for c in doc["checkpoints"]}["global_step5"]
    assert not ds["ok"] and ds["error"]["code"] == "UNSUPPORTED_FORMAT"
    assert FOREIGN + "DeepSpeed pipeline" in ds["error"]["message"]
    code, out, err = cli("verify", str(run), "--all")
    assert code == 1 and "3 OK, 1 not read" in out


def test_verify_all_of_an_empty_root(tmp_path, cli):
    code, out, err = cli("verify", str(tmp_path), "--all", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["ok"], doc["checkpoints"]) == (True, [])


# ------------------------------------------------------------------ S3


def _opts(bucket) -> list[str]:
    o = bucket.storage_options
    return [f"--storage-option=endpoint_url={o['endpoint_url']}",
            f"--storage-option=key={o['key']}", f"--storage-option=secret={o['secret']}"]


def test_ls_of_an_empty_s3_prefix_is_an_empty_place(s3_bucket, cli, tmp_path):
    write_tiny_dcp(tmp_path / "step-1")
    s3_bucket.upload(tmp_path, "run")
    url = s3_bucket.url("run/nothing-here")
    code, out, err = cli("ls", url, *_opts(s3_bucket))
    assert (code, err) == (0, "") and out == f"no checkpoints under {url}\n"
    code, out, err = cli("ls", url, "--json", *_opts(s3_bucket))
    assert code == 0 and json.loads(out)["checkpoints"] == []
    missing = f"s3://{s3_bucket.bucket}-gone/run"
    code, out, err = cli("ls", missing, *_opts(s3_bucket))
    assert code == 3 and "no such bucket" in _one_line(err)


def test_foreign_layout_on_s3(zoo, s3_bucket, cli):
    s3_bucket.upload(zoo / "pipe", "pipe")
    code, out, err = cli("inspect", s3_bucket.url("pipe/global_step5"), *_opts(s3_bucket))
    assert code == 3 and FOREIGN + "DeepSpeed pipeline" in _one_line(err)
    code, out, err = cli("ls", s3_bucket.url("pipe"), "--json", *_opts(s3_bucket))
    assert code == 0, err
    assert [(r["name"], r["state"]) for r in json.loads(out)["checkpoints"]] == \
        [("global_step5", "unknown")]


# ------------------------------------------------------------------ names alone


@pytest.mark.parametrize("files,name", [
    (["layer_00-model_00-model_states.pt", "layer_01-model_00-model_states.pt",
      "mp_rank_00_model_states.pt"], "DeepSpeed pipeline"),
    (["layer_0_expert_0_mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt",
      "expp_rank_0_mp_rank_00_optim_states.pt"], "DeepSpeed MoE"),
    (["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"],
     "DeepSpeed ZeRO-1/2"),
    (["zero_pp_rank_0_mp_rank_00optim_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"],
     "DeepSpeed ZeRO-3"),
    (["metadata.json", "common.pt", "decoder.layers.0/.zarray"], "Megatron-core torch_dist"),
    (["_METADATA", "_sharding", "array/.zarray"], "Orbax"),
    (["latest_checkpointed_iteration.txt", "iter_0000010/mp_rank_00/model_optim_rng.pt",
      "iter_0000020/mp_rank_00/model_optim_rng.pt"], "Megatron legacy"),
])
def test_recognise(files, name):
    from ckptctl.formats.foreign import recognise

    assert recognise(dict.fromkeys(files, 1)).startswith(name)


@pytest.mark.parametrize("files", [
    ["model.pt"], ["ema_model_states.pt"], ["optimizer.pt", "model.safetensors"],
    [".metadata", "__0_0.distcp"], ["latest", "step-1/.metadata"], ["zero/notes.txt"],
    ["metadata.json", "model.safetensors"],
])
def test_recognise_leaves_other_layouts_alone(files):
    from ckptctl.formats.foreign import recognise

    assert recognise(dict.fromkeys(files, 1)) is None
