"""Target layouts: mesh and placement parsing, torch.chunk splitting, presets, rule errors."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckptctl.errors import UsageError
from ckptctl.layout import (Placement, chunk_span, load_rules, local_box, parse_mesh,
                            parse_placement, preset)


@given(st.integers(0, 300), st.integers(1, 17))
def test_chunk_span_matches_torch_chunk(n, k):
    pieces = torch.chunk(torch.arange(n), k) if n else ()
    for i in range(k):
        off, size = chunk_span(n, k, i)
        if i < len(pieces):
            p = pieces[i]
            assert (off, size) == (int(p[0]) if len(p) else n, len(p))
        else:
            assert size == 0


@given(st.lists(st.integers(1, 40), min_size=1, max_size=3), st.data())
def test_local_boxes_tile_the_tensor(shape, data):
    nd = len(shape)
    mesh = parse_mesh(",".join(f"m{i}={data.draw(st.integers(1, 4))}"
                               for i in range(data.draw(st.integers(1, 3)))))
    shard = tuple(data.draw(st.one_of(st.none(), st.integers(0, nd - 1))) for _ in mesh.sizes)
    order = tuple(data.draw(st.permutations(range(len(mesh.sizes)))))
    p = Placement(shard, order)
    cover = torch.zeros(shape, dtype=torch.int32)
    boxes = set()
    for r in range(mesh.world_size):
        offs, sizes = local_box(tuple(shape), p, mesh, r)
        if (offs, sizes) in boxes:
            continue
        boxes.add((offs, sizes))
        cover[tuple(slice(o, o + s) for o, s in zip(offs, sizes))] += 1
    assert bool((cover == 1).all())


def test_two_d_strided_matches_fsdp2_over_tp():
    mesh = parse_mesh("dp=2,tp=2")
    rules = preset("llama", mesh)
    p = rules.placement_for("model.layers.0.attention.wq.weight", (1001, 128))
    assert [local_box((1001, 128), p, mesh, r)[1][0] for r in range(4)] == [251, 250, 250, 250]
    wo = rules.placement_for("model.layers.0.attention.wo.weight", (128, 128))
    assert wo.shard == (0, 1)
    norm = rules.placement_for("model.norm.weight", (128,))
    assert norm.shard == (0, None)
    exp_avg = rules.placement_for("optim.state.layers.0.attention.wq.weight.exp_avg", (1001, 128))
    assert exp_avg == p
    assert rules.placement_for("optim.state.layers.0.attention.wq.weight.step", ()).replicated
    assert rules.placement_for("rng.cpu", (5056,)).replicated


def test_parse_errors():
    for bad in ("dp", "dp=0", "dp=2,dp=2", "=3", "dp=x"):
        with pytest.raises(UsageError):
            parse_mesh(bad)
    with pytest.raises(UsageError):
        parse_placement("Split(0)")
    with pytest.raises(UsageError, match="needs a mesh dim named tp"):
        preset("llama", parse_mesh("dp=2"))
    with pytest.raises(UsageError, match="unknown rules preset"):
        preset("nope", parse_mesh("dp=2"))


RULES = """
mesh = "tp=4"
[[rule]]
match = "*.w"
placements = { tp = "Shard(2)" }
"""


def test_rule_sharding_missing_dim_is_usage_error():
    rules = load_rules(RULES, None)
    with pytest.raises(UsageError, match=r"a\.w.*\*\.w.*dim 2"):
        rules.placement_for("a.w", (8, 8))


def test_rule_more_shards_than_elements():
    rules = load_rules(RULES.replace("Shard(2)", "Shard(0)"), None)
    with pytest.raises(UsageError, match="more shards than elements"):
        rules.placement_for("a.w", (3, 8))
    ok = load_rules(RULES.replace("Shard(2)", "Shard(0)") + "allow_empty = true\n", None)
    assert ok.placement_for("a.w", (3, 8)).shard == (0,)


def test_rules_file_errors():
    with pytest.raises(UsageError, match="not valid TOML"):
        load_rules("[[rule", parse_mesh("dp=2"))
    with pytest.raises(UsageError, match="not in the mesh"):
        load_rules('[[rule]]\nmatch="*"\nplacements={tp="Shard(0)"}', parse_mesh("dp=2"))
    with pytest.raises(UsageError, match="exactly one of match or regex"):
        load_rules('[[rule]]\nplacements={dp="Shard(0)"}', parse_mesh("dp=2"))
