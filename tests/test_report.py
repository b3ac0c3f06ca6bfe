"""``ckptctl report``: what the page and its --json hold, proven against the verbs that
compute it (the per-layer change equals ``diff --json``'s ``layers`` for the same pair).
The page in a real browser: tests/test_report_browser.py (slow suite)."""
from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest

from conftest import dcp_save

pytest.importorskip("matplotlib")

LAYERS = 4


def _state(step: int, *, nan_in: int | None = None, frozen: tuple = ()) -> dict:
    """A small model whose layers move by step (layer i by i+1 units of 1e-3), a frozen
    set of layers that never move, and optionally a NaN in one layer."""
    import torch

    g = torch.Generator().manual_seed(0)
    model = {"embed.weight": torch.randn(16, 8, generator=g)}
    for i in range(LAYERS):
        w = torch.randn(8, 8, generator=g)
        b = torch.zeros(8)
        if i not in frozen:
            w = w + step * (i + 1) * 1e-3
        if nan_in == i:
            w[0, 0] = float("nan")
        model[f"layers.{i}.weight"] = w
        model[f"layers.{i}.bias"] = b
    model["head.weight"] = torch.randn(4, 8, generator=g) * (1 + step * 1e-4)
    optim = {"state": {"layers.0.weight": {"exp_avg": torch.full((8, 8), float(step))}},
             "param_groups": [{"lr": 0.01}]}
    return {"model": model, "optim": optim, "step": step}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """run/step-{10,20,30,60}: steps 40 and 50 missing (a gap); layer 3 frozen; step 60
    has a NaN in layer 1."""
    root = tmp_path_factory.mktemp("report") / "run"
    for step in (10, 20, 30):
        dcp_save(root / f"step-{step}", _state(step, frozen=(3,)))
    dcp_save(root / "step-60", _state(60, frozen=(3,), nan_in=1))
    return root


def _json(cli, *args) -> dict:
    code, out, err = cli(*args, "--json")
    assert code == (1 if args[0] == "diff" else 0), err  # diff: 1 when they differ
    return json.loads(out)


def test_change_equals_diff_json(cli, run):
    doc = _json(cli, "report", str(run))
    pairs = [(c["a_step"], c["b_step"]) for c in doc["changes"]]
    assert pairs == [(20, 10), (30, 20), (60, 30)]
    for c in doc["changes"]:
        d = _json(cli, "diff", c["a"], c["b"], "--only", "model")
        assert c["layers"] == d["layers"]  # the same numbers, not recomputed
    last = {x["layer"].removeprefix("model."): x for x in doc["changes"][-1]["layers"]}
    assert last["layers.1"]["rel_l2"] is None and last["layers.1"]["nonfinite_mismatch"] == 1
    assert last["layers.3"]["rel_l2"] == 0.0 and last["layers.3"]["tensors_changed"] == 0
    first = {x["layer"].removeprefix("model."): x for x in doc["changes"][0]["layers"]}
    # layer i moved by (i+1)e-3 per step: more change deeper in (bias never moves)
    assert 0 < first["layers.0"]["rel_l2"] < first["layers.1"]["rel_l2"] < first["layers.2"]["rel_l2"]
    assert first["layers.0"]["fraction_changed"] == pytest.approx(64 / 72)
    assert all(x["part"] == "model" for x in first.values())  # the model by default


def test_run_bytes_and_gaps(cli, run):
    doc = _json(cli, "report", str(run))
    (tier,) = doc["tiers"]
    assert [c["step"] for c in tier["checkpoints"]] == [10, 20, 30, 60]
    assert tier["gaps"] == [[30, 60, 2]]
    ls = _json(cli, "ls", str(run))
    assert [{k: v for k, v in c.items() if k != "pack_ratio"} for c in tier["checkpoints"]] \
        == ls["checkpoints"]
    ins = _json(cli, "inspect", str(run / "step-60"))
    b = doc["breakdown"]
    assert b["url"] == str(run / "step-60") and b["tensor_bytes"] == ins["tensor_bytes"]
    assert sum(b["parts"].values()) == sum(b["dtypes"].values()) == ins["tensor_bytes"]
    assert sum(x["bytes"] for x in b["layers"]) == ins["tensor_bytes"]
    assert [x["layer"] for x in b["layers"]][:3] == ["model.embed", "model.head", "model.layers.0"]


def test_against_a_base_and_all_parts(cli, run):
    doc = _json(cli, "report", str(run), "--against", str(run / "step-10"), "--only", "all",
                "--pairs", "2")
    assert [(c["a_step"], c["b_step"]) for c in doc["changes"]] == [(30, 10), (60, 10)]
    layers = {x["layer"] for x in doc["changes"][0]["layers"]}
    assert "optim.state.layers.0" in layers and "model.layers.0" in layers
    d = _json(cli, "diff", str(run / "step-30"), str(run / "step-10"))
    assert doc["changes"][0]["layers"] == d["layers"]


def test_one_checkpoint(cli, run):
    doc = _json(cli, "report", str(run / "step-20"))
    assert doc["tiers"] == [] and doc["changes"] == []
    assert doc["breakdown"]["step"] == 20
    doc = _json(cli, "report", str(run / "step-20"), "--against", str(run / "step-10"))
    assert [(c["a_step"], c["b_step"]) for c in doc["changes"]] == [(20, 10)]


def test_page_is_self_contained(cli, run, tmp_path):
    out = tmp_path / "r.html"
    code, stdout, err = cli("report", str(run), "--output", str(out), "--save-seconds", "60",
                            "--mtbf", "2.8h", "--interval", "30m")
    assert code == 0, err
    assert "wrote" in stdout and "4 checkpoints" in stdout
    page = out.read_text()
    charts = re.findall(r'<section data-chart="(\w+)">\s*<svg', page)
    assert charts == ["run", "bytes", "change", "plan"]
    # nothing to fetch: no src or href but data: URLs, no script but the JSON data
    assert not re.search(r'\b(?:src|href)\s*=\s*"(?!data:|#)', page)
    assert re.findall(r"<script[^>]*>", page) == ['<script type="application/json" '
                                                  'id="report-data">']
    data = json.loads(re.search(r'id="report-data">(.*?)</script>', page, re.S)[1]
                      .replace("<\\/", "</"))
    again = _json(cli, "report", str(run))
    assert [c["layers"] for c in data["changes"]] == [c["layers"] for c in again["changes"]]
    assert data["tiers"] == again["tiers"] and data["breakdown"] == again["breakdown"]
    assert "2 saves missing between steps 30 and 60" in page
    assert list(tmp_path.iterdir()) == [out]  # no temporary file left


def test_plan_curve(cli, run):
    doc = _json(cli, "report", str(run / "step-10"), "--save-seconds", "60", "--mtbf", "2.8h")
    p = doc["plan"]
    assert p["optimal"]["interval_seconds"] == pytest.approx(math.sqrt(2 * 60 * 2.8 * 3600),
                                                            rel=0.01)
    assert min(p["overheads"]) == pytest.approx(p["optimal"]["overhead"], rel=0.01)


def test_packs_show_their_ratio(cli, run, tmp_path):
    cold = tmp_path / "cold"
    for step in (10, 20):
        code, _, err = cli("pack", str(run / f"step-{step}"), str(cold / f"step-{step}"))
        assert code == 0, err
    doc = _json(cli, "report", str(cold))
    rows = doc["tiers"][0]["checkpoints"]
    assert [r["format"] for r in rows] == ["dcp", "dcp"]  # what each pack holds, as ls says
    assert all(r["pack_ratio"] and r["pack_ratio"] > 0 for r in rows)
    d = _json(cli, "diff", str(cold / "step-20"), str(cold / "step-10"), "--only", "model")
    assert doc["changes"][0]["layers"] == d["layers"]


def test_tiers_of_a_config(cli, run, tmp_path):
    hot, warm = tmp_path / "hot", tmp_path / "warm"
    warm.mkdir()
    shutil.copytree(run / "step-60", hot / "step-60")
    for step in (10, 20, 30):
        shutil.copytree(run / f"step-{step}", warm / f"step-{step}")
    cfg = tmp_path / "ckptctl.toml"
    cfg.write_text(f'[[tier]]\nname = "hot"\nurl = "{hot}"\n[[tier]]\nname = "warm"\n'
                   f'url = "{warm}"\n[[tier]]\nname = "gone"\nurl = "{tmp_path / "nope"}"\n')
    doc = _json(cli, "--config", str(cfg), "report")
    assert [t["name"] for t in doc["tiers"]] == ["hot", "warm", "gone"]
    assert doc["tiers"][2]["error"] and doc["tiers"][2]["checkpoints"] == []
    # the steps of all tiers in one sequence, each read from the hottest place holding it
    assert [(c["a_step"], c["b_step"]) for c in doc["changes"]] == [(20, 10), (30, 20), (60, 30)]
    assert doc["changes"][-1]["a"] == str(hot / "step-60")


def test_usage_errors(cli, run, tmp_path):
    code, _, err = cli("report", str(run), "--json", "--max-memory", "1KiB")
    assert code == 2 and "--max-memory" in err
    code, _, err = cli("report", str(run))
    assert code == 2 and "--output" in err and err.count("\n") == 1
    code, _, err = cli("report", str(run), "--json", "--save-seconds", "60")
    assert code == 2 and "--mtbf" in err
    code, _, err = cli("report", str(tmp_path / "nothing"), "--json")
    assert code in (2, 3, 4) and "Traceback" not in err and err.count("\n") == 1


def test_without_matplotlib_json_still_works(run, tmp_path):
    """The charts need the report extra; --json does not import matplotlib."""
    import subprocess

    code = ("import sys, runpy; sys.modules['matplotlib'] = None; sys.argv[0] = 'ckptctl'; "
            "runpy.run_module('ckptctl', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code, "report", str(run), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([sys.executable, "-c", code, "report", str(run), "--output",
                        str(tmp_path / "r.html")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "ckptctl[report]" in p.stderr, p.stderr
    assert not (tmp_path / "r.html").exists()


def test_on_s3_as_locally(cli, run, moto_bucket):
    """A root on S3: the same rows and the same per-layer change as the local copy, each
    pair read within --max-memory."""
    for step in (10, 20, 60):
        moto_bucket.upload(run / f"step-{step}", f"run/step-{step}")
    o = moto_bucket.storage_options
    opts = ["-o", f"endpoint_url={o['endpoint_url']}", "-o", f"key={o['key']}", "-o",
            f"secret={o['secret']}"]
    doc = _json(cli, "report", moto_bucket.url("run"), *opts, "--max-memory", "1MiB")
    assert [c["step"] for c in doc["tiers"][0]["checkpoints"]] == [10, 20, 60]
    assert [(c["a_step"], c["b_step"]) for c in doc["changes"]] == [(20, 10), (60, 20)], doc["notes"]
    for c in doc["changes"]:
        local = _json(cli, "diff", str(run / f"step-{c['a_step']}"),
                      str(run / f"step-{c['b_step']}"), "--only", "model")
        assert c["layers"] == local["layers"]


def test_render_leaves_the_callers_matplotlib_alone_and_is_deterministic(run):
    import matplotlib

    from ckptctl.report import collect, render

    before = dict(matplotlib.rcParams)
    pages = [render(collect(str(run))) for _ in range(2)]
    assert dict(matplotlib.rcParams) == before
    head = [p.split('id="report-data"')[0] for p in pages]  # the data holds timings
    assert head[0] == head[1] and "<text" in head[0]  # text as text, the same page


def test_an_output_that_would_lose_or_hide_something_is_refused(cli, run, tmp_path):
    """A folder, a missing folder, a checkpoint's own file, a page inside a checkpoint:
    one line, exit 2, before anything is read; nothing written. A page of its own is
    replaced."""
    meta = run / "step-10" / ".metadata"
    before = meta.read_bytes()
    for out, words in ((tmp_path, "is a folder"), (tmp_path / "nope" / "r.html", "no folder"),
                       (meta, "is not a ckptctl report page"),
                       (run / "step-20" / "r.html", "inside the checkpoint")):
        code, stdout, err = cli("report", str(run), "--output", str(out))
        assert code == 2 and words in err and err.count("\n") == 1, err
        assert "Traceback" not in err and stdout == ""
    assert meta.read_bytes() == before
    assert not (run / "step-20" / "r.html").exists()
    assert not [p for p in run.rglob("*.tmp-*")]
    page = tmp_path / "r.html"
    assert cli("report", str(run), "--output", str(page))[0] == 0
    assert cli("report", str(run), "--output", str(page))[0] == 0  # its own page: replaced
