"""The browser harness (tests/browser.py) on small pages of our own: a clean page with
inline SVG charts passes, and each kind of problem the report test must catch is caught: a
request to the network or to another file, a console error, an uncaught exception, a chart
with nothing drawn. Skipped without Chromium only where ``make venv`` cannot install it (not
root); as root a missing browser fails (:func:`browser.require_chromium`)."""
from __future__ import annotations

import struct

import pytest

from browser import render, require_chromium

#: a 1x1 PNG, inline: a data: URL is no request
PIXEL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4"
         "nGNgYPj/HwADAgH/eL9GtQAAAABJRU5ErkJggg==")

CLEAN = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>harness</title>
<style>body {{ font-family: sans-serif }} .chart {{ width: 320px }}</style></head>
<body><h1>run1</h1><p>step-10 step-20</p><img src="{PIXEL}" alt="">
<div class="chart" data-chart="bytes">
  <svg xmlns="http://www.w3.org/2000/svg" width="300" height="120" viewBox="0 0 300 120">
    <defs><path id="m" d="M 0 0 L 0 4"/></defs>
    <g id="data-bytes"><polyline points="10,100 150,40 290,60" fill="none" stroke="blue"/>
      <use href="#m" x="150" y="40"/></g>
  </svg>
</div>
<div class="chart" data-chart="changed">
  <svg xmlns="http://www.w3.org/2000/svg" width="300" height="120">
    <rect x="10" y="20" width="40" height="90" fill="green"/>
    <rect x="60" y="50" width="40" height="60" fill="green"/>
  </svg>
</div>
<div data-chart="empty"><svg width="300" height="120"><defs><rect width="9" height="9"/></defs>
  <path d=""/></svg></div>
<div data-chart="none"><p>no picture</p></div>
</body></html>
"""

DIRTY = """<!doctype html>
<html><head><meta charset="utf-8"><title>dirty</title>
<link rel="stylesheet" href="https://example.com/style.css"></head>
<body><img src="http://127.0.0.1:9/x.png" alt=""><img src="beside.png" alt="">
<script type="application/json">{"data": 1}</script>
<script>console.error("boom"); console.warn("careful"); undefinedFunction();</script>
</body></html>
"""


@pytest.fixture
def chromium():
    """The browser; skips or fails without it (:func:`browser.require_chromium`)."""
    return require_chromium()


def _png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", head
    return struct.unpack(">II", head[16:24])


def test_clean_page(chromium, tmp_path):
    page_file = tmp_path / "clean.html"
    page_file.write_text(CLEAN)
    page = render(page_file, tmp_path / "shots" / "clean.png", width=800, height=600)

    assert page.problems() == [] and page.console_warnings == []
    assert page.url == page_file.resolve().as_uri() and page.title == "harness"
    assert "step-10" in page.text and "step-20" in page.text and page.scripts == 0
    charts = {c.name: c for c in page.charts}
    assert list(charts) == ["bytes", "changed", "empty", "none"]  # document order
    assert charts["bytes"].svg and charts["bytes"].marks == 2 and charts["bytes"].series == 1
    assert (charts["bytes"].width, charts["bytes"].height) == (300, 120)
    assert charts["changed"].svg and charts["changed"].marks == 2 and charts["changed"].series == 0
    # nothing drawn: a shape in <defs> and an empty path are no marks
    assert charts["empty"].svg and charts["empty"].marks == 0
    assert not charts["none"].svg and charts["none"].marks == 0
    # the whole page, at the viewport's width
    assert page.screenshot == tmp_path / "shots" / "clean.png"
    w, h = _png_size(page.screenshot)
    assert w == 800 and h >= 600


def test_problems_are_caught(chromium, tmp_path):
    page_file = tmp_path / "dirty.html"
    page_file.write_text(DIRTY)
    page = render(page_file)

    assert page.screenshot is None
    assert sorted(page.requests) == sorted([
        "https://example.com/style.css", "http://127.0.0.1:9/x.png",
        (tmp_path / "beside.png").resolve().as_uri()])  # another file is a request too
    assert "boom" in page.console_errors and page.console_warnings == ["careful"]
    assert len(page.page_errors) == 1 and "undefinedFunction" in page.page_errors[0]
    problems = page.problems()
    assert any(p.startswith("request: http://127.0.0.1:9/") for p in problems)
    assert "console error: boom" in problems
    assert any(p.startswith("page error: ") for p in problems)


def test_without_javascript(chromium, tmp_path):
    """``javascript=False``: scripts do not run (so neither do their errors); the charts and
    the requests are still seen."""
    page_file = tmp_path / "dirty.html"
    page_file.write_text(DIRTY.replace("</body>", CLEAN.split("<body>")[1].split("</body>")[0]
                                       + "</body>"))
    page = render(page_file, tmp_path / "top.png", width=640, height=400, max_height=300,
                  javascript=False)

    assert "boom" not in page.console_errors and page.page_errors == []
    assert page.scripts == 1 and "http://127.0.0.1:9/x.png" in page.requests
    assert [c.name for c in page.charts if c.marks] == ["bytes", "changed"]
    assert _png_size(page.screenshot) == (640, 300)  # cut at max_height


def test_require_chromium_decides_by_user(monkeypatch, tmp_path):
    """Without the browser: skipped for a user, failed for root (``make venv`` installs it)."""
    import browser

    monkeypatch.setattr(browser, "CHROMIUM", tmp_path / "no-chromium")
    monkeypatch.setattr(browser.os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception, match="not root"):
        browser.require_chromium()
    monkeypatch.setattr(browser.os, "geteuid", lambda: 0)
    with pytest.raises(pytest.fail.Exception, match="as root"):
        browser.require_chromium()
    with pytest.raises(browser.BrowserMissing):
        browser.render(tmp_path / "x.html")
