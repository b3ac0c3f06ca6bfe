"""``reshard``: any checkpoint -> a DCP checkpoint at a new mesh, offline, bounded memory.

Rank r's chunks are exactly its DTensor local shards at the target layout and live in
rank r's own file ``__r_0.distcp`` (replicas once, in the lowest rank holding them;
objects in rank 0's file). Data is written first, ``.metadata`` next, the manifest last.

>>> r = reshard("ckpt/", "out/", mesh="dp=2,tp=2", rules="llama")   # doctest: +SKIP
>>> r.world_size, r.num_files                                      # doctest: +SKIP
(4, 6)
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from .._deps import check_torch
from ..errors import UsageError
from ..units import parse_size
from ..formats.detect import open_checkpoint
from ..formats.megatron import torch_dist_files
from ..layout import Rules, load_rules, parse_mesh, preset
from .copier import check_objects, copy_to_dcp
from .planner import dropped, make_plan, rule_report

DEFAULT_MAX_MEMORY = 1 << 30


@dataclass
class ReshardResult:
    src: str
    dst: str
    mesh: str
    world_size: int
    dry_run: bool
    num_chunks: int
    bytes: int  # written (dry run: to be written), the manifest aside
    num_files: int
    seconds: float
    manifest_id: str | None = None
    ranks: list[dict] = field(default_factory=list)
    placements: dict[str, str] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)  # written, the manifest aside
    #: which rules placed the tensors and why they were chosen (``name``, ``kind``: preset
    #: or file, ``chosen``: given, default or world-size), what each rule matched
    #: (``matched``), and how many tensors stay replicated (``replicated``, with examples)
    rules: dict = field(default_factory=dict)
    #: entries left out (``drop``): none of them is in the output
    dropped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


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


def rules_origin(r: Rules, *, mesh: str | None, rules: str | None,
                 world_size: int | None) -> dict:
    """Where the rules came from, for the output: ``--mesh`` without ``--rules`` picks a
    preset by the mesh's dim names (fsdp for ``dp`` alone, llama otherwise) and says so.

    >>> r = build_rules(mesh="dp=2,tp=2", rules=None, world_size=None)
    >>> rules_origin(r, mesh="dp=2,tp=2", rules=None, world_size=None)["note"]
    'llama (preset, chosen for mesh dp=2,tp=2; give --rules to choose)'
    """
    if world_size is not None:
        return {"name": r.name, "kind": "preset", "chosen": "world-size",
                "note": f"{r.name} (preset, from --world-size {world_size})"}
    if rules is None:
        return {"name": r.name, "kind": "preset", "chosen": "default",
                "note": f"{r.name} (preset, chosen for mesh {r.mesh}; give --rules to choose)"}
    kind = "preset" if r.name == rules and not os.path.isfile(rules) else "file"
    return {"name": r.name, "kind": kind, "chosen": "given", "note": f"{r.name} ({kind})"}


def reshard(src: str, dst: str, *, mesh: str | None = None, rules: str | None = None,
            world_size: int | None = None, max_memory: int | str = DEFAULT_MAX_MEMORY,
            workers: int = 4, dry_run: bool = False, storage_options: dict | None = None,
            dst_storage_options: dict | None = None, force: bool = False,
            on_bytes: Callable[[int], None] | None = None,
            on_total: Callable[[int], None] | None = None, group=None,
            drop: list[str] | None = None) -> ReshardResult:
    """Reshard ``src`` (any format) into a DCP checkpoint at ``dst`` for the target mesh.

    Every entry is carried but those ``drop`` globs name; an object entry the safe loader
    refuses (the check seal makes) is refused before a byte is written
    (:class:`~ckptctl.errors.Finding`, exit 1) unless dropped.
    ``dst`` must be new or empty; ``force`` replaces what it holds. ``on_bytes(n)``: n more
    bytes written; ``on_total(n)``: called once before writing with the plan's data bytes.
    ``group``: a :class:`~ckptctl.writing.distributed.Group` (``Group.from_env()`` under
    torchrun/srun): this process writes its share of the rank files; rank 0's result is
    the whole run's, another rank's lists its own files and has no ``manifest_id``."""
    t0 = time.monotonic()
    r = build_rules(mesh=mesh, rules=rules, world_size=world_size)
    check_torch("reshard")  # before a byte is read or written (imported only if used)
    ck = open_checkpoint(src, storage_options)
    ck.store.cache_small_files(ck.files)
    from ..formats.composite import refuse_opaque

    gone = dropped(ck, drop)
    keep = None if not gone else set(ck.tensors).union(ck.objects).difference(gone)
    # a Megatron torch_dist source stays one: its common state is carried as common.pt
    common, after = torch_dist_files(ck, set(ck.tensors).union(ck.objects).difference(gone))
    if common:
        keep = set(ck.tensors).union(ck.objects).difference(gone, common)
    refuse_opaque(ck, None if keep is None else keep.intersection(ck.objects), verb="reshard",
                  hint="reshard carries every entry: first write the parts it can carry with "
                  "consolidate --to dcp --only model,optim, or leave {them} out with --drop")
    plan = make_plan(ck, r, only=keep)
    check_objects(ck, plan.objects, workers=workers)  # before a byte is written
    report = rule_report(ck, r, plan)
    max_memory = parse_size(max_memory)
    ranks = plan.rank_summary(ck)
    result = ReshardResult(src, dst, str(plan.mesh), plan.mesh.world_size, dry_run,
                           len(plan.chunks), sum(x["write_bytes"] for x in ranks), 0, 0.0,
                           ranks=ranks, placements=dict(plan.placements),
                           rules={**rules_origin(r, mesh=mesh, rules=rules,
                                                 world_size=world_size), **asdict(report)},
                           dropped=gone)
    if not dry_run:
        if on_total:
            on_total(sum(x["write_bytes"] for x in ranks))
        done = copy_to_dcp(ck, plan, dst, max_memory=max_memory, workers=workers,
                           storage_options=storage_options if dst_storage_options is None
                           else dst_storage_options,
                           force=force, command="reshard", source=src, on_bytes=on_bytes,
                           group=group, after=after)
        result.manifest_id = done.manifest_id
        result.files = sorted(done.hashes)
        result.num_files = len(result.files)
        result.bytes = done.bytes_written
    result.seconds = round(time.monotonic() - t0, 3)
    return result


__all__ = ["ReshardResult", "build_rules", "parse_size", "reshard", "rules_origin"]
