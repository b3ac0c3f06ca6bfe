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
from .html import render


def report(target: str | None = None, storage_options: dict | None = None, *,
           output: str | None = None, page: dict | None = None, **options) -> ReportData:
    """Gather the report of ``target`` (:func:`~.data.collect` takes ``options``) and,
    with ``output``, write its page there (``page``: :func:`~.html.render`'s options):
    next to its name first, then renamed into place, so a killed report leaves the old
    page or none, never half of one."""
    data = collect(target, storage_options, **options)
    if output is not None:
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


__all__ = ["ReportData", "collect", "render", "report"]
