"""Framework folders missing pieces are refused by name (issue 34, parts 4, 6 and 7).

* A DeepSpeed universal checkpoint's ``zero/`` tree is checked against the index its own
  model-states file keeps (``param_shapes``, frozen, buffer and tied names, rank counts): a
  parameter folder missing, a state file missing, a folder no parameter name can have, a
  tensor of another shape are each refused by name by every verb that reads it.
* A Megatron legacy iteration with the distributed optimizer needs every rank's
  ``distrib_optim.pt``; its ``numel_unpadded`` must fit its buffers and its rank's
  parameters; a rank folder gone is found from the degrees the rank files' ``args`` keep.
* A DeepSpeed ``latest`` that links outside its save folder is refused; the rest is listed.
* ``gc`` and ``rm`` own what each layout names below the folder's top (``zero/<p>/*.pt``,
  ``mp_rank_*/model_optim_rng.pt``, ``distrib_optim.pt``); a user's file is still not theirs.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_framework_pieces.py
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fixtures_torch import copy_ckpt
from test_deepspeed import _json, _one_line

torch = pytest.importorskip("torch")

UNI = "global_step3_universal"


# ------------------------------------------------------------------ helpers


def _universal(deepspeed_ckpts, root: Path, name: str = UNI) -> Path:
    """A writable copy of ds_to_universal's ZeRO-2 output at ``root/name``."""
    root.mkdir(parents=True, exist_ok=True)
    return copy_ckpt(deepspeed_ckpts.variant("z2-fp32").universal_tag, root / name)


def _iteration(megatron_ckpts, root: Path, name: str = "iter_0000020") -> Path:
    """A writable copy of the TP=2 distributed-optimizer legacy iteration at ``root/name``."""
    root.mkdir(parents=True, exist_ok=True)
    return copy_ckpt(megatron_ckpts.legacy("legacy-tp2-distopt").run / "iter_0000020",
                     root / name)


def _edit(path: Path, edit) -> None:
    sd = torch.load(path, weights_only=False)
    edit(sd)
    torch.save(sd, path)


def _no_folder(tag: Path) -> None:
    shutil.rmtree(tag / "zero" / "fc1.weight")


def _no_exp_avg(tag: Path) -> None:
    (tag / "zero" / "fc1.weight" / "exp_avg.pt").unlink()


def _evil(tag: Path) -> None:
    (tag / "zero" / "..evil").mkdir()
    shutil.copy(tag / "zero" / "fc1.bias" / "fp32.pt", tag / "zero" / "..evil" / "fp32.pt")


def _transposed(tag: Path) -> None:
    def edit(d):
        d["param"] = d["param"].t().contiguous()
    _edit(tag / "zero" / "fc1.weight" / "fp32.pt", edit)


def _no_distrib_optim(it: Path) -> None:
    (it / "mp_rank_01" / "distrib_optim.pt").unlink()


def _numel(n: int, pad: int = 0):
    def damage(it: Path) -> None:
        def edit(d):
            state = d[0][torch.float32]
            for k in ("param", "exp_avg", "exp_avg_sq"):
                state[k] = torch.cat([state[k], torch.zeros(pad)])
            state["numel_unpadded"] = n
        _edit(it / "mp_rank_00" / "distrib_optim.pt", edit)
    return damage


def _no_rank(it: Path) -> None:
    shutil.rmtree(it / "mp_rank_01")


#: (id, damage, state ls gives, the piece named, words of the message)
UNIVERSAL_CASES = [
    ("no-param-folder", _no_folder, "incomplete", "zero/fc1.weight/",
     "param_shapes in mp_rank_00_model_states.pt lists fc1.weight"),
    ("no-exp-avg", _no_exp_avg, "incomplete", "zero/fc1.weight/exp_avg.pt",
     "the other parameters' folders hold exp_avg.pt"),
    ("stray-evil-folder", _evil, "corrupt", "zero/..evil/", "not a parameter name"),
    ("fp32-of-another-shape", _transposed, "corrupt", "zero/fc1.weight/fp32.pt",
     "holds shape (13, 29) but param_shapes says (29, 13)"),
]
LEGACY_CASES = [
    ("no-distrib-optim", _no_distrib_optim, "incomplete", "mp_rank_01/distrib_optim.pt",
     "mp_rank_00/distrib_optim.pt is there"),
    ("numel-unpadded-huge", _numel(10 ** 15), "corrupt", "mp_rank_00/distrib_optim.pt",
     "numel_unpadded 1,000,000,000,000,000 does not fit its param buffer of 7,120"),
    ("numel-unpadded-over-params", _numel(8000, pad=880), "corrupt",
     "mp_rank_00/distrib_optim.pt", "sums to 8,000 elements, the rank's parameters hold 7,120"),
    ("no-rank-folder", _no_rank, "incomplete", "iter_0000020",
     "args say TP 2 x PP 1, the folder holds TP 1 x PP 1: rank files missing: mp_rank_01"),
]


def _refused_everywhere(cli, root: Path, ck: Path, state: str, piece: str, words: str,
                        tmp_path: Path) -> None:
    """ls calls it ``state`` naming ``piece``; verify exits 1 naming it; inspect,
    consolidate and reshard refuse it in one line (exit 3), seal in one line (exit 1), and
    none of them writes anything."""
    row = {c["name"]: c for c in _json(cli, "ls", str(root))["checkpoints"]}[ck.name]
    assert row["state"] == state and piece in row["reason"] and words in row["reason"], row
    code, out, err = cli("verify", str(ck), "--json")
    doc = json.loads(out)
    assert code == 1 and not doc["ok"], out + err
    assert any(piece in (p["path"] or "") and words in p["message"] for p in doc["problems"]), doc
    code, out, err = cli("inspect", str(ck))
    assert (code, out) == (3, "")
    _one_line(err, piece, words)
    for verb, extra in (("consolidate", ["--only", "model", "--to", "safetensors"]),
                        ("reshard", ["--world-size", "2"])):
        dst = tmp_path / f"out-{verb}"
        code, out, err = cli(verb, str(ck), str(dst), *extra)
        assert code == 3 and not dst.exists(), (verb, out, err)
        _one_line(err, piece, words)
    code, out, err = cli("seal", str(ck))
    assert code == 1 and not (ck / "ckptctl.manifest.json").exists(), out + err
    _one_line(err, "refusing to seal", piece, words)


# ------------------------------------------------------------------ task A: universal


@pytest.mark.parametrize("case", UNIVERSAL_CASES, ids=[c[0] for c in UNIVERSAL_CASES])
def test_a_damaged_universal_checkpoint_is_refused_by_name(deepspeed_ckpts, cli, tmp_path,
                                                           case):
    _, damage, state, piece, words = case
    tag = _universal(deepspeed_ckpts, tmp_path / "root")
    damage(tag)
    _refused_everywhere(cli, tmp_path / "root", tag, state, piece, words, tmp_path)


def test_the_unbroken_universal_checkpoint_still_reads_and_seals(deepspeed_ckpts, cli,
                                                                tmp_path):
    from safetensors.torch import load_file

    tag = _universal(deepspeed_ckpts, tmp_path / "root")
    row = _json(cli, "ls", str(tmp_path / "root"))["checkpoints"][0]
    assert (row["format"], row["state"]) == ("deepspeed-universal", "complete"), row
    assert _json(cli, "verify", str(tag))["ok"]
    out = tmp_path / "hf"
    code, so, err = cli("consolidate", str(tag), str(out), "--only", "model", "--to",
                        "safetensors", "--strip-prefix", "model.")
    assert code == 0, so + err
    got = load_file(str(out / "model.safetensors"))
    assert tuple(got["fc1.weight"].shape) == (29, 13)
    code, so, err = cli("seal", str(tag))
    assert code == 0, so + err


def test_every_universal_checkpoint_deepspeed_wrote_reads(deepspeed_ckpts):
    """ZeRO-1/2/3, TP 1/2/4 (the index keeps TP rank 0's shard shapes): none is refused."""
    from ckptctl.formats import open_checkpoint

    tags = sorted(deepspeed_ckpts.root.glob(f"*/*.universal/{UNI}"))
    assert len(tags) >= 5
    for tag in tags:
        assert open_checkpoint(str(tag)).format == "deepspeed-universal", tag


def test_a_universal_model_states_file_missing_is_refused(deepspeed_ckpts, cli, tmp_path):
    tag = _universal(deepspeed_ckpts, tmp_path / "root")
    (tag / "mp_rank_00_model_states.pt").unlink()
    code, out, err = cli("inspect", str(tag))
    assert code == 3
    _one_line(err, "no *_model_states.pt", "param_shapes")


def test_a_universal_writer_refuses_params_of_uneven_state(cli, tmp_path):
    """What ckptctl writes its reader reads: a parameter missing one of the others'
    optimizer states is refused before anything is written."""
    from conftest import dcp_save

    sd = {"model": {"a": torch.ones(2), "b": torch.ones(2)},
          "optim": {"state": {"a": {"exp_avg": torch.ones(2), "exp_avg_sq": torch.ones(2),
                                    "step": torch.tensor(1.0)},
                              "b": {"exp_avg": torch.ones(2), "step": torch.tensor(1.0)}},
                    "param_groups": [{"lr": 0.1, "params": ["a", "b"]}]}}
    dcp_save(tmp_path / "src", sd)
    dst = tmp_path / "uni" / "global_step1_universal"
    code, out, err = cli("consolidate", str(tmp_path / "src"), str(dst), "--to",
                         "deepspeed-universal")
    assert code == 2 and not dst.exists(), out + err
    _one_line(err, "optim.state.b.exp_avg_sq: missing")


# ------------------------------------------------------------------ task A: Megatron legacy


@pytest.mark.parametrize("case", LEGACY_CASES, ids=[c[0] for c in LEGACY_CASES])
def test_a_damaged_legacy_iteration_is_refused_by_name(megatron_ckpts, cli, tmp_path, case):
    _, damage, state, piece, words = case
    it = _iteration(megatron_ckpts, tmp_path / "root")
    damage(it)
    _refused_everywhere(cli, tmp_path / "root", it, state, piece, words, tmp_path)


def test_the_unbroken_legacy_iteration_still_reads(megatron_ckpts, cli, tmp_path):
    it = _iteration(megatron_ckpts, tmp_path / "root")
    row = _json(cli, "ls", str(tmp_path / "root"))["checkpoints"][0]
    assert (row["format"], row["state"]) == ("megatron-legacy", "complete"), row
    assert _json(cli, "verify", str(it), "--level", "full")["ok"]
    code, so, err = cli("seal", str(it))
    assert code == 0, so + err


# ------------------------------------------------------------------ part 7: latest symlinked out


def test_a_latest_linked_outside_the_save_folder_is_refused_and_the_rest_listed(
        deepspeed_ckpts, cli, tmp_path):
    save = copy_ckpt(deepspeed_ckpts.variant("z2-fp32").save_dir, tmp_path / "save")
    (tmp_path / "elsewhere").write_text("global_step3")
    (save / "latest").unlink()
    (save / "latest").symlink_to(tmp_path / "elsewhere")
    r = _json(cli, "ls", str(save))
    assert [c["name"] for c in r["checkpoints"]] == ["global_step2", "global_step3"]
    assert r["pointers"] == [{"file": "latest", "names": None, "present": False,
                              "refused": "link points outside the checkpoint root"}]
    code, out, err = cli("ls", str(save))
    assert code == 0 and "global_step3" in out
    _one_line(err, "latest refused: link points outside the checkpoint root")
    code, out, err = cli("gc", str(save), "--keep-last", "1")
    assert code == 0, out + err
    assert not (save / "global_step2").exists() and (save / "global_step3").is_dir()
    assert (save / "latest").is_symlink() and (tmp_path / "elsewhere").read_text() == "global_step3"


# ------------------------------------------------------------------ task B: ownership


def _set_step(ck: Path, step: int) -> None:
    """Give a fixture copy its own step (so gc ranks the copies by it)."""
    for f in list(ck.glob("*model_states.pt")) + list(ck.glob("mp_rank_*/model_optim_rng.pt")):
        def edit(sd):
            sd["global_steps" if "model_states" in f.name else "iteration"] = step
        _edit(f, edit)


def _run_root(deepspeed_ckpts, megatron_ckpts, root: Path) -> tuple[list[Path], list[Path]]:
    """Three unsealed universal checkpoints and three unsealed legacy iterations."""
    unis = [_universal(deepspeed_ckpts, root / "ds", f"global_step{s}_universal")
            for s in (1, 2, 3)]
    its = [_iteration(megatron_ckpts, root / "meg", f"iter_{s:07d}") for s in (10, 20, 30)]
    for ck, step in zip(unis + its, (1, 2, 3, 10, 20, 30)):
        _set_step(ck, step)
    return unis, its


def test_layout_files_below_the_top_are_owned_and_a_users_are_not(deepspeed_ckpts,
                                                                   megatron_ckpts, tmp_path):
    from ckptctl.catalog.ownership import split_owned
    from ckptctl.storage import open_store

    for ck in (_universal(deepspeed_ckpts, tmp_path), _iteration(megatron_ckpts, tmp_path)):
        (ck / "NOTES.md").write_text("mine")
        sub = next(p for p in ck.iterdir() if p.is_dir())
        (sub / "notes.txt").write_text("mine")
        owned, foreign = split_owned(open_store(str(ck)).list_files())
        assert foreign == sorted(["NOTES.md", f"{sub.name}/notes.txt"]), foreign
        assert any("/" in f for f in owned)


def test_gc_removes_unsealed_universal_and_legacy_checkpoints(deepspeed_ckpts, megatron_ckpts,
                                                              cli, tmp_path):
    root = tmp_path / "run"
    unis, its = _run_root(deepspeed_ckpts, megatron_ckpts, root)
    code, out, err = cli("gc", str(root), "--keep-last", "1")
    assert code == 0, out + err
    assert [p.name for p in (root / "ds").iterdir()] == ["global_step3_universal"]
    assert [p.name for p in (root / "meg").iterdir()] == ["iter_0000030"]
    rows = _json(cli, "ls", str(root))["checkpoints"]
    assert [(c["name"], c["state"]) for c in rows] == [
        ("ds/global_step3_universal", "complete"), ("meg/iter_0000030", "complete")]


def test_gc_and_rm_keep_a_users_file_and_say_so(deepspeed_ckpts, megatron_ckpts, cli,
                                                 tmp_path):
    root = tmp_path / "run"
    unis, its = _run_root(deepspeed_ckpts, megatron_ckpts, root)
    (unis[0] / "NOTES.md").write_text("mine")
    (its[0] / "mp_rank_00" / "NOTES.md").write_text("mine")
    code, out, err = cli("gc", str(root), "--keep-last", "1")
    assert code == 1, out + err
    assert "NOTES.md" in err and "global_step1_universal" in err and "iter_0000010" in err, err
    assert not unis[1].exists() and not its[1].exists()
    assert (unis[0] / "zero" / "fc1.weight" / "fp32.pt").is_file()
    assert (its[0] / "mp_rank_01" / "distrib_optim.pt").is_file()
    code, out, err = cli("rm", str(unis[0]))
    assert code == 1 and unis[0].is_dir()
    _one_line(err, "NOTES.md", "not the checkpoint's")
    (unis[0] / "NOTES.md").unlink()
    code, out, err = cli("rm", str(unis[0]))
    assert code == 0 and not unis[0].exists(), out + err
    code, out, err = cli("rm", str(its[2]))
    assert code == 0 and not its[2].exists(), out + err


def test_gc_removes_a_megatron_0_19_iteration_whole(megatron_ckpts, cli, tmp_path):
    """megatron-core 0.19 writes no common.pt: its metadata.json and integrity.json are
    still the iteration's own (gc kept every such iteration for holding "files not its
    own"), and a user's file beside them is not."""
    from test_megatron import NEXT_VERSION

    run = copy_ckpt(megatron_ckpts.dist("tp2", NEXT_VERSION).run, tmp_path / "run")
    assert (run / "iter_0000010" / "integrity.json").is_file()
    assert not (run / "iter_0000010" / "common.pt").exists()
    (run / "iter_0000020" / "NOTES.md").write_text("mine")
    code, out, err = cli("gc", str(run), "--keep-last", "1")
    assert code == 0, out + err
    assert not (run / "iter_0000010").exists()
    code, out, err = cli("rm", str(run / "iter_0000020"))
    assert code == 1 and "NOTES.md" in err, out + err
