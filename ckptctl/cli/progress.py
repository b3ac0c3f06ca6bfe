"""A byte progress bar on a TTY (stderr), nothing otherwise."""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Callable, Iterator


@contextlib.contextmanager
def byte_progress(description: str, total: int | None, *, enabled: bool = True
                  ) -> Iterator[Callable[[int], None] | None]:
    """Yield an ``on_bytes(n)`` callback driving a rich progress bar, or None when stderr
    is not a terminal (or ``enabled`` is False)."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TimeRemainingColumn,
                               TransferSpeedColumn)

    lock = threading.Lock()
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)

        def advance(n: int) -> None:
            with lock:
                bar.advance(task, n)

        yield advance
