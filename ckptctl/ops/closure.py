"""State closure: which parts of a training state a checkpoint holds, from entry names.

>>> [classify(n) for n in ("model.layers.0.wq.weight", "optim.state.w.exp_avg",
...  "optim.state.w.step", "lr_scheduler.last_epoch", "rng.cpu", "step", "dataloader.epoch",
...  "lm_head.weight")]
['model', 'optim', 'optim', 'lr_scheduler', 'rng', 'step', 'dataloader', 'model']
"""
from __future__ import annotations

import re

PARTS = ("model", "optim", "lr_scheduler", "rng", "step", "dataloader")

_RULES = [
    ("optim", re.compile(r"^(optim|optimizer|optimizers|opt|optimizer_states?)(\.|$)|"
                         r"(^|\.)(exp_avg|exp_avg_sq|param_groups|momentum_buffer)(\.|$)")),
    ("lr_scheduler", re.compile(r"^(lr_schedulers?|schedulers?|sched)(\.|$)")),
    ("rng", re.compile(r"^(rng|rngs|rng_states?|random_states?|torch_rng_state|cuda_rng_state|"
                       r"numpy_rng_state|python_rng_state|generator)(\.|$)")),
    ("dataloader", re.compile(r"^(dataloaders?|data_loaders?|sampler|data_state|dataset|"
                              r"data)(\.|$)")),
    ("step", re.compile(r"^((train_state|trainer|state)\.)?(step|global_step|iteration|"
                        r"iter|steps|consumed_samples)$")),
]


def classify(name: str) -> str:
    """The part of the training state an entry belongs to (``model`` by default)."""
    for part, pat in _RULES:
        if pat.search(name):
            return part
    return "model"


def parse_parts(spec: str) -> list[str]:
    """``model,optim`` -> parts, accepting ``optimizer``/``scheduler`` spellings.

    >>> parse_parts("model, optimizer,rng")
    ['model', 'optim', 'rng']
    """
    from ..errors import UsageError

    alias = {"optimizer": "optim", "scheduler": "lr_scheduler", "lr": "lr_scheduler",
             "data": "dataloader", "weights": "model"}
    out = []
    for raw in spec.split(","):
        p = alias.get(raw.strip(), raw.strip())
        if p not in PARTS:
            raise UsageError(f"unknown state part {raw.strip()!r} (choose from {', '.join(PARTS)})")
        out.append(p)
    return out
