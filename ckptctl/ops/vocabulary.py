"""One vocabulary for every ``--json`` document (issue 21): a key means one thing in every
verb, and a meaning has one key. :data:`VOCABULARY` is the README's table ("JSON
vocabulary", generated from it); :data:`SYNONYMS` are the names a meaning could be given
and is not (the first of each group is the one used); :func:`must_be_int` says which keys
hold integers (sizes, counts, rates). ``tests/test_json_vocabulary.py`` runs every verb
with ``--json`` and holds the documents to all three.

>>> RETIRED["files_checked"], RETIRED["mb_per_s"], RETIRED["source_id"]
('num_files', 'bytes_per_second', 'manifest_id')
>>> must_be_int("bytes_sent"), must_be_int("bwlimit_bytes_per_second"), must_be_int("ratio")
(True, True, False)
"""
from __future__ import annotations

#: key -> meaning, wherever it appears (README, "JSON vocabulary").
VOCABULARY: dict[str, str] = {
    "schema_version": "version of the document's schema (2); first key of every document",
    "url": "a checkpoint's URL, as given or as listed",
    "src, dst": "what a command reads and what it writes (a URL; a tier name in watch and "
                "plan hops)",
    "a, b": "diff's two sides, each {url, format, step, num_tensors, num_objects, "
            "manifest_id}",
    "root": "the folder or prefix holding checkpoints (ls, gc, latest)",
    "name": "a checkpoint's folder name under its root (step-1200), or an entry's name",
    "manifest_id": "the checkpoint's id: the id of its manifest (xxh3-128:...); a pack "
                   "gives the id of the checkpoint it holds (the one unpack restores) and "
                   "`pack_id` its own files'; null where it is not sealed",
    "step": "the checkpoint's step: the manifest's, else a step entry, else the name",
    "state": "sealed, complete, incomplete or corrupt",
    "bytes": "a size in bytes (integer): the checkpoint's files, or what was written",
    "bytes_*, *_bytes": "sizes in bytes (integers): bytes_sent, bytes_read, tensor_bytes, ...",
    "files": "always a list of file names",
    "num_files": "the number of the checkpoint's files, its manifest aside (integer)",
    "num_*": "counts (integers): num_tensors, num_objects, num_chunks, ...",
    "seconds": "a duration in seconds; `*_seconds` likewise",
    "bytes_per_second": "a measured rate in bytes per second (integer)",
    "bwlimit_bytes_per_second": "a configured bandwidth limit in bytes per second "
                                "(integer; null: none)",
    "modified": "a checkpoint's time as listed (newest modification): ISO-8601 UTC",
    "created": "when the checkpoint was sealed (its manifest's time, kept by every copy): "
               "ISO-8601 UTC; null when unsealed",
    "initiated": "when an unfinished multipart upload was started: ISO-8601 UTC",
    "pinned, pinned_at": "whether a checkpoint is pinned, and since when (ISO-8601 UTC)",
    "ok, equal": "verify's and diff's verdicts (true: nothing wrong, no difference)",
    "verdict": "diff's verdict in one entry status: identical, equal_within_tolerance or "
               "different",
    "part": "the state part an entry belongs to: model, optim, lr_scheduler, rng, step, "
            "dataloader, meta, module16 (`parts`: counts per part)",
    "problems": "findings: [{code, severity, path, entry, message}]",
    "error": "on failure only: {code, exit_code, message, path}",
}

#: Names for one meaning: the first is the one the documents use, the rest may not appear
#: (a document that has one says the same thing under a second name).
SYNONYMS: tuple[tuple[str, ...], ...] = (
    ("num_files", "files_checked", "file_count", "files_count", "nfiles", "n_files"),
    ("manifest_id", "source_id", "checkpoint_id", "id", "ckpt_id"),
    ("bytes_per_second", "mb_per_s", "mib_per_s", "rate", "speed", "throughput",
     "bytes_per_sec"),
    ("bwlimit_bytes_per_second", "bwlimit", "bandwidth_limit", "rate_limit", "limit"),
    ("modified", "mtime", "time", "timestamp", "last_modified", "modified_at"),
    ("created", "created_at", "ctime", "sealed_at"),
    ("seconds", "duration", "elapsed", "elapsed_seconds", "took"),
    ("bytes", "size", "size_bytes", "nbytes", "num_bytes", "total_bytes",
     "bytes_written"),
    ("url", "uri", "location", "checkpoint"),
    ("num_tensors", "tensor_count", "n_tensors", "tensors_count"),
    ("step", "global_step", "iteration"),
)

#: key of schema 1 -> the key that replaced it in schema 2 (issue 21 part 4; README, "JSON
#: vocabulary"). ``created`` stays, with the one meaning of the table.
RETIRED: dict[str, str] = {
    "files_checked": "num_files", "source_id": "manifest_id", "mb_per_s": "bytes_per_second",
    "bwlimit": "bwlimit_bytes_per_second", "created": "modified (gc's checkpoints[]) / "
    "initiated (gc's uploads[])",
}

#: keys ending like a size whose value is not one
_NOT_SIZES = {"ratio"}


def must_be_int(key: str) -> bool:
    """Does ``key`` hold an integer wherever it appears (a size, a count or a rate)?

    >>> [must_be_int(k) for k in ("bytes", "num_files", "bytes_per_second", "seconds")]
    [True, True, True, False]
    """
    if key in _NOT_SIZES:
        return False
    return (key == "bytes" or key.startswith(("bytes_", "num_")) or key.endswith("_bytes")
            or key.endswith("bytes_per_second"))
