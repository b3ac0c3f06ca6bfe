"""``pack`` and ``unpack``: lossless, compressed, delta-encoded copies of a checkpoint that
restore every file byte for byte, and the re-rooting of a delta chain.

Imports integrity, writing, catalog, formats, storage and the foundations."""
