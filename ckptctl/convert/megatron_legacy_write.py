"""Write a Megatron legacy iteration folder (``mp_rank_TT[_PPP]/model_optim_rng.pt``) at a
new tensor- and pipeline-parallel degree: the inverse of the reader's merge
(:mod:`ckptctl.formats.megatron_legacy`), by the same rules: each rank file holds its
shards of the model (column/vocab dim 0, row dim 1, SwiGLU ``fc1`` as ``[gate_t; up_t]``,
replicated whole), its pipeline stage's layers numbered from 0, the embeddings on the first
stage and the final norm and output layer on the last; ``_extra_state`` as an
``io.BytesIO`` (as Transformer Engine keeps it) and the common state (``iteration``,
``args`` with the new degrees, ``checkpoint_version``, the scheduler) in every file.

The optimizer and RNG state are each source rank's own (indexed by Megatron's parameter
order, which the files do not name): they cannot be split again, so they must be left
out (``--drop 'optimizer.*' --drop 'rng_state.*'``). Memory: one output rank's shards and
the largest parameter.

>>> reshard_legacy("run/iter_0000020", "tp4/iter_0000020", tp=4, pp=1,
...                drop=["optimizer.*", "rng_state.*"])          # doctest: +SKIP
"""
from __future__ import annotations

import argparse
import io
import posixpath
import re
from dataclasses import asdict, dataclass, field

from ..errors import UsageError
from ..formats.detect import open_checkpoint
from ..formats.megatron_legacy import rank_file, rule_of
from ..storage import open_store
from ..writing.commit import commit_written
from .copier import nest
from ..writing.output import OutputDir
from .planner import dropped

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
TRACKER = "latest_checkpointed_iteration.txt"


@dataclass
class LegacyResult:
    src: str
    dst: str
    tp: int
    pp: int
    files: list[str] = field(default_factory=list)
    manifest_id: str | None = None
    dropped: list[str] = field(default_factory=list)
    tracker: str | None = None  # what was written to the parent's tracker file, if anything

    def to_dict(self) -> dict:
        return asdict(self)


def _kind(name: str, swiglu: bool) -> str:
    kind = rule_of(name, swiglu)
    if kind is None:
        raise UsageError(f"{name}: no rule says how Megatron splits it")
    return kind


def _shard(full, kind: str, tp: int, t: int, name: str):
    """TP rank ``t``'s shard of ``full`` (a torch tensor) by rule ``kind``."""
    import torch

    if kind in ("replicated", "extra") or tp == 1:
        return full.clone()
    dim = 1 if kind == "row" else 0
    if full.shape[dim] % (2 * tp if kind == "swiglu" else tp):
        raise UsageError(f"{name}: {full.shape[dim]} rows on dim {dim} do not split {tp} ways")
    if kind == "swiglu":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[t], up.chunk(tp, dim=0)[t]]).clone()
    return full.chunk(tp, dim=dim)[t].clone()


def _stage_of(name: str, layers: int, pp: int) -> tuple[int | None, str]:
    """(stage, local name) of a global model name; stage None: every stage."""
    m = _LAYER.match(name)
    if m:
        per = layers // pp
        g = int(m.group(1))
        return g // per, f"decoder.layers.{g % per}.{m.group(2)}"
    if name.startswith("embedding."):
        return 0, name
    return pp - 1, name  # final_layernorm, output_layer


def reshard_legacy(src: str, dst: str, *, tp: int, pp: int, drop: list[str] | None = None,
                   storage_options: dict | None = None, dst_storage_options: dict | None = None,
                   force: bool = False) -> LegacyResult:
    """Write ``src`` (any Megatron GPT layout ckptctl reads) as a legacy iteration folder
    at ``dst`` with ``tp`` x ``pp`` rank files; every rank file, then the manifest, then
    (when the parent has none) Megatron's tracker file naming it."""
    import torch

    from ..formats.tensorio import read_tensor

    if tp < 1 or pp < 1:
        raise UsageError(f"tp={tp}, pp={pp}: each must be at least 1 "
                         "(reshard --mesh tp=T,pp=P)")
    ck = open_checkpoint(src, storage_options)
    gone = set(dropped(ck, drop))
    keep_t = [n for n in ck.tensors if n not in gone]
    keep_o = [n for n in ck.objects if n not in gone]
    per_rank = sorted({n.split(".", 2)[0] + "." + n.split(".", 2)[1] for n in keep_t + keep_o
                       if n.startswith(("optimizer.mp_rank_", "rng_state.mp_rank_"))})
    if per_rank:
        raise UsageError(f"{per_rank[0]}: a source rank's optimizer or RNG state cannot be "
                         "split again (Megatron's parameter order is not in the files); leave "
                         "it out with --drop 'optimizer.*' --drop 'rng_state.*'")
    args_entry = ck.objects.get("args")
    argv = dict(args_entry.value) if args_entry is not None and isinstance(args_entry.value, dict) \
        else {}
    layers = argv.get("num_layers")
    if not isinstance(layers, int) or layers % pp:
        raise UsageError(f"{layers} layers do not split into {pp} pipeline stages")
    swiglu = bool(argv.get("swiglu"))
    model = [n for n in keep_t if n.startswith("model.")]
    extra = [n for n in keep_o if n.startswith("model.")]
    common = {n: ck.objects[n].value for n in keep_o if not n.startswith("model.")}
    common_t = [n for n in keep_t if not n.startswith("model.")]
    if common_t:
        raise UsageError(f"{common_t[0]}: a tensor outside the model that no rule places")
    argv.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    result = LegacyResult(src, dst, tp, pp, dropped=sorted(gone))
    store = open_store(dst, dst_storage_options if dst_storage_options is not None
                       else storage_options)
    with OutputDir(store, command="reshard --to megatron-legacy", force=force, source=src) as out:
        from ..storage.hashing import HashingWriter

        hashes = {}
        for p in range(pp):
            names = {}
            for n in model + extra:
                stage, local = _stage_of(n[len("model."):], layers, pp)
                if stage == p:
                    names[n] = local
            for t in range(tp):
                sd = {}
                for n, local in names.items():
                    if n in ck.objects:
                        v = ck.objects[n].value
                        sd[local] = io.BytesIO(v) if isinstance(v, (bytes, bytearray)) else v
                        continue
                    e = ck.tensors[n]
                    raw = bytearray(read_tensor(ck, n).tobytes())
                    full = torch.frombuffer(raw, dtype=getattr(torch, e.dtype.name)).reshape(
                        e.shape) if raw else torch.empty(e.shape, dtype=getattr(torch, e.dtype.name))
                    sd[local] = _shard(full, _kind(local, swiglu), tp, t, local)
                state = nest([(tuple(k.split(".")), v) for k, v in common.items()
                              if k != "args"])
                state["args"] = argparse.Namespace(**argv)
                state["model"] = sd
                rel = rank_file(t, p, pp)
                buf = io.BytesIO()
                torch.save(state, buf)
                with out.open(rel) as f:
                    w = HashingWriter(f)
                    w.write(buf.getvalue())
                hashes[rel] = w.result()
                result.files.append(rel)
        out.commit()
        result.manifest_id = commit_written(out.store, hashes, step=ck.step)
    parent, name = posixpath.split(store.url.rstrip("/"))
    it = "release" if name == "release" else (str(int(name[len("iter_"):]))
                                              if name.startswith("iter_") and name[5:].isdigit()
                                              else None)
    if it is not None:
        pstore = open_store(parent or "/", dst_storage_options if dst_storage_options
                            is not None else storage_options)
        if not pstore.exists(TRACKER):
            pstore.write_atomic(TRACKER, it.encode())
            result.tracker = it
    return result

