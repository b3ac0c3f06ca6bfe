"""``dcp.load`` through :class:`ckptctl.dcp.Reader` at a mesh other than the writer's, proved
bit for bit against each framework's own loader (issue 37; the one-process cases are in
``tests/test_dcp_reader.py``).

1. DeepSpeed ZeRO-3 -> FSDP2 (slow): a checkpoint DeepSpeed itself wrote at world 2 or 3
   (``z3-fp32``, ``z3-bf16``: tests/fixtures_deepspeed.py) loads into the DeepSpeed fixtures'
   model under ``fully_shard`` at the OTHER world size (``get_state_dict`` -> ``dcp.load``
   -> ``set_state_dict``): every rank's ``DTensor.full_tensor()`` of every weight equals
   zero_to_fp32's output, and Adam's ``exp_avg`` / ``exp_avg_sq`` / ``step`` equal
   DeepSpeed's own full optimizer state after ``load_checkpoint``
   (``safe_get_full_optimizer_state``, the fixture's ``.full.pt``); the param groups
   come back with DeepSpeed's settings and params named by fqn. torchtitan's own
   ``CheckpointManager`` (not slow), its initial load given the Reader through its
   state-dict adapter, loads the ZeRO-3 weights the same way.
2. DCP 2-D -> another mesh (slow): torch's dp=2 x tp=2 checkpoint (tests/fixtures_torch.py)
   loaded through the Reader at FSDP2 over 3 ranks and at TP over 2 ranks equals, on every
   rank, what DCP's own ``FileSystemReader`` loads at that same mesh: full tensors and local
   shards (digests of dtype, shape and raw bytes), model and optimizer, and the param
   groups; nothing is left unloaded, and each rank reads exactly its own shards' bytes.
3. Megatron ``torch_dist`` (one process, not slow): every tensor equals megatron-core's own
   ``load_plain_tensors`` (tests/fixtures_megatron.py), each byte read once.

The torchrun loads run ``tests/fixtures/load_with_reader.py`` (its docstring says what each
rank writes into ``tmp_path``).

    .venv/bin/python -m pytest -q -p no:cacheprovider -m slow tests/test_dcp_reader_torchrun.py
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_deepspeed import _model_names, _same, _widened  # noqa: E402
from test_megatron import RUNS, _plain_tensors  # noqa: E402
from test_reshard_torchrun import _tail  # noqa: E402

WORKER = Path(__file__).resolve().parent / "fixtures" / "load_with_reader.py"
TIMEOUT_S = 900  # a bound on a hang, not a time the test expects: loaded machines are slow
ADAM = ("exp_avg", "exp_avg_sq", "step")


def _torchrun(tmp_path: Path, worker: Path, nproc: int, *args: str, pythonpath: str = "") -> None:
    """Run ``worker`` on ``nproc`` gloo CPU ranks (``pythonpath`` first on PYTHONPATH); the
    whole output goes to ``tmp_path/torchrun.log`` and its tail into a failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(worker), *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    for attempt in (1, 2):
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
        # --standalone picks a free port, closes it, then binds it again: a parallel run can
        # take it in between. Retry that once; any other failure is the test's.
        if p.returncode == 0 or "address already in use" not in (p.stdout + p.stderr).lower():
            break
    log = tmp_path / "torchrun.log"
    log.write_text(f"$ {' '.join(cmd)}\n# rc={p.returncode} {time.monotonic() - t0:.1f}s "
                   f"attempt {attempt}\n{p.stdout}{p.stderr}")
    if p.returncode != 0:
        pytest.fail(f"{worker.name} failed (rc={p.returncode}, full output in {log}):\n"
                    f"{_tail(p, 80)}", pytrace=False)


def torchrun_load(tmp_path: Path, nproc: int, *args: str, readers: str = "ckptctl") -> dict:
    """Run the worker on ``nproc`` gloo CPU ranks; returns ``{reader: [rank 0's report, ...]}``."""
    _torchrun(tmp_path, WORKER, nproc, *args, "--readers", readers, "--out", str(tmp_path))
    out = {}
    for kind in readers.split(","):
        out[kind] = [json.loads((tmp_path / f"{kind}.rank{r}.json").read_text())
                     for r in range(nproc)]
        assert [x["world"] for x in out[kind]] == [nproc] * nproc
    return out


def _local_bytes(report: dict) -> int:
    """Bytes of every rank-local box of the report's tensors (0-dim ones left out: the Reader
    reads those whole and does not count them)."""
    return sum(getattr(torch, e["dtype"].removeprefix("torch.")).itemsize * math.prod(e["box"][1])
               for e in report["entries"].values() if e["shape"])


# ------------------------------------------------------------------ 1. DeepSpeed ZeRO-3

#: (variant, the world DeepSpeed wrote it at, the world FSDP2 loads it at)
ZERO3 = [("z3-fp32", 3, 2), ("z3-fp32", 2, 3), ("z3-bf16", 2, 3)]


@pytest.mark.slow
@pytest.mark.parametrize("name,world,nproc", ZERO3, ids=[f"{n}-w{w}-to{p}" for n, w, p in ZERO3])
def test_zero3_loads_into_fsdp2_as_deepspeed_sees_it(deepspeed_ckpts, tmp_path, name, world,
                                                      nproc):
    v = deepspeed_ckpts.variant(name, world)
    assert v.stage == 3 and nproc != v.world
    ranks = torchrun_load(tmp_path, nproc, "--model", "tinylm", "--ckpt", v.tag_dir,
                          "--full")["ckptctl"]
    digests = [{k: e["full_sha256"] for k, e in r["entries"].items()} for r in ranks]
    assert all(d == digests[0] for d in digests), "the ranks' full tensors differ"
    emb = [r["entries"]["model.emb.weight"] for r in ranks]  # sharded at nproc, not at world
    assert {tuple(e["placements"]) for e in emb} == {("S(0)",)}
    assert len({json.dumps(e["box"]) for e in emb}) == nproc
    full = torch.load(tmp_path / "ckptctl.full.pt", weights_only=False)  # rank 0's

    # the weights: zero_to_fp32's, every name (tied alias, frozen, buffer) included
    z = v.load_zero_to_fp32()
    model = {k.removeprefix("model."): t for k, t in full.items() if k.startswith("model.")}
    assert sorted(model) == sorted(z) == _model_names(v)
    # (z3-bf16: zero_to_fp32 gives the frozen params in bf16, the fp32 model holds them
    # widened; _widened takes the narrower tensor first)
    bad = [n for n, want in z.items() if not _widened(want, model[n])]
    assert bad == []

    # Adam's state: DeepSpeed's safe_get_full_optimizer_state after load_checkpoint
    oracle = v.load_full()
    trainable = v.entry["trainable"]
    state = {k.removeprefix("optim.state."): t for k, t in full.items()
             if k.startswith("optim.state.")}
    assert sorted(state) == sorted(f"{n}.{k}" for n in trainable for k in ADAM)
    bad = [(n, k) for n in trainable for k in ADAM
           if not _same(state[f"{n}.{k}"], oracle[f"{k}.{n}"])]
    assert bad == []

    # the param groups: DeepSpeed's (write_deepspeed.param_groups), params by fqn, and the lr
    # DeepSpeed's linear WarmupLR (1e-3 -> 1e-2 over 10 steps) set at its last step (2)
    groups = full["optim.param_groups"]
    assert [(g["params"], g["weight_decay"], g["betas"]) for g in groups] == [
        (["emb.weight", "fc1.weight"], 0.1, (0.9, 0.95)),
        (["norm.weight", "norm.bias", "fc1.bias"], 0.0, (0.9, 0.95))]
    assert oracle["lr_scheduler"]["last_batch_iteration"] == 2
    assert [g["lr"] for g in groups] == [pytest.approx(1e-3 + 9e-3 * 2 / 10)] * 2


#: torchtitan 0.3.0 and what its checkpointer imports (tyro, spmd_types), unpacked with no
#: dependencies into a folder of the venv by the Makefile (its own requirements pull wandb,
#: tensorboard and datasets, which the checkpointer does not use)
TORCHTITAN = Path(sys.prefix) / "torchtitan-0.3.0"


def test_torchtitans_checkpointer_starts_from_a_zero3_checkpoint(deepspeed_ckpts, tmp_path):
    """torchtitan's own CheckpointManager, its initial load pointed at a DeepSpeed ZeRO-3 tag
    written at 3 ranks, loads through the Reader (its state-dict adapter's storage reader) into
    FSDP2 at 2 ranks the weights zero_to_fp32 gives, every name, NaN-poisoned first."""
    if not TORCHTITAN.is_dir():
        pytest.skip(f"no {TORCHTITAN} (make venv unpacks torchtitan there)")
    v = deepspeed_ckpts.variant("z3-fp32", 3)
    _torchrun(tmp_path, WORKER.with_name("load_with_torchtitan.py"), 2,
              "--ckpt", str(Path(v.tag_dir).resolve()), "--out", str(tmp_path),
              pythonpath=str(TORCHTITAN))
    ranks = [json.loads((tmp_path / f"torchtitan.rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["loaded"] for r in ranks] == [True, True]
    assert ranks[0]["placements"]["emb.weight"] == ["S(0)"]
    full = torch.load(tmp_path / "torchtitan.pt", weights_only=True)
    z = v.load_zero_to_fp32()
    assert sorted(full) == sorted(z)
    assert [n for n, want in z.items() if not _same(want, full[n])] == []


# ------------------------------------------------------------------ 2. DCP at another mesh

#: (layout the 2-D checkpoint is loaded at, ranks): FSDP2 over 3 (the 1001-row vocabulary
#: splits unevenly) and TP over 2 (norms replicated, plain tensors)
MESHES = [("fsdp", 3), ("tp", 2)]


@pytest.mark.slow
@pytest.mark.parametrize("layout,nproc", MESHES, ids=[f"{m}{n}" for m, n in MESHES])
def test_a_2d_dcp_checkpoint_loads_at_another_mesh_as_torch_loads_it(torch_ckpts, tmp_path,
                                                                      layout, nproc):
    out = torchrun_load(tmp_path, nproc, "--model", "transformer", "--layout", layout,
                        "--ckpt", torch_ckpts.dcp["2d"], readers="ckptctl,torch")
    for r, (got, want) in enumerate(zip(out["ckptctl"], out["torch"])):
        assert got["entries"].keys() == want["entries"].keys()
        assert any(k.startswith("optim.state.") for k in want["entries"])
        # full tensors and this rank's local shard: digests of dtype, shape and raw bytes
        bad = sorted(k for k in want["entries"] if got["entries"][k] != want["entries"][k])
        assert bad == [], f"rank {r}: {len(bad)} entries differ, first {bad[:5]}"
        assert got["objects"] == want["objects"] and "optim.param_groups" in got["objects"]
        assert [k for k, e in got["entries"].items() if e["nan"]] == [], f"rank {r}: unloaded"
        assert got["bytes_read"] == _local_bytes(got), f"rank {r} read beyond its own shards"
    placements = {tuple(e["placements"] or ()) for e in out["ckptctl"][0]["entries"].values()}
    if layout == "fsdp":  # one 1-D mesh, not the writer's strided _S(0, 2) / S(0) x S(1)
        assert placements == {("S(0)",), ()}
    else:
        assert ("S(1)",) in placements and ("S(0)",) in placements


# ------------------------------------------------------------------ 3. Megatron torch_dist


@pytest.mark.parametrize("layout,release", RUNS,
                         ids=[n + (f"-{r}" if r else "") for n, r in RUNS])
def test_megatron_torch_dist_loads_as_load_plain_tensors(megatron_ckpts, layout, release):
    from torch.distributed.checkpoint import load

    from ckptctl.dcp import Reader

    run = megatron_ckpts.dist(layout, release)
    plain = _plain_tensors(run)
    assert plain and any(k.startswith("optimizer.") for k in plain)
    sd = {k: torch.full_like(t, float("nan")) if t.is_floating_point() else torch.full_like(t, -7)
          for k, t in plain.items()}
    reader = Reader(run.iter_dir(20))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process
        load(sd, storage_reader=reader)
    assert [k for k, want in plain.items() if not _same(sd[k], want)] == []
    assert reader.bytes_read == sum(t.numel() * t.element_size() for t in plain.values()
                                    if t.dim())


# ------------------------------------------------------------------ 4. checks shared by ranks


def _two_file_dcp(path: Path) -> dict:
    """A DCP checkpoint saved by one process: every tensor in one file (both ranks of a
    2-rank load read from it)."""
    from conftest import dcp_save

    g = torch.Generator().manual_seed(3)
    sd = {"model": {"w": torch.randn(64, 16, generator=g), "v": torch.randn(32, generator=g)}}
    dcp_save(path, sd)
    return sd


def _checks(tmp_path: Path, ckpt: Path, nproc: int = 2) -> list[dict]:
    _torchrun(tmp_path, WORKER.with_name("reader_checks.py"), nproc, "--ckpt", str(ckpt),
              "--out", str(tmp_path))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.slow
def test_ranks_check_each_file_once_and_all_refuse_a_bad_one(tmp_path, cli):
    """Sealed: the one data file both ranks read is hashed by one rank only, and its verdict
    reaches the other before either loads; a flipped byte there makes both ranks raise with
    nothing written."""
    from test_dcp_reader import _flip_data_byte

    sd = _two_file_dcp(tmp_path / "ck")
    assert cli("seal", str(tmp_path / "ck"))[0] == 0
    size = (tmp_path / "ck" / "__0_0.distcp").stat().st_size
    good = _checks(tmp_path / "good", tmp_path / "ck") if (tmp_path / "good").mkdir() is None \
        else None
    assert [r["error"] for r in good] == [None, None]
    assert sorted(r["bytes_checked"] for r in good) == [0, size]  # once, by one rank
    assert sum(r["bytes_read"] for r in good) == (64 * 16 + 32) * 4  # each its own shard
    _flip_data_byte(tmp_path / "ck", sd["model"]["w"])
    (tmp_path / "bad").mkdir()
    bad = _checks(tmp_path / "bad", tmp_path / "ck")
    assert [r["error"] for r in bad] == ["HASH_MISMATCH"] * 2, bad
    assert not any(r["written"] for r in bad)
