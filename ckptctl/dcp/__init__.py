"""torch DCP storage layers over ckptctl: :class:`SealingWriter` (``dcp.save`` that commits
a manifest as it saves) and :class:`Reader` (``dcp.load`` from any checkpoint ckptctl
reads, at any mesh, without a conversion copy).

Imports convert, writing, catalog, formats, storage and the foundations; needs torch."""
from .reader import Reader, renamer
from .writer import (HASH_TAG, OVERLAP, REFUSED_TAG, HashingFileSystem, HashingStream,
                     SealingWriter, refusal)

__all__ = ["HASH_TAG", "OVERLAP", "REFUSED_TAG", "HashingFileSystem", "HashingStream",
           "Reader", "SealingWriter", "refusal", "renamer"]
