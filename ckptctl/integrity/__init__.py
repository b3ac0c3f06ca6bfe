"""``verify`` and ``seal``: what is proven about a checkpoint's bytes, level by level, and
the manifest written only over bytes that pass.

Imports writing, catalog, formats, storage and the foundations."""
