"""A byte progress bar on a TTY (stderr), nothing otherwise.

The ops never see rich: they take ``on_bytes(n)`` (bytes done) and ``on_total(n)`` (bytes
the whole job will read or write, called once they know it, before the work starts). The
bar shows percent, rate and ETA in the binary units of the rest of the output (KiB, MiB).

>>> with byte_progress("verify", enabled=False) as bar:
...     bar is None
True
"""
from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator


class Bar:
    """``bar(n)``: n more bytes done; ``bar.total(n)``: the job is n bytes in all."""

    def __init__(self, progress, task):
        self._progress, self._task = progress, task
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self._lock:
            self._progress.advance(self._task, n)

    def total(self, n: int) -> None:
        with self._lock:
            self._progress.update(self._task, total=n)


def _columns():
    """Percent, bar, done/total, rate, ETA: sizes in KiB/MiB/GiB like ``human_bytes``."""
    from rich.progress import (
        BarColumn,
        ProgressColumn,
        TaskProgressColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    from .common import human_bytes

    class Sizes(ProgressColumn):
        def render(self, task):
            total = "?" if task.total is None else human_bytes(int(task.total))
            return Text(f"{human_bytes(int(task.completed))}/{total}", style="progress.download")

    class Rate(ProgressColumn):
        def render(self, task):
            speed = task.finished_speed or task.speed
            return Text("?/s" if speed is None else f"{human_bytes(int(speed))}/s",
                        style="progress.data.speed")

    return ("[progress.description]{task.description}", BarColumn(), TaskProgressColumn(),
            Sizes(), Rate(), TimeRemainingColumn())


@contextlib.contextmanager
def byte_progress(description: str, total: int | None = None, *, enabled: bool = True
                  ) -> Iterator[Bar | None]:
    """Yield a :class:`Bar` (pass it as ``on_bytes`` and ``bar.total`` as ``on_total``),
    or None when stderr is not a terminal or ``enabled`` is False (``--json``, ``--quiet``).

    ``with byte_progress("seal", enabled=not json) as bar:
    seal(url, on_bytes=bar, on_total=bar and bar.total)``
    """
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(*_columns(), console=Console(stderr=True), transient=True) as progress:
        yield Bar(progress, progress.add_task(description, total=total))
