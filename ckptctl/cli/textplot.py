"""Charts drawn as text in the terminal (``diff --plot``, ``plan --plot``), for a shell
without a browser: horizontal bars and a curve, drawn by plotext (6.x, imported only when
a chart is drawn, so ``ckptctl --help`` stays fast).

Each function returns the chart as a string; the caller prints it. Colour only where
stdout is a terminal and ``NO_COLOR`` is unset; otherwise plain characters with no escape
codes and no trailing spaces, the same on every machine for the same width. Width:
``$COLUMNS``, else the terminal's, else :data:`WIDTH`.

>>> print(hbars(["a    1", "b  0.5", "c  n/a"], [1.0, 0.5, None], width=30, color=False))
      ┌──────────────────────┐
a    1┤██████████████████████│
b  0.5┤████████████          │
c  n/a┤                      │
      └┬──────────┬─────────┬┘
       0         0.5        1
"""
from __future__ import annotations

import math
import shutil

from .common import console, is_tty

#: Width of a chart off a terminal without ``$COLUMNS`` (as :func:`~.common.print_fitted`).
WIDTH = 80
#: Narrowest chart drawn, whatever the terminal says.
MIN_WIDTH = 40


def plot_width() -> int:
    """Columns a chart may use: the terminal's (``$COLUMNS`` first, as
    ``shutil.get_terminal_size`` reads it), else :data:`WIDTH`; never under
    :data:`MIN_WIDTH`.

    >>> from unittest import mock
    >>> with mock.patch.dict("os.environ", COLUMNS="132"):
    ...     plot_width()
    132
    >>> with mock.patch.dict("os.environ", COLUMNS="12"):
    ...     plot_width()
    40
    """
    return max(MIN_WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns)


def use_color() -> bool:
    """Colour codes only where stdout is a terminal and rich would colour too (not with
    ``NO_COLOR`` set: no-color.org)."""
    return is_tty() and not console().no_color


def short_duration(seconds: float) -> str:
    """A duration in at most two units, the rest dropped (as ``format_duration`` drops
    fractions of a second), for an axis tick.

    >>> [short_duration(s) for s in (0.25, 42, 109.9, 1100, 11000, 43225, 86400 * 3.3)]
    ['0.25s', '42s', '1m49s', '18m20s', '3h3m', '12h', '3d7h']
    """
    from ..tiering.policy import format_duration

    if seconds < 60:
        return f"{seconds:.2g}s"
    sub = next(b for a, b in ((86400, 3600), (3600, 60), (60, 1)) if seconds >= a)
    return format_duration(seconds // sub * sub)


def require_plotext():
    """``import plotext``, the 6.x API (``plotext.figure``); else a
    :class:`~ckptctl._deps.MissingDependencyError` (exit 3) saying how to get it: a verb
    calls it before its work, so ``--plot`` fails before anything is read.

    >>> require_plotext().figure is not None
    True
    """
    from .._deps import MissingDependencyError

    hint = "needs plotext 6 or newer: pip install -U 'plotext>=6.1'"
    try:
        import plotext
    except ImportError:
        raise MissingDependencyError("--plot", hint) from None
    if not hasattr(plotext, "figure"):  # 5.x: module-level functions, no figure object
        raise MissingDependencyError("--plot", f"{hint} (this is plotext "
                                     f"{getattr(plotext, '__version__', '5.x')})")
    return plotext


def _figure(width: int, height: int):
    """plotext's figure, cleared and sized ``width`` x ``height`` cells (not cut to the
    terminal's size: a chart of many rows runs past the screen, as a table does)."""
    plotext = require_plotext()
    plotext.terminal.limit(False, False)
    fig = plotext.figure
    fig.clear()
    fig.theme("simple")  # no background: the terminal's own colours
    fig.plot_size(width, height)
    return fig


def _text(fig, color: bool | None) -> str:
    """The figure as text: coloured when ``color`` (default :func:`use_color`), else plain
    with each line's trailing spaces removed."""
    color = use_color() if color is None else color
    text = fig.build().string(colorless=not color)
    return text if color else "\n".join(line.rstrip() for line in text.splitlines())


def hbars(labels: list[str], values: list[float | None], *, width: int | None = None,
          color: bool | None = None) -> str:
    """One horizontal bar per label, top to bottom, each one row high, its length
    ``values[i]`` on a linear axis from 0 to the largest value; a value that is None (or
    not finite) has no bar, so its label must say why. ``width``: :func:`plot_width`;
    the bars get what the labels (shown as given, padded to one width) leave.

    >>> print(hbars(["x 2", "y 0"], [2.0, 0.0], width=24, color=False))
       ┌───────────────────┐
    x 2┤███████████████████│
    y 0┤                   │
       └┬────────┬────────┬┘
        0        1        2
    """
    n = len(labels)
    if n == 0 or n != len(values):
        raise ValueError("hbars needs one value per label, and at least one")
    finite = [v if v is not None and math.isfinite(v) else 0.0 for v in values]
    top = max(finite) or 1.0
    names = [str(x).ljust(max(len(str(y)) for y in labels)) for x in labels]
    width = max(width or plot_width(), len(names[0]) + 20)
    fig = _figure(width, n + 3)  # n rows of bars, the frame's two lines, the ticks' line
    rows = list(range(n, 0, -1))  # the first label on top
    fig.draw(fig.bar(rows, finite, orientation="h", width=0.6))
    ticks = 5 if width - len(names[0]) >= 44 else 3  # plotext's own skip the top one
    fig.ruler("x").ticks([top * k / (ticks - 1) for k in range(ticks)],
                         [f"{top * k / (ticks - 1):.3g}" for k in range(ticks)])
    fig.ruler("x").lim(0, top)
    fig.ruler("y").ticks(rows, names)
    fig.ruler("y").lim(1, n)
    return _text(fig, color)


def curve(xs: list[float], ys: list[float], *, marks: list[tuple[float, float, str]] = (),
          xticks: list[tuple[float, str]] = (), logx: bool = False, height: int = 16,
          width: int | None = None, color: bool | None = None) -> str:
    """The curve through (``xs``, ``ys``), each of ``marks`` (x, y, one character) drawn
    on it with a stem down to the x axis (so the y axis starts at 0 or below), the x axis
    ticked at ``xticks`` ((x, label) pairs; default plotext's own), logarithmic when
    ``logx`` (x values > 0).

    >>> text = curve([1, 10, 100], [3, 1, 3], marks=[(10, 1, "x")], logx=True,
    ...              xticks=[(1, "1s"), (10, "10s"), (100, "100s")], height=9, width=40,
    ...              color=False)
    >>> print(text)
       ┌───────────────────────────────────┐
    3.0┤▗▄▄▖                            ▄▄▖│
    2.2┤   ▝▀▀▄▄▖                  ▄▄▞▀▀   │
       │        ▝▀▀▄▄▖        ▄▄▞▀▀        │
    1.5┤             ▝▀▀▄x▄▞▀▀             │
    0.8┤                 │                 │
    0.0┤                 │                 │
       └┬────────────────┬────────────────┬┘
        1s              10s            100s
    """
    def tx(x: float) -> float:  # plotext's own log axis mislays explicit ticks: map here
        return math.log10(x) if logx else x

    fig = _figure(width or plot_width(), height)
    px = [tx(x) for x in xs]
    fig.draw(fig.signal(px, list(ys)).lines(True))
    for x, y, symbol in marks:  # a stem, not fig.line: that paints a white background
        fig.draw(fig.signal([tx(x)], [y], marker="│").fillx())
        fig.draw(fig.signal([tx(x)], [y], marker=symbol))
    if xticks:
        fig.ruler("x").ticks([tx(x) for x, _ in xticks], [label for _, label in xticks])
    fig.ruler("x").lim(min(px), max(px))
    return _text(fig, color)
