"""What ``pack`` reads: the source checkpoint (:func:`open_source`, hashed and sealed first
when it has no manifest) and the base a delta pack is made against (:func:`open_base`,
from a plain copy beside the source when one holds the same checkpoint), and the
reference a delta pack leaves in a base outside its folder (:func:`note_dependant`).
"""
from __future__ import annotations

from ..errors import CkptError, Finding, StorageError, UsageError
from ..formats.manifest import MANIFEST, Manifest, control_name
from ..formats.pack import MAX_DEPTH, PackStore


def open_source(src: str, options: dict | None, workers: int, *,
                seal_source: bool | None = None, source_manifest: bytes | None = None):
    """(store, files, manifest, its bytes, sealed by us, single file or None) of a
    complete source checkpoint. An unsealed one is hashed
    (:func:`~ckptctl.integrity.seal.seal_or_hash`) unless ``source_manifest`` (its
    manifest, computed by the caller) is given; left unsealed, its manifest exists in
    memory only (``files`` has none) and is packed from there. A single-file checkpoint's
    store is the folder holding it, its manifest the sidecar beside it."""
    from ..formats.detect import locate
    from ..formats.locate import refuse_save_folder
    from ..formats.pack import pack_view

    located = pack_view(locate(src, options), options)
    refuse_save_folder(located, src, "pack")
    store, files, single = located
    mname = control_name(MANIFEST, single)
    sealed = False
    raw = source_manifest if mname not in files else None
    if mname not in files and raw is None:
        from ..integrity.seal import seal_or_hash

        man, sealed = seal_or_hash(src, options, seal_source=seal_source, workers=workers,
                                   located=located)  # refuses an incomplete source (exit 1)
        if sealed:
            store, files, _ = pack_view(locate(src, options), options)
        else:
            raw = man.to_bytes()
    if raw is None:
        raw = store.read(mname)
    man = Manifest.parse(raw, store.display(mname))
    for rel, rec in man.files.items():
        if files.get(rel) != rec.size:
            what = "missing" if rel not in files else \
                f"{files[rel]} bytes, manifest says {rec.size}"
            raise Finding(store.display(rel), f"source does not match its manifest ({what}); "
                          "run `ckptctl verify` on it",
                          code="MISSING_FILE" if rel not in files else "SIZE_MISMATCH")
    return store, files, man, raw, sealed, single


def open_base(base: str, options: dict | None, *, plain_copy: str | None = None,
              plain_options: dict | None = None, max_depth: int = MAX_DEPTH,
              listed: tuple | None = None):
    """(store, files, checkpoint, id, depth, read from, chain) of a sealed base (a pack
    works too; ``chain``: the URLs of its own bases, nearest first). ``plain_copy``:
    where a plain copy of a packed base may be (the source's sibling of the same name);
    when it holds the same checkpoint (same id) and its bytes hash to its manifest, the
    base's content is read from there (``read from`` is its URL, else None): a delta chain
    decodes level by level over the network, so reading through it costs time that grows
    with its depth. ``listed``: a listing of the folder holding the base and its chain,
    just made (``--base auto`` chose from it): no level is listed again. The chain's
    small files come from the object cache where it holds them (a level does not change
    once committed; :class:`~ckptctl.formats.pack.ChainWalk`), so a walk costs the same
    at depth 8 as at depth 1."""
    from ..formats.detect import open_checkpoint
    from ..formats.pack import ChainWalk, chain_urls, pack_view

    walk = ChainWalk(listed=listed, persist=True)
    located = pack_view(walk.locate(base, options), options, ahead=walk)
    store, files, single = located
    chain = chain_urls(store.url, store.index) if isinstance(store, PackStore) else []
    if isinstance(store, PackStore) and store.index.depth + 1 <= max_depth:
        from ..catalog.checks import base_unrestorable

        why = base_unrestorable(store, options)  # one listing and two small reads a level
        if why:
            raise Finding(base, f"cannot pack against it: {why}", code="MISSING_BASE")
    if isinstance(store, PackStore) and plain_copy and store.index.depth + 1 <= max_depth:
        bid, depth = store.index.source_id, store.index.depth + 1
        copy = _proven_copy(plain_copy, plain_options, bid)
        if copy is not None:
            return (*copy, bid, depth, plain_copy, chain)
    man = store.manifest if isinstance(store, PackStore) else \
        Manifest.read(store, files, single)  # (a pack's names what it restores)
    if man is None:
        raise UsageError(f"--base must be a sealed checkpoint (run `ckptctl seal "
                         f"{base}` first)", base)
    ck = open_checkpoint(base, options, read_step=False, located=located)
    depth = (store.index.depth + 1) if isinstance(store, PackStore) else 1
    return store, files, ck, man.checkpoint_id, depth, None, chain


def sibling_url(src: str, base: str) -> str | None:
    """Where the source's folder would hold a checkpoint of the base's name (a tier's
    copy of it: ``hot/step-8`` for ``src`` ``hot/step-9`` and base ``cold/step-8``).

    >>> sibling_url("/nvme/run/step-9", "s3://b/cold/step-8")
    '/nvme/run/step-8'
    >>> sibling_url("s3://h/step-9", "x/step-9") is None   # the same name: no sibling
    True
    """
    folder, _, name = src.rstrip("/").rpartition("/")
    base_name = base.rstrip("/").rpartition("/")[2]
    if not base_name or base_name == name or base_name in (".", ".."):
        return None
    return f"{folder}/{base_name}" if folder else base_name


def _proven_copy(url: str, options: dict | None, want_id: str):
    """(store, files, checkpoint) of the plain sealed checkpoint at ``url`` if its id is
    ``want_id`` and every file hashes to its manifest (a copy corrupted since it was
    sealed must not become the base a pack's deltas are decoded against), else None."""
    from ..formats.detect import locate, open_checkpoint
    from ..formats.pack import is_pack
    from ..storage.hashing import hash_file

    try:
        store, files, single = locate(url, options)
        if single or is_pack(files) or MANIFEST not in files:
            return None
        man = Manifest.read(store, files)
        if man is None or man.checkpoint_id != want_id:
            return None
        for rel, rec in man.files.items():
            if files.get(rel) != rec.size or hash_file(store, rel, man.hash) != (rec.hash,
                                                                                  rec.size):
                return None
        ck = open_checkpoint(url, options, read_step=False, located=(store, files, single))
    except CkptError:
        return None  # no usable copy: the base is read through its chain
    return store, files, ck


def note_dependant(base: str, base_options: dict | None, dst: str,
                   dst_options: dict | None, base_id: str) -> None:
    """A delta pack written outside its base's folder leaves a reference there
    (:func:`~ckptctl.catalog.ownership.record_dependant`), before any byte of the pack: gc
    and rm of the base's root cannot list the pack, but they keep what it needs."""
    from ..catalog.ownership import record_dependant
    from ..formats.locate import file_format, single_files, split_file_url
    from ..storage import open_store

    bstore = open_store(base, base_options)
    dstore = open_store(dst, dst_options)
    if bstore.protocol == dstore.protocol and \
            bstore.parent().url.rstrip("/") == dstore.parent().url.rstrip("/"):
        return  # siblings: gc and rm of that root see the pack itself
    folder, name = split_file_url(base)
    if file_format(name) and single_files(open_store(folder, base_options), name):
        raise UsageError(f"a single-file base has no folder to hold the reference that keeps "
                         f"gc from removing it while the pack at {dstore.url} needs it: pack "
                         "against a base beside DST, or pass --base none", base)
    try:
        record_dependant(bstore, dstore.url, base_id)
    except StorageError as e:
        raise StorageError(bstore.url, f"cannot record in the base that the pack at "
                           f"{dstore.url} needs it ({e.message}); gc there could remove it. "
                           "Pack against a base beside DST, or pass --base none",
                           code=e.code) from None
