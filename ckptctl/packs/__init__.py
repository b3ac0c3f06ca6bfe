"""``pack`` and ``unpack``: lossless, compressed, delta-encoded copies of a checkpoint that
restore every file byte for byte, and the re-rooting of a delta chain.

- :mod:`.pack`: the ``pack`` verb and :class:`~.pack.PackResult`;
- :mod:`.sources`: what a pack is read from: the source checkpoint and its base;
- :mod:`.segments`: where a checkpoint's tensor bytes lie, and each file cut into segments;
- :mod:`.encode`: chunks encoded on a thread pool into data files laid out for one or
  many processes;
- :mod:`.unpack`: the ``unpack`` verb and :func:`~.unpack.open_pack_url`;
- :mod:`.reroot`: a delta pack written again against a newer base, crash-safe.

Imports integrity, writing, catalog, formats, storage and the foundations."""
