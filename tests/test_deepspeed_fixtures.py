"""The DeepSpeed fixtures themselves (tests/fixtures_deepspeed.py): the files DeepSpeed wrote
are there and named as DeepSpeed names them, and DeepSpeed's own views of them agree with
each other bitwise (zero_to_fp32, ``load_checkpoint`` + ``safe_get_full_*``, ds_to_universal,
and a universal resume at another world size)."""

import math

import pytest

torch = pytest.importorskip("torch")

W2 = ("z1-fp32", "z2-fp32", "z3-fp32", "z1-bf16", "z2-bf16", "z3-bf16", "z2-fp16",
      "z1-bf16-accfp32")
W3 = ("z2-fp32", "z3-fp32")
ALL = [(n, 2) for n in W2] + [(n, 3) for n in W3]
STATES = ("param", "exp_avg", "exp_avg_sq", "step")


def _load(path):
    """A DeepSpeed file: its pickles name deepspeed classes (LossScaler, ZeroStageEnum,
    fragment_address), so only the full unpickler reads them."""
    pytest.importorskip("deepspeed")
    return torch.load(path, weights_only=False, map_location="cpu")


def _model_states(v):
    return v.tag_dir / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if v.stage == 3
                        else "mp_rank_00_model_states.pt")


def test_every_variant_is_there(deepspeed_ckpts):
    assert sorted(deepspeed_ckpts.names(2)) == sorted(W2)
    assert sorted(deepspeed_ckpts.names(3)) == sorted(W3)


@pytest.mark.parametrize("name,world", ALL)
def test_files_are_named_as_deepspeed_names_them(deepspeed_ckpts, name, world):
    v = deepspeed_ckpts.variant(name, world)
    assert (v.save_dir / "latest").read_text() == v.tags[-1] == "global_step3"
    assert (v.save_dir / "zero_to_fp32.py").is_file()
    prefix = "bf16_" if v.dtype.startswith("bf16") else ""  # fp16 files carry no prefix
    optim = {f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)}
    model = ({f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)}
             if v.stage == 3 else {"mp_rank_00_model_states.pt"})
    assert {p.name for p in v.tag_dir.iterdir()} == optim | model
    for rel in v.entry["files"]:
        assert (v.save_dir / rel).is_file(), rel
    assert v.full.is_file()
    assert (v.zero_to_fp32 is None) == (name == "z1-bf16-accfp32")


def test_two_tags_and_latest(deepspeed_ckpts):
    v = deepspeed_ckpts.variant("z2-fp32")
    assert v.tags == ["global_step2", "global_step3"]
    assert sorted(p.name for p in v.save_dir.glob("global_step*")) == v.tags
    assert (v.save_dir / "latest").read_text() == "global_step3"
    two = _load(v.save_dir / "global_step2" / "mp_rank_00_model_states.pt")
    three = _load(v.tag_dir / "mp_rank_00_model_states.pt")
    assert (two["global_steps"], three["global_steps"]) == (2, 3)


@pytest.mark.parametrize("name,world", [x for x in ALL if x[0] != "z1-bf16-accfp32"])
def test_zero_to_fp32_equals_safe_get_full_fp32_param(deepspeed_ckpts, name, world):
    v = deepspeed_ckpts.variant(name, world)
    full, z = v.load_full(), v.load_zero_to_fp32()
    trainable = v.entry["trainable"]
    for n in trainable:
        assert z[n].dtype == torch.float32
        assert torch.equal(z[n], full[f"param.{n}"]), n
    # tied: both names, equal (zero_to_fp32 aliases the stored one)
    assert torch.equal(z["head.weight"], z["emb.weight"])
    assert torch.equal(z["pos_scale"], full["buffer.pos_scale"])
    if v.stage == 1:  # ZeRO-1 saves no frozen_param_*: zero_to_fp32 drops frozen params
        assert not set(v.entry["frozen"]) & set(z)
    else:  # frozen params come back in the working dtype, not fp32
        for n in v.entry["frozen"]:
            assert torch.equal(z[n], full[f"module16.{n}"]), n
    assert set(z) == set(trainable) | set(v.entry["tied"]) | set(v.entry["buffers"]) | (
        set() if v.stage == 1 else set(v.entry["frozen"]))


@pytest.mark.parametrize("name,world", ALL)
def test_full_oracle(deepspeed_ckpts, name, world):
    v = deepspeed_ckpts.variant(name, world)
    full = v.load_full()
    assert full["global_steps"] == 3
    assert full["lr_scheduler"] == {"last_batch_iteration": 2}
    assert {k: full["client_state"][k] for k in ("epoch", "note")} == {"epoch": 1, "note": "x"}
    lp = {"fp32": torch.float32, "fp16": torch.float16}.get(v.dtype, torch.bfloat16)
    for n in v.entry["trainable"]:
        assert all(f"{s}.{n}" in full for s in STATES)
        assert full[f"param.{n}"].shape == torch.Size(v.entry["params"][n])
        assert full[f"exp_avg_sq.{n}"].min() >= 0 and full[f"exp_avg.{n}"].abs().sum() > 0
        assert float(full[f"step.{n}"]) == 3.0
        assert torch.equal(full[f"module16.{n}"], full[f"param.{n}"].to(lp)), n
    for n in v.entry["frozen"]:
        assert f"param.{n}" not in full and full[f"module16.{n}"].dtype == lp


@pytest.mark.parametrize("name,world", ALL)
def test_partitions_are_padded(deepspeed_ckpts, name, world):
    v = deepspeed_ckpts.variant(name, world)
    numel = v.entry["numel"]
    assert all(numel[n] % world for n in numel)  # every param's numel prime to the world size
    prefix = "bf16_" if v.dtype.startswith("bf16") else ""
    last = _load(v.tag_dir / f"{prefix}zero_pp_rank_{world - 1}_mp_rank_00_optim_states.pt")
    osd = last["optimizer_state_dict"]
    shapes = _load(_model_states(v))["param_shapes"]
    if v.stage == 3:  # each param padded to ceil(numel / world) on every rank
        want = [sum(math.ceil(s.numel() / world) for s in g.values()) for g in shapes]
        assert [t.numel() for t in osd["fp32_flat_groups"]] == want
        assert sum(want) * world > sum(numel[n] for n in v.entry["trainable"])
    else:  # the flat group is padded at its end, on the last rank
        assert sum(osd["group_paddings"]) > 0
        moments = [s["exp_avg"].numel() for s in osd["base_optimizer_state"]["state"].values()]
        fp32 = [t.numel() for t in osd["single_partition_of_fp32_groups"]]
        if v.dtype == "bf16-accfp32":  # BF16_Optimizer keeps the padding in the fp32 partition
            assert fp32 == moments
        else:  # ZeRO-1/2 saves its fp32 partition without the padding
            assert [m - u for m, u in zip(moments, fp32)] == osd["group_paddings"]


@pytest.mark.parametrize("name,world", ALL)
def test_frozen_tied_and_buffer_are_recorded(deepspeed_ckpts, name, world):
    v = deepspeed_ckpts.variant(name, world)
    assert v.entry["tied"] == {"head.weight": "emb.weight"}
    assert v.entry["frozen"] == ["frozen.weight", "frozen.bias"]
    ms = _load(_model_states(v))  # ZeRO-3: rank 0's (only it records shared_params)
    assert ms["shared_params"] == {"head.weight": "emb.weight"}
    assert ms["buffer_names"] == ["pos_scale"]
    assert {"emb.weight", "head.weight", "pos_scale", *v.entry["frozen"]} <= set(ms["module"])
    trainable = [n for g in ms["param_shapes"] for n in g]
    assert sorted(trainable) == sorted(v.entry["trainable"]) and "frozen.weight" not in trainable
    if v.stage == 1:
        assert ms["frozen_param_shapes"] is None
    else:
        assert list(ms["frozen_param_shapes"]) == v.entry["frozen"]
    if v.stage < 3:  # the module holds the tied pair as one storage
        m = ms["module"]
        ptr = [m[n].untyped_storage().data_ptr() for n in ("head.weight", "emb.weight")]
        assert ptr[0] == ptr[1]
    else:  # partitioned params are 0-element placeholders in ZeRO-3 model states
        assert ms["module"]["emb.weight"].numel() == 0 and ms["module"]["pos_scale"].numel() == 13


def test_fp16_has_a_dynamic_loss_scaler(deepspeed_ckpts):
    v = deepspeed_ckpts.variant("z2-fp16")
    osd = _load(v.tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert type(osd["loss_scaler"]).__name__ == "DynamicLossScaler" and osd["dynamic_loss_scale"]
    assert osd["loss_scaler"].cur_scale == 256


def test_zero_to_fp32_refuses_bf16_optimizer(deepspeed_ckpts):
    v = deepspeed_ckpts.variant("z1-bf16-accfp32")
    assert "is not a zero checkpoint" in v.entry["zero_to_fp32_refused"]
    osd = _load(v.tag_dir / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    osd = osd["optimizer_state_dict"]
    assert "zero_stage" not in osd and "single_partition_of_fp32_groups" in osd


def test_zero_to_fp32_script_equals_function(deepspeed_ckpts):
    v = deepspeed_ckpts.variant("z3-fp32")
    script_out = v.root / v.entry["zero_to_fp32_script"] / "pytorch_model.bin"
    got = torch.load(script_out, weights_only=True)
    want = v.load_zero_to_fp32()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("name,world", [(n, w) for n in ("z2-fp32", "z3-fp32") for w in (2, 3)])
def test_universal_matches_the_oracle(deepspeed_ckpts, name, world):
    """ds_to_universal's zero/<param>/*.pt hold the same full tensors DeepSpeed gathers."""
    v = deepspeed_ckpts.variant(name, world)
    assert (v.universal / "latest_universal").read_text() == v.universal_tag.name
    full = v.load_full()
    for n in v.entry["trainable"]:
        for key, state in (("fp32", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            d = torch.load(v.universal_tag / "zero" / n / f"{key}.pt", weights_only=True)
            want = full[f"{state}.{n}"]
            if v.stage == 3:  # ZeRO-3's conversion writes bare flat tensors
                assert torch.equal(d, want.flatten()), (n, key)
            else:  # ZeRO-1/2's: {"param": tensor in the param's shape, "cat_dim": 0}
                assert d.keys() == {"param", "cat_dim"} and torch.equal(d["param"], want), (n, key)
        step = v.universal_tag / "zero" / n / "step.pt"
        if v.stage == 3:
            assert not step.exists()
        else:
            assert torch.equal(torch.load(step, weights_only=True), full[f"step.{n}"])


@pytest.mark.parametrize("name,world", [(n, w) for n in ("z2-fp32", "z3-fp32") for w in (2, 3)])
def test_universal_resumes_at_the_other_world_size(deepspeed_ckpts, name, world):
    v = deepspeed_ckpts.variant(name, world)
    other = 5 - world
    assert set(v.resumed) == {other}
    got, want = torch.load(v.resumed[other], weights_only=False), v.load_full()
    assert got["world"] == other and got["universal"] and got["global_steps"] == 3
    for n in v.entry["trainable"]:
        for s in STATES + ("module16",):
            a, b = (torch.as_tensor(x[f"{s}.{n}"]) for x in (got, want))
            assert torch.equal(a, b), (s, n)
    assert got["lr_scheduler"] == want["lr_scheduler"]
    # DeepSpeed's ZeRO-3 universal loader copies param group 0's settings into every group
    wd = [g["weight_decay"] for g in got["param_groups"]]
    assert wd == ([0.1, 0.1] if v.stage == 3 else [0.1, 0.0])


TP = [("tp2-z1-fp32", 4), ("tp2-z2-bf16", 4), ("tp2-z3-fp32", 4), ("tp4-z2-fp32", 4),
      ("tp2-z2-fp32", 2)]


def test_every_tp_variant_is_there(deepspeed_ckpts):
    assert sorted(deepspeed_ckpts.tp_names(4)) == sorted(n for n, w in TP if w == 4)
    assert sorted(deepspeed_ckpts.tp_names(2)) == sorted(n for n, w in TP if w == 2)


@pytest.mark.parametrize("name,world", TP)
def test_tp_files_and_oracles(deepspeed_ckpts, name, world):
    """Tag files per (dp, tp) rank as DeepSpeed names them; each TP rank's load_checkpoint
    view holds that rank's shards; the ZeRO partitions are padded at DP=2."""
    v = deepspeed_ckpts.tp(name, world)
    tp, dp = v.tp, v.dp
    assert tp * dp == world and (v.save_dir / "latest").read_text() == "global_step3"
    prefix = "bf16_" if v.dtype == "bf16" else ""
    optim = {f"{prefix}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt"
             for d in range(dp) for t in range(tp)}
    model = ({f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt" for d in range(dp)
              for t in range(tp)} if v.stage == 3
             else {f"mp_rank_{t:02d}_model_states.pt" for t in range(tp)})
    assert {p.name for p in v.tag_dir.iterdir()} == optim | model == set(v.entry["tag_files"])
    assert sorted(v.full) == list(range(tp))
    lp = torch.bfloat16 if v.dtype == "bf16" else torch.float32
    splits = {v.entry["split"][n] for n in v.entry["logical_params"]}
    assert splits == {"column", "row", "replicated"}
    for t in range(tp):
        full = v.load_full(t)
        assert (full["tp_rank"], full["dp_rank"], full["global_steps"]) == (t, 0, 3)
        assert full["lr_scheduler"] == {"last_batch_iteration": 2}
        assert {k: full["client_state"][k] for k in ("epoch", "note")} == {"epoch": 1, "note": "x"}
        for n in v.entry["trainable"]:
            assert list(full[f"param.{n}"].shape) == v.entry["shard_shapes"][n][t], n
            assert torch.equal(full[f"module16.{n}"], full[f"param.{n}"].to(lp)), n
            assert full[f"exp_avg_sq.{n}"].min() >= 0 and float(full[f"step.{n}"]) == 3.0
        for n in v.entry["frozen"]:
            assert f"param.{n}" not in full and full[f"module16.{n}"].dtype == lp
        assert "buffer.pos_scale" in full
        ms = _load(v.tag_dir / ((f"zero_pp_rank_0_mp_rank_{t:02d}_model_states.pt") if v.stage == 3
                                else f"mp_rank_{t:02d}_model_states.pt"))
        # only global rank 0's file records the tie (every one holds both names)
        assert ms["shared_params"] == ({"head.weight": "emb.weight"} if t == 0 else {})
        assert {"head.weight", "emb.weight", "pos_scale"} <= set(ms["module"])
        assert ms["mp_world_size"] == tp and ms["dp_world_size"] == dp
        if dp == 2:
            osd = _load(v.tag_dir / f"{prefix}zero_pp_rank_1_mp_rank_{t:02d}_optim_states.pt")
            osd = osd["optimizer_state_dict"]
            if v.stage == 3:
                trainable = sum(math.prod(s) for n, s in v.entry["shard_shapes"].items()
                                if n in v.entry["trainable"] for s in [s[t]])
                assert sum(x.numel() for x in osd["fp32_flat_groups"]) * dp > trainable
            else:
                assert sum(osd["group_paddings"]) > 0
    assert isinstance(v.entry["zero_to_fp32_view"], str)  # zero_to_fp32 refuses TP


@pytest.mark.parametrize("name,world", TP)
def test_tp_universal_is_the_join_of_the_tp_ranks(deepspeed_ckpts, name, world):
    """ds_to_universal's zero/<param>/*.pt (full logical tensors) are the TP ranks'
    load_checkpoint views concatenated along the split dim (replicated: all equal)."""
    v = deepspeed_ckpts.tp(name, world)
    assert (v.universal / "latest_universal").read_text() == v.universal_tag.name
    fulls = [v.load_full(t) for t in range(v.tp)]
    for n in v.entry["trainable"]:
        dim = v.entry["split_dim"][n]
        for key, state in (("fp32", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            d = torch.load(v.universal_tag / "zero" / n / f"{key}.pt", weights_only=True)
            parts = [f[f"{state}.{n}"] for f in fulls]
            if dim is None:
                assert all(torch.equal(p, parts[0]) for p in parts), (n, key)
                want = parts[0]
            else:
                want = torch.cat(parts, dim)
            assert list(want.shape) == v.entry["logical_params"][n]
            assert d.keys() == {"param"} and torch.equal(d["param"], want), (n, key)
        assert (v.universal_tag / "zero" / n / "step.pt").exists() == (v.stage < 3)
    assert v.entry["universal_unused_patterns"] == [r"^layers\.1\.norm\.bias$",
                                                    r"^layers\.1\.norm\.weight$"]
