"""The pack codec (issue 10, ``ckptctl/formats/packcodec.py``): lossless round trips over
dtypes, shapes and bases (hypothesis), the payload's bytes (golden), and hostile payloads
(truncated, bit-flipped, decompression bombs, wrong itemsize or size) refused with one
FormatError, quickly and within bounded memory."""
from __future__ import annotations

import struct
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptctl.errors import FormatError
from ckptctl.formats import packcodec as pc

torch = pytest.importorskip("torch")

DTYPES = {  # name -> (torch dtype, itemsize)
    "float32": (torch.float32, 4), "bfloat16": (torch.bfloat16, 2),
    "float16": (torch.float16, 2), "float8_e4m3fn": (torch.float8_e4m3fn, 1),
    "float64": (torch.float64, 8), "int8": (torch.int8, 1), "int32": (torch.int32, 4),
    "int64": (torch.int64, 8), "uint8": (torch.uint8, 1),
}
KINDS = ("randn", "bits", "zeros", "const", "sparse", "smallint")


def sample(dtype: str, n: int, seed: int, kind: str) -> bytes:
    """``n`` elements of ``dtype`` as raw little-endian bytes, written by torch."""
    tdt, k = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    if kind == "bits":  # any bit pattern: NaNs, infinities, subnormals
        return torch.randint(0, 256, (n * k,), generator=g, dtype=torch.uint8).numpy().tobytes()
    if kind == "randn" and tdt.is_floating_point:
        t = (torch.randn(n, generator=g, dtype=torch.float32) * 0.02).to(tdt)
    elif kind in ("randn", "smallint"):  # integers, or small whole floats
        t = torch.randint(0 if tdt == torch.uint8 else -100, 100, (n,), generator=g).to(tdt)
    elif kind == "zeros":
        t = torch.zeros(n, dtype=tdt)
    elif kind == "const":
        t = torch.full((n,), 3, dtype=torch.float32).to(tdt)
    else:  # sparse: mostly zeros
        t = torch.zeros(n, dtype=torch.float32)
        idx = torch.randint(0, max(n, 1), (max(n // 50, 1),), generator=g)
        if n:
            t[idx] = torch.randn(len(idx), generator=g)
        t = t.to(tdt)
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def roundtrip(data: bytes, itemsize: int, base=None, level: int = 3) -> tuple[str, bytes]:
    mode, payload = pc.encode(data, itemsize=itemsize, base=base, level=level)
    assert mode in pc.MODES
    out = pc.decode(mode, payload, itemsize=itemsize, size=len(data), base=base, where="t",
                    expect=pc.check(data))
    assert type(out) is bytes and out == data
    return mode, payload


# ---------------------------------------------------------------- round trips

@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(sorted(DTYPES)),
       shape=st.lists(st.integers(0, 24), max_size=3).map(tuple)
       | st.tuples(st.integers(0, 3000) | st.sampled_from([1, 7])),
       seed=st.integers(0, 2**16), kind=st.sampled_from(KINDS),
       level=st.sampled_from([-1, 1, 3, 4, 9]))
def test_roundtrip_without_base(dtype, shape, seed, kind, level):
    """Any dtype, shape and content; the tensor is handed over as a shaped numpy array of
    words (what a reader holds) and comes back as the same flat bytes."""
    k = DTYPES[dtype][1]
    data = sample(dtype, int(np.prod(shape)), seed, kind)
    tensor = np.frombuffer(data, f"<u{k}").reshape(shape)
    mode, payload = pc.encode(tensor, itemsize=k, level=level)
    assert (mode, payload) == roundtrip(data, k, level=level)
    assert mode == ("zstd" if DTYPES[dtype][1] == 1 else "planes")
    if mode == "planes":
        assert payload[4] == (pc.ROTL1 if level >= pc.ROTATE_LEVEL else pc.NONE)
    assert len(payload) <= len(data) + 5 + 5 * DTYPES[dtype][1]  # never much worse than raw


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(sorted(DTYPES)), n=st.integers(0, 3000),
       seed=st.integers(0, 2**16), kind=st.sampled_from(KINDS),
       base_kind=st.sampled_from(["random", "equal", "few", "prefix"]))
def test_roundtrip_with_base(dtype, n, seed, kind, base_kind):
    k = DTYPES[dtype][1]
    data = sample(dtype, n, seed, kind)
    if base_kind == "random":
        base = sample(dtype, n, seed + 1, "bits")
    elif base_kind == "equal":
        base = bytes(data)
    else:  # the base differs from data in a few elements, or in its first half
        b = bytearray(data)
        rng = np.random.default_rng(seed)
        where = rng.integers(0, max(n, 1), 3) if base_kind == "few" else range(n // 2)
        for i in (where if n else []):
            b[i * k] ^= 0x5A
        base = bytes(b)
    mode, payload = roundtrip(data, k, base)
    if base == data:
        assert (mode, payload) == ("same", b"")
    else:
        alone_mode, alone = pc.encode(data, itemsize=k)
        assert mode in ("xor", alone_mode)
        # a base never costs much: the XOR is kept only when it saves 20% or beats the chunk alone
        assert len(payload) <= max(len(alone), pc.XOR_TRY_ALONE * len(data) + 5 + 5 * k)
        if base_kind == "few" and n >= 1000:  # a few changed elements cost a few bytes
            assert len(payload) < len(data) / 10


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_input_types_and_odd_sizes(itemsize):
    """bytes, bytearray, memoryview and numpy arrays of any dtype are accepted; chunk sizes
    need not be a multiple of anything but the itemsize."""
    raw = sample({1: "int8", 2: "bfloat16", 4: "float32", 8: "float64"}[itemsize], 12345, 1,
                 "randn")
    arr = np.frombuffer(raw, np.uint8).view(f"<u{itemsize}")
    for obj in (raw, bytearray(raw), memoryview(raw), arr, arr.reshape(-1, 5) if
                arr.size % 5 == 0 else arr):
        mode, payload = pc.encode(obj, itemsize=itemsize)
        assert pc.decode(mode, payload, itemsize=itemsize, size=len(raw), where="t") == raw
    mode, payload = pc.encode(memoryview(raw), itemsize=itemsize, base=bytearray(len(raw)))
    assert pc.decode(mode, memoryview(payload), itemsize=itemsize, size=len(raw),
                     base=memoryview(bytes(len(raw))), where="t") == raw


def test_large_byte_chunks():
    """itemsize 1 over 64 KiB: fp8 tensors and torch.save bytes (a pickle) each take the zstd
    setting their samples favour; all round-trip, none larger than zstd -3 gives (+2%)."""
    import io

    buf = io.BytesIO()
    torch.save({"ids": list(range(20000)), "names": [f"layer.{i}" for i in range(5000)]}, buf)
    chunks = [sample("float8_e4m3fn", 1 << 20, 0, "randn"), buf.getvalue(),
              sample("int8", 1 << 17, 0, "bits"), b"model.layers.0.weight" * 10000]
    for data in chunks:
        mode, payload = roundtrip(data, 1)
        zstd3 = zstandard.ZstdCompressor(level=3).compress(data)
        assert mode == "zstd" and len(payload) <= max(1.02 * len(zstd3), len(data)) + 10


def test_full_chunk_of_bf16_beats_plain_zstd():
    """A whole CHUNK_SIZE chunk of bf16 randn (plus an odd tail chunk): planes compress
    the exponent bytes apart; plain zstd -3 does not (FACTS.md: 1.29x vs 1.46x)."""
    data = sample("bfloat16", pc.CHUNK_SIZE // 2, 0, "randn")
    mode, payload = roundtrip(data, 2)
    zstd3 = len(zstandard.ZstdCompressor(level=3).compress(data))
    assert mode == "planes"
    assert (payload[5], payload[10]) == (pc.RAW, pc.ZSTD)  # mantissa bytes raw, exponents zstd
    assert len(data) / len(payload) > 1.45
    assert zstd3 / len(payload) > 1.1
    _, rotated = roundtrip(data, 2, level=pc.ROTATE_LEVEL)
    assert len(rotated) < len(payload)
    roundtrip(data[:pc.CHUNK_SIZE // 3 * 2 + 2], 2)


def test_sampling_keeps_planes_that_compress_in_part():
    """Planes are sampled before zstd runs on them: a mantissa plane that is noise but for
    its last quarter (zeros) is still compressed."""
    t = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    t[3 << 18:] = 0
    data = t.view(torch.uint8).numpy().tobytes()
    mode, payload = roundtrip(data, 2)
    assert mode == "planes" and (payload[5], payload[10]) == (pc.ZSTD, pc.ZSTD)
    assert struct.unpack_from("<I", payload, 6)[0] < 0.8 * (1 << 20)


def test_equal_base_is_same_and_delta_is_small():
    w0 = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)) * 0.02
    base = w0.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    w1 = w0.clone()
    w1[:1000] += 1e-2 * w1[:1000].abs()  # a fine-tune touching a few rows
    data = w1.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    assert pc.encode(base, itemsize=2, base=base) == ("same", b"")
    mode, payload = roundtrip(data, 2, base)
    _, alone = pc.encode(data, itemsize=2)
    assert mode == "xor" and len(payload) * 20 < len(alone)


def test_base_that_does_not_help_is_dropped():
    """A chunk that moved everywhere (like Adam's exp_avg between steps, here an unrelated
    base): stored alone (mode ``planes``), which decodes without the base."""
    data = sample("float32", 50000, 0, "randn")
    base = sample("float32", 50000, 1, "randn")
    mode, payload = pc.encode(data, itemsize=4, base=base)
    assert mode == "planes" and payload == pc.encode(data, itemsize=4)[1]
    assert pc.decode(mode, payload, itemsize=4, size=len(data), where="t") == data


def test_threads_share_nothing():
    """Many threads encoding and decoding at once give the same bytes as one thread."""
    chunks = [sample(d, 20000, s, "randn") for s in range(6) for d in ("bfloat16", "float32")]
    ks = [2, 4] * 6
    want = [pc.encode(c, itemsize=k) for c, k in zip(chunks, ks)]

    def job(i):
        mode, payload = pc.encode(chunks[i], itemsize=ks[i])
        out = pc.decode(mode, payload, itemsize=ks[i], size=len(chunks[i]), where=str(i))
        return (mode, payload), out

    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(job, list(range(len(chunks))) * 3))
    for i, (enc, out) in enumerate(got):
        assert enc == want[i % len(chunks)] and out == chunks[i % len(chunks)]


def test_encode_refuses_bad_arguments():
    with pytest.raises(ValueError, match="itemsize"):
        pc.encode(b"abc", itemsize=3)
    with pytest.raises(ValueError, match="whole number"):
        pc.encode(b"abc", itemsize=2)
    with pytest.raises(ValueError, match="base has 2 bytes"):
        pc.encode(b"abcd", itemsize=2, base=b"ab")
    with pytest.raises(ValueError, match="contiguous"):
        pc.encode(np.zeros((4, 4), np.float32)[:, 1], itemsize=4)


def test_check_is_xxh3_64():
    import xxhash

    data = b"\x00\x01" * 1000
    assert pc.check(data) == xxhash.xxh3_64_hexdigest(data) and len(pc.check(data)) == 16


# ---------------------------------------------------------------- golden bytes

def test_golden_planes_payload():
    """fp32 [0, 1, -2, 3] split into 4 raw planes (4 bytes do not compress); from level 4 on,
    rotated left one bit first (sign to bit 0). Written out by hand from the format in the
    module docstring."""
    data = np.array([0.0, 1.0, -2.0, 3.0], "<f4").tobytes()
    # words 0, 0x3f800000, 0xc0000000, 0x40400000
    want = (b"CZ\x01\x04\x00"
            + b"\x00\x04\x00\x00\x00" * 4
            + bytes([0, 0, 0, 0]) + bytes([0, 0, 0, 0]) + bytes([0, 0x80, 0, 0x40])
            + bytes([0, 0x3F, 0xC0, 0x40]))
    assert pc.encode(data, itemsize=4) == ("planes", want)
    assert pc.decode("planes", want, itemsize=4, size=16, where="g") == data
    # rotl1: 0, 0x7f000000, 0x80000001, 0x80800000
    want = (b"CZ\x01\x04\x01"
            + b"\x00\x04\x00\x00\x00" * 4
            + bytes([0, 0, 1, 0]) + bytes([0, 0, 0, 0]) + bytes([0, 0, 0, 0x80])
            + bytes([0, 0x7F, 0x80, 0x80]))
    assert pc.encode(data, itemsize=4, level=pc.ROTATE_LEVEL) == ("planes", want)
    assert pc.decode("planes", want, itemsize=4, size=16, where="g") == data


def test_golden_xor_and_zstd_payloads():
    data = np.array([1, 2, 3], "<u2").tobytes()
    base = np.array([1, 0x102, 3], "<u2").tobytes()
    want = (b"CZ\x01\x02\x00" + b"\x00\x03\x00\x00\x00" * 2
            + bytes([0, 0, 0]) + bytes([0, 1, 0]))  # no rotation with a base
    assert pc.encode(data, itemsize=2, base=base) == ("xor", want)
    assert pc.decode("xor", want, itemsize=2, size=6, base=base, where="g") == data
    mode, payload = pc.encode(b"a" * 1000, itemsize=1)
    assert mode == "zstd" and payload[:6] == b"CZ\x01\x01\x00\x01"  # one plane, zstd
    assert struct.unpack_from("<I", payload, 6)[0] == len(payload) - 10
    assert zstandard.frame_content_size(payload[10:]) == 1000
    mode, payload = pc.encode(b"", itemsize=4)
    assert (mode, payload) == ("planes", b"CZ\x01\x04\x00" + b"\x00\x00\x00\x00\x00" * 4)


# ---------------------------------------------------------------- hostile payloads

def _refused(fn, match=None):
    """``fn()`` raises FormatError with a one-line message, fast, in bounded memory."""
    tracemalloc.start()
    t = time.perf_counter()
    try:
        with pytest.raises(FormatError, match=match) as e:
            fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t < 5  # generous: these take milliseconds
    assert "\n" not in str(e.value) and str(e.value).startswith("h: ")
    return peak


def _payload(mode, k, planes, transform=None):
    """Hand-assembled payload: planes are (method, bytes)."""
    t = pc.ROTL1 if transform is None and mode == "planes" else (transform or 0)
    head = b"CZ" + bytes([1, k, t])
    return head + b"".join(struct.pack("<BI", m, len(b)) for m, b in planes) + \
        b"".join(b for _, b in planes)


def test_truncated_payload_refused_at_every_length():
    data = sample("bfloat16", 4000, 3, "randn")
    mode, payload = pc.encode(data, itemsize=2)
    for cut in range(0, len(payload), 7):
        with pytest.raises(FormatError):
            pc.decode(mode, payload[:cut], itemsize=2, size=len(data), where="h")
    _refused(lambda: pc.decode(mode, payload + b"x", itemsize=2, size=len(data), where="h"),
             "1 byte longer")


def test_bit_flips_raise_format_error_or_fail_the_check():
    """Every single-bit flip in the header, and many in the body: a FormatError, never
    another exception, never more or fewer bytes than asked for; a flip the format cannot
    see (inside a raw plane) is caught by ``expect``."""
    data = sample("float32", 3000, 4, "randn")
    mode, payload = pc.encode(data, itemsize=4)
    want = pc.check(data)
    hs = 5 + 5 * 4
    bits = list(range(hs * 8)) + list(range(hs * 8, len(payload) * 8, 37))
    for bit in bits:
        bad = bytearray(payload)
        bad[bit // 8] ^= 1 << (bit % 8)
        try:
            out = pc.decode(mode, bytes(bad), itemsize=4, size=len(data), where="h")
        except FormatError as e:
            assert "\n" not in str(e)
            continue
        assert len(out) == len(data)
        if out != data:
            with pytest.raises(FormatError, match="fail their check"):
                pc.decode(mode, bytes(bad), itemsize=4, size=len(data), where="h", expect=want)


def test_bomb_declaring_its_real_size_is_refused_before_decompressing():
    """A 256 MiB plane of zeros (a few KiB compressed) in a chunk that says 8 KiB: refused
    from the frame header alone."""
    n = 4096
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(256 << 20))
    assert len(bomb) < 64 << 10
    payload = _payload("planes", 2, [(pc.ZSTD, bomb), (pc.RAW, bytes(n))])
    peak = _refused(lambda: pc.decode("planes", payload, itemsize=2, size=2 * n, where="h"),
                    "plane 0 declares 268435456 bytes, not 4096")
    assert peak < 1 << 20


def test_bomb_lying_about_its_size_is_refused_within_the_size():
    """The same frame with its header patched to claim 4 KiB: zstd stops at the 4 KiB
    buffer instead of expanding 256 MiB."""
    n = 4096
    bomb = bytearray(zstandard.ZstdCompressor(level=1).compress(bytes(256 << 20)))
    params = zstandard.get_frame_parameters(bytes(bomb))
    assert params.content_size == 256 << 20
    fhd = bomb[4]
    assert fhd >> 6 == 2  # 4-byte content size field, right after the window descriptor
    at = 5 + (0 if fhd & 0x20 else 1)
    bomb[at:at + 4] = struct.pack("<I", n)
    assert zstandard.frame_content_size(bytes(bomb)) == n
    payload = _payload("zstd", 1, [(pc.ZSTD, bytes(bomb))])
    peak = _refused(lambda: pc.decode("zstd", payload, itemsize=1, size=n, where="h"),
                    "plane 0 does not decompress")
    assert peak < 1 << 20


def test_frame_without_size_or_not_zstd_is_refused():
    n = 1000
    cctx = zstandard.ZstdCompressor(write_content_size=False)
    co = cctx.compressobj()
    nosize = co.compress(bytes(n)) + co.flush()
    _refused(lambda: pc.decode("zstd", _payload("zstd", 1, [(pc.ZSTD, nosize)]), itemsize=1,
                               size=n, where="h"), "declares no size")
    _refused(lambda: pc.decode("zstd", _payload("zstd", 1, [(pc.ZSTD, b"garbage!")]),
                               itemsize=1, size=n, where="h"), "not a zstd frame")
    two = zstandard.ZstdCompressor().compress(bytes(n))
    _refused(lambda: pc.decode("zstd", _payload("zstd", 1, [(pc.ZSTD, two + two)]),
                               itemsize=1, size=n, where="h"), "does not decompress")


@pytest.mark.parametrize("case,match", [
    ("wrong itemsize", "payload has 4 planes; a 'planes' chunk of 2-byte elements has 2"),
    ("wrong size", "raw plane 0 has 100 bytes, not 101|declares"),
    ("size not whole", "size 401 is not a whole number of 4-byte elements"),
    ("bad magic", "magic"),
    ("bad version", "codec version 9"),
    ("bad method", "plane 1 has unknown method 7"),
    ("bad transform", "transform 5"),
    ("rotation in xor", "transform 1, not valid in a 'xor' chunk"),
    ("unknown mode", "unknown chunk mode 'lz4'"),
    ("xor without base", "a 'xor' chunk needs its base"),
    ("base wrong length", "base has 3 bytes, the chunk 400"),
    ("same with payload", "a 'same' chunk carries 3 payload bytes"),
    ("bad itemsize", "itemsize 3 is not one of"),
    ("absurd size", "chunk claims 1099511627776 bytes, more than the codec's 1073741824"),
    ("short header", "payload of 20 bytes is shorter than its 25-byte header"),
    ("plane longer than payload", "raw plane 0 has 101 bytes, not 100"),
])
def test_malformed_payloads(case, match):
    data = sample("float32", 100, 0, "bits")
    _, payload = pc.encode(data, itemsize=4)
    kw = {"itemsize": 4, "size": 400, "where": "h"}
    mode = "planes"
    if case == "wrong itemsize":
        kw["itemsize"] = 2
    elif case == "wrong size":
        kw["size"] = 404
    elif case == "size not whole":
        kw["size"] = 401
    elif case == "bad magic":
        payload = b"XX" + payload[2:]
    elif case == "bad version":
        payload = payload[:2] + b"\x09" + payload[3:]
    elif case == "bad method":
        payload = payload[:10] + b"\x07" + payload[11:]
    elif case == "bad transform":
        payload = payload[:4] + b"\x05" + payload[5:]
    elif case == "rotation in xor":
        _, payload = pc.encode(data, itemsize=4, level=pc.ROTATE_LEVEL)
        mode, kw["base"] = "xor", bytes(400)
    elif case == "unknown mode":
        mode = "lz4"
    elif case == "xor without base":
        mode = "xor"
    elif case == "base wrong length":
        mode, kw["base"] = "xor", b"abc"
    elif case == "same with payload":
        mode, payload, kw["base"] = "same", b"abc", bytes(400)
    elif case == "absurd size":
        kw["size"] = 1 << 40
    elif case == "bad itemsize":
        kw["itemsize"] = 3
    elif case == "short header":
        payload = payload[:20]
    elif case == "plane longer than payload":
        payload = payload[:5] + struct.pack("<BI", pc.RAW, 101) + payload[10:]
    _refused(lambda: pc.decode(mode, payload, **kw), match)


def test_hostile_payload_never_raises_anything_else():
    """Random garbage after a valid header prefix: FormatError or the right number of bytes."""
    rng = np.random.default_rng(0)
    data = sample("bfloat16", 500, 1, "randn")
    _, good = pc.encode(data, itemsize=2)
    for i in range(300):
        cut = int(rng.integers(0, len(good)))
        junk = rng.integers(0, 256, int(rng.integers(0, 64)), dtype=np.uint8).tobytes()
        bad = good[:cut] + junk
        try:
            out = pc.decode("planes", bad, itemsize=2, size=len(data), where="h")
        except FormatError:
            continue
        assert len(out) == len(data)
