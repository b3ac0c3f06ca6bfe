"""One vocabulary for every ``--json`` document (issue 21; issue 35 item 9): a key means
one thing in every verb, holds the same value in every verb that describes one checkpoint,
and a meaning has one key. :data:`VOCABULARY` is the README's table ("JSON vocabulary",
generated from it); :data:`SYNONYMS` are the names a meaning could be given and is not (the
first of each group is the one used); :func:`must_be_int` says which keys hold integers
(sizes, counts, rates); :func:`counted_files` is the one definition of a checkpoint's
``num_files`` and ``bytes``. ``tests/test_json_vocabulary.py`` runs every verb with
``--json`` and holds the documents to all of them.

>>> RETIRED["files_checked"], RETIRED["mb_per_s"], RETIRED["files_read"]
('num_files', 'bytes_per_second', 'num_files_read')
>>> must_be_int("bytes_sent"), must_be_int("bwlimit_bytes_per_second"), must_be_int("ratio")
(True, True, False)
"""
from __future__ import annotations

#: Version of every ``--json`` document (README, "JSON output"): it changes when a key is
#: removed or changes meaning (:data:`RENAMED`, :data:`CHANGED`), never for a new key.
SCHEMA_VERSION = 3

#: key -> meaning, wherever it appears (README, "JSON vocabulary").
VOCABULARY: dict[str, str] = {
    "schema_version": f"version of the document's schema ({SCHEMA_VERSION}); first key of "
                      "every document",
    "url": "a checkpoint's location as it was given: a relative path stays relative, a URL "
           "stays a URL (a tier reference: its tier's URL); a checkpoint found under a root "
           "is shown under that root as given. So are `root`, `src`, `dst` and every `path`",
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
    "bytes": "a size in bytes (integer): of a checkpoint, the total size of the files "
             "`num_files` counts; of a command, what it wrote",
    "bytes_*, *_bytes": "sizes in bytes (integers): bytes_sent, bytes_read, tensor_bytes, ...",
    "files": "always a list of file names",
    "num_files": "the number of files a checkpoint owns, as stored at its place (integer): "
                 "those its format names, those its manifest lists and a model folder's "
                 "side files (config.json, tokenizer files), but ckptctl's own markers "
                 "(manifest, pin, writing marker) and leftover temporary files; a file put "
                 "beside it (NOTES.md) counts once a seal lists it; a pack counts its own "
                 "files. The same number in ls, inspect, verify, seal and rm",
    "num_*": "counts (integers): num_tensors, num_objects, num_chunks, num_files_read, "
             "num_tensors_checked, num_errors, num_warnings, ...",
    "seconds": "a duration in seconds; `*_seconds` likewise",
    "bytes_per_second": "a measured rate in bytes per second (integer)",
    "bwlimit_bytes_per_second": "a configured bandwidth limit in bytes per second "
                                "(integer; null: none)",
    "modified": "a checkpoint's time as listed (newest modification): ISO-8601 UTC",
    "created": "when the checkpoint was sealed (its manifest's time, kept by every copy): "
               "ISO-8601 UTC; null when unsealed",
    "initiated": "when an unfinished multipart upload was started: ISO-8601 UTC",
    "pinned, pinned_at": "whether a checkpoint is pinned, and since when (ISO-8601 UTC)",
    "ok, equal": "a verdict, true where the command exits 0: verify's `ok` is false on a "
                 "problem of severity error (with `strict`, on a warning too); diff's "
                 "`equal` is false on any difference",
    "strict": "verify's `--strict`: warnings (EXTRA_FILE, STRAY_TEMP, ORPHANED_UPLOAD) fail "
              "too; without it they are counted (`num_warnings`) and exit 0",
    "reason": "why, in words, of what it sits in (a state in an ls row, a pin in pin, a "
              "failure in watch): free text, so two verbs may word it differently",
    "verdict": "diff's verdict in one entry status: identical, equal_within_tolerance or "
               "different",
    "part": "the state part an entry belongs to: model, optim, lr_scheduler, rng, step, "
            "dataloader, meta, module16 (`parts`: counts per part)",
    "problems": "findings: [{code, severity (error or warning), path, entry, message}]",
    "error": "on failure only: {code, exit_code, message, path}",
}

#: Names for one meaning: the first is the one the documents use, the rest may not appear
#: (a document that has one says the same thing under a second name).
SYNONYMS: tuple[tuple[str, ...], ...] = (
    ("num_files", "files_checked", "file_count", "files_count", "nfiles", "n_files"),
    ("num_files_read", "files_read"),
    ("num_tensors_checked", "tensors_checked", "checked_tensors"),
    ("num_warnings", "warning_count", "n_warnings"),
    ("num_errors", "error_count", "n_errors"),
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

#: schema version -> {key of the version before: the key that replaced it} (README, "JSON
#: vocabulary"). ``created`` stays, with the one meaning of the table.
RENAMED: dict[int, dict[str, str]] = {
    2: {"files_checked": "num_files", "source_id": "manifest_id",
        "mb_per_s": "bytes_per_second", "bwlimit": "bwlimit_bytes_per_second",
        "created": "modified (gc's checkpoints[]) / initiated (gc's uploads[])"},
    3: {"files_read": "num_files_read", "tensors_checked": "num_tensors_checked"},
}
#: schema version -> what else changed meaning in it
CHANGED: dict[int, str] = {
    3: "verify's `ok` is false on an error only (on a warning too with `--strict`; "
       "`num_errors`, `num_warnings` and `strict` say which); `num_files` and `bytes` count "
       "the files a checkpoint owns in every verb (ls and inspect counted its manifest and "
       "files put beside it, verify those files; inspect and verify of a pack count its own "
       "files, as ls does); every location is shown as it was given (ls, latest, gc, pin and "
       "rm made a relative path absolute)",
}
#: every retired key -> the key that replaced it
RETIRED: dict[str, str] = {old: new for renames in RENAMED.values()
                           for old, new in renames.items()}

#: keys whose values are places (shown as given: :data:`VOCABULARY`'s ``url``)
LOCATION_KEYS = frozenset({"url", "root", "src", "dst", "path"})

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


def counted_files(files: dict[str, int], manifest=None, *, single: str | None = None,
                  store=None) -> dict[str, int]:
    """The files a checkpoint's ``num_files`` counts and its ``bytes`` sums, in every verb:
    of ``files`` (its folder's listing, relative to it), those the checkpoint owns
    (:func:`~ckptctl.catalog.ownership.split_owned`: what its format names, what its
    ``manifest`` lists, a model folder's side files; ``single``: a lone file, which owns
    itself) but ckptctl's own markers (manifest, pin, writing marker, references) and
    leftover temporary files. A file a user put beside it (``NOTES.md``) is not counted
    until a seal lists it. ``store``: where a pack is read as the checkpoint it holds (a
    :class:`~ckptctl.formats.pack.PackStore`), the pack's own files are counted.

    >>> sorted(counted_files({".metadata": 1, "__0_0.distcp": 8, "NOTES.md": 2,
    ...     "ckptctl.manifest.json": 3, ".ckptctl-pinned": 1, "..metadata.x1.tmp": 1}))
    ['.metadata', '__0_0.distcp']
    """
    from ..formats.manifest import is_control_file, is_temp_name
    from .ownership import split_owned

    raw = getattr(store, "raw_files", None)
    if raw:  # a pack: its index and data files (its own manifest lists just those)
        files, manifest, single = raw, None, None
    owned, _ = split_owned(files, manifest, single=single)
    return {rel: size for rel, size in owned.items()
            if not is_control_file(rel) and not is_temp_name(rel)}
