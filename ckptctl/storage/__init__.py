"""Storage: fsspec URL -> :class:`Store` (ranged reads, listing, safe paths)."""
from .store import IOStats, Store, open_store, parse_storage_options, safe_relpath, split_url

__all__ = ["IOStats", "Store", "open_store", "parse_storage_options", "safe_relpath", "split_url"]
