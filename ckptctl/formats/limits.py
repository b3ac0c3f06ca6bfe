"""Bounds checked before anything is allocated (DESIGN.md, safety rails).

>>> from ckptctl.model import DTYPES
>>> check_shape((2, 3), DTYPES["float32"])
24
>>> check_shape((2**40, 2**40), DTYPES["float32"], where="x.safetensors: w")
Traceback (most recent call last):
ckptctl.errors.UnsafeInputError: x.safetensors: w: shape [1099511627776, 1099511627776] is absurdly large
"""
from __future__ import annotations

import json
import math

from ..errors import FormatError, UnsafeInputError

#: safetensors' own limit on its JSON header.
MAX_SAFETENSORS_HEADER = 100_000_000
#: A 10,000-rank DCP run with 300k chunks has a 44 MB .metadata; 1 GiB is far past sane.
MAX_METADATA_BYTES = 1 << 30
#: Largest tensor we agree to describe: 2**50 bytes (1 PiB).
MAX_TENSOR_BYTES = 1 << 50
MAX_NDIM = 64
#: Deepest nesting of containers a reader walks; real state dicts nest fewer than 10 levels.
MAX_NEST_DEPTH = 256
#: Most nodes a walk of one unpickled object may reach *again* through shared references
#: (a dict or list named a second time, counted with all it holds). Everything else a walk
#: visits is paid for by bytes of the file (a pickle builds an object or two per opcode),
#: but a memo reference costs two bytes and can double a walk per level: a 1.8 KB file
#: naming one dict twice, 22 levels deep, flattens to 4M entries (issue 34). Legitimate
#: sharing is tied weights (shared tensors are leaves: they cost one node per name) and
#: small constants (every param group's ``betas`` tuple); 65,536 nodes (a shared tree of
#: ~32k entries) costs the hungriest reader, ``inspect`` at ~3 KB per entry, ~100 MB.
MAX_SHARED_NODES = 1 << 16


def check_shape(shape, dtype, *, where: str = "") -> int:
    """Refuse shapes whose byte size overflows sane bounds; return the byte size."""
    if len(shape) > MAX_NDIM:
        raise UnsafeInputError(where or None, f"tensor has {len(shape)} dims")
    numel = math.prod(shape)
    nbytes = dtype.nbytes(numel)
    if nbytes > MAX_TENSOR_BYTES or any(s > MAX_TENSOR_BYTES for s in shape):
        raise UnsafeInputError(where or None, f"shape {list(shape)} is absurdly large")
    return nbytes


def count_key(data: bytes, key: str) -> int:
    """How often the JSON string ``key`` (quotes included) occurs in the raw bytes
    ``data``: a count taken before parsing (one pass, nothing allocated) that bounds
    the records carrying that key. A key spelled with ``\\u`` escapes is missed, so the
    parsed document must be counted again; a value equal to ``key`` counts too (harmless
    for a limit far above real counts).

    >>> count_key(b'{"a": {"kind": 1}, "b": {"kind": 2}, "c": 3}', "kind")
    2
    """
    return data.count(b'"' + key.encode() + b'"')


def load_json(data: bytes | str, where: str, what: str = "file"):
    """Parse JSON read from a checkpoint: bad or absurdly nested input (json recurses per
    level) is one :class:`FormatError` naming ``where``, never a RecursionError.

    >>> load_json(b'{"a": [1]}', "x.json")
    {'a': [1]}
    >>> load_json("[" * 100000 + "]" * 100000, "x.json", "index")
    Traceback (most recent call last):
    ckptctl.errors.FormatError: x.json: index nests too deeply
    """
    try:
        return json.loads(data)
    except RecursionError:
        raise FormatError(where, f"{what} nests too deeply") from None
    except (UnicodeDecodeError, ValueError):
        raise FormatError(where, f"{what} is not valid JSON") from None
