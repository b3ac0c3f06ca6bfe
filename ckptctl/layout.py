"""Target layouts: a device mesh plus per-tensor placements chosen by ordered rules.

Semantics follow DTensor: each mesh dim either replicates a tensor or shards one of its
dims, splitting it like ``torch.chunk`` (chunks of ``ceil(n / k)``, trailing ranks may get
less or nothing). When several mesh dims shard the same tensor dim, they split in the
order ``split_order`` gives (default: mesh order, DTensor's ``Shard``; FSDP2 over tensor
parallel splits ``tp`` first, then ``dp``, torch's strided sharding).

>>> mesh = parse_mesh("dp=2,tp=2")
>>> rules = preset("llama", mesh)
>>> p = rules.placement_for("model.layers.0.attention.wq.weight", (1001, 128))
>>> p.describe(mesh)
'dp:Shard(0) tp:Shard(0) order=tp,dp'
>>> [local_box((1001, 128), p, mesh, r) for r in range(4)]
[((0, 0), (251, 128)), ((501, 0), (250, 128)), ((251, 0), (250, 128)), ((751, 0), (250, 128))]
"""
from __future__ import annotations

import fnmatch
import functools
import math
import re
from dataclasses import dataclass, field

from .errors import UsageError
from .parts import classify

REPLICATE = None  # a mesh dim that does not shard: Replicate()


@dataclass(frozen=True)
class Mesh:
    """Named mesh dims in DeviceMesh order; rank = row-major index of the coordinates."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def coords(self, rank: int) -> tuple[int, ...]:
        return _coords(self.sizes, rank)

    def __str__(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.names, self.sizes))


@functools.lru_cache(maxsize=1 << 16)  # the planner asks once per rank per tensor
def _coords(sizes: tuple[int, ...], rank: int) -> tuple[int, ...]:
    out = []
    for s in reversed(sizes):
        out.append(rank % s)
        rank //= s
    return tuple(reversed(out))


def parse_mesh(spec: str) -> Mesh:
    """``dp=8,tp=4`` -> Mesh.

    >>> parse_mesh("dp=8, tp=4").world_size
    32
    """
    names, sizes = [], []
    for part in spec.split(","):
        name, sep, size = part.strip().partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_]\w*", name.strip()) or not size.strip().isdigit():
            raise UsageError(f"bad mesh dim {part.strip()!r}: expected NAME=SIZE, e.g. dp=8,tp=4")
        if int(size) < 1:
            raise UsageError(f"mesh dim {name} must have size >= 1")
        if name.strip() in names:
            raise UsageError(f"mesh dim {name.strip()} given twice")
        names.append(name.strip())
        sizes.append(int(size))
    if not names:
        raise UsageError("empty mesh")
    return Mesh(tuple(names), tuple(sizes))


@dataclass(frozen=True)
class Placement:
    """One placement per mesh dim (``None``: replicate, ``d``: shard tensor dim d) and the
    order in which mesh dims split a tensor dim they share."""

    shard: tuple[int | None, ...]
    split_order: tuple[int, ...] | None = None  # mesh dim indices; None: mesh order

    def describe(self, mesh: Mesh) -> str:
        parts = [f"{n}:{'Replicate()' if d is None else f'Shard({d})'}"
                 for n, d in zip(mesh.names, self.shard)]
        if self.split_order is not None and list(self.split_order) != sorted(self.split_order):
            parts.append("order=" + ",".join(mesh.names[i] for i in self.split_order))
        return " ".join(parts)

    @property
    def replicated(self) -> bool:
        return all(d is None for d in self.shard)


def parse_placement(text: str) -> int | None:
    """``Shard(1)`` -> 1, ``Replicate()`` -> None.

    >>> parse_placement("Shard(1)"), parse_placement("replicate")
    (1, None)
    """
    t = text.strip()
    m = re.fullmatch(r"(?i)shard\((-?\d+)\)|s(-?\d+)", t)
    if m:
        return int(m.group(1) or m.group(2))
    if re.fullmatch(r"(?i)replicate(\(\))?|r", t):
        return None
    raise UsageError(f"bad placement {text!r}: expected Shard(d) or Replicate()")


def chunk_span(n: int, k: int, i: int) -> tuple[int, int]:
    """(offset, size) of piece ``i`` of ``n`` split ``k`` ways like ``torch.chunk``/DTensor.

    >>> [chunk_span(10, 4, i) for i in range(4)], chunk_span(2, 4, 3)
    ([(0, 3), (3, 3), (6, 3), (9, 1)], (2, 0))
    """
    full = -(-n // k) if k else n
    start = full * i
    if start >= n:
        return n, 0
    return start, min(n, start + full) - start


def local_box(shape: tuple[int, ...], p: Placement, mesh: Mesh, rank: int
              ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (offsets, sizes) box rank ``rank`` holds of a tensor of ``shape``."""
    coords = mesh.coords(rank)
    offs, sizes = [0] * len(shape), list(shape)
    order = p.split_order if p.split_order is not None else tuple(range(len(mesh.sizes)))
    for i in order:
        d = p.shard[i]
        if d is None:
            continue
        o, s = chunk_span(sizes[d], mesh.sizes[i], coords[i])
        offs[d] += o
        sizes[d] = s
    return tuple(offs), tuple(sizes)


# --------------------------------------------------------------------------- rules


@dataclass
class Rule:
    pattern: str
    shard: dict[str, int | None]  # mesh dim name -> tensor dim or None
    order: tuple[str, ...] | None = None
    regex: bool = False
    allow_empty: bool = False  # may leave ranks with empty shards (as FSDP2 does)
    _re: re.Pattern | None = field(default=None, repr=False)
    label: str | None = None  # a short name for reports (presets); else the pattern

    def matches(self, name: str) -> bool:
        if self.regex:
            if self._re is None:
                self._re = re.compile(self.pattern)
            return self._re.search(name) is not None
        return fnmatch.fnmatchcase(name, self.pattern)


_OPTIM_STATE = re.compile(r"^(optim|optimizer)\.state\.(.+)\.([^.]+)$")


@dataclass
class Rules:
    """Ordered rules: the first rule whose pattern matches a tensor's name places it;
    unmatched tensors (and 0-dim ones) are replicated. Optimizer state entries
    (``optim.state.<param>.<key>``) follow their parameter when their shape is the same."""

    mesh: Mesh
    rules: list[Rule]
    name: str = "custom"
    #: Presets place only model weights and optimizer state; RNG, dataloader and other
    #: tensors stay replicated, as the training framework saved them.
    parts: tuple[str, ...] | None = None

    def rule_for(self, name: str) -> Rule | None:
        if self.parts is not None:
            if classify(name) not in self.parts:
                return None
        for candidate in _candidates(name):
            for r in self.rules:
                if r.matches(candidate):
                    return r
        return None

    def placement_for(self, name: str, shape: tuple[int, ...]) -> Placement:
        rule = self.rule_for(name) if shape else None
        if rule is None:
            return Placement((None,) * len(self.mesh.names))
        shard = []
        for mname in self.mesh.names:
            d = rule.shard.get(mname)
            if d is not None and d < 0:
                d += len(shape)
            if d is not None and not 0 <= d < len(shape):
                raise UsageError(f"{name}: rule {rule.pattern!r} shards dim {rule.shard[mname]} "
                                 f"on {mname}, but the tensor has {len(shape)} dims {list(shape)}")
            shard.append(d)
        order = None
        if rule.order:
            order = tuple(self.mesh.names.index(n) for n in rule.order if n in self.mesh.names)
            order += tuple(i for i in range(len(self.mesh.names)) if i not in order)
        p = Placement(tuple(shard), order)
        _check_fits(name, shape, p, self.mesh, rule)
        return p


def _candidates(name: str) -> list[str]:
    m = _OPTIM_STATE.match(name)
    if m:  # optimizer state follows its parameter: try model.<param> and <param>
        return [f"model.{m.group(2)}", m.group(2), name]
    return [name]


def _check_fits(name: str, shape, p: Placement, mesh: Mesh, rule: Rule) -> None:
    """Refuse splits that leave ranks with nothing (more shards than elements) unless the
    rule allows it (presets do, as FSDP2 pads such parameters). An empty tensor (a dim of
    size 0) shards like any other, as DTensor does: each rank's box is empty."""
    if 0 in shape:
        return
    per_dim: dict[int, int] = {}
    for i, d in enumerate(p.shard):
        if d is not None:
            per_dim[d] = per_dim.get(d, 1) * mesh.sizes[i]
    for d, k in per_dim.items():
        if k > shape[d] and not rule.allow_empty:
            raise UsageError(f"{name}: rule {rule.pattern!r} splits dim {d} of size {shape[d]} "
                             f"into {k} shards (more shards than elements)")


def _rule(pattern: str, order=None, label: str | None = None, **shard) -> Rule:
    regex = pattern.startswith("re:")
    return Rule(pattern[3:] if regex else pattern, shard, tuple(order) if order else None, regex,
                allow_empty=True, label=label)


# Tensor-parallel naming schemes: column-parallel (shard dim 0 of the weight), row-parallel
# (dim 1), vocab-parallel embeddings (dim 0) and output heads (dim 0).
_COLWISE = r"re:(^|\.)(wq|wk|wv|q_proj|k_proj|v_proj|qkv_proj|query_key_value|c_attn|w1|w3|" \
           r"gate_proj|up_proj|gate_up_proj|fc1|c_fc|dense_h_to_4h)\.(weight|bias)$"
_ROWWISE = r"re:(^|\.)(wo|o_proj|out_proj|dense|c_proj|w2|down_proj|fc2|dense_4h_to_h)\.weight$"
_VOCAB = r"re:(^|\.)(tok_embeddings|embed_tokens|wte|word_embeddings|embed_in)\.weight$"
_HEAD = r"re:(^|\.)(output|lm_head|embed_out)\.weight$"


def preset(name: str, mesh: Mesh) -> Rules:
    """Built-in rules: ``fsdp`` (everything ``Shard(0)`` on ``dp``) and ``llama``/``tp``
    (tensor parallel on ``tp`` for the common transformer names, plus ``Shard(0)`` on ``dp``
    applied after ``tp`` as FSDP2 does over a TP model)."""
    has_dp, has_tp = "dp" in mesh.names, "tp" in mesh.names
    if name == "fsdp":
        if not has_dp:
            raise UsageError("preset fsdp needs a mesh dim named dp")
        return Rules(mesh, [_rule("*", dp=0)], "fsdp", parts=("model", "optim"))
    if name in ("llama", "tp", "transformer"):
        if not has_tp:
            raise UsageError(f"preset {name} needs a mesh dim named tp")
        dp = {"dp": 0} if has_dp else {}
        order = ("tp", "dp") if has_dp else None
        rules = [_rule(_COLWISE, order, "column-parallel (wq, q_proj, w1, up_proj, ...)",
                       tp=0, **dp),
                 _rule(_ROWWISE, order, "row-parallel (wo, o_proj, w2, down_proj, ...)",
                       tp=1, **dp),
                 _rule(_VOCAB, order, "vocab embedding (tok_embeddings, embed_tokens, ...)",
                       tp=0, **dp),
                 _rule(_HEAD, order, "output head (output, lm_head, embed_out)", tp=0, **dp)]
        if has_dp:
            rules.append(_rule("*", dp=0, label="everything else"))
        return Rules(mesh, rules, name, parts=("model", "optim"))
    raise UsageError(f"unknown rules preset {name!r} (built in: fsdp, llama, tp)")


def load_rules(text: str, mesh: Mesh | None, *, where: str = "rules") -> Rules:
    """Rules from TOML::

        mesh = "dp=2,tp=4"            # optional if --mesh is given
        [[rule]]
        match = "*.attention.w[qkv].weight"   # glob; or  regex = "..."
        placements = { tp = "Shard(0)", dp = "Shard(0)" }
        order = ["tp", "dp"]          # optional split order for a shared tensor dim
        allow_empty = true            # optional: allow more shards than elements
    """
    import tomllib

    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{where}: not valid TOML ({e})") from None
    if mesh is None:
        if "mesh" not in doc:
            raise UsageError(f"{where}: no mesh (give --mesh or mesh = \"dp=..,tp=..\")")
        mesh = parse_mesh(str(doc["mesh"]))
    rules = []
    for i, r in enumerate(doc.get("rule", [])):
        pat = r.get("match") or r.get("glob")
        regex = r.get("regex")
        if bool(pat) == bool(regex):
            raise UsageError(f"{where}: rule {i + 1} needs exactly one of match or regex")
        pl = r.get("placements", {})
        if not isinstance(pl, dict):
            raise UsageError(f"{where}: rule {i + 1}: placements must be a table")
        unknown = set(pl) - set(mesh.names)
        if unknown:
            raise UsageError(f"{where}: rule {i + 1} names mesh dim(s) {sorted(unknown)} "
                             f"not in the mesh {mesh}")
        shard = {k: parse_placement(str(v)) for k, v in pl.items()}
        order = r.get("order")
        if order is not None and (not isinstance(order, list) or set(order) - set(mesh.names)):
            raise UsageError(f"{where}: rule {i + 1}: order must list mesh dims")
        rules.append(Rule(regex or pat, shard, tuple(order) if order else None, bool(regex),
                          allow_empty=bool(r.get("allow_empty", False))))
    return Rules(mesh, rules, where)
