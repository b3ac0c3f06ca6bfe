"""Checkpoints across tiers: ``promote``, ``gc``, ``latest``, ``rm``, ``pin`` and ``plan``,
over the tier config (``ckptctl.toml``) and the retention policy.

Imports packs, integrity, writing, catalog, formats, storage and the foundations."""
