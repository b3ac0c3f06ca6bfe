"""Megatron-core ``torch_dist`` checkpoints (``dist_checkpointing.save``): a DCP folder plus
what Megatron puts around it, read into the one logical model without Megatron.

- ``.metadata`` is DCP's, with one more attribute, ``all_local_plans`` (the ranks' save
  plans): read with the DCP allow-list plus exactly those planner classes
  (:func:`~.safe_pickle.planner_globals`).
- ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``) is the commit marker:
  Megatron writes it after every rank's data and ``.metadata``, so a folder without it is
  a save that did not finish (``NOT_COMMITTED``).
- The common state, ``common.pt`` (a ``torch.save`` of what every rank shares:
  ``iteration``, ``args``, ``checkpoint_version``, the optimizer's param groups, the LR
  scheduler), is parsed with the restricted loader (``argparse.Namespace`` as an inert
  record) into plain entries under their own names; ``iteration`` is the step.
- ShardedObjects (``<key>/shard_<offset>_<shape>``: RNG states, ``_extra_state``) stay
  DCP byte entries, classed as ``rng`` / ``meta`` (:mod:`ckptctl.parts`), so ``--only
  model`` selects tensors only.
- Layers stacked on a leading axis (``decoder.layers.<name>`` of shape ``(num_layers,
  ...)``) are read as stored; :func:`unstack_name` gives the per-layer names.

>>> is_megatron_config({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
True
"""
from __future__ import annotations

import math
from dataclasses import replace

from ..errors import FormatError
from ..model import Checkpoint, Chunk, Extent, TensorEntry
from ..storage import Store
from .dcp import read_dcp
from .limits import load_json
from .safe_pickle import ADMITTABLE, record_class
from .torchfile import EntryBuilder, TorchFile

CONFIG = "metadata.json"
CONFIG_LIMIT = 64 << 10  # Megatron's is ~100 bytes
COMMON = "common.pt"
#: newer Megatron-core keeps the common state in the DCP files, as this bytes entry
COMMON_ENTRY = "common_state/shard_0_1"
#: Megatron's own SHA-256 manifest of the folder's files (``save_integrity=True``), written
#: after metadata.json: ``{"algorithm": "sha256", "files": {name: hex digest}}``
INTEGRITY = "integrity.json"
#: the classes a common state pickles beside plain values and tensors
COMMON_GLOBALS = {ADMITTABLE["argparse.Namespace"]: record_class("Namespace")}


def is_megatron_config(doc) -> bool:
    """Whether a parsed ``metadata.json`` is Megatron-core's ``torch_dist`` config."""
    return isinstance(doc, dict) and doc.get("sharded_backend") == "torch_dist"


def dist_files(files: dict[str, int]) -> set[str]:
    """The files beside DCP's own that a ``torch_dist`` folder's layout names (its
    ``metadata.json``, ``common.pt`` and ``integrity.json``), from the folder's listing
    ``files``: empty unless DCP's ``.metadata`` and ``metadata.json`` are both there.

    >>> sorted(dist_files({".metadata": 1, CONFIG: 1, INTEGRITY: 1, "NOTES.md": 1}))
    ['integrity.json', 'metadata.json']
    >>> dist_files({CONFIG: 1, INTEGRITY: 1})
    set()
    """
    if ".metadata" not in files or CONFIG not in files:
        return set()
    return {CONFIG, COMMON, INTEGRITY} & set(files)


def read_dist(store: Store, files: dict[str, int], *, strict: bool = True) -> Checkpoint:
    """Read a ``torch_dist`` folder: ``metadata.json``, DCP's metadata (one GET each) and
    the common state (three small reads of ``common.pt``).

    >>> ck = read_dist(open_store("run/iter_0000020"), files)   # doctest: +SKIP
    >>> ck.step, ck.info["origin"]                               # doctest: +SKIP
    (20, 'Megatron-core torch_dist, checkpoint version 3.0')
    """
    where = store.display(CONFIG)
    if CONFIG not in files:
        raise FormatError(store.url, "a Megatron-core torch_dist checkpoint without "
                          "metadata.json: Megatron writes it last (the save did not finish)",
                          code="NOT_COMMITTED")
    if files[CONFIG] > CONFIG_LIMIT:
        raise FormatError(where, f"{files[CONFIG]} bytes: not Megatron's config")
    config = load_json(store.read(CONFIG), where)
    if not is_megatron_config(config):
        raise FormatError(where, "not a Megatron-core torch_dist config (sharded_backend)")
    ck = read_dcp(store, files, strict=strict, plans=True)
    ck.info["megatron"] = {"backend": "torch_dist", "config": config}
    notes = ck.info.setdefault("notes", [])
    if COMMON in files:
        _common_entries(ck, TorchFile(store, COMMON, files[COMMON], COMMON_GLOBALS), COMMON)
        ck.info["zip_files"] = [COMMON]  # verify --level full checks its CRCs
    elif COMMON_ENTRY in ck.objects:
        ext = ck.objects[COMMON_ENTRY].extent
        if ext is None or ext.encoding != "torch_zip":
            raise FormatError(store.display(ext.file if ext else CONFIG),
                              f"{COMMON_ENTRY}: the common state is stored "
                              f"{ext.encoding if ext else 'nowhere'}; this reader parses it "
                              "only as written without a transform")
        tf = TorchFile(store, ext.file, ext.length, COMMON_GLOBALS, base=ext.offset)
        if not (isinstance(tf.obj, list) and len(tf.obj) == 1):  # a ShardedObject's [data]
            raise FormatError(tf.where, f"{COMMON_ENTRY} holds {type(tf.obj).__name__}, not "
                              "the one-item list Megatron saves")
        tf.obj = tf.obj[0]
        _common_entries(ck, tf, COMMON_ENTRY)
        # parsed above with Namespace as a record: carried (reshard) and checked as such
        ck.objects[COMMON_ENTRY] = replace(ck.objects[COMMON_ENTRY],
                                           admitted=("argparse.Namespace",))
        notes.append(f"the common state (iteration, args) is read from the byte entry "
                     f"{COMMON_ENTRY}, which carries it whole")
    else:
        notes.append("no common state (common.pt): no iteration or args recorded")
    version = getattr(ck.objects.get("checkpoint_version"), "value", None)
    ck.info["origin"] = "Megatron-core torch_dist" + (
        f", checkpoint version {version}" if version is not None else "")
    return ck


def _common_entries(ck: Checkpoint, tf: TorchFile, common: str) -> None:
    """Add the entries of common state ``tf`` (a dict) to ``ck`` under their own names."""
    if not isinstance(tf.obj, dict):
        raise FormatError(tf.where, f"the common state is {type(tf.obj).__name__}, not a dict")
    b = EntryBuilder(ck, default_file=tf.rel)
    before = set(ck.tensors) | set(ck.objects)
    for key, value in tf.obj.items():
        if not isinstance(key, str):
            raise FormatError(tf.where, f"common state key {key!r} is not a string")
        b.objects(key, value, tf)
    ck.info["megatron"]["common"] = common
    ck.info["megatron"]["common_entries"] = sorted((set(ck.tensors) | set(ck.objects)) - before)


def carrier(ck: Checkpoint) -> str | None:
    """The byte entry that holds ``ck``'s common state whole (``common_state/shard_0_1``;
    its entries are read apart too), or None. A copy into another format writes the
    entries; a ``torch_dist`` copy writes the carrier (:func:`torch_dist_files`).

    >>> carrier(Checkpoint("x", "dcp")) is None
    True
    """
    meg = ck.info.get("megatron") or {}
    return COMMON_ENTRY if meg.get("common") == COMMON_ENTRY else None


def unstack_name(name: str, layer: int) -> str | None:
    """The per-layer name of layer ``layer`` of a stacked entry (``decoder.layers.X`` of
    shape ``(num_layers, ...)``), or None when ``name`` is no stacked entry.

    >>> unstack_name("decoder.layers.mlp.linear_fc1.weight", 3)
    'decoder.layers.3.mlp.linear_fc1.weight'
    >>> unstack_name("decoder.layers.3.mlp.linear_fc1.weight", 0) is None
    True
    """
    head, sep, rest = name.partition("layers.")
    if not sep or (head and not head.endswith(".")) or not rest or rest.split(".", 1)[0].isdigit():
        return None
    return f"{head}layers.{layer}.{rest}"


def torch_dist_files(ck: Checkpoint, kept: set[str]) -> tuple[set[str], list[tuple[str, bytes]]]:
    """What a DCP copy of Megatron checkpoint ``ck`` needs to stay a ``torch_dist``
    checkpoint: the common-state entries read from ``common.pt`` or from the byte entry
    ``common_state/shard_0_1`` (to leave out of the DCP files: the carrier holds them) and
    the files to write after ``.metadata``: the source's ``common.pt`` (its bytes as they
    are) and ``metadata.json`` last, the commit marker. The common state is carried whole
    (the byte entry as a DCP entry, as stored): dropping part of it is refused.

    >>> torch_dist_files(Checkpoint("x", "dcp"), set())
    (set(), [])
    """
    meg = ck.info.get("megatron") or {}
    if meg.get("backend") != "torch_dist":  # a legacy source becomes plain DCP
        return set(), []
    common = set(meg.get("common_entries", ()))
    after = []
    if meg.get("common"):
        whole = common | ({COMMON_ENTRY} if meg["common"] == COMMON_ENTRY else set())
        dropped = sorted(whole - kept)
        if dropped:
            raise FormatError(ck.root, f"{dropped[0]} is part of Megatron's common state "
                              f"({meg['common']}), which is carried whole: keep it")
    if meg.get("common") == COMMON:
        after.append((COMMON, ck.store.read(COMMON)))
    after.append((CONFIG, ck.store.read(CONFIG)))
    return common, after


def unstack(ck: Checkpoint, names: list[str]) -> list[str]:
    """Replace each stacked entry among ``names`` (``decoder.layers.X`` whose first dim is
    the layer count: :func:`unstack_name`) by one entry per layer
    (``decoder.layers.<i>.X``), each chunk cut into its layers' rows, which are ranged
    reads of the same bytes; returns ``names`` with the per-layer names in their place.
    A chunk whose bytes are not row-major in its file (compressed, strided) is refused.

    >>> unstack(Checkpoint("x", "dcp"), [])
    []
    """
    from .tensorio import row_major_span

    out: list[str] = []
    for name in names:
        t = ck.tensors.get(name)
        if t is None or not t.shape or unstack_name(name, 0) is None:
            out.append(name)
            continue
        layers = {i: TensorEntry(unstack_name(name, i), t.dtype, t.shape[1:], [])
                  for i in range(t.shape[0])}
        for c in t.chunks:
            span = row_major_span(ck, t, c)
            if span is None:
                raise FormatError(ck.store.display(c.extent.file), f"{name}: a chunk stored "
                                  "compressed or strided cannot be cut into layers")
            row = t.dtype.nbytes(math.prod(c.sizes[1:]))
            for j in range(c.sizes[0]):
                layers[c.offsets[0] + j].chunks.append(Chunk(
                    c.offsets[1:], c.sizes[1:],
                    Extent(c.extent.file, span[0] + j * row, row, "raw")))
        del ck.tensors[name]
        for e in layers.values():
            if e.name in ck.tensors or e.name in ck.objects:
                raise FormatError(ck.root, f"{e.name}: both stacked ({name}) and stored apart")
            ck.tensors[e.name] = e
            out.append(e.name)
    return out
