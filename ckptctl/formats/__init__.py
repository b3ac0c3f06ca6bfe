"""Formats: readers that map DCP, safetensors (single + HF), torch.save, DeepSpeed, Megatron,
Orbax and packs onto the logical model, the byte-level writers, and format detection.
Imports storage and the foundations (model, errors, layout, ...) only.

>>> from ckptctl.formats import open_checkpoint
>>> open_checkpoint.__module__
'ckptctl.formats.detect'

Names are imported on first use (a command that only lists pays for no reader).
"""
from __future__ import annotations

import importlib

_EXPORTS = {"detect_format": "detect", "open_checkpoint": "detect", "step_from_name": "detect",
            "read_object": "tensorio", "read_tensor": "tensorio", "tensor_bytes": "tensorio"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
