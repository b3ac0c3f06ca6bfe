"""State closure: which parts of a training state a checkpoint holds, from entry names.

>>> [classify(n) for n in ("model.layers.0.wq.weight", "optim.state.w.exp_avg",
...  "optim.state.w.step", "lr_scheduler.last_epoch", "rng.cpu", "step", "dataloader.epoch",
...  "lm_head.weight", "callbacks.EarlyStopping.wait_count", "epoch", "custom.0")]
['model', 'optim', 'optim', 'lr_scheduler', 'rng', 'step', 'dataloader', 'model', 'meta', 'meta', 'meta']

Trainer and callback state (Lightning's ``callbacks``, ``loops``, ``hyper_parameters``,
``epoch``; accelerate's custom objects, the AMP scaler) is ``meta``: not model, not optimizer.
"""
from __future__ import annotations

import re

from ..parts import OPTIONAL_PARTS, PARTS, classify  # noqa: F401 - re-exported: ops name parts here


#: Tensors that models register as buffers, not parameters (BatchNorm statistics, position
#: ids, rotary frequencies, GPT-2 style causal masks).
_BUFFER = re.compile(r"(^|\.)(running_mean|running_var|num_batches_tracked|position_ids|"
                     r"token_type_ids|inv_freq|masked_bias)$|(^|\.)(attn|attention)\.bias$")


def is_parameter(name: str, dtype) -> bool:
    """Whether a model-part tensor counts as a parameter: floating, and not named like a
    buffer. Integer and bool tensors are always buffers.

    >>> from ckptctl.model import DTYPES
    >>> [is_parameter(n, DTYPES[d]) for n, d in (("bn.weight", "float32"),
    ...  ("bn.running_mean", "float32"), ("bn.num_batches_tracked", "int64"),
    ...  ("h.0.attn.bias", "float32"), ("h.0.attn.c_attn.bias", "float32"),
    ...  ("rotary_emb.inv_freq", "float32"), ("mask", "bool"))]
    [True, False, False, False, True, False, False]
    """
    return dtype.is_floating and not _BUFFER.search(name)


def parse_parts(spec: str) -> list[str]:
    """``model,optim`` -> parts, accepting ``optimizer``/``scheduler`` spellings.

    >>> parse_parts("model, optimizer,rng")
    ['model', 'optim', 'rng']
    """
    from ..errors import UsageError

    alias = {"optimizer": "optim", "scheduler": "lr_scheduler", "lr": "lr_scheduler",
             "data": "dataloader", "weights": "model", "trainer": "meta", "callbacks": "meta",
             "other": "meta", "custom": "meta"}
    out = []
    for raw in spec.split(","):
        p = alias.get(raw.strip(), raw.strip())
        if p not in PARTS:
            raise UsageError(f"unknown state part {raw.strip()!r} (choose from {', '.join(PARTS)})")
        out.append(p)
    return out
