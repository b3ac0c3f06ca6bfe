"""Write safetensors files by streaming tensor bytes, and HF sharded layouts.

The header is computed up front from shapes and dtypes (padded with spaces to 8 bytes, as
safetensors does), then each tensor's bytes follow in header order.

>>> import io
>>> out = io.BytesIO()
>>> write_file(out, [("w", "F32", (2,), 8)], lambda name: [b"\\0" * 8], {"format": "pt"})
>>> from safetensors import deserialize
>>> [(k, v["shape"]) for k, v in deserialize(out.getvalue())]
[('w', [2])]
"""
from __future__ import annotations

import json
import struct
from typing import Callable, Iterable

Entry = tuple[str, str, tuple[int, ...], int]  # name, safetensors dtype, shape, nbytes


def header_bytes(entries: list[Entry], metadata: dict[str, str] | None) -> bytes:
    """``u64 length | JSON`` for ``entries`` laid out in order."""
    doc: dict = {}
    if metadata:
        doc["__metadata__"] = metadata
    pos = 0
    for name, code, shape, nbytes in entries:
        doc[name] = {"dtype": code, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_file(out, entries: list[Entry], blocks_for: Callable[[str], Iterable],
               metadata: dict[str, str] | None = None) -> None:
    """Write one safetensors file to the binary stream ``out``."""
    out.write(header_bytes(entries, metadata))
    for name, _, _, nbytes in entries:
        n = 0
        for b in blocks_for(name):
            out.write(b)
            n += len(b)
        if n != nbytes:
            raise RuntimeError(f"{name}: wrote {n} bytes, expected {nbytes}")


def shard_names(count: int, stem: str = "model") -> list[str]:
    """HF file names: ``model.safetensors`` or ``model-00001-of-00003.safetensors``...

    >>> shard_names(1), shard_names(2)
    (['model.safetensors'], ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'])
    """
    if count == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def split_shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Greedy, in order: a new shard when the next tensor would pass ``max_bytes``
    (a tensor larger than that gets a shard of its own), as HF's ``save_pretrained``."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e[3] > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e[3]
    return shards


def index_json(shards: list[list[Entry]], names: list[str]) -> bytes:
    """``model.safetensors.index.json`` for the shards."""
    total = sum(e[3] for s in shards for e in s)
    wm = {e[0]: f for s, f in zip(shards, names) for e in s}
    return (json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))},
                       indent=2) + "\n").encode()
