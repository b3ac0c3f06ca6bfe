"""Optional dependencies: the one place that imports torch for ckptctl and says how to get
it when it is missing.

``pip install ckptctl`` gives every verb that reads DCP and safetensors (``ls``,
``inspect``, ``verify``, ``seal``) without torch; torch.save inputs and the conversions
(``reshard``, ``consolidate``) need ``pip install 'ckptctl[torch]'``.

>>> try:
...     raise MissingDependencyError("consolidate")
... except MissingDependencyError as e:
...     (e.exit_code, str(e))
(3, "consolidate: needs PyTorch: pip install 'ckptctl[torch]'")
"""
from __future__ import annotations

from .errors import CkptError, ProblemCode

TORCH_HINT = "needs PyTorch: pip install 'ckptctl[torch]'"


class MissingDependencyError(CkptError):
    """An optional library that this verb or input needs is not installed (exit 3)."""

    default_code: str = ProblemCode.MISSING_DEPENDENCY

    def __init__(self, what: str, message: str = TORCH_HINT):
        super().__init__(what, message)


def require_torch(what: str):
    """``import torch``, or raise :class:`MissingDependencyError` naming ``what`` (the verb,
    or the file that needs it) with the install hint.

    >>> require_torch("ckpt/model.pt").__name__                # doctest: +SKIP
    'torch'
    """
    try:
        import torch
    except ImportError as e:
        if (e.name or "").split(".")[0] != "torch":
            raise  # torch is there but one of its own imports failed: a real error
        raise MissingDependencyError(what) from None
    return torch


def check_torch(what: str) -> None:
    """Raise :class:`MissingDependencyError` now if torch is not installed, without
    importing it (1-2 s and ~200 MB): a conversion fails before it writes a byte, and one
    that never needs torch (DCP to safetensors, no dtype change) never pays for it.

    >>> check_torch("consolidate")                            # doctest: +SKIP
    """
    import importlib.util

    try:
        missing = importlib.util.find_spec("torch") is None
    except (ImportError, ValueError):  # torch hidden (sys.modules["torch"] = None) or broken
        missing = True
    if missing:
        raise MissingDependencyError(what)
