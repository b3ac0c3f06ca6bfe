"""Count NaN and Inf values of any floating dtype, on raw bytes (bf16 and float8 too).

Works on bit patterns, so no dtype needs numpy support: an IEEE-style value is non-finite
when its exponent bits are all ones (NaN if the mantissa is non-zero); the float8
variants without infinities have their own NaN encodings.

>>> import numpy as np
>>> from ckptctl.model import DTYPES
>>> a = np.array([1.0, np.nan, np.inf, -np.inf], dtype=np.float32).view("V4")
>>> count_non_finite(a, DTYPES["float32"])
{'nan': 1, 'inf': 2}
>>> bf = np.array([0x3F80, 0x7FC0, 0xFF80], dtype=np.uint16).view("V2")  # 1.0, NaN, -Inf
>>> count_non_finite(bf, DTYPES["bfloat16"])
{'nan': 1, 'inf': 1}
"""
from __future__ import annotations

import numpy as np

from ..model import DType

# dtype -> (unsigned view, exponent mask, mantissa mask)
_IEEE = {
    "float16": (np.uint16, 0x7C00, 0x03FF),
    "bfloat16": (np.uint16, 0x7F80, 0x007F),
    "float32": (np.uint32, 0x7F800000, 0x007FFFFF),
    "float64": (np.uint64, 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
    "complex64": (np.uint32, 0x7F800000, 0x007FFFFF),
    "complex128": (np.uint64, 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
    "complex32": (np.uint16, 0x7C00, 0x03FF),
    "float8_e5m2": (np.uint8, 0x7C, 0x03),
}
# float8 formats without Inf: value patterns that mean NaN (under a mask)
_NAN_ONLY = {
    "float8_e4m3fn": (0x7F, 0x7F),  # S.1111.111
    "float8_e4m3fnuz": (0xFF, 0x80),  # the negative-zero pattern
    "float8_e5m2fnuz": (0xFF, 0x80),
    "float8_e8m0fnu": (0xFF, 0xFF),
}


def count_non_finite(arr: np.ndarray, dtype: DType) -> dict[str, int] | None:
    """NaN and Inf counts of a tensor given as raw bytes, or None if not floating."""
    raw = np.ascontiguousarray(arr).reshape(-1)
    if dtype.name in _IEEE:
        ut, exp, man = _IEEE[dtype.name]
        bits = raw.view(ut)
        special = (bits & ut(exp)) == ut(exp)
        nan = int(np.count_nonzero(special & ((bits & ut(man)) != 0)))
        inf = int(np.count_nonzero(special)) - nan
        return {"nan": nan, "inf": inf}
    if dtype.name in _NAN_ONLY:
        mask, pattern = _NAN_ONLY[dtype.name]
        bits = raw.view(np.uint8)
        return {"nan": int(np.count_nonzero((bits & np.uint8(mask)) == np.uint8(pattern))),
                "inf": 0}
    return None
