"""``consolidate``: one full tensor per entry, as safetensors (HF layout), torch.save or a
single-rank DCP checkpoint; streamed in row blocks with bounded memory, then sealed.

>>> r = consolidate("ckpt/", "hf/", to="safetensors", only="model", dtype="bf16",
...                 strip_prefix="model.")                           # doctest: +SKIP
>>> r.files                                                          # doctest: +SKIP
['model.safetensors']
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from .._deps import check_torch
from ..errors import UsageError
from ..formats.composite import refuse_opaque
from ..formats.detect import open_checkpoint
from ..formats.safetensors_write import index_json, shard_names, split_shards, write_file
from ..formats.torchsave import SUFFIXES
from ..model import DTYPES, Checkpoint, dtype_from_name
from ..storage import HashingWriter, Store, open_store, split_url
from ..storage.localio import copies_through_memory
from ..catalog.closure import classify, parse_parts
from ..writing.commit import commit_written
from .copier import (BlockStream, SpanWriter, check_objects, copy_to_dcp, decode_object,
                     dtype_converter, kernel_spans, nest, staging_size, stream_depth)
from ..catalog.inspect import few_names
from ..writing.output import OutputDir
from .planner import consolidation_plan, dropped
from ..units import parse_size
from .reshard import DEFAULT_MAX_MEMORY

TARGETS = ("safetensors", "torch", "dcp", "deepspeed-universal", "orbax")


@dataclass
class ConsolidateResult:
    src: str
    dst: str
    to: str
    files: list[str]  # written, the manifest aside
    num_tensors: int
    num_objects: int
    bytes: int  # written, the manifest aside
    seconds: float
    manifest_id: str | None = None
    renamed: dict[str, str] = field(default_factory=dict)
    side_files: list[str] = field(default_factory=list)  # carried from SRC (in ``files`` too)
    dropped: list[str] = field(default_factory=list)  # entries left out (``drop``)
    #: entries a target rebuilds from others and so does not store (DeepSpeed's module16)
    derived: list[str] = field(default_factory=list)
    num_files: int = field(init=False, default=0)

    def __post_init__(self):
        self.num_files = len(self.files)

    def to_dict(self) -> dict:
        return asdict(self)


def _select(ck: Checkpoint, only: str | None) -> tuple[list[str], list[str]]:
    parts = set(parse_parts(only)) if only else None
    keep = (lambda n: True) if parts is None else (lambda n: classify(n) in parts)
    return sorted(n for n in ck.tensors if keep(n)), sorted(n for n in ck.objects if keep(n))


def _target_dtype(dtype: str | None):
    if dtype is None:
        return None
    try:
        d = dtype_from_name(dtype)
    except KeyError:
        raise UsageError(f"unknown --dtype {dtype!r} (bf16, fp16, fp32)") from None
    if d.kind != "float":
        raise UsageError(f"--dtype must be a floating type, got {dtype}")
    return d.name


#: Files of an HF model folder that are not weights but belong with them; carried by
#: ``consolidate --to safetensors`` when the output holds the model part.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "vocab.json", "vocab.txt", "merges.txt", "*.model", "chat_template.jinja",
              "chat_template.json", "preprocessor_config.json")


def output_stem(names: list[str]) -> str:
    """The safetensors file stem for the selected tensors: what they hold.

    >>> output_stem(["model.w", "optim.state.w.exp_avg"]), output_stem(["optim.state.w.exp_avg"])
    ('model', 'optim')
    >>> output_stem(["rng.cpu", "optim.state.w.step"]), output_stem(["lm_head.weight"])
    ('state', 'model')
    """
    parts = {classify(n) for n in names}
    if not parts or "model" in parts:
        return "model"
    return parts.pop() if len(parts) == 1 else "state"


def side_files(ck: Checkpoint, include: list[str], *, defaults: bool = True) -> list[str]:
    """The side files of ``ck``'s folder to carry: the :data:`SIDE_FILES` at its top level
    (``defaults``: the output holds the model), plus every file an ``include`` glob
    matches. A glob that matches nothing, or matches checkpoint data, is refused."""
    import fnmatch

    from ..formats.dcp import METADATA
    from ..formats.manifest import MANIFEST, WRITING_MARKER, is_temp_name

    data = {c.extent.file for t in ck.tensors.values() for c in t.chunks if c.extent}
    data |= {o.extent.file for o in ck.objects.values() if o.extent}
    candidates = sorted(f for f in ck.files if "/" not in f and not is_temp_name(f)
                        and f not in (MANIFEST, WRITING_MARKER))  # top-level files only
    out = [f for f in candidates if defaults and f not in data
           and any(fnmatch.fnmatchcase(f, g) for g in SIDE_FILES)]
    for g in include:
        hit = [f for f in candidates if fnmatch.fnmatchcase(f, g)]
        if not hit:
            raise UsageError(f"--include {g!r} matches no file of {ck.root} (files: "
                             f"{few_names(candidates)})")
        for f in hit:
            if f in data or f == METADATA or f.endswith((".safetensors", ".index.json")):
                raise UsageError(f"--include {g!r} matches {f}, which is checkpoint data: "
                                 "the conversion writes its own")
            if f not in out:
                out.append(f)
    return sorted(out)


def _copy_file(src: Store, rel: str, size: int, od: OutputDir,
               block: int = 8 << 20) -> tuple[str, int]:
    """Copy one file through ``od`` (durable once closed); its (digest, size)."""
    with od.open(rel) as f:
        w = HashingWriter(f)
        if size <= block:
            w.write(src.read(rel))
        else:
            for start in range(0, size, block):
                w.write(src.read_range(rel, start, min(size, start + block)))
    return w.result()


def _writer(f, ck: Checkpoint, on_bytes, *, spans: bool = False, buffer: int):
    """The writer of output file ``f``: a :class:`SpanWriter` where it copies source
    spans, or where it writes past the page cache (a local ext2/3/4 file,
    :func:`~ckptctl.storage.localio.copies_through_memory`; staging buffers of ``buffer``
    bytes), else a ``HashingWriter``. The caller closes a ``SpanWriter``, after its result
    or on the way out."""
    if f.path is not None and (spans or copies_through_memory(f.path)):
        return SpanWriter(f, ck.store, on_bytes=on_bytes, buffer=buffer)
    return HashingWriter(f, on_bytes=on_bytes)


def _staged(od: OutputDir) -> bool:
    """Do this output's writers stage through DirectWriter buffers (local ext2/3/4)?"""
    return od.store.is_local and copies_through_memory(od.store.full(""))


def _out_name(name: str, strip: str | None) -> str:
    return name[len(strip):] if strip and name.startswith(strip) else name


#: Default ``max_shard_size`` of a folder output (HF's own default); a file output is one
#: file whatever its size unless a limit is given.
DEFAULT_MAX_SHARD = "5GB"


def file_target(dst: str) -> str | None:
    """The format a destination names by its extension, when it names one file:
    ``safetensors`` (``.safetensors``), ``torch`` (``.pt``, ``.pth``, ``.bin``, ``.ckpt``),
    else None (a folder).

    >>> file_target("out/x.safetensors"), file_target("s3://b/m.pt"), file_target("hf/")
    ('safetensors', 'torch', None)
    """
    _, path = split_url(dst)
    if path.endswith(".safetensors"):
        return "safetensors"
    return "torch" if path.endswith(SUFFIXES) else None


def resolve_target(dst: str, to: str | None) -> str:
    """The output format: ``to``, or the one ``dst``'s extension names
    (:func:`file_target`), else safetensors (a folder in HF layout). A file extension
    that ``to`` disagrees with is a usage error: the file would not be what its name says.

    >>> resolve_target("x.pt", None), resolve_target("hf/", None), resolve_target("x.pt", "torch")
    ('torch', 'safetensors', 'torch')
    >>> resolve_target("x.pt", "safetensors")
    Traceback (most recent call last):
    ckptctl.errors.UsageError: x.pt: --to safetensors writes a .safetensors file or a folder, not a .pt file; name it x.safetensors, or leave --to out (the extension says torch)
    """
    named = file_target(dst)
    if to is None:
        return named or "safetensors"
    if to not in TARGETS:
        raise UsageError(f"--to must be one of {', '.join(TARGETS)}")
    if named is None or named == to:
        return to
    ext = "." + dst.rstrip("/").rsplit(".", 1)[-1]
    stem = dst.rstrip("/")[:-len(ext)]
    if to in ("dcp", "deepspeed-universal", "orbax"):
        raise UsageError(f"--to {to} writes a folder, not a {ext} file; name a folder "
                         f"(e.g. {stem})", dst)
    want = ".safetensors" if to == "safetensors" else ".pt"
    raise UsageError(f"--to {to} writes a {want} file or a folder, not a {ext} file; name it "
                     f"{stem}{want}, or leave --to out (the extension says {named})", dst)


def _file_place(dst: str) -> tuple[str, str]:
    """(folder URL, file name) of a one-file destination."""
    d = dst.rstrip("/")
    return tuple(d.rsplit("/", 1)) if "/" in d else (".", d)


def consolidate(src: str, dst: str, *, to: str | None = None, only: str | None = None,
                dtype: str | None = None, strip_prefix: str | None = None,
                max_shard_size: int | str | None = None,
                max_memory: int | str = DEFAULT_MAX_MEMORY,
                workers: int = 4, storage_options: dict | None = None,
                dst_storage_options: dict | None = None, force: bool = False,
                on_bytes: Callable[[int], None] | None = None,
                on_total: Callable[[int], None] | None = None,
                include: list[str] | None = None, group=None,
                drop: list[str] | None = None, unstack_layers: bool = False) -> ConsolidateResult:
    """Write every selected entry of ``src`` whole, into ``dst`` in format ``to``.

    ``only`` selects state parts; ``drop`` globs leave entries out; ``unstack_layers``
    writes each layer of a stacked entry (Megatron's ``decoder.layers.X`` of shape
    ``(num_layers, ...)``) as its own ``decoder.layers.<i>.X``. An object entry the
    safe loader refuses (the check seal makes) is refused before a byte is written
    (:class:`~ckptctl.errors.Finding`, exit 1) unless dropped.

    ``dst`` must be new or empty; ``force`` replaces what is there. A ``dst`` ending in
    ``.safetensors`` (or ``.pt``, ``.pth``, ``.bin``, ``.ckpt``) is that one file
    (:func:`file_target`): ``to`` defaults to what the extension says and may not
    disagree with it (:func:`resolve_target`); it is written under a temporary name,
    fsync'd and renamed into place last, replacing an existing file (never a folder)
    only with ``force``, and carries no manifest (a lone file has no folder of its own
    to hold one) and no side files; ``max_shard_size`` that would split it is refused.
    A folder ``--to safetensors`` names its files after what they hold
    (``model.safetensors``; ``optim.safetensors`` for ``only="optim"``; shards of
    ``max_shard_size``, default 5GB, with an index) and carries the source folder's side
    files (:data:`SIDE_FILES`, plus ``include`` globs) when it holds the model.

    ``group``: a :class:`~ckptctl.writing.distributed.Group` (``Group.from_env()`` under
    torchrun/srun): output file ``i`` (shards in order, then side files; DCP: the one rank
    file; torch or one named file: that file) is process ``i % world_size``'s, rank 0
    writes the index and the manifest and its result is the whole run's."""
    from ..writing.distributed import Group

    group = group if group is not None else Group()
    t0 = time.monotonic()
    to = resolve_target(dst, to)
    one_file = file_target(dst) is not None
    if one_file and to == "safetensors" and include:
        raise UsageError(f"--include carries side files into a folder; {dst} is one file "
                         "(name a folder to carry them)")
    conv_to = _target_dtype(dtype)
    max_memory = parse_size(max_memory)
    check_torch("consolidate")  # before a byte is read or written (imported only if used)
    if to == "orbax":
        from .orbax_write import check_tensorstore

        check_tensorstore()
    ck = open_checkpoint(src, storage_options)
    ck.store.cache_small_files(ck.files)
    tensors, objects, gone = _entries(ck, src, only, drop, unstack_layers)
    _refuse_selection(ck, src, to, tensors, objects, strip_prefix, include)
    side = side_files(ck, include or [], defaults=to == "safetensors" and not one_file
                      and output_stem(tensors) == "model")
    check_objects(ck, objects, workers=workers)  # before a byte is written
    plan = consolidation_plan(ck, only=set(tensors) | set(objects))
    if on_total:  # the tensor bytes the plan writes (on_bytes also counts headers, objects)
        on_total(sum(DTYPES[conv_to].nbytes(math.prod(c.sizes))
                     if conv_to and c.dtype.kind == "float" else c.nbytes for c in plan.chunks))
    # dst's own options ({} included: a local DST, or one set by the environment)
    opts = storage_options if dst_storage_options is None else dst_storage_options
    if to == "dcp":
        done = copy_to_dcp(ck, plan, dst, max_memory=max_memory, workers=workers,
                           storage_options=opts, convert_dtype=conv_to, force=force,
                           command="consolidate --to dcp", source=src, on_bytes=on_bytes,
                           group=group)
        return ConsolidateResult(src, dst, to, sorted(done.hashes), len(tensors),
                                 len(objects), done.bytes_written,
                                 round(time.monotonic() - t0, 3), done.manifest_id,
                                 dropped=gone)
    io = _TensorIO(ck, plan, conv_to, max_memory, on_bytes)
    renamed = _renames(tensors + objects, strip_prefix)
    if to == "deepspeed-universal":
        return _consolidate_universal(ck, src, dst, tensors, objects, plan, gone, t0,
                                      strip_prefix=strip_prefix, group=group,
                                      max_memory=max_memory, opts=opts, force=force,
                                      on_bytes=on_bytes)
    if to == "orbax":
        return _consolidate_orbax(ck, src, dst, tensors, objects, renamed, io, gone, t0,
                                  group=group, opts=opts, force=force, max_memory=max_memory,
                                  workers=workers, on_bytes=on_bytes)
    if (to == "torch" or one_file) and group.rank != 0:  # one file: rank 0's, no share
        return ConsolidateResult(src, dst, to, [], len(tensors), len(objects), 0,
                                 round(time.monotonic() - t0, 3), dropped=gone)
    if to == "torch":
        out = _write_torch(ck, dst, opts, tensors, objects, renamed, io.stream, io.writer,
                           io.out_dtype, strip_prefix, force)
    else:
        limit = max_shard_size if max_shard_size is not None or one_file else DEFAULT_MAX_SHARD
        out = _write_safetensors(dst, opts, ck, tensors, renamed, io.stream, io.writer,
                                 io.out_dtype, parse_size(limit) if limit is not None else None,
                                 workers, force, stem=output_stem(tensors), side=side,
                                 group=group, spans_for=io.spans_for, one_file=one_file)
    mid = out.manifest_id
    return ConsolidateResult(src, dst, to, sorted(out.hashes), len(tensors), len(objects),
                             sum(n for _, n in out.hashes.values()),
                             round(time.monotonic() - t0, 3), mid,
                             {k: v for k, v in renamed.items() if k != v},
                             side if to == "safetensors" else [], gone)


def _entries(ck: Checkpoint, src: str, only: str | None, drop: list[str] | None,
             unstack_layers: bool) -> tuple[list[str], list[str], list[str]]:
    """(tensors, objects, dropped) to write: the ``only`` parts less the ``drop`` globs,
    stacked layers split with ``unstack_layers``; a usage error when nothing is left."""
    tensors, objects = _select(ck, only)
    gone = dropped(ck, drop)
    if gone:
        left_out = set(gone)
        tensors = [n for n in tensors if n not in left_out]
        objects = [n for n in objects if n not in left_out]
    from ..formats.megatron import carrier

    # Megatron's common state goes out as its entries (iteration, args, ...), read from it
    objects = [n for n in objects if n != carrier(ck)]
    if unstack_layers:
        from ..formats.megatron import unstack

        tensors = unstack(ck, tensors)
    if not tensors and not objects:
        given = ([f"--only {only}"] if only else []) + [f"--drop {g}" for g in drop or ()]
        raise UsageError(f"nothing selected in {src} ({' '.join(given)})")
    return tensors, objects, gone


def _refuse_selection(ck: Checkpoint, src: str, to: str, tensors: list[str],
                      objects: list[str], strip_prefix: str | None,
                      include: list[str] | None) -> None:
    """Refuse, before a byte is written, what target ``to`` cannot do with the selection:
    store its objects, rename by a ``strip_prefix`` that matches nothing or that it
    ignores, carry ``include`` side files."""
    if to == "safetensors" and objects:  # safetensors holds tensors only: never drop silently
        shown = ", ".join(objects[:4]) + (", ..." if len(objects) > 4 else "")
        raise UsageError(f"the selection holds {len(objects)} non-tensor entr"
                         f"{'y' if len(objects) == 1 else 'ies'} ({shown}) that safetensors "
                         "cannot store; select tensors only with --only model, or keep them "
                         "with --to torch")
    refuse_opaque(ck, objects, verb="consolidate")
    if strip_prefix is not None and not any(n.startswith(strip_prefix) for n in tensors + objects):
        raise UsageError(f"--strip-prefix {strip_prefix!r} matches no selected entry (names: "
                         f"{few_names(tensors + objects)})", src)
    if to == "dcp" and strip_prefix is not None:
        raise UsageError("--strip-prefix renames entries of a safetensors or torch output; "
                         "--to dcp keeps the names")
    if include and to != "safetensors":
        raise UsageError("--include carries side files into a --to safetensors (HF) folder "
                         f"only; --to {to} carries none")


def _renames(names: list[str], strip: str | None) -> dict[str, str]:
    """Each entry's output name, ``strip`` taken off; two that collide are a usage error."""
    renamed = {n: _out_name(n, strip) for n in names}
    if len(set(renamed.values())) != len(renamed):
        raise UsageError("--strip-prefix makes two entries collide")
    return renamed


class _TensorIO:
    """How the planned tensors of ``ck`` are read and written: read-ahead streams (cast
    to ``conv_to``), output writers and kernel-copy spans, within ``max_memory``."""

    def __init__(self, ck: Checkpoint, plan, conv_to: str | None, max_memory: int, on_bytes):
        self.ck, self.conv_to, self.max_memory, self.on_bytes = ck, conv_to, max_memory, on_bytes
        self.by_name = {tc.name: tc for tc in plan.chunks}

    def convert_for(self, tc):
        """The cast of planned tensor ``tc`` to ``conv_to``, or None where none is needed."""
        if self.conv_to and tc.dtype.kind == "float" and tc.dtype.name != self.conv_to:
            return dtype_converter(tc.dtype.name, self.conv_to)
        return None

    def stream(self, names: list[str], streams: int, staged: bool) -> BlockStream:
        """One read-ahead stream over the tensors of one output file, in write order;
        ``staged``: its writer's staging buffers come out of the same --max-memory."""
        return BlockStream(self.ck, [self.by_name[n] for n in names],
                           convert_for=self.convert_for,
                           depth=stream_depth(self.max_memory, streams, staged))

    def writer(self, f, streams: int, spans: bool = False):
        """The writer of output file ``f`` (:func:`_writer`), one of ``streams``."""
        return _writer(f, self.ck, self.on_bytes, spans=spans,
                       buffer=staging_size(self.max_memory, streams))

    def spans_for(self, name: str):
        """The tensor as local source byte runs to copy in the kernel, or None."""
        tc = self.by_name[name]
        return kernel_spans(self.ck, tc, self.convert_for(tc))

    def out_dtype(self, name: str) -> str:
        d = self.ck.tensors[name].dtype
        return self.conv_to if self.conv_to and d.kind == "float" else d.name


def _consolidate_universal(ck: Checkpoint, src: str, dst: str, tensors: list[str],
                           objects: list[str], plan, gone: list[str], t0: float, *,
                           strip_prefix: str | None, group, max_memory: int, opts,
                           force: bool, on_bytes) -> ConsolidateResult:
    """``--to deepspeed-universal``: rank 0 writes the folder, less the entries DeepSpeed
    rebuilds (``derived``)."""
    to = "deepspeed-universal"
    if strip_prefix is not None:
        raise UsageError("--strip-prefix renames entries of a safetensors or torch "
                         "output; a universal checkpoint names parameters itself")
    if group.rank != 0:
        return ConsolidateResult(src, dst, to, [], len(tensors), len(objects), 0,
                                 round(time.monotonic() - t0, 3), dropped=gone)
    from .universal_write import write_universal

    # the 16-bit copies of model.* (DeepSpeed's module16): DeepSpeed rebuilds them
    copies = [n for n in tensors if classify(n) == "module16"]
    tensors = [n for n in tensors if n not in set(copies)]
    hashes, mid = write_universal(ck, dst, tensors=tensors, objects=objects, plan=plan,
                                  max_memory=max_memory, opts=opts, force=force,
                                  on_bytes=on_bytes)
    return ConsolidateResult(src, dst, to, sorted(hashes), len(tensors), len(objects),
                             sum(n for _, n in hashes.values()),
                             round(time.monotonic() - t0, 3), mid, dropped=gone,
                             derived=copies)


def _consolidate_orbax(ck: Checkpoint, src: str, dst: str, tensors: list[str],
                       objects: list[str], renamed: dict[str, str], io, gone: list[str],
                       t0: float, *, group, opts, force: bool, max_memory: int, workers: int,
                       on_bytes) -> ConsolidateResult:
    """``--to orbax``: rank 0 writes the single-host Orbax checkpoint
    (:mod:`~ckptctl.convert.orbax_write`); the others have no share."""
    to = "orbax"
    if group.rank != 0:
        return ConsolidateResult(src, dst, to, [], len(tensors), len(objects), 0,
                                 round(time.monotonic() - t0, 3), dropped=gone)
    from .orbax_write import write_orbax

    hashes, mid = write_orbax(ck, dst, tensors=tensors, objects=objects, renamed=renamed,
                              io=io, opts=opts, force=force, max_memory=max_memory,
                              workers=workers, on_bytes=on_bytes)
    return ConsolidateResult(src, dst, to, sorted(hashes), len(tensors), len(objects),
                             sum(n for _, n in hashes.values()),
                             round(time.monotonic() - t0, 3), mid,
                             {k: v for k, v in renamed.items() if k != v}, dropped=gone)


@dataclass
class _Written:
    store: Store
    hashes: dict[str, tuple[str, int]]  # file -> (digest, size)
    folder: bool
    manifest_id: str | None = None  # a folder is a checkpoint: sealed; a lone .pt is not


def _finish(od: OutputDir, ck: Checkpoint, hashes: dict, folder: bool) -> _Written:
    """Data and format markers are written: commit, then seal (a folder only)."""
    od.commit()
    mid = commit_written(od.store, hashes, step=ck.step) if folder else None
    return _Written(od.store, hashes, folder, mid)


def _write_safetensors(dst, opts, ck, tensors, renamed, stream, writer, out_dtype,
                       max_shard, workers, force, *, stem: str = "model",
                       side: list[str] = (), group=None,
                       spans_for=lambda name: None, one_file: bool = False) -> _Written:
    """Write the safetensors output: a folder (shards, index, side files; sealed), or
    with ``one_file`` the one file ``dst`` names (``max_shard`` None: no limit)."""
    entries = []
    for n in tensors:
        d = DTYPES[out_dtype(n)]
        if d.safetensors is None:
            raise UsageError(f"{n}: dtype {d.name} has no safetensors encoding; use --to torch")
        entries.append((renamed[n], d.safetensors, ck.tensors[n].shape,
                        d.nbytes(ck.tensors[n].numel)))
    by_out = {renamed[n]: n for n in tensors}
    entries.sort(key=lambda e: e[0])
    shards = split_shards(entries, max_shard) if max_shard is not None else [entries]
    if one_file:
        return _write_one_safetensors(dst, opts, ck, shards, by_out, stream, writer,
                                      spans_for, force)
    names = shard_names(len(shards), stem)
    from ..writing.distributed import Group, write_shared

    group = group if group is not None else Group()
    # output file i (shards in order, then side files) is process i % world_size's
    jobs = group.mine([("shard", shard, fname) for shard, fname in zip(shards, names)]
                      + [("side", None, rel) for rel in side])
    mine = [(shard, fname) for kind, shard, fname in jobs if kind == "shard"]
    nstreams = max(1, min(workers, len(mine)))
    od = OutputDir(open_store(dst, opts), command="consolidate --to safetensors",
                   force=force, source=ck.root)

    def one(job):
        shard, fname = job
        return fname, _write_shard(od, shard, fname, by_out, stream, writer, spans_for,
                                   nstreams)

    def write() -> dict:
        hashes = dict(od.map(one, mine, nstreams))
        for kind, _, rel in jobs:  # config, tokenizer...: data too, durable before the index
            if kind == "side":
                hashes[rel] = _copy_file(ck.store, rel, ck.files[rel], od)
        return {"hashes": {rel: list(v) for rel, v in hashes.items()}}

    def finish(reports: list[dict]) -> _Written:
        hashes = {rel: (d, int(n)) for rep in reports for rel, (d, n) in rep["hashes"].items()}
        if len(shards) > 1:
            data = index_json(shards, names)
            index = f"{stem}.safetensors.index.json"
            od.write_atomic(index, data)
            from ..storage import digest_bytes

            hashes[index] = (digest_bytes(data), len(data))
        return _finish(od, ck, hashes, True)

    done = write_shared(group, od, write, finish, planned=[*names, *side])
    if isinstance(done, _Written):
        return done
    return _Written(od.store, {rel: (d, n) for rel, (d, n) in done["hashes"].items()}, True)


def _write_shard(od: OutputDir, shard, fname: str, by_out: dict, stream, writer, spans_for,
                 nstreams: int) -> tuple[str, int]:
    """Write one safetensors file of ``od``; its (digest, size)."""
    names = [by_out[e[0]] for e in shard]
    # bytes stored as they go out (raw dim-0 shards, no cast) are copied in the kernel
    spans = {n: spans_for(n) for n in names} if od.store.is_local else {}
    s = stream([n for n in names if spans.get(n) is None], nstreams, _staged(od))

    def items(out: str):
        sp = spans.get(by_out[out])
        return sp if sp is not None else s.blocks(by_out[out])

    with od.open(fname) as f:
        w = writer(f, nstreams, spans=any(spans.values()))
        try:
            write_file(w, shard, items, {"format": "pt"})
            return w.result()
        finally:
            if isinstance(w, SpanWriter):
                w.close()


def _write_one_safetensors(dst, opts, ck, shards, by_out, stream, writer, spans_for,
                           force) -> _Written:
    """``consolidate ... x.safetensors``: the one file ``dst`` names, written under a
    temporary name and renamed into place once durable (:class:`OutputDir`'s
    ``single_file``); no manifest, as for a lone ``x.pt``. A limit that splits the model
    is refused before a byte is written."""
    if len(shards) > 1:
        total = sum(e[3] for sh in shards for e in sh)
        raise UsageError(f"--max-shard-size splits the output into {len(shards)} files "
                         f"({total} bytes of tensors), but {dst} is one file: leave "
                         "--max-shard-size out, or name a folder for shards and an index", dst)
    folder, fname = _file_place(dst)
    od = OutputDir(open_store(folder, opts), command="consolidate --to safetensors",
                   force=force, single_file=fname, source=ck.root)
    with od:
        result = _write_shard(od, shards[0], fname, by_out, stream, writer, spans_for, 1)
        return _finish(od, ck, {fname: result}, False)


def _write_torch(ck, dst, opts, tensors, objects, renamed, stream, writer, out_dtype,
                 strip, force) -> _Written:
    from ..formats.torchwrite import TensorRef, TorchZipWriter, lift_tensors, pickle_state

    single_file = file_target(dst) == "torch"
    if single_file:
        folder, fname = _file_place(dst)
        od = OutputDir(open_store(folder, opts), command="consolidate --to torch",
                       force=force, single_file=fname, source=ck.root)
    else:
        od = OutputDir(open_store(dst, opts), command="consolidate --to torch", force=force,
                       source=ck.root)
        fname = "model.pt"
    paths = ck.info.get("paths") or {}

    def out_path(n: str) -> tuple:
        p = paths.get(n, (n,))
        if strip and n.startswith(strip):
            head = strip.rstrip(".")
            p = p[1:] if p and p[0] == head and len(p) > 1 else (renamed[n],)
        return p

    refs = {n: TensorRef(str(i), out_dtype(n), ck.tensors[n].shape) for i, n in enumerate(tensors)}
    inner_keys = (str(i) for i in itertools.count(len(tensors)))
    lifted = [(out_path(n), lift_tensors(decode_object(ck, n), inner_keys)) for n in objects]
    tree = nest([(out_path(n), refs[n]) for n in tensors] + [(p, v) for p, (v, _) in lifted])
    s = stream(tensors, 1, _staged(od))
    with od:
        with od.open(fname) as f:
            w = writer(f, 1)
            try:
                zw = TorchZipWriter(w, pickle_state(tree))
                for n in tensors:
                    zw.write_record(refs[n].key, s.blocks(n))
                for _, (_, records) in lifted:
                    for key, data in records:
                        zw.write_record(key, [data])
                zw.close()
                result = w.result()
            finally:
                if isinstance(w, SpanWriter):
                    w.close()
        return _finish(od, ck, {fname: result}, not single_file)
