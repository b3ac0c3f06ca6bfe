"""The in-memory cache of whole small remote files behind
:meth:`~ckptctl.storage.store.Store.cache_small_files`: :class:`SmallFileCache`.

>>> c = SmallFileCache({"a": 3, "big": 1 << 30}, max_file=16, budget=64)
>>> c.wants("a"), c.wants("big"), c.get("a", lambda: b"abc"), c.get("a", lambda: b"not read")
(True, False, b'abc', b'abc')
"""
from __future__ import annotations

import threading


class SmallFileCache:
    """Whole small files kept in memory, least recently used evicted past ``budget``."""

    def __init__(self, sizes: dict[str, int], max_file: int, budget: int):
        import collections

        self.sizes, self.max_file, self.budget = dict(sizes), max_file, budget
        self.data: "collections.OrderedDict[str, bytes]" = collections.OrderedDict()
        self.lock = threading.Lock()
        self.loading: dict[str, threading.Lock] = {}

    def wants(self, rel: str) -> bool:
        size = self.sizes.get(rel)
        return size is not None and size <= self.max_file

    def get(self, rel: str, load) -> bytes:
        with self.lock:
            if rel in self.data:
                self.data.move_to_end(rel)
                return self.data[rel]
            file_lock = self.loading.setdefault(rel, threading.Lock())
        with file_lock:  # one GET per file even when threads ask at once
            with self.lock:
                if rel in self.data:
                    return self.data[rel]
            blob = load()
            with self.lock:
                self.data[rel] = blob
                while sum(len(b) for b in self.data.values()) > self.budget and len(self.data) > 1:
                    self.data.popitem(last=False)
            return blob
