"""Megatron-core ``torch_dist`` checkpoints read through the verbs (issue 19), checked bit for
bit against megatron-core's own views of the same files (tests/fixtures_megatron.py: a tiny
``GPTModel`` saved by ``dist_checkpointing.save`` at TP=2 and at PP=2 on 2 gloo ranks, in
Megatron's run layout; ``load_plain_tensors`` and ``load_common_state_dict`` as oracles).
megatron-core 0.16.1 writes ``common.pt``; 0.19.2 (``NEXT_VERSION``) keeps the common state
in the byte entry ``common_state/shard_0_1`` and writes ``integrity.json``.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_megatron.py
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import warnings
from pathlib import Path

import pytest

from fixtures_megatron import NEXT_VERSION
from fixtures_torch import copy_ckpt
from test_deepspeed import _json, _one_line, _same, _tensor

torch = pytest.importorskip("torch")

RUNS = (("tp2", None), ("pp2", None), ("tp2", NEXT_VERSION))
CARRIER = "common_state/shard_0_1"


@pytest.fixture(params=RUNS, ids=lambda p: p[0] + (f"-{p[1]}" if p[1] else ""))
def run(request, megatron_ckpts):
    return megatron_ckpts.dist(*request.param)


@pytest.fixture
def next_run(megatron_ckpts):
    return megatron_ckpts.dist("tp2", NEXT_VERSION)


def _plain_tensors(run, it: int = 20) -> dict:
    return {k: v for k, v in run.load_plain(it).items() if isinstance(v, torch.Tensor)}


def _model_keys(plain: dict) -> list[str]:
    return sorted(k for k in plain if not k.startswith("optimizer."))


def test_every_tensor_equals_megatrons_load_plain_tensors(run):
    from ckptctl.formats import open_checkpoint

    ck = open_checkpoint(str(run.iter_dir(20)))
    plain = _plain_tensors(run)
    assert ck.format == "dcp" and ck.step == 20 and ck.info["step_source"] == "entry"
    assert ck.info["origin"] == "Megatron-core torch_dist, checkpoint version 3.0"
    assert set(plain) <= set(ck.tensors)
    bad = [k for k, want in plain.items() if not _same(_tensor(ck, k), want)]
    assert bad == []
    # the rest of the tensors: the common state's (optimizer.state.common_step)
    assert set(ck.tensors) - set(plain) == {"optimizer.state.common_step"}


def test_common_state_entries_equal_load_common_state_dict(run):
    from ckptctl.formats import open_checkpoint

    ck = open_checkpoint(str(run.iter_dir(20)))
    common = run.load_common(20)
    objs = {k: o.value for k, o in ck.objects.items()}
    assert objs["iteration"] == common["iteration"] == 20
    assert objs["checkpoint_version"] == common["checkpoint_version"] == 3.0
    # args (an argparse.Namespace, parsed as an inert record): one entry, its fields
    assert objs["args"] == {k: v for k, v in vars(common["args"]).items()
                            if not isinstance(v, torch.dtype)} | \
        {k: str(v).removeprefix("torch.") for k, v in vars(common["args"]).items()
         if isinstance(v, torch.dtype)}  # a torch dtype by its name
    for k, v in common["opt_param_scheduler"].items():
        assert objs[f"opt_param_scheduler.{k}"] == v, k
    assert _same(_tensor(ck, "optimizer.state.common_step"), common["optimizer"]["state"]["common_step"])


def test_inspect_says_framework_step_and_a_full_closure(run, cli):
    r = _json(cli, "inspect", str(run.iter_dir(20)))
    assert (r["format"], r["step"], r["step_source"]) == ("dcp", 20, "entry")
    assert r["origin"] == "Megatron-core torch_dist, checkpoint version 3.0"
    assert {k: v for k, v in r["closure"].items() if k != "dataloader"} == \
        {"model": True, "optim": True, "lr_scheduler": True, "rng": True, "step": True,
         "meta": True}
    code, out, err = cli("inspect", str(run.iter_dir(10)))
    assert code == 0 and "step 10 (from entry)" in out, out + err


@pytest.mark.parametrize("to,suffix", [("safetensors", "model.safetensors"), ("torch", "model.pt")])
def test_consolidate_only_model_equals_megatrons_tensors(run, cli, tmp_path, to, suffix):
    """--only model selects the weights alone (ShardedObjects: _extra_state is meta, the RNG
    state rng), so it reaches safetensors; every tensor equals load_plain_tensors'."""
    out = tmp_path / "out"
    code, so, err = cli("consolidate", str(run.iter_dir(20)), str(out), "--only", "model",
                        "--to", to)
    assert code == 0, so + err
    if to == "safetensors":
        from safetensors.torch import load_file

        got = load_file(str(out / suffix))
    else:
        got = torch.load(out / suffix, weights_only=True)
    plain = _plain_tensors(run)
    assert sorted(got) == _model_keys(plain)
    assert [k for k in got if not _same(got[k], plain[k])] == []


def test_reshard_into_dcp_loads_with_dcp_load(run, cli, tmp_path):
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "dcp"
    # every entry is carried: the RNG states (their numpy arrays are data) byte for byte
    code, so, err = cli("reshard", str(run.iter_dir(20)), str(out), "--world-size", "3")
    assert code == 0, so + err
    from ckptctl.formats import open_checkpoint
    from ckptctl.convert.copier import object_payload

    a, b = open_checkpoint(str(run.iter_dir(20))), open_checkpoint(str(out))
    rng = sorted(k for k in a.objects if k.startswith("rng_state/"))
    assert rng and rng == sorted(k for k in b.objects if k.startswith("rng_state/"))
    assert all(object_payload(a, k) == object_payload(b, k) for k in rng)
    plain = _plain_tensors(run)
    sd = {k: torch.full_like(v, float("nan")) for k, v in plain.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    assert [k for k in plain if not _same(sd[k], plain[k])] == []


# ------------------------------------------------------------------ the run root


def test_ls_latest_and_gc_of_a_run_root_honour_the_tracker(megatron_ckpts, cli, tmp_path):
    run = copy_ckpt(megatron_ckpts.dist("tp2").run, tmp_path / "run")
    r = _json(cli, "ls", str(run))
    assert [(c["name"], c["step"], c["state"]) for c in r["checkpoints"]] == \
        [("iter_0000010", 10, "complete"), ("iter_0000020", 20, "complete")]
    assert r["pointers"] == [{"file": "latest_checkpointed_iteration.txt",
                              "names": "iter_0000020", "present": True}]
    code, out, err = cli("latest", str(run))
    assert (code, out.strip()) == (0, str(run / "iter_0000020")), err
    # the tracker names the older one (a save after it did not update it): gc keeps it
    (run / "latest_checkpointed_iteration.txt").write_text("10")
    code, out, err = cli("latest", str(run))  # the newest, and what Megatron would resume
    assert (code, out.strip()) == (0, str(run / "iter_0000020")), err
    _one_line(err, "ckptctl: warning: latest_checkpointed_iteration.txt names iter_0000010, "
                   "not this newest one")
    r = _json(cli, "gc", str(run), "--keep-last", "1")
    assert sorted(p.name for p in run.iterdir()) == \
        ["iter_0000010", "iter_0000020", "latest_checkpointed_iteration.txt"], r
    # a tracker naming a folder that is gone: one line, and ls still lists the rest
    (run / "latest_checkpointed_iteration.txt").write_text("30")
    code, out, err = cli("ls", str(run))
    assert code == 0 and "iter_0000020" in out
    _one_line(err, "ckptctl: warning: latest_checkpointed_iteration.txt names iter_0000030, "
                   "which is not here")


def test_reading_verbs_open_the_iteration_the_tracker_names(megatron_ckpts, cli, tmp_path):
    run = copy_ckpt(megatron_ckpts.dist("tp2").run, tmp_path / "run")
    (run / "latest_checkpointed_iteration.txt").write_text("10")
    r = _json(cli, "inspect", str(run))
    assert (r["url"], r["step"]) == (str(run / "iter_0000010"), 10)
    # verbs that take one checkpoint whole name the iteration instead (exit 2)
    code, out, err = cli("verify", str(run))
    assert code == 2
    _one_line(err, "a Megatron run root", f"`ckptctl verify {run / 'iter_0000010'}`")
    # a tracker naming a folder that is gone: one line, not a guess at another iteration
    (run / "latest_checkpointed_iteration.txt").write_text("30")
    code, out, err = cli("inspect", str(run))
    assert (code, out) == (3, "")
    _one_line(err, "names iter_0000030, which this folder does not hold")


# ------------------------------------------------------------------ broken, hostile


def test_a_folder_without_metadata_json_is_not_committed(megatron_ckpts, cli, tmp_path):
    ck = copy_ckpt(megatron_ckpts.dist("tp2").iter_dir(20), tmp_path / "iter_0000020")
    (ck / "metadata.json").unlink()
    code, out, err = cli("inspect", str(ck))
    assert (code, out) == (3, ""), err
    _one_line(err, "without metadata.json", "Megatron writes it last")
    code, out, err = cli("inspect", str(ck), "--json")
    assert json.loads(out)["error"]["code"] == "NOT_COMMITTED"
    r = _json(cli, "ls", str(tmp_path))
    assert [(c["name"], c["state"]) for c in r["checkpoints"]] == [("iter_0000020", "incomplete")]


class _Payload:
    def __reduce__(self):
        import os

        return (os.system, ("touch PWNED",))


def test_a_metadata_pickle_naming_anything_else_is_refused(megatron_ckpts, cli, tmp_path):
    """The planner classes are admitted, nothing more: a payload hidden in all_local_plans
    is refused before anything runs."""
    ck = copy_ckpt(megatron_ckpts.dist("tp2").iter_dir(20), tmp_path / "iter_0000020")
    md = pickle.loads((ck / ".metadata").read_bytes())
    md.all_local_plans[0] = dataclasses.replace(md.all_local_plans[0], planner_data=_Payload())
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    code, out, err = cli("inspect", str(ck), "--json")
    e = json.loads(out)["error"]
    assert e["code"] == "UNSAFE_INPUT" and "posix.system" in e["message"], e
    assert not (Path.cwd() / "PWNED").exists() and not (ck / "PWNED").exists()


def test_a_different_sharded_backend_is_refused_by_name(megatron_ckpts, cli, tmp_path):
    ck = copy_ckpt(megatron_ckpts.dist("tp2").iter_dir(20), tmp_path / "iter_0000020")
    (ck / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    code, out, err = cli("inspect", str(ck))
    assert (code, out) == (3, ""), err
    _one_line(err, "looks like Megatron-core zarr")


def _equal_tree(a, b, path="") -> list[str]:
    """Paths where two nested dicts of tensors differ (bit for bit)."""
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [p for k in a for p in _equal_tree(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, torch.Tensor):
        return [] if _same(a, b) else [path]
    return [] if a == b else [path]


def _reload(ckpt: Path, out: Path, release: str | None) -> dict:
    """megatron-core's own ``dist_checkpointing.load`` of ``ckpt`` at TP=1 on 1 rank
    (write_megatron.py reload), under the venv's 0.16.1 or the unpacked ``release``."""
    import subprocess
    import sys

    from fixtures_megatron import WRITER, next_env

    env = next_env() if release else dict(os.environ)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=1", str(WRITER), "reload", "--ckpt", str(ckpt),
                        "--tp", "1", "--pp", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=600,
                       env={**env, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.mark.slow  # torchrun launches of megatron-core (about 20 s each)
@pytest.mark.parametrize("release", [None, NEXT_VERSION], ids=["0.16.1", NEXT_VERSION])
def test_a_reshard_stays_torch_dist_and_megatron_loads_it_at_another_tp(megatron_ckpts, cli,
                                                                         tmp_path, release):
    """reshard of a torch_dist checkpoint writes DCP plus Megatron's common state (0.16.1:
    common.pt; 0.19: the common_state byte entry, as stored) and, last, metadata.json;
    megatron-core's own dist_checkpointing.load at TP=1 (1 rank) gives the state it gives
    for the source itself: weights, Adam state, scheduler, iteration."""
    from ckptctl.formats import open_checkpoint
    from ckptctl.convert.copier import object_payload

    run = megatron_ckpts.dist("tp2", release)
    out = tmp_path / "run" / "iter_0000020"
    code, so, err = cli("reshard", str(run.iter_dir(20)), str(out), "--world-size", "3",
                        "--drop", "rng_state/*")
    assert code == 0, so + err
    names = {p.name for p in out.iterdir()}
    assert {"metadata.json", ".metadata"} <= names and "integrity.json" not in names
    if release is None:
        assert (out / "common.pt").read_bytes() == (run.iter_dir(20) / "common.pt").read_bytes()
        theirs = run.load_reload("tp1pp1")
    else:
        assert "common.pt" not in names
        a, b = open_checkpoint(str(run.iter_dir(20))), open_checkpoint(str(out))
        assert object_payload(a, CARRIER) == object_payload(b, CARRIER)
        theirs = _reload(run.iter_dir(20), tmp_path / "theirs.pt", release)
    mine = _reload(out, tmp_path / "reload.pt", release)
    assert _equal_tree(mine[0], theirs[0]) == []
    assert (mine["iteration"], mine["scheduler"]) == (theirs["iteration"], theirs["scheduler"])
    assert mine["saved_args"] == theirs["saved_args"]


def test_verify_full_checks_megatrons_integrity_json(next_run, cli, tmp_path):
    """megatron-core 0.19.2's own integrity.json (save(verify_integrity=True): the SHA-256
    of every other file, written last)."""
    ck = copy_ckpt(next_run.iter_dir(20), tmp_path / "iter_0000020")
    assert (ck / "integrity.json").exists()
    r = _json(cli, "verify", str(ck), "--level", "full")
    assert r["ok"] and r["content"] == "integrity.json", r
    assert r["num_files_read"] == 4  # 2 .distcp, .metadata, metadata.json (and the manifest)
    # one flipped byte in a data file: found, and named
    f = ck / "__1_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 1
    f.write_bytes(bytes(data))
    code, out, err = cli("verify", str(ck), "--level", "full", "--json")
    r = json.loads(out)
    assert code == 1 and not r["ok"]
    bad = [p for p in r["problems"] if p["code"] == "HASH_MISMATCH"]
    assert [Path(p["path"]).name for p in bad] == ["__1_0.distcp"], r["problems"]
    assert "integrity.json" in bad[0]["message"]


def test_an_integrity_json_of_another_kind_is_a_finding(next_run, cli, tmp_path):
    ck = copy_ckpt(next_run.iter_dir(20), tmp_path / "iter_0000020")
    (ck / "integrity.json").write_text(json.dumps({"algorithm": "md5", "files": {}}))
    code, out, err = cli("verify", str(ck), "--level", "full", "--json")
    r = json.loads(out)
    assert code == 1 and [p["code"] for p in r["problems"]] == ["MALFORMED_METADATA"], r


# ------------------------------------------------------------------ 0.19: the common_state entry


def test_the_common_state_entry_is_read_as_its_entries_and_carried_whole(next_run, cli,
                                                                         tmp_path):
    """0.19 keeps the common state in the byte entry common_state/shard_0_1 (a ShardedObject
    holding [dict]): read with Namespace as a record (verify's weights-only scan admits
    exactly that for this entry); an export writes its entries, not the carrier too."""
    code, out, err = cli("inspect", str(next_run.iter_dir(20)))
    assert code == 0 and "step 20 (from entry)" in out and CARRIER in out, out + err
    r = _json(cli, "verify", str(next_run.iter_dir(20)), "--level", "full")
    assert r["ok"], r
    out = tmp_path / "all.pt"
    code, so, err = cli("consolidate", str(next_run.iter_dir(20)), str(out), "--to", "torch")
    assert code == 0, so + err
    from ckptctl.formats.safe_pickle import numpy_globals

    with torch.serialization.safe_globals(numpy_globals()):  # the rng states' numpy arrays
        got = torch.load(out, weights_only=True)  # tensors inside objects are real storages
    common = next_run.load_common(20)
    assert CARRIER not in got and got["iteration"] == common["iteration"] == 20
    assert got["args"] == {k: (str(v).removeprefix("torch.") if isinstance(v, torch.dtype)
                               else v) for k, v in vars(common["args"]).items()}
    rng = got["rng_state/shard_0.0_1.2"][0][0]
    assert isinstance(rng["torch_rng_state"], torch.Tensor)


def test_dropping_part_of_the_common_state_from_a_torch_dist_reshard_is_refused(next_run, cli,
                                                                                tmp_path):
    out = tmp_path / "r"
    code, so, err = cli("reshard", str(next_run.iter_dir(20)), str(out), "--world-size", "2",
                        "--drop", "args")
    assert code == 3 and not out.exists(), so + err
    _one_line(err, f"args is part of Megatron's common state ({CARRIER}), which is carried "
                   "whole: keep it")


def test_a_common_state_entry_naming_another_class_is_refused(next_run, cli, tmp_path):
    """Only argparse.Namespace is admitted in the carrier: the same bytes naming another
    global (same length, so the file stays well-formed) are refused by name."""
    ck = copy_ckpt(next_run.iter_dir(20), tmp_path / "iter_0000020")
    f = ck / "__0_0.distcp"
    data = f.read_bytes()
    assert data.count(b"argparse\nNamespace\n") == 1
    f.write_bytes(data.replace(b"argparse\nNamespace\n", b"builtins\nenumerate\n"))
    (ck / "integrity.json").unlink()
    code, out, err = cli("inspect", str(ck), "--json")
    e = json.loads(out)["error"]
    assert code == 3 and e["code"] == "UNSAFE_INPUT" and "builtins.enumerate" in e["message"], e


def test_unstack_layers_writes_one_entry_per_layer(run, cli, tmp_path):
    """--unstack-layers: decoder.layers.X of shape (num_layers, ...) becomes
    decoder.layers.<i>.X, each equal to row i of Megatron's stacked tensor."""
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    code, so, err = cli("consolidate", str(run.iter_dir(20)), str(out), "--only", "model",
                        "--unstack-layers")
    assert code == 0, so + err
    got = load_file(str(out / "model.safetensors"))
    want = {}
    for k, v in _plain_tensors(run).items():
        if k.startswith("optimizer."):
            continue
        if k.startswith("decoder.layers."):
            want.update({k.replace("decoder.layers.", f"decoder.layers.{i}.", 1): v[i]
                         for i in range(v.shape[0])})
        else:
            want[k] = v
    assert sorted(got) == sorted(want)
    assert [k for k in got if not _same(got[k], want[k].contiguous())] == []


# ------------------------------------------------------------------ NeMo folders


def _nemo1(src: Path, root: Path) -> Path:
    """An extracted NeMo 1 ``.nemo`` as NeMo's save_to lays it out with distributed
    weights: model_config.yaml and tokenizer files beside ``model_weights/`` (the
    Megatron torch_dist folder). No NeMo runs here: the folder is assembled from a
    megatron-core checkpoint."""
    copy_ckpt(src, root / "model_weights")
    (root / "model_config.yaml").write_text("tensor_model_parallel_size: 2\n")
    (root / "a1b2c3_tokenizer.model").write_bytes(b"tokenizer")
    return root


def test_a_nemo_folder_stands_for_the_megatron_checkpoint_inside(megatron_ckpts, next_run,
                                                                  cli, tmp_path):
    """NeMo 1 (model_config.yaml + model_weights/) and NeMo 2 (context/ + weights/):
    reading verbs open the weights, whole-checkpoint verbs name them (exit 2)."""
    n1 = _nemo1(megatron_ckpts.dist("tp2").iter_dir(20), tmp_path / "nemo1")
    n2 = tmp_path / "nemo2"
    copy_ckpt(next_run.iter_dir(20), n2 / "weights")
    (n2 / "context").mkdir()
    (n2 / "context" / "io.json").write_text("{}")
    for folder, weights, run in ((n1, "model_weights", megatron_ckpts.dist("tp2")),
                                 (n2, "weights", next_run)):
        r = _json(cli, "inspect", str(folder))
        assert (r["url"], r["step"]) == (str(folder / weights), 20), r
        out = tmp_path / f"hf-{weights}"
        code, so, err = cli("consolidate", str(folder), str(out), "--only", "model")
        assert code == 0, so + err
        from safetensors.torch import load_file

        got, plain = load_file(str(out / "model.safetensors")), _plain_tensors(run)
        assert sorted(got) == _model_keys(plain)
        assert [k for k in got if not _same(got[k], plain[k])] == []
        code, so, err = cli("verify", str(folder))
        assert code == 2
        _one_line(err, "a NeMo checkpoint folder", f"`ckptctl verify {folder / weights}`")
    r = _json(cli, "ls", str(tmp_path))
    assert {"nemo1/model_weights", "nemo2/weights"} <= {c["name"] for c in r["checkpoints"]}


def test_a_nemo_archive_and_per_rank_nemo_weights_are_refused_by_name(megatron_ckpts, cli,
                                                                      tmp_path):
    import tarfile

    n1 = _nemo1(megatron_ckpts.dist("tp2").iter_dir(20), tmp_path / "nemo1")
    with tarfile.open(tmp_path / "model.nemo", "w:") as tar:
        tar.add(n1, arcname=".")
    code, out, err = cli("inspect", str(tmp_path / "model.nemo"))
    assert (code, out) == (3, "")
    _one_line(err, "a NeMo archive", "tar -xf model.nemo -C DIR")
    ranks = tmp_path / "tp2"
    for t in range(2):
        (ranks / f"mp_rank_0{t}").mkdir(parents=True)
        torch.save({"model.decoder.final_layernorm.weight": torch.ones(4)},
                   ranks / f"mp_rank_0{t}" / "model_weights.ckpt")
    (ranks / "model_config.yaml").write_text("tensor_model_parallel_size: 2\n")
    code, out, err = cli("inspect", str(ranks))
    assert (code, out) == (3, "")
    _one_line(err, "not a format ckptctl reads: looks like NeMo 1 per-rank model weights")


# ------------------------------------------------------------------ S3


@pytest.mark.parametrize("layout", ["0.19-run", "legacy"])
def test_s3_reads_equal_local(megatron_ckpts, next_run, s3_bucket, cli, tmp_path, layout):
    """A Megatron run root (0.19: the common_state entry, integrity.json) and a legacy TP x
    PP folder, uploaded to loopback S3: inspect says what it says locally (the tracker
    followed), verify --level full checks integrity.json there, and the export is the
    same bytes."""
    from test_deepspeed import _opts

    run = next_run.run if layout == "0.19-run" else \
        megatron_ckpts.legacy("legacy-tp2pp2").run
    s3_bucket.upload(run, f"runs/{layout}")
    url = s3_bucket.url(f"runs/{layout}")
    remote = _json(cli, "inspect", url, *_opts(s3_bucket))
    local = _json(cli, "inspect", str(run))
    assert remote["url"] == f"{url}/iter_0000020"
    for r in (remote, local):
        r.pop("url")
    assert remote == local and remote["step"] == 20
    r = _json(cli, "verify", f"{url}/iter_0000020", "--level", "full", *_opts(s3_bucket))
    assert r["ok"], r
    if layout == "0.19-run":
        assert r["content"] == "integrity.json"
    outs = []
    for src, extra in ((url, _opts(s3_bucket)), (str(run), [])):
        out = tmp_path / f"out-{len(outs)}"
        code, so, err = cli("consolidate", src, str(out), "--only", "model", *extra)
        assert code == 0, so + err
        outs.append((out / "model.safetensors").read_bytes())
    assert outs[0] == outs[1]
