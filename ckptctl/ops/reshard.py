"""``reshard``: any checkpoint -> a DCP checkpoint at a new mesh, offline, bounded memory.

Rank r's chunks are exactly its DTensor local shards at the target layout and live in
rank r's own file ``__r_0.distcp`` (replicas once, in the lowest rank holding them;
objects in rank 0's file). Data is written first, ``.metadata`` next, the manifest last.

>>> r = reshard("ckpt/", "out/", mesh="dp=2,tp=2", rules="llama")   # doctest: +SKIP
>>> r.world_size, r.files                                          # doctest: +SKIP
(4, 6)
"""
from __future__ import annotations

import io
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from ..errors import FormatError, UsageError
from ..formats.dcp_write import DcpWriter
from ..formats.detect import open_checkpoint
from ..layout import Rules, load_rules, parse_mesh, preset
from ..model import Checkpoint
from ..storage import Store, open_store
from .output import OutputDir
from .plan import Plan, consolidation_plan, make_plan

DEFAULT_MAX_MEMORY = 1 << 30


@dataclass
class ReshardResult:
    src: str
    dst: str
    mesh: str
    world_size: int
    dry_run: bool
    chunks: int
    bytes_written: int
    files: int
    seconds: float
    manifest_id: str | None = None
    ranks: list[dict] = field(default_factory=list)
    placements: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def parse_size(text: str | int) -> int:
    """``1GiB``, ``512MB``, ``5GB``, ``1e9`` -> bytes.

    >>> parse_size("1GiB"), parse_size("5GB"), parse_size("512M")
    (1073741824, 5000000000, 536870912)
    """
    if isinstance(text, int):
        return text
    t = text.strip().upper().replace(" ", "")
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "KB": 10**3,
             "MB": 10**6, "GB": 10**9, "TB": 10**12, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30,
             "T": 1 << 40, "B": 1}
    for u, mul in units.items():
        if t.endswith(u):
            num = t[: -len(u)]
            break
    else:
        num, mul = t, 1
    try:
        value = float(num)
    except ValueError:
        raise UsageError(f"bad size {text!r} (examples: 1GiB, 512MB)") from None
    if value <= 0:
        raise UsageError(f"size must be positive: {text!r}")
    return int(value * mul)


def build_rules(*, mesh: str | None, rules: str | None, world_size: int | None) -> Rules:
    """``--world-size N`` | ``--mesh ... --rules PRESET|FILE.toml`` -> Rules."""
    if world_size is not None:
        if mesh or (rules and rules != "fsdp"):
            raise UsageError("--world-size N is shorthand for --mesh dp=N --rules fsdp; "
                             "give one or the other")
        if world_size < 1:
            raise UsageError("--world-size must be >= 1")
        return preset("fsdp", parse_mesh(f"dp={world_size}"))
    m = parse_mesh(mesh) if mesh else None
    if rules and (rules.endswith(".toml") or os.path.isfile(rules)):
        try:
            text = open(rules, encoding="utf-8").read()
        except OSError as e:
            raise UsageError(f"cannot read rules file {rules}: {e.strerror}") from None
        return load_rules(text, m, where=rules)
    if m is None:
        raise UsageError("give --mesh (e.g. dp=8,tp=4) or --world-size N")
    if rules is None:
        rules = "fsdp" if m.names == ("dp",) else "llama"
    return preset(rules, m)


def object_payload(ck: Checkpoint, name: str) -> bytes:
    """A DCP bytes entry for object ``name``: the source's own torch.save zip when it is
    DCP (decompressed), else ``torch.save`` of the value (already loaded safely)."""
    o = ck.objects[name]
    if o.extent is not None and o.extent.encoding in ("torch_zip", "torch_zip+zstd"):
        from ..formats.tensorio import decompress_bounded

        blob = ck.store.read_range(o.extent.file, o.extent.offset, o.extent.offset + o.extent.length)
        if len(blob) != o.extent.length:
            raise FormatError(ck.store.display(o.extent.file), f"{name}: truncated")
        if o.extent.encoding == "torch_zip+zstd":
            blob = decompress_bounded(blob, ck.store.display(o.extent.file), 1 << 30)
        return blob
    import torch

    buf = io.BytesIO()
    torch.save(o.value, buf)
    return buf.getvalue()


def write_dcp(ck: Checkpoint, plan: Plan, out: OutputDir, *, max_memory: int, workers: int,
              convert_dtype: str | None = None,
              on_bytes: Callable[[int], None] | None = None) -> DcpWriter:
    """Execute ``plan`` into a DCP checkpoint in ``out`` (data files, then ``.metadata``)."""
    from .copier import BlockStream, dtype_converter, stream_depth

    by_rank = {r: cs for r, cs in plan.by_rank().items() if cs or r == 0}
    nworkers = max(1, min(workers, len(by_rank)))
    writer = DcpWriter(out.store, on_bytes=on_bytes, sink=out)

    def converts(tc) -> bool:
        return bool(convert_dtype and tc.dtype.kind == "float" and tc.dtype.name != convert_dtype)

    def items(rank):
        stream = BlockStream(ck, by_rank[rank], depth=stream_depth(max_memory, nworkers),
                             convert_for=lambda tc: dtype_converter(tc.dtype.name, convert_dtype)
                             if converts(tc) else None)
        for tc in by_rank[rank]:
            dtype = convert_dtype if converts(tc) else tc.dtype.name
            shape = ck.tensors[tc.name].shape
            yield ("tensor", tc.name, dtype, shape, tc.offsets, tc.sizes, stream.blocks(tc.name))
        if rank == 0:
            for name in plan.objects:
                yield ("object", name, object_payload(ck, name))

    out.map(lambda r: writer.write_rank(r, items(r)), sorted(by_rank), nworkers)
    paths = ck.info.get("paths") or {}
    names = {tc.name for tc in plan.chunks} | set(plan.objects)
    writer.commit({n: paths.get(n, (n,)) for n in sorted(names)})
    return writer


def commit_output(dst: Store, hashes: dict, *, step: int | None, tags: list[str]) -> str:
    """Seal a freshly written checkpoint from the hashes its writer computed."""
    from .seal import write_manifest

    out = open_checkpoint(dst.url, None, read_step=False, located=(dst, dst.list_files(), None))
    return write_manifest(dst, out, hashes, algo="xxh3-128", step=step, tags=tags)


def reshard(src: str, dst: str, *, mesh: str | None = None, rules: str | None = None,
            world_size: int | None = None, max_memory: int | str = DEFAULT_MAX_MEMORY,
            workers: int = 4, dry_run: bool = False, storage_options: dict | None = None,
            dst_storage_options: dict | None = None, force: bool = False,
            on_bytes: Callable[[int], None] | None = None) -> ReshardResult:
    """Reshard ``src`` (any format) into a DCP checkpoint at ``dst`` for the target mesh.

    ``dst`` must be new or empty; ``force`` replaces what it holds."""
    t0 = time.monotonic()
    r = build_rules(mesh=mesh, rules=rules, world_size=world_size)
    ck = open_checkpoint(src, storage_options)
    ck.store.cache_small_files(ck.files)
    from ..formats.composite import refuse_opaque

    refuse_opaque(ck, verb="reshard", hint="reshard carries every entry: first write the parts "
                  "it can carry with consolidate --to dcp --only model,optim")
    plan = make_plan(ck, r)
    return _execute(ck, plan, src, dst, dry_run=dry_run, max_memory=parse_size(max_memory),
                    workers=workers, storage_options=dst_storage_options or storage_options,
                    on_bytes=on_bytes, t0=t0, force=force, command="reshard")


def _execute(ck, plan: Plan, src: str, dst: str, *, dry_run: bool, max_memory: int,
             workers: int, storage_options, on_bytes, t0, convert_dtype=None, force=False,
             command="reshard") -> ReshardResult:
    ranks = plan.rank_summary(ck)
    result = ReshardResult(src, dst, str(plan.mesh), plan.mesh.world_size, dry_run,
                           len(plan.chunks), sum(x["write_bytes"] for x in ranks), 0, 0.0,
                           ranks=ranks, placements=plan.placements)
    if dry_run:
        result.seconds = round(time.monotonic() - t0, 3)
        return result
    with OutputDir(open_store(dst, storage_options), command=command, force=force,
                   source=src) as out:
        writer = write_dcp(ck, plan, out, max_memory=max_memory, workers=workers,
                           convert_dtype=convert_dtype, on_bytes=on_bytes)
        out.commit()
        result.manifest_id = commit_output(out.store, writer.hashes, step=ck.step, tags=[])
    result.files = len(writer.hashes) + 1
    result.bytes_written = sum(n for _, n in writer.hashes.values())
    result.seconds = round(time.monotonic() - t0, 3)
    return result


__all__ = ["ReshardResult", "build_rules", "consolidation_plan", "parse_size", "reshard"]
