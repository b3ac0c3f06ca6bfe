"""``reshard``, ``consolidate`` and ``diff``: the logical tensors of any checkpoint cut into
a target layout (a plan, then a copier that executes it), written as DCP, safetensors,
torch.save, DeepSpeed-universal or Megatron; or two checkpoints compared through them.

Imports writing, catalog, formats, storage and the foundations; never integrity or packs."""
