"""Storage: fsspec URL -> :class:`Store` (ranged reads, listing, safe paths, atomic
commit, streaming writes, multipart uploads, server-side copy, ordered deletes), streaming
content hashes, a shared rate limiter and retries with backoff.

Imports the foundations (errors, units, model) only: nothing here knows a checkpoint format."""
from .hashing import ALGORITHMS, HashBehind, HashingWriter, digest_bytes, hash_file, new_hasher, normalize_algo
from .ratelimit import RateLimiter, parse_rate
from .retry import is_transient, with_retries
from .backends import open_store
from .store import Store
from .store_core import Capabilities, IOStats
from .urls import parse_storage_options, safe_relpath, split_url

__all__ = ["ALGORITHMS", "Capabilities", "HashBehind", "HashingWriter", "IOStats", "RateLimiter", "Store",
           "digest_bytes", "hash_file", "is_transient", "new_hasher", "normalize_algo",
           "open_store", "parse_rate", "parse_storage_options", "safe_relpath", "split_url",
           "with_retries"]
