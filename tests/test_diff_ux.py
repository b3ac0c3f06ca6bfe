"""``ckptctl diff`` for people (issue 35 item 5): comparing an export with its source.

The verdict comes first, then the counts, then what differs, largest change first and
capped (``--limit``); ``--stat`` counts per state part; ``--only`` takes a part or a glob
and composes with ``--map``; ``--common`` compares only the entries both sides hold.
The source is the FSDP fixture (DCP, model + optimizer + rng + step + ...), the export its
model consolidated to safetensors with ``model.`` stripped, as an HF export is.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli

safetensors_numpy = pytest.importorskip("safetensors.numpy")

MODEL_TENSORS = 39  # the fixture's model part


@pytest.fixture(scope="module")
def src(torch_ckpts) -> str:
    return str(torch_ckpts.dcp["fsdp"])


@pytest.fixture(scope="module")
def export(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ux") / "hf"
    code, o, e = run_cli("consolidate", src, str(out), "--to", "safetensors", "--only", "model",
                         "--strip-prefix", "model.", "-q")
    assert code == 0, (o, e)
    return out


@pytest.fixture(scope="module")
def parts_of_src(src) -> dict[str, int]:
    """Entries per state part, from the names' first component (the fixture names its
    parts plainly: model., optim., rng., step, ...), independent of the classifier."""
    from ckptctl.formats.detect import open_checkpoint

    ck = open_checkpoint(src)
    out: dict[str, int] = {}
    for n in list(ck.tensors) + list(ck.objects):
        out[n.split(".")[0]] = out.get(n.split(".")[0], 0) + 1
    return out


def _edited(export: Path, dst: Path, edit) -> Path:
    """A copy of the export's tensors with ``edit(dict)`` applied, as one safetensors file."""
    tensors = dict(safetensors_numpy.load_file(str(export / "model.safetensors")))
    edit(tensors)
    dst.mkdir()
    safetensors_numpy.save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _stat_table(out: str) -> dict[str, list[int]]:
    """part -> [same, differ, only in A, only in B] from ``--stat`` output."""
    lines = out.splitlines()
    start = next(i for i, x in enumerate(lines) if x.split()[:3] == ["part", "same", "differ"])
    return {x.split()[0]: [int(v.replace(",", "")) for v in x.split()[1:]]
            for x in lines[start + 1:] if x.strip()}


# ------------------------------------------------------------------ --map with --only


def test_map_then_only_model_part_is_identical_verdict_first(src, export):
    code, out, err = run_cli("diff", src, str(export), "--map", "model.=", "--only", "model")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"identical: {MODEL_TENSORS} tensors (bit for bit)"
    assert lines[1].startswith(f"identical: {MODEL_TENSORS} entries")
    assert lines[2].startswith("proven: ")
    # a glob over A's own names composes with --map too (it was refused: selects nothing)
    code, out, err = run_cli("diff", src, str(export), "--map", "model.=", "--only", "model.*")
    assert (code, err) == (0, "") and out.splitlines()[0] == lines[0]
    # and over the names after --map, as before
    code, out, _ = run_cli("diff", src, str(export), "--map", "model.=", "--only", "layers.0.*")
    assert code == 0 and out.splitlines()[0] == "identical: 9 tensors (bit for bit)"


def test_only_takes_part_spellings_and_says_what_it_takes(src, export):
    from ckptctl.convert.diff import diff

    r = diff(src, src, only=["optimizer"])  # parse_parts' spelling of optim
    assert r.equal and set(r.parts) == {"optim"}
    assert sum(r.counts.values()) == len([e for e in r.entries if e.name.startswith("optim.")])
    code, out, err = run_cli("diff", src, str(export), "--map", "model.=", "--only", "nope.*")
    assert code == 2 and "selects no entry" in err and "state parts: model, optim" in err


def test_map_alone_reports_the_optimizer_as_only_in_a(src, export, parts_of_src):
    """No failure on the optimizer entries: they are only in A, counted and listed last,
    the list capped, and the verdict says how to compare the rest."""
    one_sided = sum(n for p, n in parts_of_src.items() if p != "model")
    code, out, err = run_cli("diff", src, str(export), "--map", "model.=")
    assert code == 1 and err == ""
    lines = out.splitlines()
    assert lines[0] == (f"differ: {one_sided} only in A (--common compares the "
                        f"{MODEL_TENSORS} entries both hold)")
    assert f"only in A: {one_sided}" in lines[1]
    rows = [x for x in lines if "only_in_a" in x]
    assert len(rows) == 20  # the default --limit
    assert lines[-1] == f"... and {one_sided - 20} more (--limit 0 lists every one)"
    code, out, _ = run_cli("diff", src, str(export), "--map", "model.=", "--limit", "0")
    assert code == 1 and len([x for x in out.splitlines() if "only_in_a" in x]) == one_sided
    assert "more (--limit" not in out


# ------------------------------------------------------------------ --stat


def test_stat_first_line_is_the_verdict_and_counts_per_part(src, export, parts_of_src):
    code, out, err = run_cli("diff", src, str(export), "--map", "model.=", "--stat")
    assert code == 1 and err == ""
    assert out.splitlines()[0].startswith("differ: ")
    table = _stat_table(out)
    want = {p: [n, 0, 0, 0] if p == "model" else [0, 0, n, 0] for p, n in parts_of_src.items()}
    assert table == want
    assert "only_in_a" not in out  # --stat: counts instead of the entry list
    doc = json.loads(run_cli("diff", src, str(export), "--map", "model.=", "--json")[1])
    assert doc["parts"] == {p: ({"identical": n} if p == "model" else {"only_in_a": n})
                            for p, n in parts_of_src.items()}
    assert doc["verdict"] == "different" and doc["equal"] is False
    # one checkpoint against itself: every part the same, verdict still first
    code, out, _ = run_cli("diff", src, src, "--stat")
    assert code == 0 and out.splitlines()[0].startswith("identical: ")
    assert _stat_table(out) == {p: [n, 0, 0, 0] for p, n in parts_of_src.items()}


# ------------------------------------------------------------------ --common


def test_common_exits_0_against_an_export_without_the_optimizer(src, export, parts_of_src):
    one_sided = sum(n for p, n in parts_of_src.items() if p != "model")
    code, out, err = run_cli("diff", src, str(export), "--map", "model.=", "--common")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == (f"identical: {MODEL_TENSORS} tensors (bit for bit); {one_sided} only "
                        "in A, not compared (--common)")
    assert f"only in A: {one_sided}" in lines[1]  # counted in the summary ...
    assert "only_in_a" not in out  # ... not listed
    code, out, _ = run_cli("diff", src, str(export), "--map", "model.=", "--common", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["equal"] is True and doc["verdict"] == "identical"
    assert doc["common"] is True and doc["differing"] == []
    assert doc["counts"] == {"identical": MODEL_TENSORS, "only_in_a": one_sided}
    # --common and --stat together: exit 0, verdict first, the one-sided parts counted
    code, out, _ = run_cli("diff", src, str(export), "--map", "model.=", "--common", "--stat")
    assert code == 0 and out.splitlines()[0] == lines[0]
    assert _stat_table(out)["optim"] == [0, 0, parts_of_src["optim"], 0]


def test_common_still_exits_1_on_a_common_difference(src, export, tmp_path):
    def bump(t):
        t["norm.weight"] = t["norm.weight"] + np.float32(0.5)

    changed = _edited(export, tmp_path / "changed", bump)
    code, out, _ = run_cli("diff", src, str(changed), "--map", "model.=", "--common")
    assert code == 1
    assert out.splitlines()[0].startswith(f"differ: 1 of {MODEL_TENSORS} tensors; ")
    assert [x.split()[:2] for x in out.splitlines() if x.startswith("norm.weight")] == \
        [["norm.weight", "different"]]


def test_common_without_a_name_in_common_is_a_usage_error(src, export):
    code, _, err = run_cli("diff", src, str(export), "--common")  # no --map: no name shared
    assert code == 2 and "no entry name in common" in err and "--map" in err
    # without --common the verdict says why, and how to fix it
    code, out, _ = run_cli("diff", src, str(export))
    assert code == 1 and out.splitlines()[0].endswith("(no name in common: --map OLD=NEW "
                                                      "renames A's)")


# ------------------------------------------------------------------ largest change first


def test_differences_listed_largest_change_first(src, export, tmp_path):
    """Structure first (shape), then by relative L2 change (w2 doubled in B: 0.5, before
    norm.weight +0.5 on one element: ~0.04, although that one's max |a-b| is larger),
    then the small change, then what B lacks; the JSON ``differing`` in the same order."""
    def edit(t):
        t["layers.3.feed_forward.w2.weight"] = t["layers.3.feed_forward.w2.weight"] * 2
        t["norm.weight"] = t["norm.weight"].copy()
        t["norm.weight"][0] += 0.5
        t["layers.0.attention.wk.weight"] = t["layers.0.attention.wk.weight"].copy()
        t["layers.0.attention.wk.weight"][0, 0] += 1e-3
        t["output.weight"] = np.ascontiguousarray(t["output.weight"][:1000])
        del t["tok_embeddings.weight"]

    b = _edited(export, tmp_path / "b", edit)
    want = ["output.weight", "layers.3.feed_forward.w2.weight", "norm.weight",
            "layers.0.attention.wk.weight", "tok_embeddings.weight"]
    code, out, err = run_cli("diff", src, str(b), "--map", "model.=", "--only", "model")
    assert code == 1 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"differ: 4 of {MODEL_TENSORS - 1} tensors, 1 only in A"
    head = lines.index(next(x for x in lines if x.split()[:2] == ["entry", "status"]))
    assert [x.split()[0] for x in lines[head + 1:]] == want
    assert [x.split()[1] for x in lines[head + 1:]] == ["shape_mismatch", "different",
                                                        "different", "different", "only_in_a"]
    doc = json.loads(run_cli("diff", src, str(b), "--map", "model.=", "--only", "model",
                             "--json")[1])
    assert doc["differing"] == want
    rows = {e["name"]: e for e in doc["entries"]}
    assert rows["norm.weight"]["max_abs_diff"] > rows["layers.3.feed_forward.w2.weight"][
        "max_abs_diff"]  # ranked by relative change, not max |a-b|
    assert all(e["part"] == "model" for e in doc["entries"])
    # --limit 2: the two largest, then the count of the rest
    code, out, _ = run_cli("diff", src, str(b), "--map", "model.=", "--only", "model",
                           "--limit", "2")
    lines = out.splitlines()
    head = lines.index(next(x for x in lines if x.split()[:2] == ["entry", "status"]))
    assert [x.split()[0] for x in lines[head + 1:head + 3]] == want[:2]
    assert lines[-1] == "... and 3 more (--limit 0 lists every one)"


def test_equal_within_tolerance_verdict(src, export, tmp_path):
    def nudge(t):
        t["norm.weight"] = t["norm.weight"] + np.float32(1e-4)

    b = _edited(export, tmp_path / "b", nudge)
    code, out, _ = run_cli("diff", src, str(b), "--map", "model.=", "--common", "--atol",
                           "1e-3")
    assert code == 0
    assert out.splitlines()[0].startswith(f"equal: {MODEL_TENSORS} tensors (1 within "
                                          "atol=0.001, rtol=0); ")
    doc = json.loads(run_cli("diff", src, str(b), "--map", "model.=", "--only", "model",
                             "--atol", "1e-3", "--json")[1])
    assert doc["verdict"] == "equal_within_tolerance" and doc["equal"] is True
