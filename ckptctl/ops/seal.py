"""``seal``: write the manifest of a checkpoint a framework wrote, making it "committed".

Structural checks run first; an incomplete or inconsistent checkpoint is refused (exit 1).
Sealing a sealed checkpoint verifies it against its manifest instead and says so.
The manifest is written last, atomically and exclusively: a concurrent sealer loses
cleanly instead of overwriting.

>>> r = seal("ckpt/", step=1200, tags=["release"])          # doctest: +SKIP
>>> r.action, r.manifest_id                                 # doctest: +SKIP
('sealed', 'xxh3-128:5c1f...')
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable

from .._deps import MissingDependencyError
from ..errors import CkptError, Finding, StorageError, UsageError
from ..formats.detect import locate, open_checkpoint
from ..formats.manifest import MANIFEST, Manifest, is_control_file, is_temp_name
from ..storage import digest_bytes, hash_file, normalize_algo
from .commit import commit, manifest_for
from .verify import Problem, verify


#: Remote files up to this size are hashed from the one whole-file GET the store caches
#: (the default ``max_file`` of :meth:`~ckptctl.storage.Store.cache_small_files`).
SMALL_FILE = 16 << 20


@dataclass
class SealResult:
    url: str
    action: str  # "sealed" or "verified"
    manifest_id: str | None
    format: str
    step: int | None
    hash: str
    num_files: int
    bytes: int
    seconds: float
    problems: list[Problem] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _worst(problems: list[Problem]) -> Problem:
    return next((p for p in problems if p.severity == "error"), problems[0])


def seal(url: str, storage_options: dict | None = None, *, hash: str | None = None,
         step: int | None = None, tags: list[str] | None = None, workers: int = 4,
         on_bytes: Callable[[int], None] | None = None,
         on_total: Callable[[int], None] | None = None, update: bool = False) -> SealResult:
    """Hash every file and write ``ckptctl.manifest.json`` last.

    Raises :class:`~ckptctl.errors.Finding` (exit 1) if the checkpoint is incomplete or
    inconsistent, or if it is sealed and no longer matches its manifest.

    A sealed checkpoint is verified against its manifest; files it does not list are
    reported (``problems``: EXTRA_FILE warnings). ``update=True`` reseals it instead:
    once every listed file still matches its hash, the files added since are hashed and
    a new manifest (the old step and tags kept unless given; ``hash=None``: the old
    algorithm) atomically replaces the old one, last (action ``"updated"``).

    >>> seal("ckpt/", update=True).action                       # doctest: +SKIP
    'updated'
    """
    t0 = time.monotonic()
    algo = normalize_algo(hash or "xxh3-128")
    located = locate(url, storage_options)
    store, files, single = located
    if single:
        raise UsageError("seal takes a checkpoint folder (the manifest lives beside the "
                         "files); put the file in its own folder", url)
    # Listed once, opened once: the listing and the checkpoint are passed on, and small
    # remote files (.metadata, the manifest, small chunks) are fetched once and shared by
    # the metadata reader, verify and the hashes (S3: one LIST, one GET of .metadata).
    store.cache_small_files(files)
    if MANIFEST in files:
        r = verify(url, storage_options, level="full", workers=workers, on_bytes=on_bytes,
                   located=located, uploads=False, on_total=on_total)
        if any(p.severity == "error" for p in r.problems):  # a stray temp file is no reason
            p = _worst(r.problems)
            raise Finding(p.path or url, f"already sealed, but {p.code}: {p.message}"
                          + (f" (+{len(r.problems) - 1} more)" if len(r.problems) > 1 else ""),
                          code=p.code)
        doc = Manifest.read(store, files)
        old = _update_plan(doc, files, hash=hash, step=step, tags=tags) if update else None
        if old is None:
            return SealResult(url, "verified", doc.id, doc.format, doc.step, doc.hash,
                              len(doc.files), doc.total_bytes,
                              round(time.monotonic() - t0, 3), problems=list(r.problems))
        algo, step, tags, known = old
        already = doc.total_bytes  # verify read them
    else:
        known, already = {}, 0
    try:
        ck = open_checkpoint(url, storage_options, strict=False, located=located)
    except (StorageError, MissingDependencyError):
        raise
    except CkptError:
        ck = None  # verify opens it again and reports what is wrong as a finding
    r = verify(url, storage_options, level="structure", workers=workers, located=located,
               checkpoint=ck, uploads=False)
    if any(p.severity == "error" for p in r.problems):  # e.g. what a killed seal left
        p = _worst(r.problems)
        raise Finding(p.path or url, f"refusing to seal: {p.code}: {p.message}"
                      + (f" (+{len(r.problems) - 1} more problems)" if len(r.problems) > 1 else ""),
                      code=p.code)
    if step is None:
        step = ck.step
    names = sorted(rel for rel in files if not is_control_file(rel) and not is_temp_name(rel)
                   and rel not in known)  # known: proven against the manifest just now
    if on_total:
        on_total(already + sum(files[rel] for rel in names))

    def one(rel):
        if not store.is_local and files[rel] <= SMALL_FILE:  # already fetched: no new GET
            data = store.read(rel)
            if on_bytes:
                on_bytes(len(data))
            return rel, (digest_bytes(data, algo), len(data))
        return rel, hash_file(store, rel, algo, on_bytes)

    with ThreadPoolExecutor(max(1, min(workers, len(names)))) as pool:
        hashes = {**known, **dict(pool.map(one, names))}
    for rel, (_, size) in hashes.items():
        if size != files[rel]:
            raise Finding(store.display(rel), "changed size while being sealed: is a writer "
                          "still running?", code="SIZE_MISMATCH")
    mid = commit(store, manifest_for(ck, hashes, algo=algo, step=step, tags=tags),
                 replace=MANIFEST in files)  # only --update gets here then
    return SealResult(url, "updated" if MANIFEST in files else "sealed", mid, ck.format, step, algo,
                      len(hashes), sum(size for _, size in hashes.values()),
                      round(time.monotonic() - t0, 3))


def _update_plan(doc: Manifest, files: dict[str, int], *, hash: str | None, step: int | None,
                 tags: list[str] | None):
    """For ``seal --update`` of a verified sealed checkpoint: (algo, step, tags, the
    listed files' (digest, size) to keep), or None when the manifest already says it all.

    >>> from ckptctl.formats.manifest import FileEntry
    >>> doc = Manifest({"x": FileEntry(1, "h")}, step=5, tags=["a"])
    >>> _update_plan(doc, {"x": 1, MANIFEST: 9}, hash=None, step=None, tags=None) is None
    True
    >>> _update_plan(doc, {"x": 1, "config.json": 2}, hash=None, step=None, tags=["b"])
    ('xxh3-128', 5, ['a', 'b'], {'x': ('h', 1)})
    """
    algo = normalize_algo(hash) if hash else doc.hash
    new_tags = sorted(set(doc.tags) | set(tags or []))
    new_step = doc.step if step is None else step
    added = [rel for rel in files if rel not in doc.files and not is_control_file(rel)
             and not is_temp_name(rel)]
    if not added and new_step == doc.step and new_tags == sorted(doc.tags) and algo == doc.hash:
        return None
    known = doc.hashes() if algo == doc.hash else {}
    return algo, new_step, new_tags, known
