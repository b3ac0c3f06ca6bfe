"""``diff --plot`` and ``plan --plot`` (issue 40): charts drawn in the terminal, for a shell
without a browser.

``diff --plot`` draws one bar per layer, labelled with the figures ``diff --json`` carries
in ``layers`` (relative L2 change to 3 significant digits, % of values changed), NaN/Inf
and n/a marked rather than drawn as 0; ``plan --plot`` draws the expected overhead against
the interval (:func:`ckptctl.tiering.plan.overhead_curve`) with the optimum and the chosen
interval marked. Neither touches ``--json``'s stdout, and off a terminal neither writes an
escape code. The checkpoints are two small safetensors files written with numpy.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from conftest import run_cli

safetensors_numpy = pytest.importorskip("safetensors.numpy")

#: What the chart's rows are drawn with: a bar cell, and the frame's tick on the y axis.
BAR, ROW = "█", "┤"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    """A and B: layers 1-4 changed by different amounts, 0 and 5 identical, 6 NaN in B
    only (NaN/Inf), 7 all zero in B (||b|| = 0: n/a), plus an unchanged norm."""
    rng = np.random.default_rng(40)
    a, b = {}, {}
    for i in range(6):
        w = rng.standard_normal((16, 8)).astype(np.float32)
        a[f"model.layers.{i}.attn.weight"] = w
        b[f"model.layers.{i}.attn.weight"] = w + np.float32(0.02 * i) * (
            np.arange(w.size).reshape(w.shape) % (i + 2) == 0) if i < 5 else w.copy()
    a["model.layers.6.mlp.weight"] = np.ones((4, 4), np.float32)
    nan = np.ones((4, 4), np.float32)
    nan[1, 2] = np.nan
    b["model.layers.6.mlp.weight"] = nan
    a["model.layers.7.mlp.weight"] = np.ones((4, 4), np.float32)
    b["model.layers.7.mlp.weight"] = np.zeros((4, 4), np.float32)
    a["model.norm.weight"] = b["model.norm.weight"] = np.ones(8, np.float32)
    d = tmp_path_factory.mktemp("plots")
    safetensors_numpy.save_file(a, str(d / "a.safetensors"))
    safetensors_numpy.save_file(b, str(d / "b.safetensors"))
    return str(d / "a.safetensors"), str(d / "b.safetensors")


@pytest.fixture(scope="module")
def layers(pair) -> list[dict]:
    code, out, err = run_cli("diff", *pair, "--json")
    assert code == 1, (out, err)
    return json.loads(out)["layers"]


def rows(out: str) -> list[tuple[list[str], str]]:
    """The chart's rows: (the label's words, the bar cells drawn)."""
    return [(line.split(ROW)[0].split(), line.split(ROW)[1]) for line in out.splitlines()
            if ROW in line]


def canvas(out: str) -> list[str]:
    """The inside of the (one) chart's frame, a string per row, y axis labels left out."""
    lines = out.splitlines()
    top = next(i for i, line in enumerate(lines) if "┌" in line)
    bottom = next(i for i, line in enumerate(lines) if "└" in line)
    return [line[min(i for i in (line.find(ROW), line.find("│")) if i >= 0) + 1:-1]
            for line in lines[top + 1:bottom]]


def rel_text(x: dict) -> str:
    """How a layer's relative L2 change is labelled: as ``diff``'s detail says one (3
    significant digits), NaN/Inf or n/a where there is no finite ratio."""
    if x["rel_l2"] is None:
        return "NaN/Inf" if x["nonfinite_mismatch"] else "n/a"
    return f"{x['rel_l2']:.3g}"


def test_diff_plot_draws_a_bar_per_layer_with_the_json_figures(pair, layers):
    code, out, err = run_cli("diff", *pair, "--plot", "--limit", "0")
    assert (code, err) == (1, "")
    assert out.splitlines()[0].startswith("differ: ")  # the usual output comes first
    got = rows(out)
    assert [words[0] for words, _ in got] == [x["layer"] for x in layers]  # layer order
    for (words, bar), x in zip(got, layers):
        assert words[1:] == [rel_text(x), f"{100 * x['fraction_changed']:.3g}%"], words
        drawn = bar.count(BAR)
        if x["rel_l2"] is None or x["rel_l2"] == 0:
            assert drawn == 0, (x["layer"], bar)  # no finite ratio / no change: no bar
    finite = [(x["rel_l2"], bar.count(BAR)) for (_, bar), x in zip(got, layers)
              if x["rel_l2"]]
    assert len(finite) >= 4 and sorted(finite) == sorted(finite, key=lambda t: (t[1], t[0]))
    assert max(n for _, n in finite) > 20  # the largest change spans the chart
    # the unchanged layers are there, as 0
    same = [w for w, _ in got if w[0] in ("model.layers.0", "model.layers.5", "model.norm")]
    assert [w[1:] for w in same] == [["0", "0%"]] * 3
    assert "\x1b[" not in out  # not a terminal: no colour codes


def test_nan_and_zero_norm_layers_are_marked_not_drawn_as_zero(pair, layers):
    by = {x["layer"]: x for x in layers}
    assert by["model.layers.6"]["rel_l2"] is None and by["model.layers.6"]["nonfinite_mismatch"]
    assert by["model.layers.7"]["rel_l2"] is None and not by["model.layers.7"]["nonfinite_mismatch"]
    code, out, _ = run_cli("diff", *pair, "--plot", "--limit", "0")
    labels = {w[0]: w[1] for w, _ in rows(out)}
    assert (labels["model.layers.6"], labels["model.layers.7"]) == ("NaN/Inf", "n/a")
    assert "NaN/Inf: NaN or Inf on one side only" in out and "n/a: ||b|| = 0" in out


def test_limit_caps_the_rows_to_the_largest_changes_and_says_so(pair, layers):
    code, out, _ = run_cli("diff", *pair, "--plot", "--limit", "4")
    got = [w[0] for w, _ in rows(out)]
    # no finite ratio ranks first, then the largest relative L2 changes; shown in layer order
    finite = sorted((x for x in layers if x["rel_l2"] is not None), key=lambda x: -x["rel_l2"])
    want = {"model.layers.6", "model.layers.7", *(x["layer"] for x in finite[:2])}
    assert got == [x["layer"] for x in layers if x["layer"] in want]
    left = [x for x in layers if x["layer"] not in want]
    unchanged = sum(not x["tensors_changed"] for x in left)
    assert unchanged == 3  # layers 0 (changed by 0 x 0.02) and 5, the norm
    assert f"... and {len(left)} more layers, less changed ({unchanged} of them unchanged): " \
           "--limit 0 plots every one" in out
    # the default --limit (20) shows all of these few layers
    assert len(rows(run_cli("diff", *pair, "--plot")[1])) == len(layers)


def test_plot_is_as_wide_as_the_terminal_says(pair, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    out = run_cli("diff", *pair, "--plot")[1]
    chart = [line for line in out.splitlines() if ROW in line or "┌" in line or "└" in line]
    assert {len(line) for line in chart} == {100}


def test_json_and_quiet_ignore_plot(pair, layers):
    code, out, err = run_cli("diff", *pair, "--json", "--plot")
    assert code == 1 and err == ""
    assert json.loads(out)["layers"] == layers  # stdout is the JSON document, whole
    assert run_cli("diff", *pair, "--quiet", "--plot") == (1, "", "")


def test_plot_without_a_common_tensor_says_so(tmp_path):
    safetensors_numpy.save_file({"a.w": np.ones(2, np.float32)}, str(tmp_path / "a.safetensors"))
    safetensors_numpy.save_file({"b.w": np.ones(2, np.float32)}, str(tmp_path / "b.safetensors"))
    code, out, _ = run_cli("diff", str(tmp_path / "a.safetensors"),
                           str(tmp_path / "b.safetensors"), "--plot")
    assert code == 1 and "no tensor compared on both sides, nothing to plot" in out
    assert ROW not in out


# ------------------------------------------------------------------------------ plan

PLAN = ("plan", "--checkpoint-size", "1TB", "--save-seconds", "60", "--mtbf", "2.8h",
        "--nodes", "128")


def test_plan_plot_draws_the_curve_and_marks_the_optimum_and_the_chosen_interval():
    from ckptctl.tiering.policy import format_duration

    doc = json.loads(run_cli(*PLAN, "--interval", "30m", "--json")[1])
    code, out, err = run_cli(*PLAN, "--interval", "30m", "--plot")
    assert (code, err) == (0, "")
    assert out.index("local capacity per node") < out.index(ROW)  # after the figures
    inside = "".join(canvas(out))
    assert inside.count("*") == 1 and inside.count("o") == 1
    assert sum(inside.count(c) for c in "▀▄▚▞▖▗▘▝") > 40  # the curve
    assert (f"* optimal interval tau* = {format_duration(doc['optimal_interval_seconds'])}"
            f" (Young): {doc['overhead_optimal']:.2%} overhead") in out
    assert f"o chosen interval 30m: {doc['overhead_chosen']:.2%} overhead" in out
    # the x axis is labelled in durations, the optimum's among them
    ticks = out.splitlines()[out.splitlines().index(next(
        line for line in out.splitlines() if line.lstrip().startswith("└"))) + 1].split()
    assert format_duration(doc["optimal_interval_seconds"]) in ticks and len(ticks) >= 3
    assert "\x1b[" not in out
    # without --interval, nothing is chosen
    out = run_cli(*PLAN, "--plot")[1]
    assert "* optimal interval" in out and "o chosen" not in out


def test_plan_json_and_quiet_ignore_plot():
    code, out, err = run_cli(*PLAN, "--json", "--plot")
    assert code == 0 and json.loads(out)["interval_formula"] == "young"
    assert run_cli(*PLAN, "--quiet", "--plot") == (0, "", "")


def test_overhead_curve_is_plans_model():
    from ckptctl.tiering.plan import overhead_curve, plan

    for c, m, chosen in ((60, 10080, 1800), (1200, 10800, None), (60, 10080, 86400 * 3)):
        r = plan(10**12, c, m, interval_seconds=chosen)
        curve = overhead_curve(c, m, chosen=chosen)
        xs, ys = curve["intervals_seconds"], curve["overheads"]
        best = curve["optimal"]
        assert best["interval_seconds"] == r.optimal_interval_seconds
        assert best["overhead"] == r.overhead_optimal
        assert best["formula"] == r.interval_formula
        assert (curve["chosen"] or {}).get("overhead") == r.overhead_chosen
        assert len(xs) == 81 and all(a < b for a, b in zip(xs, xs[1:]))
        assert xs[0] <= best["interval_seconds"] / 10 * (1 + 1e-9)
        assert xs[-1] >= best["interval_seconds"] * 10 * (1 - 1e-9)
        if chosen:
            assert xs[0] < chosen < xs[-1]
        assert all(0 <= y <= 1 for y in ys)
        # the optimum sits at the bottom of the curve (Young's and Daly's are near the
        # exact minimum of Daly's model: within a sample of it)
        low = min(range(len(xs)), key=ys.__getitem__)
        assert abs(math.log(xs[low] / best["interval_seconds"])) < 2 * math.log(xs[1] / xs[0])
    json.dumps(overhead_curve(60, 10080))  # the HTML report's input: plain JSON


def test_textplot_colours_only_when_asked():
    from ckptctl.cli.textplot import curve, hbars

    plain = hbars(["a", "b"], [1.0, None], width=40, color=False)
    assert "\x1b[" not in plain and plain == "\n".join(x.rstrip() for x in plain.splitlines())
    assert "\x1b[" in hbars(["a", "b"], [1.0, None], width=40, color=True)
    assert "\x1b[" in curve([1, 2, 3], [1, 0, 1], width=40, color=True)
    assert "\x1b[" not in curve([1, 2, 3], [1, 0, 1], width=40, color=False)


def test_plotext_5_is_refused_before_any_work(pair, monkeypatch):
    """plotext 6 rewrote the API (one ``plotext.figure``): under 5.x, --plot is one line
    and exit 3, before the diff reads a byte; without --plot nothing needs it."""
    import sys
    import types

    old = types.ModuleType("plotext")
    old.__version__ = "5.3.2"
    monkeypatch.setitem(sys.modules, "plotext", old)
    hint = "ckptctl: error: --plot: needs plotext 6 or newer: pip install -U 'plotext>=6.1'"
    for args in (("diff", *pair), PLAN):
        code, out, err = run_cli(*args, "--plot")
        assert (code, out) == (3, "") and err.startswith(hint), err
    assert run_cli("diff", *pair, "--json", "--plot")[0] == 1  # ignored: not needed
    assert run_cli(*PLAN)[0] == 0
