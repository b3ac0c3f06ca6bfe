"""``ckptctl report``: a run at a glance, as one self-contained HTML file and as JSON.

:mod:`.data` gathers what the verbs already compute (``ls`` of each tier, ``inspect`` of
one checkpoint, ``diff``'s per-layer change between consecutive checkpoints, ``plan``'s
overhead curve); :mod:`.html` draws it with matplotlib as inline SVG (no script, no
network: it opens from a laptop's disk or a CI artifact).

Imports tiering and every package below it (catalog for ls and inspect, convert for
diff), beside service on its layer: neither imports the other.

>>> r = report("runs/llama", output="llama.html")      # doctest: +SKIP
>>> [c["step"] for c in r.tiers[0].checkpoints]        # doctest: +SKIP
[100, 200, 300]
"""
from __future__ import annotations

import os

from .data import ReportData, collect
from .html import GENERATOR, render


def report(target: str | None = None, storage_options: dict | None = None, *,
           output: str | None = None, page: dict | None = None, **options) -> ReportData:
    """Gather the report of ``target`` (:func:`~.data.collect` takes ``options``) and,
    with ``output``, write its page there (``page``: :func:`~.html.render`'s options):
    next to its name first, then renamed into place, so a killed report leaves the old
    page or none, never half of one. An ``output`` that is a folder, has no folder to go
    in, is some other file (a checkpoint's ``.metadata``), or lies inside a checkpoint of
    the report is refused before anything is read."""
    if output is not None:
        check_output(output)
    data = collect(target, storage_options, **options)
    if output is not None:
        _not_inside_a_checkpoint(output, data)
        text = render(data, **(page or {}))
        tmp = f"{output}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, output)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return data


def check_output(output: str) -> None:
    """Refuse a page's path that would lose or hide something (UsageError, exit 2).

    >>> import tempfile
    >>> check_output(tempfile.mkdtemp())
    Traceback (most recent call last):
    ckptctl.errors.UsageError: --output ... is a folder: name the page's file (report.html)
    """
    from ..errors import UsageError

    if os.path.isdir(output):
        raise UsageError(f"--output {output} is a folder: name the page's file (report.html)")
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise UsageError(f"--output {output}: no folder {parent} to write it in")
    if os.path.lexists(output):
        try:
            with open(output, "rb") as f:
                head = f.read(512)
        except OSError as e:
            raise UsageError(f"--output {output}: cannot read what is there ({e.strerror})")
        if GENERATOR.encode() not in head:
            raise UsageError(f"--output {output} exists and is not a ckptctl report page: "
                             "it is left alone; name another file")


def _not_inside_a_checkpoint(output: str, data: ReportData) -> None:
    from ..errors import UsageError

    where = os.path.abspath(output)
    urls = [c["url"] for t in data.tiers for c in t.checkpoints]
    if data.breakdown is not None:
        urls.append(data.breakdown.url)
    for url in urls:
        if "://" in url:
            continue
        root = os.path.abspath(url)
        if where == root or where.startswith(root.rstrip("/") + "/"):
            raise UsageError(f"--output {output} is inside the checkpoint {url}: a page "
                             "there would become one of its files; write it elsewhere")


__all__ = ["ReportData", "check_output", "collect", "render", "report"]
