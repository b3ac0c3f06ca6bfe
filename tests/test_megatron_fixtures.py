"""The Megatron fixtures themselves (tests/fixtures_megatron.py): the files megatron-core wrote
are there and named as Megatron names them, and megatron's own views of them agree with each
other bitwise (``load_plain_tensors``, ``load_common_state_dict``, every rank's live shards at
save time, ``dist_checkpointing.load`` at another TP/PP grid), and the legacy generator's
split rules are megatron-core's own (checked against megatron's TP=2 shards)."""

import importlib.util

import pytest

torch = pytest.importorskip("torch")

from fixtures_megatron import GENERATORS, ITERATIONS, LAYOUTS  # noqa: E402

_spec = importlib.util.spec_from_file_location("write_megatron_legacy",
                                               GENERATORS / "write_megatron_legacy.py")
legacy_writer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(legacy_writer)

GRIDS = {"tp2": (2, 1), "pp2": (1, 2)}  # layout -> (tp, pp) of the run that wrote it


def _layer(keys: dict, name: str):
    """The global layer of local module ``name`` (None outside decoder.layers): a factory
    (SwiGLU fc1) carries no offset, so take it from a sibling ShardedTensor of its layer."""
    if not name.startswith("decoder.layers."):
        return None
    prefix = name.split(".")[2]
    for n, k in keys.items():
        if n.split(".")[2:3] == [prefix] and n.startswith("decoder.layers.") and \
                "global_offset" in k and k["prepend_axis_num"] == 1:
            return k["global_offset"][0]
    raise AssertionError(name)


def _expected(keys: dict, name: str, full: dict, tp: int, tp_rank: int, prefix: str = ""):
    """This rank's tensor ``name`` cut out of megatron's full tensors ``full``."""
    k = keys[name]
    layer = _layer(keys, name)
    t = full[prefix + k["key"]]
    if layer is not None:
        t = t[layer]
    if k.get("factory"):  # SwiGLU fc1: [gate_t; up_t], the legacy writer's rule
        return legacy_writer.split(name, t, tp, tp_rank)
    offset, shape = k["global_offset"][k["prepend_axis_num"]:], k["local_shape"]
    return t[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


# -- torch_dist ---------------------------------------------------------------------------


def test_every_run_is_there(megatron_ckpts):
    assert megatron_ckpts.dist_names() == list(LAYOUTS)
    for name in LAYOUTS:
        r = megatron_ckpts.dist(name)
        assert (r.tp, r.pp, r.world) == (*GRIDS[name], 2)
        assert r.entry["megatron_core"] == "0.16.1"


@pytest.mark.parametrize("name", LAYOUTS)
def test_run_layout_is_megatrons(megatron_ckpts, name):
    r = megatron_ckpts.dist(name)
    assert (r.run / "latest_checkpointed_iteration.txt").read_text() == "20" == r.entry["tracker"]
    assert sorted(p.name for p in r.run.iterdir()) == [
        "iter_0000010", "iter_0000020", "latest_checkpointed_iteration.txt"]
    for it in ITERATIONS:
        d = r.iter_dir(it)
        names = sorted(p.name for p in d.iterdir())
        # two files per rank (the writer's default thread_count=2), global metadata, common
        distcp = [f"__{rank}_{t}.distcp" for rank in range(r.world) for t in range(2)]
        assert names == sorted([".metadata", "common.pt", "metadata.json", *distcp])
        assert names == r.iteration(it)["files"]
        assert r.iteration(it)["metadata_json"]["sharded_backend"] == "torch_dist"
        assert r.iteration(it)["integrity_json"] is False
        assert r.plain(it).is_file() and r.common(it).is_file() and r.live(it).is_file()
    for path in r.reloads.values():
        assert path.is_file()


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("it", ITERATIONS)
def test_common_state_is_the_non_tensor_part_of_plain(megatron_ckpts, name, it):
    r = megatron_ckpts.dist(name)
    plain, common = r.load_plain(it), r.load_common(it)
    assert sorted(common) == r.iteration(it)["common_keys"]
    for k, v in common.items():
        if k not in ("args", "optimizer"):
            assert plain[k] == v, k
    assert common["iteration"] == it and common["checkpoint_version"] == 3.0
    assert common["args"].tensor_model_parallel_size == r.tp
    assert common["args"].pipeline_model_parallel_size == r.pp
    assert common["args"].padded_vocab_size == r.entry["padded_vocab_size"]
    assert common["opt_param_scheduler"]["num_steps"] == it // 10
    assert int(common["optimizer"]["state"]["common_step"]) == it // 10
    assert [g["weight_decay"] for g in common["optimizer"]["param_groups"]] == [0.1, 0.0]
    assert common["content_metadata"] == r.iteration(it)["content_metadata"]
    tensors = {k: v for k, v in plain.items() if torch.is_tensor(v) and v.dim() > 0}
    assert sorted(tensors) == r.iteration(it)["plain_keys"]
    assert plain["embedding.word_embeddings.weight"].shape == (r.entry["padded_vocab_size"], 16)
    assert plain["decoder.layers.mlp.linear_fc1.weight"].shape == (2, 64, 16)  # layers stacked


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("it", ITERATIONS)
def test_plain_tensors_hold_every_ranks_live_shards(megatron_ckpts, name, it):
    """load_plain_tensors' full tensors, cut at each ShardedTensor's offset (and SwiGLU fc1
    by the legacy writer's rule), are exactly each rank's weights and Adam state at save."""
    r = megatron_ckpts.dist(name)
    plain, live, keys = r.load_plain(it), r.load_live(it), r.sharded_keys(it)
    for rank in range(r.world):
        mine, k = live[rank], keys[str(rank)]
        tensors = {n for n in k if "object" not in k[n]}
        assert tensors == set(mine["model"]), rank
        for n in tensors:
            assert torch.equal(_expected(k, n, plain, r.tp, mine["tp_rank"]),
                               mine["model"][n]), (rank, n)
            for state in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(
                    _expected(k, n, plain, r.tp, mine["tp_rank"], f"optimizer.state.{state}."),
                    mine["optim"][n][state]), (rank, n, state)


def test_iterations_differ(megatron_ckpts):
    r = megatron_ckpts.dist("tp2")
    a, b = r.load_plain(10), r.load_plain(20)
    assert not torch.equal(a["output_layer.weight"], b["output_layer.weight"])


@pytest.mark.parametrize("name", LAYOUTS)
def test_megatron_reloads_at_tp1_to_the_full_tensors(megatron_ckpts, name):
    """``dist_checkpointing.load`` on ONE rank at TP=1 PP=1 gives plain's full tensors (vocab
    rows beyond TP=1's padded size 128 dropped: allow_shape_mismatch)."""
    r = megatron_ckpts.dist(name)
    plain, keys = r.load_plain(20), r.sharded_keys(20)
    got = r.load_reload("tp1pp1")
    assert got["iteration"] == 20 and got["padded_vocab_size"] == 128
    assert got["scheduler"]["num_steps"] == 2
    assert (got["rng_state"] is None) == ((r.tp, r.pp) != (1, 1))
    model, optim = got[0]["model"], got[0]["optim"]
    seen = set()
    for rank in range(r.world):
        k = keys[str(rank)]
        for n in (n for n in k if "object" not in k[n]):
            layer = _layer(k, n)
            full_name = n if layer is None else ".".join(
                ["decoder", "layers", str(layer), *n.split(".")[3:]])
            t = plain[k[n]["key"]] if layer is None else plain[k[n]["key"]][layer]
            if n.endswith(("word_embeddings.weight", "output_layer.weight")):
                t = t[:128]
            assert torch.equal(model[full_name], t), full_name
            for state in ("exp_avg", "exp_avg_sq"):
                s = plain[f"optimizer.state.{state}.{k[n]['key']}"]
                s = s if layer is None else s[layer]
                if n.endswith(("word_embeddings.weight", "output_layer.weight")):
                    s = s[:128]
                assert torch.equal(optim[full_name][state], s), (full_name, state)
            seen.add(full_name)
    assert seen == set(model)


@pytest.mark.parametrize("name,grid,like", [("tp2", "tp1pp2", "pp2"), ("pp2", "tp2pp1", "tp2")])
def test_megatron_reloads_at_the_other_grid(megatron_ckpts, name, grid, like):
    """TP=2 -> PP=2 and PP=2 -> TP=2 on 2 ranks: each rank's loaded shards are plain's full
    tensors cut as the run written at that grid cuts them (its sharded_keys)."""
    r, other = megatron_ckpts.dist(name), megatron_ckpts.dist(like)
    plain, keys = r.load_plain(20), other.sharded_keys(20)
    got = r.load_reload(grid)
    assert got["rng_state"] is None and got["iteration"] == 20
    vocab = plain["embedding.word_embeddings.weight"].shape[0]
    for rank in range(2):
        mine, k = got[rank], keys[str(rank)]
        assert set(mine["model"]) == {n for n in k if "object" not in k[n]}
        for n, t in mine["model"].items():
            if n.endswith(("word_embeddings.weight", "output_layer.weight")):
                # allow_shape_mismatch: the rows the checkpoint has, zeros past its vocab
                off = k[n]["global_offset"][0]
                have = max(0, min(vocab - off, t.shape[0]))
                assert torch.equal(t[:have], plain[k[n]["key"]][off:off + have]), (rank, n)
                assert not t[have:].any(), (rank, n)
                continue
            assert torch.equal(t, _expected(k, n, plain, other.tp, mine["tp_rank"])), (rank, n)


# -- legacy ----------------------------------------------------------------------------------


def _load(path):
    return torch.load(path, weights_only=False, map_location="cpu")


def test_every_legacy_run_is_there(megatron_ckpts):
    assert sorted(megatron_ckpts.legacy_names()) == ["legacy-tp2-distopt", "legacy-tp2pp2", "legacy-tp4"]


def test_legacy_layout_is_megatrons(megatron_ckpts):
    a = megatron_ckpts.legacy("legacy-tp2pp2")
    assert (a.run / "latest_checkpointed_iteration.txt").read_text() == "20"
    for it in ("iter_0000010", "iter_0000020"):
        assert sorted(p.name for p in (a.run / it).iterdir()) == [
            "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    b = megatron_ckpts.legacy("legacy-tp4")
    assert (b.run / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert sorted(p.name for p in (b.run / "release").iterdir()) == [
        f"mp_rank_{t:02d}" for t in range(4)]
    for run in (a, b):
        assert all(f.is_file() and f.name == "model_optim_rng.pt" for f in run.files)


def _join(name: str, shards: list) -> torch.Tensor:
    """Inverse of the TP split, written independently of ``split``."""
    if name.endswith(legacy_writer.SWIGLU):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if name.endswith(legacy_writer.COLUMN):
        return torch.cat(shards, dim=0)
    if name.endswith(legacy_writer.ROW):
        return torch.cat(shards, dim=1)
    assert all(torch.equal(s, shards[0]) for s in shards), name
    return shards[0]


@pytest.mark.parametrize("name", ["legacy-tp2pp2", "legacy-tp4", "legacy-tp2-distopt"])
def test_legacy_shards_join_to_the_full_tensors(megatron_ckpts, name):
    run = megatron_ckpts.legacy(name)
    truth = run.load_full()
    full, per = truth["model"], truth["layers_per_stage"]
    folder = "release" if run.entry["release"] else "iter_0000020"
    joined = {}
    for p in range(run.pp):
        files = [_load(run.run / folder / (f"mp_rank_{t:02d}" + (f"_{p:03d}" if run.pp > 1
                                                                   else ""))
                       / "model_optim_rng.pt") for t in range(run.tp)]
        for f in files:
            assert f["checkpoint_version"] == 3.0 and f["iteration"] == 20
            assert f["args"].tensor_model_parallel_size == run.tp
            assert ("optimizer" in f) == bool(run.entry["optimizer"]) == ("rng_state" in f)
        assert list(files[0]["model"]) == run.entry["names"][f"0_{p}"]
        for n, v in files[0]["model"].items():
            if n.endswith("_extra_state"):
                assert (v is None) == (run.entry["spec"] == "local")
                continue
            g = n
            if n.startswith("decoder.layers."):
                i, rest = n[len("decoder.layers."):].split(".", 1)
                g = f"decoder.layers.{int(i) + p * per}.{rest}"
            joined[g] = _join(n, [f["model"][n] for f in files])
            if run.entry["optimizer"] is True:
                index = {v2: int(k2) for k2, v2 in truth["optim_index"][f"0_{p}"].items()}
                for state in ("exp_avg", "exp_avg_sq"):
                    shards = [f["optimizer"]["state"][index[n]][state] for f in files]
                    assert torch.equal(_join(n, shards), truth["optim"][20][g][state]), (g, state)
    assert set(joined) == set(full)
    for g, t in full.items():
        assert torch.equal(joined[g], t), g
    assert full["embedding.word_embeddings.weight"].shape[0] == run.entry["padded_vocab_size"]


def test_distributed_optimizer_buckets_hold_each_ranks_shards_in_grad_buffer_order(
        megatron_ckpts):
    """distrib_optim.pt (get_parameter_state_dp_zero's layout): per TP rank, one fp32
    buffer whose param / exp_avg / exp_avg_sq are the rank's shards flattened in the
    recorded order, and the rank file's optimizer holds the param groups only."""
    run = megatron_ckpts.legacy("legacy-tp2-distopt")
    truth = run.load_full()
    for t in range(run.tp):
        rank = run.run / "iter_0000020" / f"mp_rank_{t:02d}"
        f, d = _load(rank / "model_optim_rng.pt"), _load(rank / "distrib_optim.pt")
        assert set(f["optimizer"]) == {"optimizer"} and "state" not in f["optimizer"]["optimizer"]
        assert all("params" not in g and g["step"] == 1
                   for g in f["optimizer"]["optimizer"]["param_groups"])
        assert f["args"].use_distributed_optimizer is True
        assert d["buckets_coalesced"] is True and set(d) == {"buckets_coalesced", 0}
        bucket = d[0][torch.float32]
        order = truth["distopt_order"][f"{t}_0"]
        want = torch.cat([f["model"][n].reshape(-1) for n in order])
        assert torch.equal(bucket["param"], want) and bucket["numel_unpadded"] == want.numel()
        assert bucket["exp_avg"].shape == bucket["exp_avg_sq"].shape == want.shape
