"""N-D boxes: the regions of a tensor that chunks, shards and target chunks hold.

A box is a pair of int tuples ``(offsets, sizes)``, one entry per tensor dim, exactly as
:class:`~ckptctl.model.Chunk` stores them. The planner cuts source chunks by target boxes
with :func:`intersect`; diff and pack compare chunk layouts with the same functions.
A 0-dim box ``((), ())`` holds the one element of a scalar.

>>> a, b = ((0, 0), (4, 4)), ((2, 3), (4, 4))
>>> intersect(a, b)
((2, 3), (2, 1))
>>> relative(intersect(a, b), b[0]), numel(intersect(a, b))
((0, 0), 2)
>>> intersect(a, ((4, 0), (1, 4))) is None          # touching edges share nothing
True
"""
from __future__ import annotations

import math
from bisect import bisect_left
from operator import sub
from typing import Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]


def numel(box: Box) -> int:
    """Elements in ``box``.

    >>> numel(((0, 0), (3, 5))), numel(((), ())), numel(((7,), (0,)))
    (15, 1, 0)
    """
    return math.prod(box[1])


def intersect(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` cover, or None when they share no element (disjoint,
    touching, or either empty). Boxes must have the same number of dims.

    >>> intersect(((0,), (10,)), ((8,), (5,)))
    ((8,), (2,))
    >>> intersect(((0, 0), (2, 2)), ((0, 2), (2, 2))) is None
    True
    >>> intersect(((), ()), ((), ()))
    ((), ())
    """
    (a_off, a_size), (b_off, b_size) = a, b
    if len(a_off) != len(b_off):
        raise ValueError(f"boxes of {len(a_off)} and {len(b_off)} dims do not intersect")
    lo, size = [], []  # a plain loop that stops at the first disjoint dim: the planner's hot path
    for x, s, y, t in zip(a_off, a_size, b_off, b_size):
        low = x if x > y else y
        high = x + s if x + s < y + t else y + t
        if high <= low:
            return None
        lo.append(low)
        size.append(high - low)
    return tuple(lo), tuple(size)


def relative(box: Box, origin: tuple[int, ...]) -> tuple[int, ...]:
    """``box``'s offsets measured from ``origin`` (the offsets of a box that holds it):
    where a piece sits inside its chunk.

    >>> relative(((5, 2), (1, 1)), (4, 0))
    (1, 2)
    """
    return tuple(map(sub, box[0], origin))


def contains(outer: Box, inner: Box) -> bool:
    """Whether ``outer`` covers every element of ``inner`` (an empty ``inner`` is covered
    by any box of its dims).

    >>> box = ((0, 0), (4, 4))
    >>> contains(box, ((1, 1), (3, 3))), contains(box, ((1, 1), (4, 1)))
    (True, False)
    """
    if numel(inner) == 0:
        return len(inner[0]) == len(outer[0])
    return all(o <= i and i + s <= o + t
               for o, t, i, s in zip(outer[0], outer[1], inner[0], inner[1]))


class BoxIndex:
    """The boxes of a tiling, indexed so that finding those a query box meets costs a
    binary search plus the hits, not a test of every box (a 10,000-rank tensor has 10,000
    chunks, cut by thousands of target boxes).

    The boxes are sorted by their offset along the dim where they are split most; a
    query looks only at boxes that start less than the widest box's reach before it.

    >>> ix = BoxIndex([((0, 0), (2, 4)), ((2, 0), (2, 4)), ((4, 0), (2, 4))])
    >>> ix.hits(((1, 1), (2, 2)))
    [(0, ((1, 1), (1, 2))), (1, ((2, 1), (1, 2)))]
    """

    def __init__(self, boxes: Sequence[Box]):
        self._boxes = list(boxes)
        nd = len(self._boxes[0][0]) if self._boxes else 0
        live = [i for i, b in enumerate(self._boxes) if numel(b)]
        self._dim = None
        if nd and live:
            self._dim = max(range(nd), key=lambda d: (len({self._boxes[i][0][d] for i in live}), -d))
        d = self._dim
        self._order = sorted(live, key=lambda i: self._boxes[i][0][d]) if d is not None else live
        self._starts = [self._boxes[i][0][d] for i in self._order] if d is not None else []
        self._reach = max((self._boxes[i][1][d] for i in live), default=0) if d is not None else 0

    def hits(self, box: Box) -> list[tuple[int, Box]]:
        """``(i, intersection)`` for each indexed box ``i`` that shares an element with
        ``box``, in index order."""
        d = self._dim
        if d is None:
            cand = self._order
        else:
            lo, hi = box[0][d], box[0][d] + box[1][d]
            cand = sorted(self._order[bisect_left(self._starts, lo - self._reach + 1):
                                      bisect_left(self._starts, hi)])
        out = []
        for i in cand:
            hit = intersect(box, self._boxes[i])
            if hit is not None:
                out.append((i, hit))
        return out


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[Box, int]]:
    """The boxes that elements ``[start, stop)`` of a row-major tensor of ``shape`` make
    up, in flat order, each with the flat index of its first element. Each box's elements
    are contiguous in flat order, so a flat range of bytes (a ZeRO partition's piece of a
    parameter) becomes at most ``2 * ndim - 1`` chunks of the one logical model.

    >>> flat_range_boxes((3, 4), 2, 9)
    [(((0, 2), (1, 2)), 2), (((1, 0), (1, 4)), 4), (((2, 0), (1, 1)), 8)]
    >>> flat_range_boxes((3, 4), 4, 12), flat_range_boxes((), 0, 1), flat_range_boxes((5,), 2, 2)
    ([(((1, 0), (2, 4)), 4)], [(((), ()), 0)], [])
    """
    shape = tuple(shape)
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"range [{start}, {stop}) outside a tensor of shape {list(shape)}")
    out: list[tuple[Box, int]] = []

    def walk(dims: tuple[int, ...], lo: int, hi: int, off: tuple[int, ...], base: int) -> None:
        if lo == hi:
            return
        ones = (1,) * len(off)  # the dims above: one index each
        if not dims:
            out.append(((off, ones), base))
            return
        inner = math.prod(dims[1:])
        if lo % inner == 0 and hi % inner == 0:
            out.append(((off + (lo // inner,) + (0,) * (len(dims) - 1),
                         ones + (hi // inner - lo // inner,) + dims[1:]), base + lo))
            return
        r0, r1 = lo // inner, hi // inner
        if r0 == r1:  # inside one row
            walk(dims[1:], lo - r0 * inner, hi - r0 * inner, off + (r0,), base + r0 * inner)
            return
        first = r0
        if lo % inner:
            walk(dims[1:], lo % inner, inner, off + (r0,), base + r0 * inner)
            first = r0 + 1
        if r1 > first:
            out.append(((off + (first,) + (0,) * (len(dims) - 1),
                         ones + (r1 - first,) + dims[1:]), base + first * inner))
        if hi % inner:
            walk(dims[1:], 0, hi % inner, off + (r1,), base + r1 * inner)

    walk(shape, start, stop, (), 0)
    return out
