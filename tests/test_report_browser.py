"""``ckptctl report`` in a real browser (issue 40): the report of the demo's run, rendered by
Debian's headless Chromium (tests/browser.py), loads with no console error, no page error
and no request of any kind (one self-contained file), every chart holds an inline SVG with
its data series drawn in it, with or without JavaScript, and the page names each checkpoint.

The run is the README picture's (tests/report_picture.py): the demo's torchrun generator,
the same training saved at steps 10, 20 and 30, cached under ``tests/.cache/report-run/``.
The screenshot and the page are kept as artifacts in ``tests/.artifacts/``.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from browser import render, require_chromium
from report_picture import STEPS, demo_run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "tests" / ".artifacts"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """``run1/step-10``, ``step-20``, ``step-30``: one FSDP2 training saved three times."""
    return demo_run(tmp_path_factory.mktemp("report") / "run1")


def test_report_renders_in_chromium(run, tmp_path):
    require_chromium()
    html = tmp_path / "report.html"
    p = subprocess.run([sys.executable, "-m", "ckptctl", "report", str(run), "--output", str(html),
                        "--save-seconds", "60", "--mtbf", "2.8h", "--interval", "30m"],
                       check=False, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr
    assert html.is_file() and html.stat().st_size > 0

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "report.png"
    shutil.copyfile(html, ARTIFACTS / "report.html")
    page = render(html, shot)
    print(f"screenshot: {shot}")

    assert page.problems() == [], page.problems()
    if page.console_warnings:
        print("console warnings:", *page.console_warnings, sep="\n  ")
    assert [c.name for c in page.charts] == ["run", "bytes", "change", "plan"]
    for chart in page.charts:
        assert chart.svg and chart.marks > 0, f"chart {chart.name!r} has nothing drawn: {chart}"
        assert chart.width > 0 and chart.height > 0, f"chart {chart.name!r} is not shown: {chart}"
        # empty axes have marks too (frame, ticks): the data are the series the report marks
        # (matplotlib gid "data-*" on each plotted artist)
        assert chart.series > 0, f"chart {chart.name!r} has no data series: {chart}"
    for step in STEPS:
        assert f"step-{step}" in page.text, f"step-{step} not on the page"

    # no JavaScript needed: the same charts, drawn the same, with scripts off
    bare = render(html, javascript=False)
    assert bare.problems() == [], bare.problems()
    assert [(c.name, c.marks) for c in bare.charts] == [(c.name, c.marks) for c in page.charts]
