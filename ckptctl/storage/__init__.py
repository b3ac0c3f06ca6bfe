"""Storage: fsspec URL -> :class:`Store` (ranged reads, listing, safe paths, atomic
commit) and streaming content hashes."""
from .hashing import ALGORITHMS, HashingWriter, digest_bytes, hash_file, new_hasher, normalize_algo
from .store import IOStats, Store, open_store, parse_storage_options, safe_relpath, split_url

__all__ = ["ALGORITHMS", "HashingWriter", "IOStats", "Store", "digest_bytes", "hash_file", "new_hasher",
           "normalize_algo", "open_store", "parse_storage_options", "safe_relpath", "split_url"]
