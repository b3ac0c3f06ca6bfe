"""Casts and DCP writes without torch (issue 35 item 10).

1. ``copier.Cast``: every floating pair, bit for bit against torch's ``.to(dtype)`` over
   random bit patterns and the special values (±0, ±inf, NaNs with payloads, subnormals,
   max finite, values that round to inf, ties), in place on a reused buffer too.
2. ``.metadata`` pickled without torch: the very bytes ``pickle.dumps`` gives for torch's
   own objects, and ``Pickle4`` the very bytes of ``pickle.dumps`` on plain data.
3. ``reshard`` / ``consolidate --dtype`` in a child process leave torch out of
   ``sys.modules``, and torch's own ``dcp.load`` reads what they wrote, bit for bit.
"""
from __future__ import annotations

import io
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl.formats.dcp_write import DcpWriter, _interned
from ckptctl.formats.torchwrite import Pickle4, Global, dumps4, ref_dumps
from ckptctl.convert.copier import CAST_STEP, CASTS, Cast, dtype_converter, object_payload, plain_value

BITS = {"float32": np.uint32, "float64": np.uint64, "float16": np.uint16, "bfloat16": np.uint16}
#: torch's NaN bits follow its vectorized loop on x86-64 (see copier's table); elsewhere
#: (or ATEN_CPU_CAPABILITY=default) only numbers are compared and a NaN must stay a NaN
VECTORIZED = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
PAD = 64  # elements after the values: torch casts them in its vectorized loop, not its tail

SPECIAL_F32 = [
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # ±0, ±inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA00000,  # NaNs
    0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,  # subnormals, min normal, max
    0x7F7F8000, 0x7F7F7FFF, 0x3F808000, 0x3F818000, 0x3F80C000,  # bf16: to inf, ties
    0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000,  # f16: max, just under/at inf
    0x33000000, 0x33000001, 0x387FC000, 0x38800000, 0x3F801000, 0x3F803000,  # f16 subnormal, ties
]
SPECIAL_F64 = [
    0, 1 << 63, 0x7FF0000000000000, 0xFFF0000000000000,
    0x7FF8000000000000, 0x7FF0000000000001, 0xFFF4000000000000, 0x7FF00000DEADBEEF,
    0xFFFFFFFFFFFFFFFF, 1, 0x000FFFFFFFFFFFFF, 0x7FEFFFFFFFFFFFFF, 0x47EFFFFFE0000000,
    0x47EFFFFFF0000000, 0x36A0000000000000, 0x3E70000000000000, 0x3FF0000010000000,
]


def torch_cast(bits: np.ndarray, src: str, dst: str) -> np.ndarray:
    """torch's ``.to(dst)`` of ``bits`` (viewed as ``src``), as raw ``dst`` bits."""
    raw = bits.astype(BITS[src]).tobytes() + bytes(PAD * np.dtype(BITS[src]).itemsize)
    t = torch.frombuffer(bytearray(raw), dtype=getattr(torch, src)).to(getattr(torch, dst))
    return t.view(torch.uint8).numpy().view(BITS[dst])[:len(bits)].copy()


def is_nan(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32) != (
            bits.astype(np.uint32) << 16).view(np.float32)
    x = bits.view({"float32": np.float32, "float64": np.float64, "float16": np.float16}[dtype])
    return np.isnan(x)


def assert_same_as_torch(bits: np.ndarray, src: str, dst: str) -> None:
    bits = bits.astype(BITS[src])
    got = np.frombuffer(bytes(Cast(src, dst)(bits.tobytes())), dtype=BITS[dst])
    want = torch_cast(bits, src, dst)
    if not VECTORIZED:
        nan = is_nan(want, dst)
        assert (is_nan(got, dst) == nan).all()
        got, want = got[~nan], want[~nan]
    bad = np.flatnonzero(got != want)
    assert not bad.size, [(hex(bits[i]), hex(want[i]), hex(got[i])) for i in bad[:5]]


# --------------------------------------------------------------------------- 1. casts

SIXTEEN = [p for p in CASTS if p[0] in ("float16", "bfloat16")]


@pytest.mark.parametrize("src,dst", SIXTEEN, ids=[f"{s}-{d}" for s, d in SIXTEEN])
def test_every_16_bit_value_casts_as_torch_does(src, dst):
    assert_same_as_torch(np.arange(1 << 16, dtype=np.uint16), src, dst)


def _bits(width: int, special: list[int]):
    return st.lists(st.one_of(st.integers(0, (1 << width) - 1), st.sampled_from(special)),
                    min_size=1, max_size=200)


F32_PAIRS = [p for p in CASTS if p[0] == "float32"]
F64_PAIRS = [p for p in CASTS if p[0] == "float64"]


@pytest.mark.parametrize("src,dst", F32_PAIRS, ids=[f"{s}-{d}" for s, d in F32_PAIRS])
@settings(max_examples=150)
@given(values=_bits(32, SPECIAL_F32))
def test_float32_casts_as_torch_does(src, dst, values):
    assert_same_as_torch(np.array(values, dtype=np.uint64), src, dst)


@pytest.mark.parametrize("src,dst", F64_PAIRS, ids=[f"{s}-{d}" for s, d in F64_PAIRS])
@settings(max_examples=150)
@given(values=_bits(64, SPECIAL_F64))
def test_float64_casts_as_torch_does(src, dst, values):
    assert_same_as_torch(np.array(values, dtype=np.uint64), src, dst)


@pytest.mark.parametrize("src,dst", CASTS, ids=[f"{s}-{d}" for s, d in CASTS])
def test_random_bits_and_near_specials_cast_as_torch_does(src, dst):
    rng = np.random.default_rng(35)
    width = np.dtype(BITS[src]).itemsize * 8
    special = {32: SPECIAL_F32, 64: SPECIAL_F64}.get(width, [0, 0x7C00, 0x7E01, 0xFC01, 0x7F81])
    mask = (1 << width) - 1
    near = np.array([(v + d) & mask for v in special for d in range(-3, 4)], dtype=np.uint64)
    wide = rng.integers(0, 1 << min(width, 63), size=100_000, dtype=np.uint64)
    if width == 64:
        wide |= rng.integers(0, 2, size=wide.size, dtype=np.uint64) << np.uint64(63)
    assert_same_as_torch(np.concatenate([near, wide & np.uint64(mask)]), src, dst)


@pytest.mark.parametrize("dst,tie_bits", [("bfloat16", 16), ("float16", 13)])
def test_float64_rounds_twice_through_float32_as_torch_does(dst, tie_bits):
    """A float64 just off a tie of the target rounds onto the tie in float32 first, then to
    even: torch's result, not a single rounding's (numpy's own float64 -> float16)."""
    rng = np.random.default_rng(7)
    tops = rng.integers(0, 1 << 8, size=4000).astype(np.uint32)
    f32 = (np.uint32(0x3F800000) + (tops << np.uint32(tie_bits))) | np.uint32(1 << (tie_bits - 1))
    f64 = f32.view(np.float32).astype(np.float64).view(np.uint64)
    values = np.concatenate([f64, f64 + np.uint64(1), f64 - np.uint64(1)])
    once = values.view(np.float64).astype(np.float16).view(np.uint16)
    if dst == "float16":  # the case is real: one rounding gives other bits
        assert (once != values.view(np.float64).astype(np.float32).astype(np.float16)
                .view(np.uint16)).any()
    assert_same_as_torch(values, "float64", dst)


@pytest.mark.parametrize("src,dst", CASTS, ids=[f"{s}-{d}" for s, d in CASTS])
def test_cast_in_place_over_several_steps(src, dst):
    """The block at the end of a reused buffer, the result written from its start (what
    chunk_blocks does), over more elements than one cast step: the same bytes."""
    rng = np.random.default_rng(1)
    n = 2 * CAST_STEP + 123
    bits = rng.integers(0, 1 << 62, size=n, dtype=np.uint64).astype(BITS[src])
    cast = Cast(src, dst)
    fresh = bytes(cast(bits.tobytes()))
    need = bits.nbytes
    cap = max(need, cast.out_size(need))
    buf = np.full(cap, 0xAB, dtype=np.uint8)
    buf[cap - need:] = bits.view(np.uint8)
    got = cast(memoryview(buf[cap - need:]), buf)
    assert got.nbytes == cast.out_size(need)
    assert bytes(got) == fresh
    assert_same_as_torch(bits, src, dst)


def test_pairs_without_a_numpy_cast_keep_torch():
    conv = dtype_converter("float32", "float8_e4m3fn")
    x = np.array([0.5, -3.0, 448.0, 1e-3], dtype=np.float32)
    want = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy().tobytes()
    assert bytes(conv(x.tobytes())) == want
    assert conv.out_size(16) == 4
    out = np.zeros(16, dtype=np.uint8)
    assert bytes(conv(x.tobytes(), out)) == want


def test_no_conversion_is_none_and_empty_blocks_stay_empty():
    assert dtype_converter("bfloat16", "bfloat16") is None
    assert bytes(dtype_converter("float32", "bfloat16")(b"")) == b""


# --------------------------------------------------------------------------- 2. .metadata


def torch_metadata_bytes(w: DcpWriter, planner_data: dict) -> bytes:
    """What ``DcpWriter.commit`` wrote before issue 35: torch's own objects, pickled."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata,
                                                       ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    fqn_ = sys.intern
    sdm: dict = {}
    for fqn, (dtype, shape, chunks) in sorted(w.meta.tensors.items()):
        sdm[fqn_(fqn)] = TensorStorageMetadata(
            properties=TensorProperties(dtype=getattr(torch, dtype)), size=torch.Size(shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                    for o, s in sorted(chunks)])
    for fqn in sorted(w.meta.objects):
        sdm[fqn_(fqn)] = BytesStorageMetadata()
    storage = {}
    for (fqn, offsets), (rel, off, length) in sorted(
            w.meta.storage.items(), key=lambda kv: (kv[0][0], kv[0][1] is not None,
                                                    kv[0][1] or ())):
        idx = MetadataIndex(fqn_(fqn), torch.Size(offsets) if offsets is not None else None)
        storage[idx] = _StorageInfo(fqn_(rel), off, length)
    md = Metadata(state_dict_metadata=sdm, planner_data=_interned(planner_data),
                  storage_data=storage,
                  storage_meta=StorageMeta(checkpoint_id=None, save_id=w._save_id()),
                  version="1.0.0")
    return pickle.dumps(md, protocol=4)  # Python's default before 3.14 (5 there: same opcodes)


class _Sink:
    def write_atomic(self, rel, data):
        self.data = data


TORCH_DTYPES = ["float32", "bfloat16", "float16", "float64", "int64", "int32", "uint8", "bool",
                "int8", "complex64", "float8_e4m3fn", "float8_e5m2", "uint16"]


def writer_with(tensors: list[tuple[str, str, tuple, list]], objects: list[str]) -> DcpWriter:
    """A DcpWriter that has "written" ``tensors`` (name, dtype, shape, [(offsets, sizes)])
    and ``objects`` (names), as write_rank records them."""
    w = DcpWriter(store=None, sink=_Sink())
    pos = 0
    for name, dtype, shape, chunks in tensors:
        for r, (offsets, sizes) in enumerate(chunks):
            w.meta.tensors.setdefault(name, (dtype, tuple(shape), []))[2].append(
                (tuple(offsets), tuple(sizes)))
            w.meta.storage[(name, tuple(offsets))] = (f"__{r % 3}_0.distcp", pos, 1500 + r)
            pos += 1500 + r
    for name in objects:
        w.meta.objects.add(name)
        w.meta.storage[(name, None)] = ("__0_0.distcp", pos, 900)
        pos += 900
    w.hashes.update({f"__{r}_0.distcp": (f"{r:032x}", r) for r in range(3)})
    return w


def assert_metadata_as_torch_pickles(w: DcpWriter, planner_data: dict) -> bytes:
    got = w.commit(planner_data)
    assert got == torch_metadata_bytes(w, planner_data)
    return got


def _paths(names) -> dict:
    return {n: tuple(n.split(".")) for n in names}


def test_metadata_is_torchs_own_pickle_for_a_large_layout():
    """Frames (64 KiB), memo references past 255, batches of 1000 items, big offsets."""
    tensors = [(f"model.layers.{i}.attn.wq.weight", TORCH_DTYPES[i % len(TORCH_DTYPES)],
                (24, 8 + i % 5), [((r * 3, 0), (3, 8 + i % 5)) for r in range(8)])
               for i in range(700)]
    tensors.append(("model.huge", "float32", (3_000_000_000, 2), [((0, 0), (3_000_000_000, 2))]))
    tensors.append(("model.scalar", "float32", (), [((), ())]))
    tensors.append(("model.4d", "bfloat16", (2, 3, 4, 5), [((0, 0, 0, 0), (1, 3, 4, 5)),
                                                          ((1, 0, 0, 0), (1, 3, 4, 5))]))
    objects = [f"optim.param_groups.{j}.lr" for j in range(1200)] + ["step"]
    data = assert_metadata_as_torch_pickles(writer_with(tensors, objects),
                                            _paths([t[0] for t in tensors] + objects))
    assert len(data) > 10 * 65536


def test_metadata_names_that_match_its_own_field_names():
    """Names equal to strings the pickle holds anyway: attribute names (``offset``,
    ``fqn``), module and class names (torch.Size's "torch" is the interned string, a
    dtype's is not: as measured with torch 2.13 on CPython 3.11); not ASCII; longer than
    255 bytes."""
    names = ["offset", "fqn", "version", "sizes", "relative_path", "torch", "Size", "float32",
             "torch.distributed.checkpoint.metadata", "torch.serialization", "_get_layout",
             "_StorageInfo", "TensorProperties", "modèle.poids", "x" * 300, "model.é" * 60]
    # a name from the checkpoint, not this module's "1.0.0" constant (the reference's)
    objects = ["length", "index", ".".join("100")]
    tensors = [(n, "float32", (4,), [((0,), (2,)), ((2,), (2,))]) for n in names]
    assert_metadata_as_torch_pickles(writer_with(tensors, objects), _paths(names + objects))


_name = st.text(st.sampled_from("ab.0é_"), min_size=1, max_size=12)


@settings(max_examples=40)
@given(layout=st.lists(st.tuples(_name, st.sampled_from(TORCH_DTYPES),
                                 st.lists(st.integers(0, 1 << 33), min_size=0, max_size=4),
                                 st.integers(1, 40)),
                       max_size=30, unique_by=lambda t: t[0]),
       objects=st.lists(_name, max_size=10, unique=True))
def test_metadata_is_torchs_own_pickle(layout, objects):
    tensors = []
    for name, dtype, shape, nchunks in layout:
        chunks = [(tuple([k] + [0] * (len(shape) - 1)), tuple(shape)) for k in range(nchunks)] \
            if shape else [((), ())]
        tensors.append((name, dtype, tuple(shape), chunks))
    objects = [o for o in objects if o not in {t[0] for t in tensors}]
    assert_metadata_as_torch_pickles(writer_with(tensors, objects),
                                     _paths([t[0] for t in tensors] + objects))


_plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 80), 1 << 80) | st.text(max_size=300)
    | st.floats(allow_nan=False),
    lambda kids: st.lists(kids, max_size=5) | st.tuples(kids, kids)
    | st.dictionaries(st.text(max_size=5), kids, max_size=5) | st.lists(kids, max_size=5)
    .map(tuple),
    max_leaves=60)


@settings(max_examples=200)
@given(value=_plain)
def test_pickle4_writes_what_pickle_dumps_writes(value):
    shared = [value, value, {"again": value}]  # shared objects: memo references
    assert Pickle4().dump(shared) == pickle.dumps(shared, protocol=4)


def test_pickle4_long_and_large_values_and_the_fallback():
    big = ["k" * 70_000, 1 << 3000, list(range(2500)), {str(i): i for i in range(1500)}]
    assert dumps4(big) == pickle.dumps(big, protocol=4)
    od = Global("collections", "OrderedDict")
    import collections
    assert dumps4([od, od]) == pickle.dumps([collections.OrderedDict] * 2, protocol=4)
    assert ref_dumps([od], 4) == pickle.dumps([collections.OrderedDict], protocol=4)


@settings(max_examples=150)
@given(value=_plain)
def test_plain_values_pickle_as_torch_save_does(value):
    import zipfile

    from ckptctl.formats.torchwrite import pickle_state

    buf = io.BytesIO()
    torch.save(value, buf)
    with zipfile.ZipFile(buf) as z:
        data_pkl = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    assert plain_value(value)
    assert pickle_state(value) == data_pkl


def test_plain_object_payloads_load_in_torch_as_they_were():
    from types import SimpleNamespace

    for v in [0.1, 3, (0.9, 0.95), ["emb.weight"], None, True, {"a": [1.5, "x"]}, 1 << 70]:
        assert plain_value(v)
        o = SimpleNamespace(extent=None, value=v)
        ck = SimpleNamespace(objects={"x": o})
        blob = object_payload(ck, "x")
        assert torch.load(io.BytesIO(blob), weights_only=True) == v
    assert not plain_value(b"bytes") and not plain_value(torch.zeros(1))


# --------------------------------------------------------------------------- 3. end to end

CHILD = """
import sys
from ckptctl.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert not e.code, f"exit {e.code}"
assert "torch" not in sys.modules, "torch was imported"
"""


def run_without_torch(*args: str) -> None:
    """Run ``ckptctl ARGS`` in a child process and fail if it imported torch."""
    r = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def dcp_load_all(path: Path) -> dict:
    """Everything in a DCP checkpoint, loaded by torch's own reader (no process group)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    FileSystemReader(str(path)).read_metadata()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _load_state_dict_from_keys(checkpoint_id=str(path))


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_reshard_writes_dcp_without_torch(tmp_path, cli):
    from conftest import write_tiny_dcp

    sd = write_tiny_dcp(tmp_path / "src")
    out = tmp_path / "out"
    run_without_torch("reshard", str(tmp_path / "src"), str(out), "--world-size", "2")
    got = dcp_load_all(out)
    for name, t in sd["model"].items():
        assert_bits_equal(got["model"][name], t)
    assert got["optim"] == sd["optim"] and got["step"] == 42
    from ckptctl.formats.detect import open_checkpoint

    ck = open_checkpoint(str(out))
    assert {n: t.shape for n, t in ck.tensors.items()} == \
        {f"model.{n}": tuple(t.shape) for n, t in sd["model"].items()}
    code, so, err = cli("verify", str(out), "--level", "full")
    assert code == 0, so + err


def test_reshard_of_a_deepspeed_checkpoint_without_torch(deepspeed_ckpts, tmp_path, cli):
    from test_deepspeed import _dcp_load, _same

    v = deepspeed_ckpts.variant("z2-fp32", 2)
    out = tmp_path / "dcp"
    run_without_torch("reshard", str(v.tag_dir), str(out), "--world-size", "3")
    full = v.load_full()
    sd = _dcp_load(out, v, full)
    for n in v.entry["trainable"]:
        assert _same(sd["model"][n], full[f"param.{n}"]), n
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert _same(sd["optim"]["state"][n][k], full[f"{k}.{n}"]), (n, k)
    assert (sd["step"], sd["client_state"]) == (3, {"epoch": 1, "note": "x"})
    code, so, err = cli("verify", str(out), "--level", "full")
    assert code == 0, so + err


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_consolidate_dtype_to_dcp_without_torch(tmp_path, dtype):
    from conftest import dcp_save

    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 70, generator=g)
    w[0, :6] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40, 3.4e38, 65519.0])
    sd = {"model": {"w": w, "b": torch.randn(7, generator=g).double(),
                    "h": torch.randn(5, generator=g).half(), "i": torch.arange(4)}}
    dcp_save(tmp_path / "src", sd)
    out = tmp_path / "out"
    run_without_torch("consolidate", str(tmp_path / "src"), str(out), "--to", "dcp",
                      "--dtype", dtype)
    got = dcp_load_all(out)["model"]
    to = {"bf16": "bfloat16", "fp16": "float16"}[dtype]
    for name, t in sd["model"].items():
        src = str(t.dtype).removeprefix("torch.")
        want = t
        if t.is_floating_point() and src != to:  # torch's own .to, bit for bit
            raw = t.contiguous().view(-1).view(torch.uint8).numpy().view(BITS[src])
            want = torch.from_numpy(torch_cast(raw, src, to).view(np.int16)) \
                .view(getattr(torch, to)).reshape(t.shape)
        assert_bits_equal(got[name], want)
