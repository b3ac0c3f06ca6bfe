"""Formats: readers that map DCP, safetensors (single + HF) and torch.save onto the
logical model, plus format detection."""
from .detect import detect_format, open_checkpoint, step_from_name
from .tensorio import read_object, read_tensor, tensor_bytes

__all__ = ["detect_format", "open_checkpoint", "read_object", "read_tensor", "step_from_name",
           "tensor_bytes"]
