"""Write a real DCP checkpoint as an N-rank job would, in one process, in seconds.

    .venv/bin/python bench/make_scale_dcp.py --ranks 10000 [--tensors 30] [--mesh fsdp|2d] [--out DIR]

Without ``--out`` the checkpoint goes to (and is reused from) the cache,
``~/.cache/ckptctl-bench/scale/<mesh>-r<ranks>-t<tensors>-v<version>/ckpt``; the path is
printed on the last line of stdout.

What it writes is what ``torch.distributed.checkpoint.save`` (``FileSystemWriter``,
``thread_count=1``) writes for a llama-like model trained on N ranks:

* ``__{r}_0.distcp`` for every rank ``r``: the ``step`` bytes entry (rank 0 only) first, then
  the rank's tensor chunks in state-dict order (one writer thread), each one
  the exact bytes ``torch.save`` writes for that local shard (a complete zip);
* ``.metadata``: ``pickle.dump`` of a ``torch.distributed.checkpoint.metadata.Metadata`` built
  from torch's own classes (``TensorStorageMetadata``, ``ChunkStorageMetadata``,
  ``MetadataIndex``, ``BytesStorageMetadata``, the filesystem writer's ``_StorageInfo``),
  as ``FileSystemWriter.finish`` pickles it.

Layouts (the tensor names follow llama, so ``--rules llama`` applies):

* ``--mesh fsdp``: every weight ``Shard(0)`` over the N ranks with FSDP2's ``torch.chunk``
  split; a tensor has ``k*N - 1`` rows, so the last rank's shard is one row short;
* ``--mesh 2d``: ``dp x tp`` with ``tp=8`` (N must be a multiple of 8), rank ``r`` at
  ``(r // 8, r % 8)``: column-parallel weights (wq, wk, wv, w1, w3, tok_embeddings, output)
  are split on dim 0 by tp, then each tp piece on dim 0 by dp (FSDP2 over TP); row-parallel
  weights (wo, w2) are split on dim 1 by tp and on dim 0 by dp: true 2-D blocks;
* both: the norms (``attention_norm``, ``ffn_norm``, ``norm``) are replicated and stored once
  (one chunk each, spread over the ranks as DCP's dedup does), ``step`` is a bytes entry.

Values are deterministic: flat element ``i`` of the ``t``-th tensor (state-dict order) is
``(i + 1009 * t) % 256`` for bf16 tensors and ``% 65536`` for fp32 ones (exact in either
dtype); :func:`expected` rebuilds any full tensor.

Speed: ``torch.save`` costs ~120 us per call, too slow for 300,000 chunks on a busy
machine. Every chunk of one shape and dtype is the same zip apart from the data bytes, their
CRC-32 (in the data descriptor and the central directory) and the 40-digit
``.data/serialization_id`` record (which PyTorch derives from a hash of the record names
and of the records' CRC-32s) with its own CRC. So :class:`_Template` runs ``torch.save`` once
per shape and patches those fields; it checks itself against ``torch.save`` on the first
chunk of every shape, and ``tests/test_scale_generator.py`` compares every chunk of small
checkpoints, and whole files against ``dcp.save``, byte for byte.

>>> from bench.make_scale_dcp import make                       # doctest: +SKIP
>>> make("/tmp/ckpt16", ranks=16, mesh="2d")                    # doctest: +SKIP
"""
from __future__ import annotations

import argparse
import fcntl
import io
import os
import pickle
import shutil
import struct
import sys
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

VERSION = 2  # bump when the output changes: it is part of the cache key
CACHE = Path(os.environ.get("CKPTCTL_BENCH_CACHE", Path.home() / ".cache" / "ckptctl-bench")) / "scale"
TP = 8
STEP = 1000

# (name pattern, tensor-parallel kind, dtype, rows per dp rank k, cols): column-parallel
# tensors have ``cols`` columns; row-parallel ones 4 (fsdp) or 2 per tp rank (2d), see specs()
_LAYER = [("model.layers.{i}.attention.wq.weight", "col", "float32", 2, 8),
          ("model.layers.{i}.attention.wk.weight", "col", "float32", 2, 8),
          ("model.layers.{i}.attention.wv.weight", "col", "float32", 2, 8),
          ("model.layers.{i}.attention.wo.weight", "row", "float32", 2, 0),
          ("model.layers.{i}.feed_forward.w1.weight", "col", "float32", 3, 8),
          ("model.layers.{i}.feed_forward.w2.weight", "row", "float32", 2, 0),
          ("model.layers.{i}.feed_forward.w3.weight", "col", "float32", 3, 8)]
_NORM_COLS = 8


@dataclass(frozen=True)
class Spec:
    """One tensor of the generated state dict."""
    name: str
    kind: str          # "col", "row" (tensor-parallel kind) or "rep" (replicated, one chunk)
    dtype: str         # torch dtype name
    shape: tuple[int, ...]
    tid: int           # position among the tensors, state-dict order (seeds the values)
    k: int = 0         # rows per dp rank (before the uneven last one)

    @property
    def modulus(self) -> int:
        return 256 if self.dtype == "bfloat16" else 65536


def specs(ranks: int, tensors: int = 30, mesh: str = "fsdp") -> list[Spec]:
    """The tensors, in state-dict order: ``tensors`` sharded weights (tok_embeddings, then 7
    per layer, then output) plus replicated norms for every layer used and the final norm.

    >>> [s.name for s in specs(4, tensors=3)]
    ['model.tok_embeddings.weight', 'model.layers.0.attention.wq.weight', 'model.layers.0.attention_norm.weight', 'model.layers.0.ffn_norm.weight', 'model.norm.weight', 'model.output.weight']
    """
    if ranks < 1 or tensors < 2:
        raise ValueError("need ranks >= 1 and tensors >= 2 (tok_embeddings and output)")
    if mesh not in ("fsdp", "2d"):
        raise ValueError(f"mesh must be fsdp or 2d, not {mesh!r}")
    if mesh == "2d" and ranks % TP:
        raise ValueError(f"--mesh 2d needs ranks divisible by tp={TP}, got {ranks}")
    layered = tensors - 2
    layers = (layered + len(_LAYER) - 1) // len(_LAYER)
    raw = [("model.tok_embeddings.weight", "col", "bfloat16", 4, 8)]
    for i in range(layers):
        take = _LAYER[:min(len(_LAYER), layered - i * len(_LAYER))]
        raw += [(n.format(i=i), kind, dt, k, c) for n, kind, dt, k, c in take]
        raw += [(f"model.layers.{i}.attention_norm.weight", "rep", "float32", 0, 0),
                (f"model.layers.{i}.ffn_norm.weight", "rep", "float32", 0, 0)]
    raw += [("model.norm.weight", "rep", "float32", 0, 0),
            ("model.output.weight", "col", "bfloat16", 4, 8)]
    out = []
    for tid, (name, kind, dt, k, c) in enumerate(raw):
        if kind == "rep":
            shape = (_NORM_COLS,)
        elif mesh == "fsdp":
            shape = (k * ranks - 1, c if kind == "col" else 4)
        elif kind == "col":
            shape = (TP * (k * (ranks // TP) - 1), c)
        else:  # row-parallel: dim 1 split by tp, dim 0 by dp
            shape = (k * (ranks // TP) - 1, TP * 2)
        out.append(Spec(name, kind, dt, shape, tid, k))
    return out


def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    """(offset, size) of part ``i`` of ``n`` split like ``torch.chunk`` (FSDP2)."""
    cs = -(-n // parts)
    off = min(i * cs, n)
    return off, max(0, min(cs, n - off))


def chunk_of(spec: Spec, rank: int, ranks: int, mesh: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of ``rank``'s shard of a sharded tensor.

    >>> s = specs(16, tensors=2)[0]; s.shape, chunk_of(s, 15, 16, "fsdp")
    ((63, 8), ((60, 0), (3, 8)))
    """
    if mesh == "fsdp":
        off, size = _split(spec.shape[0], ranks, rank)
        return (off, 0), (size, spec.shape[1])
    dp, (i, j) = ranks // TP, divmod(rank, TP)
    if spec.kind == "col":
        p = spec.shape[0] // TP
        off, size = _split(p, dp, i)
        return (j * p + off, 0), (size, spec.shape[1])
    off, size = _split(spec.shape[0], dp, i)
    c = spec.shape[1] // TP
    return (off, j * c), (size, c)


def rep_rank(spec: Spec, specs_: list[Spec], ranks: int) -> int:
    """Which rank stores a replicated tensor (spread like DCP's dedup)."""
    nrep = [s.tid for s in specs_ if s.kind == "rep"].index(spec.tid)
    return (nrep * 7919) % ranks


def expected(spec: Spec):
    """The full tensor the checkpoint holds for ``spec`` (a torch tensor).

    >>> import torch; s = specs(2, tensors=2)[0]; bool(expected(s)[0, 1] == 1)
    True
    """
    import torch

    n = 1
    for d in spec.shape:
        n *= d
    flat = (torch.arange(n, dtype=torch.int64) + 1009 * spec.tid) % spec.modulus
    return flat.to(getattr(torch, spec.dtype)).reshape(spec.shape)


def _full_array(spec: Spec):
    """``expected(spec)`` as a numpy array of the raw little-endian element bits."""
    import torch

    t = expected(spec)
    bits = torch.int16 if spec.dtype == "bfloat16" else torch.int32
    return t.view(bits).numpy()


# --------------------------------------------------------------------------- torch.save zips
_M64 = (1 << 64) - 1


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on uint64, as PyTorchStreamWriter folds record CRCs."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _M64) + (seed >> 2)) & _M64)) & _M64


class _Template:
    """``torch.save`` of one shape and dtype, with the fields that depend on the values."""

    def __init__(self, shape: tuple[int, ...], dtype: str):
        import torch

        self.shape, self.dtype = shape, dtype
        buf = io.BytesIO()
        torch.save(torch.zeros(shape, dtype=getattr(torch, dtype)), buf)
        z = buf.getvalue()
        self.bytes = bytearray(z)
        records = self._records(z)
        names = list(records)
        if names[-1] != "archive/.data/serialization_id" or "archive/data/0" not in records:
            raise RuntimeError(f"unexpected torch.save layout: {names}")
        self.data = records["archive/data/0"]
        self.sid = records["archive/.data/serialization_id"]
        self.nbytes = self.data[1]
        # the CRC fold of every record before the serialization id; data/0 is the one that varies
        k = names.index("archive/data/0")
        seed = 0
        for n in names[:k]:
            seed = _hash_combine(seed, records[n][4])
        self.seed_before = seed
        self.after = [records[n][4] for n in names[k + 1:-1]]
        self.sid_prefix = bytes(z[self.sid[0]:self.sid[0] + 20])

    @staticmethod
    def _records(z: bytes) -> dict[str, tuple[int, int, int, int, int]]:
        """name -> (data offset, size, descriptor CRC position, central CRC position, CRC)."""
        eocd = z.rfind(b"PK\x05\x06")
        n_entries, = struct.unpack_from("<H", z, eocd + 10)
        cd_off, = struct.unpack_from("<I", z, eocd + 16)
        if cd_off == 0xFFFFFFFF:  # zip64: the real offset is in the zip64 end record
            z64 = z.rfind(b"PK\x06\x06")
            n_entries, = struct.unpack_from("<Q", z, z64 + 32)
            cd_off, = struct.unpack_from("<Q", z, z64 + 48)
        out, p = {}, cd_off
        for _ in range(n_entries):
            if z[p:p + 4] != b"PK\x01\x02":
                raise RuntimeError("torch.save zip: bad central directory")
            crc, _, usize, nlen, xlen, clen = struct.unpack_from("<IIIHHH", z, p + 16)
            lho, = struct.unpack_from("<I", z, p + 42)
            name = z[p + 46:p + 46 + nlen].decode()
            if lho == 0xFFFFFFFF or usize == 0xFFFFFFFF:
                raise RuntimeError("torch.save zip: zip64 entries are not supported here")
            lnlen, lxlen = struct.unpack_from("<HH", z, lho + 26)
            data = lho + 30 + lnlen + lxlen
            flags, = struct.unpack_from("<H", z, lho + 6)
            if not flags & 8 or z[data + usize:data + usize + 4] != b"PK\x07\x08":
                raise RuntimeError("torch.save zip: expected a data descriptor")
            desc = data + usize + 4
            if struct.unpack_from("<I", z, desc)[0] != crc:
                raise RuntimeError("torch.save zip: descriptor CRC mismatch")
            out[name] = (data, usize, desc, p + 16, crc)
            p += 46 + nlen + xlen + clen
        return out

    def render(self, data: bytes) -> bytes:
        """The bytes ``torch.save`` writes for a tensor of this shape holding ``data``."""
        b = self.bytes
        off, n, desc, cen, _ = self.data
        if len(data) != n:
            raise ValueError(f"{len(data)} data bytes for a {n}-byte record")
        crc = zlib.crc32(data)
        b[off:off + n] = data
        pc = struct.pack("<I", crc)
        b[desc:desc + 4] = pc
        b[cen:cen + 4] = pc
        seed = _hash_combine(self.seed_before, crc)
        for c in self.after:
            seed = _hash_combine(seed, c)
        sid = self.sid_prefix + b"%020d" % seed
        soff, _, sdesc, scen, _ = self.sid
        b[soff:soff + 40] = sid
        ps = struct.pack("<I", zlib.crc32(sid))
        b[sdesc:sdesc + 4] = ps
        b[scen:scen + 4] = ps
        return bytes(b)


def torch_save_bytes(tensor) -> bytes:
    """What ``torch.save(tensor, stream)`` writes (the reference the templates are checked on)."""
    import torch

    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


# --------------------------------------------------------------------------- the checkpoint
def layout(ranks: int, tensors: int = 30, mesh: str = "fsdp"):
    """Per rank, the chunks it writes in file order: ``[(spec, offsets, sizes), ...]``.

    DCP's order within a file (``FileSystemWriter``, one thread): bytes entries first
    (``step``, rank 0), then the tensors in state-dict order.
    """
    sp = specs(ranks, tensors, mesh)
    per_rank: list[list] = [[] for _ in range(ranks)]
    for s in sp:
        if s.kind == "rep":
            per_rank[rep_rank(s, sp, ranks)].append((s, (0,), s.shape))
            continue
        for r in range(ranks):
            off, size = chunk_of(s, r, ranks, mesh)
            per_rank[r].append((s, off, size))
    return sp, per_rank


def make(out: str | os.PathLike, ranks: int, tensors: int = 30, mesh: str = "fsdp", *,
         check: bool = True, log=None, checkpoint_id: str | os.PathLike | None = None) -> dict:
    """Write the checkpoint into ``out`` (created; must not hold files). Returns stats.

    ``checkpoint_id``: the path recorded in ``storage_meta`` (default ``out``; the cache
    writes to a temporary folder and renames it).

    >>> make("/tmp/scale16", ranks=16)["chunks"]           # doctest: +SKIP
    561
    """
    import numpy as np
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out}: not empty")
    sp, per_rank = layout(ranks, tensors, mesh)
    arrays = {s.tid: _full_array(s) for s in sp}
    templates: dict[tuple, _Template] = {}
    checked: set[tuple] = set()
    step_buf = io.BytesIO()
    torch.save(STEP, step_buf)  # DefaultSavePlanner.resolve_data for a non-tensor value
    step_bytes = step_buf.getvalue()

    md = {}
    for s in sp:  # metadata keys in state-dict order, step last
        md[s.name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=getattr(torch, s.dtype)),
            size=torch.Size(s.shape), chunks=[])
    md["step"] = BytesStorageMetadata()
    storage: dict = {}
    nchunks = 0
    total = 0
    for r, items in enumerate(per_rank):
        key = f"__{r}_0.distcp"
        pieces = []
        pos = 0
        fqns: dict[str, str] = {}  # one str object per name per rank, as after gathering plans
        if r == 0:
            pieces.append(step_bytes)
            storage[MetadataIndex("step")] = _StorageInfo(key, 0, len(step_bytes))
            pos = len(step_bytes)
        for s, off, size in items:
            tk = (size, s.dtype)
            tpl = templates.get(tk)
            if tpl is None:
                tpl = templates[tk] = _Template(size, s.dtype)
            a = arrays[s.tid]
            if len(size) == 1:
                view = a[off[0]:off[0] + size[0]]
            else:
                view = a[off[0]:off[0] + size[0], off[1]:off[1] + size[1]]
            zipped = tpl.render(np.ascontiguousarray(view).tobytes())
            if check and tk not in checked:
                box = tuple(slice(o, o + n) for o, n in zip(off, size))
                ref = torch_save_bytes(expected(s)[box].clone(memory_format=torch.contiguous_format))
                if ref != zipped:
                    raise RuntimeError(f"template for {size} {s.dtype} differs from torch.save")
                checked.add(tk)
            pieces.append(zipped)
            fqn = fqns.setdefault(s.name, "".join(s.name))  # a distinct copy per rank
            chunks = md[s.name].chunks
            storage[MetadataIndex(fqn, off, len(chunks))] = _StorageInfo(key, pos, len(zipped))
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)))
            pos += len(zipped)
            nchunks += 1
        with open(out / key, "wb") as f:
            f.write(b"".join(pieces))
        total += pos
        if log and ranks >= 1000 and (r + 1) % (ranks // 10) == 0:
            log(f"  {r + 1}/{ranks} ranks written ({time.perf_counter() - t0:.1f} s)")
    t_files = time.perf_counter() - t0
    planner_data = {s.name: ("model", s.name[len("model."):]) for s in sp}
    planner_data["step"] = ("step",)
    save_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"ckptctl-scale:{mesh}:{ranks}:{tensors}:{VERSION}"))
    meta = Metadata(state_dict_metadata=md, planner_data=planner_data, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=Path(checkpoint_id or out),
                                             save_id=save_id),
                    version="1.0.0")
    tmp = out / ".metadata.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(meta, f)  # exactly FileSystemWriter.finish
    os.replace(tmp, out / ".metadata")
    md_size = (out / ".metadata").stat().st_size
    return {"path": str(out), "ranks": ranks, "tensors": len(sp), "mesh": mesh,
            "chunks": nchunks, "distcp_bytes": total, "metadata_bytes": md_size,
            "seconds": time.perf_counter() - t0, "seconds_files": t_files}


def cached(ranks: int, tensors: int = 30, mesh: str = "fsdp", *, name: str = "ckpt",
           log=None) -> Path:
    """The cached checkpoint for these parameters, generated on first use (flock-protected).

    ``name``: the folder inside the parameters' cache folder; a second name gives a second
    checkpoint with the same content beside the first (for ``diff`` and ``ls``).
    """
    d = CACHE / f"{mesh}-r{ranks}-t{tensors}-v{VERSION}"
    ckpt = d / name
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (ckpt / ".metadata").exists():
            return ckpt
        tmp = d / f"tmp.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        stats = make(tmp, ranks, tensors, mesh, log=log, checkpoint_id=ckpt)
        shutil.rmtree(ckpt, ignore_errors=True)
        os.replace(tmp, ckpt)
        (d / f"{name}.txt").write_text(_describe(stats) + "\n")
        return ckpt


def _describe(st: dict) -> str:
    return (f"{st['ranks']} ranks ({st['mesh']}), {st['tensors']} tensors, {st['chunks']} chunks, "
            f".metadata {st['metadata_bytes'] / 1e6:.1f} MB, .distcp {st['distcp_bytes'] / 1e6:.0f} MB "
            f"in {st['ranks']} files; {st['seconds']:.1f} s ({st['seconds_files']:.1f} s files)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, required=True, help="ranks of the simulated job")
    ap.add_argument("--tensors", type=int, default=30, help="sharded tensors (default 30)")
    ap.add_argument("--mesh", choices=("fsdp", "2d"), default="fsdp",
                    help=f"fsdp: Shard(0) over all ranks; 2d: dp x tp, tp={TP} (default fsdp)")
    ap.add_argument("--out", help="write here (must be empty or missing); default: the cache")
    ap.add_argument("--name", default="ckpt",
                    help="cache only: folder name in the parameters' cache folder (default ckpt)")
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="skip the torch.save cross-check of each shape's first chunk")
    a = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    if a.out:
        st = make(a.out, a.ranks, a.tensors, a.mesh, check=a.check, log=log)
        log(_describe(st))
        print(st["path"])
    else:
        p = cached(a.ranks, a.tensors, a.mesh, name=a.name, log=log)
        stats = p.parent / f"{p.name}.txt"
        log((stats.read_text().strip() if stats.exists() else "") +
            f" [cache: {time.perf_counter() - t0:.1f} s]")
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
