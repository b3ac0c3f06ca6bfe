"""Render a local HTML file in a real headless browser and say what happened (a test harness).

Debian's Chromium (``/usr/bin/chromium``, installed by ``make venv`` when it runs as root),
driven by playwright's sync API; playwright downloads no browser here. The page is opened
from its ``file://`` URL in a fresh, empty profile, with the browser's own background
traffic switched off, and every request but the file itself is recorded and aborted
(``data:`` URLs make none): a self-contained page records none. :func:`render` returns what
a test asserts on::

    from browser import render, require_chromium

    require_chromium()  # skips the test without a browser, unless root (then it fails)
    page = render(tmp_path / "report.html", tmp_path / "report.png")
    assert page.problems() == []  # console errors, page errors, requests
    for chart in page.charts:  # each element with a data-chart="NAME" attribute
        assert chart.svg and chart.marks > 0, chart

Charts are the elements marked ``data-chart="NAME"``; each holds an inline ``<svg>``. A
chart's ``marks`` counts its drawn shapes (``path``, ``rect``, ``use``, ``polyline``,
``polygon``, ``line``, ``circle``, ``ellipse`` with a non-empty box, outside ``<defs>``);
``series`` counts the elements marked as data series (a ``data-series`` attribute, or an id
starting ``data-``, as matplotlib writes an artist's ``gid``), where the page marks them.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
#: the flags the closed network needs: without the background-networking ones Chromium
#: tries Google's hosts at every start; as root it needs --no-sandbox
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
#: a limit on loading the page, not something a test measures
TIMEOUT_MS = 120_000

_CHARTS_JS = """() => Array.from(document.querySelectorAll('[data-chart]')).map(el => {
  const svg = el.querySelector('svg');
  const shapes = svg ? Array.from(svg.querySelectorAll(
      'path, rect, use, polyline, polygon, line, circle, ellipse')) : [];
  const drawn = shapes.filter(s => {
    if (s.closest('defs, clipPath, marker, mask, pattern, symbol')) return false;
    try { const b = s.getBBox(); return b.width > 0 || b.height > 0; } catch (e) { return false; }
  });
  const box = (svg || el).getBoundingClientRect();
  return {name: el.getAttribute('data-chart'), svg: !!svg, marks: drawn.length,
          series: svg ? svg.querySelectorAll('[data-series], [id^="data-"]').length : 0,
          width: box.width, height: box.height};
})"""

#: scripts that would run: a data block (``<script type="application/json">``) is none
_SCRIPTS_JS = """() => Array.from(document.scripts).filter(s => !s.type
  || /^(module|(text|application)\\/(x-)?(java|ecma)script)$/i.test(s.type.trim())).length"""


@dataclass(frozen=True)
class Chart:
    """One ``[data-chart]`` element as drawn: its name, whether it holds an ``<svg>``, the
    number of drawn shapes and of marked data series in it, and its size in CSS pixels."""

    name: str
    svg: bool
    marks: int
    series: int
    width: float
    height: float


@dataclass(frozen=True)
class Rendered:
    """What rendering a page gave: its URL, title and text, every console error and warning
    (``"error: text"``), every uncaught page error, every request for anything but the page
    itself (all aborted), its charts, how many scripts it holds that would run (a JSON data
    block is none), and the screenshot's path (or None)."""

    url: str
    title: str
    text: str
    console_errors: list[str] = field(default_factory=list)
    console_warnings: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    charts: list[Chart] = field(default_factory=list)
    scripts: int = 0
    screenshot: Path | None = None

    def problems(self) -> list[str]:
        """Console errors, page errors and requests, one line each: ``[]`` for a clean page."""
        return ([f"console error: {m}" for m in self.console_errors]
                + [f"page error: {m}" for m in self.page_errors]
                + [f"request: {u}" for u in self.requests])


class BrowserMissing(RuntimeError):
    """No Chromium at :data:`CHROMIUM`."""


def require_chromium() -> Path:
    """:data:`CHROMIUM`, for a test that needs it. Where it is missing the test is skipped
    with the reason, but only for a user who cannot install it: as root ``make venv``
    installs it, so a missing browser there fails the test."""
    import pytest

    if CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    if os.geteuid() != 0:
        pytest.skip(f"no browser at {CHROMIUM} (not root, so `make venv` did not install "
                    "Debian's chromium: apt-get install chromium)")
    pytest.fail(f"no browser at {CHROMIUM}, as root: `make venv` installs Debian's chromium "
                "(rm .venv/.installed and run it again)", pytrace=False)


def render(html: Path | str, screenshot: Path | str | None = None, *, width: int = 1200,
           height: int = 900, full_page: bool = True, max_height: int | None = None,
           javascript: bool = True) -> Rendered:
    """Open the local file ``html`` in headless Chromium at a ``width`` x ``height``
    viewport, wait for its load event (and its fonts), and return a :class:`Rendered`.

    ``screenshot``: where to write a PNG of the page (the whole page when ``full_page``, its
    first ``max_height`` pixels at most when given, else the viewport). ``javascript=False``
    renders with scripts off, to show a page needs none. Raises :class:`BrowserMissing`
    without the browser.
    """
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.is_file():
        raise BrowserMissing(f"no browser at {CHROMIUM}")
    url = Path(html).resolve().as_uri()
    console_errors, console_warnings, page_errors, requests = [], [], [], []

    def on_console(msg):
        if msg.type == "error":
            console_errors.append(msg.text)
        elif msg.type == "warning":
            console_warnings.append(msg.text)

    def watch(page):
        page.on("console", on_console)
        page.on("pageerror", lambda err: page_errors.append(str(err)))
        page.on("websocket", lambda ws: requests.append(ws.url))

    def route(r):  # the page itself loads; nothing else leaves (or even reads a file)
        if r.request.url == url:
            r.continue_()
        else:
            requests.append(r.request.url)
            r.abort("blockedbyclient")

    with sync_playwright() as pw, tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=str(CHROMIUM), headless=True, args=FLAGS,
            viewport={"width": width, "height": height}, offline=True,
            java_script_enabled=javascript, service_workers="block")
        try:
            context.route("**/*", route)
            page = context.pages[0] if context.pages else context.new_page()
            watch(page)
            context.on("page", watch)  # popups, once the first page is watched
            page.goto(url, wait_until="load", timeout=TIMEOUT_MS)
            page.evaluate("() => document.fonts.ready.then(() => true)")
            charts = [Chart(**c) for c in page.evaluate(_CHARTS_JS)]
            scripts = page.evaluate(_SCRIPTS_JS)
            shot = None
            if screenshot is not None:
                shot = Path(screenshot)
                shot.parent.mkdir(parents=True, exist_ok=True)
                clip = None
                if full_page and max_height:
                    full = page.evaluate("() => document.documentElement.scrollHeight")
                    clip = {"x": 0, "y": 0, "width": width, "height": min(full, max_height)}
                page.screenshot(path=str(shot), full_page=full_page, clip=clip,
                                animations="disabled", caret="hide", timeout=TIMEOUT_MS)
            rendered = Rendered(url=url, title=page.title(), text=page.inner_text("body"),
                                console_errors=console_errors,
                                console_warnings=console_warnings, page_errors=page_errors,
                                requests=requests, charts=charts, scripts=scripts,
                                screenshot=shot)
        finally:
            context.close()
    return rendered
