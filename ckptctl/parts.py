"""The parts of a training state (model, optim, lr_scheduler, rng, step, dataloader,
meta, and DeepSpeed's ``module16``: the module's own 16-bit weights beside the fp32
master weights of ``model``) and which part an entry belongs to, from its name alone. A leaf: layout's presets
place only model and optimizer entries, ops report state closure with it
(:mod:`ckptctl.catalog.closure`).

>>> [classify(n) for n in ("model.layers.0.wq.weight", "optim.state.w.step", "epoch", "rng.cpu",
...  "module16.lin.weight")]
['model', 'optim', 'meta', 'rng', 'module16']
>>> [classify(n) for n in ("decoder.layers.mlp.linear_fc1._extra_state/shard_0_2",
...  "rng_state/shard_0.0_2.1", "opt_param_scheduler.max_lr", "args.hidden_size",
...  "common_state/shard_0_1")]
['meta', 'rng', 'lr_scheduler', 'meta', 'meta']
>>> [classify(n) for n in ("opt_state.0.mu.w", "state.opt_state.0.nu.w", "state.params.w",
...  "state.step")]
['optim', 'optim', 'model', 'step']
"""
from __future__ import annotations

import re

PARTS = ("model", "optim", "lr_scheduler", "rng", "step", "dataloader", "meta", "module16")
#: Parts that only some formats have: a state closure names them only where present.
OPTIONAL_PARTS = ("module16",)

_RULES = [
    ("module16", re.compile(r"^module16\.")),
    ("meta", re.compile(r"^(callbacks|loops|hyper_parameters|hparams|hparams_name|hparams_type|"
                        r"datamodule_hyper_parameters|datamodule_hparams_name|epoch|"
                        r"pytorch-lightning_version|lightning_version|custom|meta|scaler|"
                        r"native_amp_scaling_state|amp_scaling_state|trainer_state|client_state|"
                        r"args|checkpoint_version|num_floating_point_operations_so_far|"
                        r"content_metadata)(_\d+)?(\.|$)")),
    # Megatron-core's common state as one ShardedObject (its entries are read apart too)
    ("meta", re.compile(r"^common_state/shard_")),
    # a module's _extra_state (Transformer Engine's FP8 metadata; Megatron's ShardedObject
    # ``<key>/shard_<offset>_<shape>``): bytes beside the weights, not a weight
    ("meta", re.compile(r"(^|\.)_extra_state(/|\.|$)")),
    # ``opt_state``: Orbax / optax (``opt_state.0.mu.<param>``); under a Flax TrainState
    # saved as an item named ``state`` (``state.opt_state...``), as the step rule allows
    ("optim", re.compile(r"^((train_state|state)\.)?"
                         r"(optim|optimizer|optimizers|opt|opt_state|optimizer_states?|"
                         r"distrib_optim)"
                         r"(_\d+)?(\.|$)|"
                         r"(^|\.)(exp_avg|exp_avg_sq|param_groups|momentum_buffer)(\.|$)")),
    ("lr_scheduler", re.compile(r"^(lr_schedulers?|schedulers?|sched|opt_param_scheduler)"
                                r"(_\d+)?(\.|$)")),
    ("rng", re.compile(r"^(rng|rngs|rng_states?|random_states?|torch_rng_state|cuda_rng_state|"
                       r"numpy_rng_state|python_rng_state|generator)(\.|/|$)")),
    ("dataloader", re.compile(r"^(dataloaders?|data_loaders?|sampler|data_state|dataset|"
                              r"data)(_\d+)?(\.|$)")),
    ("step", re.compile(r"^((train_state|trainer|state)\.)?(step|global_step|iteration|"
                        r"iter|steps|consumed_samples)$")),
]


def classify(name: str) -> str:
    """The part of the training state an entry belongs to (``model`` by default)."""
    for part, pat in _RULES:
        if pat.search(name):
            return part
    return "model"
