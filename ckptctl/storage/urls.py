"""The names a store is opened with: URLs split into protocol and path
(:func:`split_url`), ``--storage-option`` flags turned into fsspec options
(:func:`parse_storage_options`), and paths found in a checkpoint checked to stay under its
root (:func:`safe_relpath`).

>>> split_url("s3://bucket/run/"), safe_relpath("a/./b.bin")
(('s3', 'bucket/run'), 'a/b.bin')
"""
from __future__ import annotations

import os
import posixpath

from ..errors import UnsafeInputError, UsageError


def parse_storage_options(pairs: list[str] | None) -> dict:
    """Turn repeated ``key=value`` flags into fsspec storage options.

    Values ``true``/``false``/integers are typed; dotted keys nest.

    >>> parse_storage_options([  # doctest: +NORMALIZE_WHITESPACE
    ...     "endpoint_url=http://x:9", "client_kwargs.region_name=us", "use_ssl=false",
    ...     "max_concurrency=4"])
    {'endpoint_url': 'http://x:9', 'client_kwargs': {'region_name': 'us'}, 'use_ssl': False,
     'max_concurrency': 4}
    """
    out: dict = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option expects key=value, got {pair.split('=')[0]!r}")
        value: object = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        elif raw.lstrip("-").isdigit():
            value = int(raw)
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def split_url(url: str) -> tuple[str, str]:
    """``s3://b/p`` -> (``s3``, ``b/p``); plain paths and ``file://`` -> (``file``, abs path).

    >>> split_url("s3://bucket/run/step-1/"), split_url("file:///tmp/x")
    (('s3', 'bucket/run/step-1'), ('file', '/tmp/x'))
    """
    if "://" in url:
        proto, rest = url.split("://", 1)
        proto = proto.lower()
        if proto == "file":
            return "file", os.path.abspath(rest or "/")
        if proto in ("s3", "s3a", "gs", "gcs", "az", "abfs") and (not rest or rest[0] == "/"):
            raise UsageError(f"no bucket in the URL (expected {proto}://BUCKET/PREFIX)", url)
        return proto, rest.rstrip("/")
    return "file", os.path.abspath(url)


def safe_relpath(rel: str, *, where: str = "") -> str:
    """Normalise a path found in a checkpoint and refuse anything that leaves the root.

    >>> safe_relpath("./a/b.distcp")
    'a/b.distcp'
    >>> safe_relpath("../etc/passwd")
    Traceback (most recent call last):
    ckptctl.errors.UnsafeInputError: path '../etc/passwd' escapes the checkpoint root
    """
    bad = (not rel or "\x00" in rel or rel.startswith(("/", "\\")) or "\\" in rel
           or (len(rel) > 1 and rel[1] == ":"))
    norm = posixpath.normpath(rel) if not bad else rel
    if bad or norm == ".." or norm.startswith("../") or norm == ".":
        raise UnsafeInputError(where or None, f"path {rel!r} escapes the checkpoint root",
                               code="PATH_ESCAPE")
    return norm

