"""Training-loop callbacks that seal each checkpoint as soon as the framework saved it.

``HFSealingCallback`` (a ``transformers.TrainerCallback``: ``on_save`` seals the
``checkpoint-N`` folder the Trainer just wrote) and ``LightningSealingCallback`` (a
Lightning ``Callback``: each checkpoint file, once written, gets its folder sealed).
``watch=`` names a tier config: the checkpoints must land in its first tier, where
``ckptctl watch`` takes sealed ones (nothing else is written for it). transformers and
Lightning are imported when a callback class is first used, never by ``import ckptctl``.

>>> from ckptctl.callbacks import HFSealingCallback              # doctest: +SKIP
>>> Trainer(model, args, callbacks=[HFSealingCallback(watch="ckptctl.toml")])  # doctest: +SKIP
"""
from __future__ import annotations

import functools
import os

from ._deps import MissingDependencyError
from .errors import UsageError
from .formats.manifest import CONTROL_FILES, MANIFEST
from .integrity.seal import SealResult, seal


def seal_saved(folder: str, *, step: int | None = None, tags: list[str] | None = None,
               storage_options: dict | None = None) -> SealResult:
    """Seal the checkpoint a training loop just saved in ``folder`` (``ckptctl seal``).

    >>> seal_saved("out/checkpoint-20", step=20).action          # doctest: +SKIP
    'sealed'
    """
    return seal(os.fspath(folder), storage_options, step=step, tags=tags)


def first_tier(watch: str | None) -> str | None:
    """The URL of the first tier of the config ``watch`` (None: no hand-off), where the
    checkpoints must be saved for ``ckptctl watch`` to take them.

    >>> first_tier(None) is None
    True
    """
    if watch is None:
        return None
    from .tiering.config import load_config

    tiers = load_config(os.fspath(watch)).tiers
    if not tiers:
        raise UsageError("the config names no tier to hand checkpoints to", os.fspath(watch))
    return tiers[0].url


def check_in_tier(root: str, tier: str | None, watch) -> None:
    """Refuse (exit 2) a save root that ``ckptctl watch`` would not list as its first tier.

    >>> check_in_tier("/nvme/run1", "/nvme/run1/", "ckptctl.toml")
    >>> check_in_tier("/tmp/x", "/nvme/run1", "ckptctl.toml")
    Traceback (most recent call last):
    ckptctl.errors.UsageError: /tmp/x: checkpoints saved here are not in the first tier of ckptctl.toml (/nvme/run1): watch would not see them
    """
    if tier is None or _same_place(root, tier):
        return
    raise UsageError(f"checkpoints saved here are not in the first tier of {watch} "
                     f"({tier}): watch would not see them", os.fspath(root))


def _same_place(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def __getattr__(name: str):
    if name == "HFSealingCallback":
        return _hf_class()
    if name == "LightningSealingCallback":
        return _lightning_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _need(module: str, what: str, pip: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        if not (e.name or "").startswith(module.split(".")[0]):
            raise
        raise MissingDependencyError(what, f"needs {pip}: pip install {pip}") from None


@functools.cache
def _hf_class():
    transformers = _need("transformers", "HFSealingCallback", "transformers")

    class HFSealingCallback(transformers.TrainerCallback):
        """Seal every ``checkpoint-N`` folder the HF ``Trainer`` saves, on the main
        process, right after the save (``on_save``); step N, ``tags`` on each.
        ``watch``: a tier config whose first tier is ``output_dir`` (checked at the
        start of training).

        >>> from ckptctl.callbacks import HFSealingCallback      # doctest: +SKIP
        >>> cb = HFSealingCallback(tags=["run7"])                # doctest: +SKIP
        >>> trainer = Trainer(model, args, callbacks=[cb])       # doctest: +SKIP
        >>> trainer.train()                                      # doctest: +SKIP
        """

        def __init__(self, *, tags: list[str] | None = None, watch: str | None = None):
            self.tags = list(tags or [])
            self.watch = watch
            self.results: list[SealResult] = []

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                check_in_tier(args.output_dir, first_tier(self.watch), self.watch)

        def on_save(self, args, state, control, **kwargs):
            if not state.is_world_process_zero:
                return
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            self.results.append(seal_saved(folder, step=state.global_step, tags=self.tags))

    return HFSealingCallback


def _lightning():
    try:
        return _need("lightning.pytorch", "LightningSealingCallback", "lightning")
    except MissingDependencyError:
        return _need("pytorch_lightning", "LightningSealingCallback", "lightning")


@functools.cache
def _lightning_class():
    pl = _lightning()

    class SealingCheckpointIO(pl.plugins.CheckpointIO):
        """The trainer's CheckpointIO, then the seal of the saved file's folder; a
        removal (``save_top_k``) takes the manifest away first."""

        def __init__(self, inner, owner):
            self.inner = inner
            self.owner = owner

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
            self.owner.seal_file(os.fspath(path), checkpoint.get("global_step"))

        def load_checkpoint(self, path, map_location=None, **kwargs):
            return self.inner.load_checkpoint(path, map_location=map_location, **kwargs)

        def remove_checkpoint(self, path):
            folder = os.path.dirname(os.fspath(path))
            if os.path.exists(os.path.join(folder, MANIFEST)):
                os.remove(os.path.join(folder, MANIFEST))  # the commit marker goes first
            self.inner.remove_checkpoint(path)
            try:
                os.rmdir(folder)  # the checkpoint's own folder, once empty
            except OSError:
                pass

        def teardown(self):
            self.inner.teardown()

    class LightningSealingCallback(pl.Callback):
        """Seal each checkpoint Lightning saves, once its file is written. A sealed
        checkpoint is a folder: save each one in its own, e.g.
        ``ModelCheckpoint(dirpath=root, filename="step-{step}/model",
        auto_insert_metric_name=False)``; a file whose folder holds anything else
        (``last.ckpt`` beside the step folders) is refused (exit 2). ``watch``: a tier
        config whose first tier is that ``root``.

        >>> from ckptctl.callbacks import LightningSealingCallback   # doctest: +SKIP
        >>> ckpt = ModelCheckpoint(dirpath="run", filename="step-{step}/model",
        ...                        auto_insert_metric_name=False)    # doctest: +SKIP
        >>> Trainer(callbacks=[ckpt, LightningSealingCallback()]).fit(model)  # doctest: +SKIP
        """

        def __init__(self, *, tags: list[str] | None = None, watch: str | None = None):
            self.tags = list(tags or [])
            self.watch = watch
            self.tier = None
            self.results: list[SealResult] = []

        def setup(self, trainer, pl_module, stage):
            # the save goes through the strategy's CheckpointIO: seal right behind it
            io = trainer.strategy.checkpoint_io
            if type(io).__name__ == "AsyncCheckpointIO":  # returns before the file is there
                raise UsageError("LightningSealingCallback cannot seal behind "
                                 "AsyncCheckpointIO: its save returns before the file is "
                                 "written", type(io).__name__)
            if not isinstance(io, SealingCheckpointIO):
                trainer.strategy.checkpoint_io = SealingCheckpointIO(io, self)
            if trainer.is_global_zero:
                self.tier = first_tier(self.watch)

        def seal_file(self, path: str, step) -> None:
            folder = os.path.dirname(os.path.abspath(path))
            others = [n for n in os.listdir(folder) if n != os.path.basename(path)
                      and n not in CONTROL_FILES]
            if others:
                raise UsageError("a sealed checkpoint needs a folder of its own, and this "
                                 f"one also holds {others[0]}: save with ModelCheckpoint("
                                 "filename='step-{step}/model', auto_insert_metric_name=False)",
                                 path)
            check_in_tier(os.path.dirname(folder), self.tier, self.watch)
            step = step if isinstance(step, int) else None
            self.results.append(seal_saved(folder, step=step, tags=self.tags))

    return LightningSealingCallback
