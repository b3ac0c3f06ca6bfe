"""Shared-reference pickles cost what their bytes cost (issue 34, part 2): a ~2 KB
``torch.save`` file whose dict names the same dict twice, 22 levels deep, flattens to 4M
entries. Every reader refuses it by name in one line, before any walk; a listing of a root
holding it costs what a small file costs. The CLI checks run the real CLI in a
subprocess, bounded in peak RSS against the same verb on a healthy twin (the old behaviour
cost 50-90 s and 3-5 GB per verb) and, very loosely, in wall time.
"""
from __future__ import annotations

import io
import json
import pickle
import tracemalloc
from pathlib import Path

import pytest

from ckptctl.formats.limits import MAX_SHARED_NODES
from ckptctl.formats.safe_pickle import GraphBoundError, check_graph, loads_primitive
from ckptctl.formats.torchsave import flatten
from conftest import run_measured
from fixtures_megatron import NEXT_VERSION
from fixtures_torch import copy_ckpt

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
LEVELS = 22  # the file: 2**22 leaves
SECONDS = 20.0  # loose: a loaded CI machine; the old behaviour took 50-90 s
MORE_MB = 100  # what the hostile file may cost beyond its healthy twin
WORDS = "shared references"


def shared_tree(leaf, levels: int = LEVELS) -> dict:
    """``{"x": d, "y": d}`` around ``{"a": leaf}``, ``levels`` deep: one dict per level
    in memory (and in a pickle), ``2 ** levels`` leaves to a walk."""
    d = {"a": leaf}
    for _ in range(levels):
        d = {"x": d, "y": d}
    return d


def _walked(v) -> int:
    """Nodes a naive recursive walk visits (the reference check_graph must agree with)."""
    if isinstance(v, dict) and v:
        return 1 + sum(_walked(x) for x in v.values())
    if isinstance(v, (list, tuple)) and v:
        return 1 + sum(_walked(x) for x in v)
    return 1


# ------------------------------------------------------------------ the bound itself


@pytest.mark.parametrize("levels", [0, 1, 5, 12])
def test_count_equals_what_a_walk_visits_without_walking(levels):
    t = (1, 2, 3)
    obj = {"tree": shared_tree([t, t], levels), "rng": list(range(1000)), "e": {}, "t": ()}
    assert check_graph(obj) == _walked(obj)


def test_tied_weights_and_shared_constants_still_flatten():
    w = torch.ones(3)
    betas = (0.9, 0.999)
    sub = {"w": w, "b": torch.zeros(1)}
    obj = {"model": {"emb": w, "head": w}, "ema": sub, "again": sub,
           "param_groups": [{"betas": betas, "lr": 0.1} for _ in range(50_000)]}
    flat = flatten(obj)
    assert flat["model.emb"] is flat["model.head"] is flat["ema.w"] is flat["again.w"]
    assert flat["param_groups.49999.betas"] == betas
    assert len(flat) == 2 + 4 + 2 * 50_000


def test_the_shared_tree_is_refused_before_any_walk():
    tree = shared_tree(1)
    tracemalloc.start()
    try:
        with pytest.raises(GraphBoundError, match=f"past {MAX_SHARED_NODES:,} nodes through "
                           "shared references") as e:
            flatten({"model": tree}, where="bomb.pt")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert e.value.path == "bomb.pt" and e.value.code == "UNSAFE_INPUT"
    assert peak < 4 << 20, peak  # the bookkeeping of ~23 dicts, not 4M entries


def test_just_inside_the_bound_still_reads():
    def revisits(levels: int) -> int:  # the second name of each level's subtree
        return sum(3 * 2 ** k - 1 for k in range(levels))

    levels = max(n for n in range(LEVELS) if revisits(n) <= MAX_SHARED_NODES)
    assert levels == 14 and check_graph(shared_tree(1, levels)) == 3 * 2 ** levels - 1
    assert len(flatten(shared_tree(1, levels))) == 2 ** levels
    with pytest.raises(GraphBoundError):
        flatten(shared_tree(1, levels + 1))


def test_a_long_list_named_again_and_again_is_refused():
    """One level of sharing is enough when the shared thing is long: each name of it
    makes a walk go through its items again."""
    items = list(range(10_000))
    check_graph({"a": [items] * 7})  # 6 more walks of 10,001 nodes: inside the bound
    with pytest.raises(GraphBoundError, match=WORDS):
        check_graph({"a": [items] * 8})


def test_a_dict_inside_itself_is_refused():
    d: dict = {"w": 1}
    d["self"] = d
    with pytest.raises(GraphBoundError, match="contains itself"):
        flatten({"model": d}, where="loop.pt")


def test_decoded_object_values_are_bounded_too():
    data = pickle.dumps(shared_tree(1))
    assert len(data) < 1000
    with pytest.raises(GraphBoundError, match=WORDS):
        loads_primitive(data, where="ckpt/__0_0.distcp: extra")


# ------------------------------------------------------------------ the CLI, measured


def _run(*args):
    """(exit code, stdout, stderr, wall s, peak RSS MiB) of ``ckptctl ARGS``; never a
    traceback."""
    code, out, err, wall, mb = run_measured(*args, timeout=10 * SECONDS, cwd=ROOT)
    assert "Traceback" not in err and "internal error" not in err, (args, err)
    assert wall < SECONDS, (args, wall, err)
    return code, out, err, mb


def _one_line(code: int, err: str, want_code: int, *words: str) -> None:
    assert code == want_code, (code, err)
    assert err.startswith("ckptctl: error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, err


def _lone_root(root: Path, tree) -> Path:
    """``step-1.pt`` (healthy) and ``bomb.pt`` holding ``tree`` as its model."""
    root.mkdir()
    torch.save({"model": {"w": torch.ones(2)}, "step": 1}, root / "step-1.pt")
    torch.save({"model": tree, "step": 5}, root / "bomb.pt")
    return root


def test_a_root_holding_the_lone_file_costs_what_its_size_costs(tmp_path):
    root = _lone_root(tmp_path / "run", shared_tree(torch.ones(2)))
    twin = _lone_root(tmp_path / "twin", shared_tree(torch.ones(2), 0))
    assert (root / "bomb.pt").stat().st_size < 4096  # the is 1,819 bytes
    for d in (root, twin):  # seal takes a folder: the file alone in one
        (d / "alone").mkdir()
        (d / "alone" / "model.pt").write_bytes((d / "bomb.pt").read_bytes())
    verbs = {"ls": ("ls", "{r}", "--json"), "latest": ("latest", "{r}"),
             "gc": ("gc", "{r}", "--keep-last", "1", "--dry-run"),
             "inspect": ("inspect", "{r}/bomb.pt"),
             "verify": ("verify", "{r}/bomb.pt", "--json"), "seal": ("seal", "{r}/alone")}
    got = {}
    for verb, args in verbs.items():
        base = _run(*(a.format(r=twin) for a in args))
        got[verb] = _run(*(a.format(r=root) for a in args))
        assert got[verb][3] < base[3] + MORE_MB, (verb, got[verb][3], base[3])
        assert base[0] == 0, (verb, base)

    code, out, err, _ = got["ls"]
    assert code == 0, err
    rows = {c["name"]: c for c in json.loads(out)["checkpoints"]}
    assert (rows["step-1.pt"]["state"], rows["bomb.pt"]["state"]) == ("complete", "corrupt")
    reason = rows["bomb.pt"]["reason"]
    assert reason.startswith("UNSAFE_INPUT: ") and WORDS in reason, reason
    code, out, err, _ = got["latest"]
    assert (code, out.strip()) == (0, str(root / "step-1.pt")), err
    code, out, err, _ = got["gc"]
    assert code == 0 and "0 to remove" in out, out + err
    code, _, err, _ = got["inspect"]
    _one_line(code, err, 3, "bomb.pt", WORDS)
    code, out, err, _ = got["verify"]
    assert code == 1 and [p["code"] for p in json.loads(out)["problems"]] == ["UNSAFE_INPUT"], out
    code, _, err, _ = got["seal"]
    _one_line(code, err, 1, "alone/model.pt", WORDS)
    assert sorted(p.name for p in (root / "alone").iterdir()) == ["model.pt"]  # nothing sealed


# ------------------------------------------------------------------ framework readers


def _add_tree(path: Path) -> None:
    """Add the shared tree to a torch.save'd dict (a fixture we wrote: full unpickler)."""
    sd = torch.load(path, weights_only=False)
    sd["bomb"] = shared_tree(torch.ones(2))
    torch.save(sd, path)


def _deepspeed(request, tmp_path):
    """The tree as DeepSpeed client state (``save_checkpoint(client_state=...)``)."""
    v = request.getfixturevalue("deepspeed_ckpts").variant("z2-fp32")
    run = copy_ckpt(v.save_dir, tmp_path / "run")
    f = run / v.tag_dir.name / "mp_rank_00_model_states.pt"
    _add_tree(f)
    return v.save_dir, run, f.parent, f.name


def _legacy(request, tmp_path):
    """The tree in one legacy Megatron rank file (``mp_rank_00_000/model_optim_rng.pt``)."""
    lr = request.getfixturevalue("megatron_ckpts").legacy("legacy-tp2pp2")
    run = copy_ckpt(lr.run, tmp_path / "run")
    f = run / "iter_0000020" / "mp_rank_00_000" / "model_optim_rng.pt"
    _add_tree(f)
    return lr.run, run, f.parent.parent, "mp_rank_00_000/model_optim_rng.pt"


def _dist_common_pt(request, tmp_path):
    """The tree in a torch_dist ``common.pt`` (megatron-core 0.16)."""
    dr = request.getfixturevalue("megatron_ckpts").dist("tp2")
    run = copy_ckpt(dr.run, tmp_path / "run")
    _add_tree(run / "iter_0000020" / "common.pt")
    return dr.run, run, run / "iter_0000020", "common.pt"


def _dist_common_entry(request, tmp_path):
    """The tree in a torch_dist ``common_state`` bytes entry (megatron-core 0.19): the
    entry's new bytes appended to its .distcp file, ``.metadata`` pointed at them."""
    import torch.distributed.checkpoint  # noqa: F401  (the classes .metadata pickles)

    dr = request.getfixturevalue("megatron_ckpts").dist("tp2", NEXT_VERSION)
    run = copy_ckpt(dr.run, tmp_path / "run")
    ck = run / "iter_0000020"
    md = pickle.loads((ck / ".metadata").read_bytes())
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == "common_state/shard_0_1"]
    data = (ck / info.relative_path).read_bytes()
    (common,) = torch.load(io.BytesIO(data[info.offset:info.offset + info.length]),
                           weights_only=False)
    common["bomb"] = shared_tree(torch.ones(2))
    buf = io.BytesIO()
    torch.save([common], buf)
    info.offset, info.length = len(data), len(buf.getvalue())
    (ck / info.relative_path).write_bytes(data + buf.getvalue())
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    (ck / "integrity.json").unlink()  # its hashes name the old bytes
    return dr.run, run, ck, info.relative_path


READERS = {"deepspeed-client-state": _deepspeed, "megatron-legacy-rank-file": _legacy,
           "torch-dist-common-pt": _dist_common_pt,
           "torch-dist-common-state-entry": _dist_common_entry}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_reader_refuses_the_tree_by_name_in_one_line(request, tmp_path, reader):
    healthy, run, ck, named = READERS[reader](request, tmp_path)
    base_inspect = _run("inspect", healthy / ck.name)
    base_ls = _run("ls", healthy)
    assert base_inspect[0] == base_ls[0] == 0, (base_inspect, base_ls)
    bound = max(base_inspect[3], base_ls[3]) + MORE_MB

    code, _, err, mb = _run("inspect", ck)
    _one_line(code, err, 3, f"{ck.name}/{named}", WORDS)
    assert mb < bound, ("inspect", mb, bound)
    code, out, err, mb = _run("verify", ck, "--json")
    assert code == 1 and [p["code"] for p in json.loads(out)["problems"]] == ["UNSAFE_INPUT"], out
    assert mb < bound, ("verify", mb, bound)
    code, _, err, mb = _run("seal", ck)
    _one_line(code, err, 1, named, WORDS)
    assert not (ck / "ckptctl.manifest.json").exists() and mb < bound
    code, out, err, mb = _run("ls", run, "--json")
    rows = {c["name"]: c["state"] for c in json.loads(out)["checkpoints"]}
    assert code == 0 and rows[ck.name] == "corrupt" and set(rows.values()) == {
        "complete", "corrupt"}, (rows, err)
    assert mb < base_ls[3] + MORE_MB, ("ls", mb, base_ls[3])
    code, out, err, mb = _run("latest", run)
    assert code == 0 and out.strip() != str(ck) and mb < bound, (out, err)
    code, out, err, mb = _run("gc", run, "--keep-last", "1", "--dry-run")
    assert code == 0 and "0 to remove" in out and mb < bound, (out, err)
