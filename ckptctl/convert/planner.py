"""Resharding as a pure plan: which boxes of which source chunks make each target chunk.

The planner decides *what* (target chunks per rank, placements); the copier
(:mod:`ckptctl.convert.copier`) decides nothing and only moves bytes. They meet only through
the frozen dataclasses here. Boxes are cut with :func:`ckptctl.boxes.intersect`.

>>> from ckptctl.model import Checkpoint, TensorEntry, Chunk, Extent, DTYPES
>>> from ckptctl.layout import parse_mesh, preset
>>> halves = [Chunk((0, 0), (2, 2), Extent("__0_0.distcp", 0, 1)),
...           Chunk((2, 0), (2, 2), Extent("__1_0.distcp", 0, 1))]
>>> src = Checkpoint("x", "dcp", tensors={
...     "model.w": TensorEntry("model.w", DTYPES["float32"], (4, 2), halves)})
>>> p = make_plan(src, preset("fsdp", parse_mesh("dp=4")))
>>> [(c.rank, c.offsets, c.sizes, len(c.pieces)) for c in p.chunks]
[(0, (0, 0), (1, 2), 1), (1, (1, 0), (1, 2), 1), (2, (2, 0), (1, 2), 1), (3, (3, 0), (1, 2), 1)]
>>> p.placements["model.w"]
'dp:Shard(0)'
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from ..bulk import paused_gc
from ..boxes import BoxIndex, numel, relative
from ..errors import FormatError, ProblemCode, UsageError
from ..layout import Mesh, Placement, Rules, local_box
from ..model import Checkpoint, Chunk, DType, TensorEntry
from ..parts import classify


@dataclass(frozen=True)
class Piece:
    """A box copied from one source chunk into one target chunk."""

    src: Chunk
    src_offsets: tuple[int, ...]  # within the source chunk
    dst_offsets: tuple[int, ...]  # within the target chunk
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class TargetChunk:
    name: str
    dtype: DType
    rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.nbytes(numel((self.offsets, self.sizes)))


@dataclass(frozen=True)
class Plan:
    """What a reshard or consolidation writes: every target chunk (in write order), each
    tensor's placement, and the object entries carried over (on rank 0). Immutable."""

    mesh: Mesh
    chunks: tuple[TargetChunk, ...]
    placements: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    objects: tuple[str, ...] = ()

    def by_rank(self) -> dict[int, list[TargetChunk]]:
        out: dict[int, list[TargetChunk]] = {r: [] for r in range(self.mesh.world_size)}
        for c in self.chunks:
            out[c.rank].append(c)
        return out

    def rank_summary(self, src: Checkpoint) -> list[dict]:
        """Per rank: chunks, bytes written, bytes read (from which source files)."""
        rows = []
        for rank, chunks in self.by_rank().items():
            read: dict[str, int] = {}
            for c in chunks:
                for p in c.pieces:
                    read[p.src.extent.file] = (read.get(p.src.extent.file, 0)
                                               + c.dtype.nbytes(numel((p.dst_offsets, p.sizes))))
            rows.append({"rank": rank, "num_chunks": len(chunks),
                         "write_bytes": sum(c.nbytes for c in chunks),
                         "read_bytes": sum(read.values()), "read_files": sorted(read)})
        return rows


def chunk_index(t: TensorEntry) -> BoxIndex:
    """A :class:`~ckptctl.boxes.BoxIndex` of ``t``'s chunks, for :func:`pieces_for`."""
    return BoxIndex([(c.offsets, c.sizes) for c in t.chunks])


def pieces_for(t: TensorEntry, offsets, sizes, index: BoxIndex | None = None) -> tuple[Piece, ...]:
    """The pieces of ``t``'s source chunks that cover the box ``offsets``/``sizes``.

    ``index``: :func:`chunk_index` of ``t``, built once when many boxes are cut from it.
    """
    if not sizes:  # 0-dim: the one chunk
        return (Piece(t.chunks[0], (), (), ()),) if t.chunks else ()
    box = (tuple(offsets), tuple(sizes))
    out = []
    covered = 0
    for i, hit in (index or chunk_index(t)).hits(box):
        c = t.chunks[i]
        out.append(Piece(c, relative(hit, c.offsets), relative(hit, box[0]), hit[1]))
        covered += numel(hit)
    want = numel(box)
    if covered != want:
        raise FormatError(t.name, f"source chunks cover {covered} of the {want} elements "
                          f"of box {list(offsets)}+{list(sizes)}: run verify --level structure",
                          code=ProblemCode.CHUNK_GAP if covered < want
                          else ProblemCode.CHUNK_OVERLAP)
    return tuple(out)


def make_plan(ck: Checkpoint, rules: Rules, *, only: set[str] | None = None) -> Plan:
    """Plan the target layout ``rules`` for every tensor of ``ck`` (or those in ``only``).

    Every placement is validated before anything is read or written; a rule that does not
    fit a tensor raises :class:`~ckptctl.errors.UsageError` naming both.
    """
    with paused_gc():
        return _make_plan(ck, rules, only)


def _make_plan(ck: Checkpoint, rules: Rules, only: set[str] | None) -> Plan:
    mesh = rules.mesh
    placed: dict[str, Placement] = {}
    for name, t in ck.tensors.items():
        if only is None or name in only:
            placed[name] = rules.placement_for(name, t.shape)
    chunks: list[TargetChunk] = []
    for name, p in placed.items():
        t = ck.tensors[name]
        index = chunk_index(t)
        seen: set[tuple] = set()
        for rank in range(mesh.world_size):
            offs, sizes = local_box(t.shape, p, mesh, rank)
            if (offs, sizes) in seen:
                continue  # a replica: written once, by the lowest rank holding it
            seen.add((offs, sizes))
            empty = any(s == 0 for s in sizes)
            if empty and t.numel:
                continue  # ranks left with nothing of this tensor hold no chunk
            chunks.append(TargetChunk(name, t.dtype, rank, offs, sizes,
                                      () if empty else pieces_for(t, offs, sizes, index)))
    return Plan(mesh, tuple(chunks),
                MappingProxyType({n: p.describe(mesh) for n, p in placed.items()}),
                tuple(sorted(n for n in ck.objects if only is None or n in only)))


@dataclass(frozen=True)
class RuleMatch:
    """What one rule placed: how many tensors it matched (the first rule to match wins)."""

    rule: str  # its label (presets), else its pattern
    pattern: str  # ``re:`` before a regex
    placements: str  # e.g. ``tp:Shard(0) dp:Shard(0)``
    tensors: int
    examples: tuple[str, ...]


@dataclass(frozen=True)
class RuleReport:
    """Per rule, what it matched; and the tensors no rule shards (they stay replicated)."""

    matched: tuple[RuleMatch, ...]
    replicated: int
    replicated_examples: tuple[str, ...]


def rule_report(ck: Checkpoint, rules: Rules, plan: Plan, *, examples: int = 3) -> RuleReport:
    """What each rule of ``rules`` matched among the tensors ``plan`` places.

    >>> from ckptctl.model import Checkpoint, TensorEntry, DTYPES
    >>> from ckptctl.layout import parse_mesh, preset
    >>> t = lambda n: TensorEntry(n, DTYPES["float32"], (4, 4), [])
    >>> ck = Checkpoint("x", "dcp", tensors={n: t(n) for n in ["model.a.wq.weight", "model.b.w"]})
    >>> rules = preset("llama", parse_mesh("tp=2"))
    >>> plan = Plan(rules.mesh, (), {n: "" for n in ck.tensors})
    >>> r = rule_report(ck, rules, plan)
    >>> [(m.tensors, m.examples) for m in r.matched][:2], r.replicated, r.replicated_examples
    ([(1, ('model.a.wq.weight',)), (0, ())], 1, ('model.b.w',))
    """
    hits: dict[int, list[str]] = {i: [] for i in range(len(rules.rules))}
    replicated: list[str] = []
    for name in sorted(plan.placements):
        rule = rules.rule_for(name) if ck.tensors[name].shape else None
        if rule is not None:
            hits[next(i for i, r in enumerate(rules.rules) if r is rule)].append(name)
        if rule is None or all(d is None for d in rule.shard.values()):
            replicated.append(name)
    # model and optimizer tensors first: those are the ones a rule was meant for
    replicated.sort(key=lambda n: (classify(n) not in ("model", "optim"), n))
    matched = tuple(
        RuleMatch(r.label or ("re:" if r.regex else "") + r.pattern,
                  ("re:" if r.regex else "") + r.pattern,
                  " ".join(f"{m}:{'Replicate()' if d is None else f'Shard({d})'}"
                           for m, d in r.shard.items()),
                  len(hits[i]), tuple(hits[i][:examples]))
        for i, r in enumerate(rules.rules))
    return RuleReport(matched, len(replicated), tuple(replicated[:examples]))


def dropped(ck: Checkpoint, patterns) -> list[str]:
    """The entries of ``ck`` (tensors and objects) that ``--drop`` globs name, sorted; a
    glob that names no entry is refused (:class:`~ckptctl.errors.UsageError`, exit 2).

    >>> from ckptctl.model import Checkpoint, ObjectEntry
    >>> ck = Checkpoint("x", "dcp", objects={n: ObjectEntry(n) for n in ["extra.a", "extra.b", "step"]})
    >>> dropped(ck, ["extra.*"]), dropped(ck, [])
    (['extra.a', 'extra.b'], [])
    >>> dropped(ck, ["nope"])
    Traceback (most recent call last):
    ckptctl.errors.UsageError: --drop 'nope' names no entry of x (entries: extra.a, extra.b, step)
    """
    import fnmatch

    names = [*ck.tensors, *ck.objects]
    out: set[str] = set()
    for g in patterns or ():
        hit = [n for n in names if fnmatch.fnmatchcase(n, g)]
        if not hit:
            from ..catalog.inspect import few_names

            raise UsageError(f"--drop {g!r} names no entry of {ck.root} (entries: "
                             f"{few_names(names)})")
        out.update(hit)
    return sorted(out)


def consolidation_plan(ck: Checkpoint, *, only: set[str] | None = None) -> Plan:
    """One whole chunk per tensor, on rank 0: what consolidate writes."""
    return make_plan(ck, Rules(Mesh(("world",), (1,)), []), only=only)
