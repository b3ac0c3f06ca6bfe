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
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a_off, a_size, b_off, b_size))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def relative(box: Box, origin: tuple[int, ...]) -> tuple[int, ...]:
    """``box``'s offsets measured from ``origin`` (the offsets of a box that holds it):
    where a piece sits inside its chunk.

    >>> relative(((5, 2), (1, 1)), (4, 0))
    (1, 2)
    """
    return tuple(o - base for o, base in zip(box[0], origin))


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
