"""Sizes and rates as people write them on a command line: ``512MiB``, ``5GB``,
``200MiB/s``. A leaf: every layer parses with it.

>>> parse_size("1GiB"), parse_rate("1.5GB/s")
(1073741824, 1500000000.0)
"""
from __future__ import annotations

import re

from .errors import UsageError


def parse_size(text: str | int) -> int:
    """``1GiB``, ``512MB``, ``5GB``, ``1e9`` -> bytes.

    >>> parse_size("1GiB"), parse_size("5GB"), parse_size("512M")
    (1073741824, 5000000000, 536870912)
    """
    if isinstance(text, int):
        return text
    t = text.strip().upper().replace(" ", "")
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "KB": 10**3,
             "MB": 10**6, "GB": 10**9, "TB": 10**12, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30,
             "T": 1 << 40, "B": 1}
    for u, mul in units.items():
        if t.endswith(u):
            num = t[: -len(u)]
            break
    else:
        num, mul = t, 1
    try:
        value = float(num)
    except ValueError:
        raise UsageError(f"bad size {text!r} (examples: 1GiB, 512MB)") from None
    if value <= 0:
        raise UsageError(f"size must be positive: {text!r}")
    return int(value * mul)


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
_RATE = re.compile(r"(?P<num>\d+(?:\.\d*)?|\.\d+)(?:e(?P<exp>[+-]?\d+))?\s*"
                   r"(?P<unit>[kmgt]i?)?(?P<b>b)?(?P<per>/s)?", re.I)


def parse_rate(text: str | float | int | None) -> float | None:
    """A bandwidth in bytes per second, or None for no limit (``0``, ``off``, empty).

    ``KB``/``MB``/``GB``/``TB`` are powers of 1000, ``KiB``/``MiB``/``GiB``/``TiB`` powers of
    1024; a bare ``K``/``M``/``G``/``T`` means the binary unit, as in rclone's ``--bwlimit``.
    ``/s`` is optional. Only bytes: there is no bits unit.

    >>> parse_rate("200MiB/s"), parse_rate("1.5GB/s"), parse_rate("100M"), parse_rate("100MiB")
    (209715200.0, 1500000000.0, 104857600.0, 104857600.0)
    >>> parse_rate("0"), parse_rate("off"), parse_rate(""), parse_rate(None), parse_rate(1e6)
    (None, None, None, None, 1000000.0)
    >>> parse_rate("fast")
    Traceback (most recent call last):
    ckptctl.errors.UsageError: bad rate 'fast' (examples: 200MiB/s, 1.5GB/s, 100M, off)
    """
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        t = str(text).strip()
        if t.lower() in ("", "0", "off", "none", "unlimited"):
            return None
        m = _RATE.fullmatch(t)
        if m is None:
            raise UsageError(f"bad rate {str(text)[:40]!r} (examples: 200MiB/s, 1.5GB/s, 100M, off)")
        unit = (m["unit"] or "").lower()
        if len(unit) == 1 and not m["b"]:  # bare K/M/G/T: binary, like rclone
            unit += "i"
        value = float(m["num"]) * 10 ** int(m["exp"] or 0) * _UNITS[unit]
    if value != value or value < 0 or value == float("inf"):
        raise UsageError(f"rate must be a positive number of bytes per second, got {text!r}")
    return value or None
