"""Box intersection (ckptctl.boxes), the one place the planner, diff and pack cut chunks:
checked element by element against numpy masks on random boxes, and against the planner
on random chunk grids."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl.boxes import contains, intersect, numel, relative

SHAPE = (7, 5, 3)


@st.composite
def boxes(draw, ndim: int):
    """A box inside SHAPE[:ndim], possibly empty."""
    offs, sizes = [], []
    for d in SHAPE[:ndim]:
        o = draw(st.integers(0, d))
        offs.append(o)
        sizes.append(draw(st.integers(0, d - o)))
    return tuple(offs), tuple(sizes)


def region(offsets, sizes) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


def mask(box, ndim: int) -> np.ndarray:
    m = np.zeros(SHAPE[:ndim], dtype=bool)
    m[region(*box)] = True
    return m


pairs = st.integers(1, 3).flatmap(lambda n: st.tuples(st.just(n), boxes(n), boxes(n)))


@settings(max_examples=300, deadline=None)
@given(pairs)
def test_intersection_is_the_common_elements(case):
    ndim, a, b = case
    both = mask(a, ndim) & mask(b, ndim)
    hit = intersect(a, b)
    assert hit == intersect(b, a)
    if hit is None:
        assert not both.any()
        return
    assert (mask(hit, ndim) == both).all()
    assert numel(hit) == int(both.sum()) > 0
    assert contains(a, hit) and contains(b, hit)
    # relative offsets index the same elements inside each box
    ra, rb = relative(hit, a[0]), relative(hit, b[0])
    grid = np.arange(np.prod(SHAPE[:ndim])).reshape(SHAPE[:ndim])
    in_a, in_b = grid[region(*a)], grid[region(*b)]
    assert (in_a[region(ra, hit[1])] == in_b[region(rb, hit[1])]).all()


@settings(max_examples=200, deadline=None)
@given(pairs)
def test_contains_matches_masks(case):
    ndim, a, b = case
    assert contains(a, b) == bool((mask(a, ndim) | ~mask(b, ndim)).all())


def test_scalars_and_dimension_mismatch():
    assert intersect(((), ()), ((), ())) == ((), ())
    assert numel(((), ())) == 1
    with pytest.raises(ValueError):
        intersect(((0,), (1,)), ((0, 0), (1, 1)))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 6), st.integers(1, 4), st.integers(1, 4),
       st.integers(1, 5))
def test_planner_pieces_tile_every_target_box(rows, cols, src_parts, dst_parts, ncol_parts):
    """Source chunks in a grid, target rows split dst_parts ways: the planner's pieces
    (cut with intersect) rebuild each target box exactly."""
    from ckptctl.layout import chunk_span, parse_mesh, preset
    from ckptctl.model import DTYPES, Checkpoint, Chunk, Extent, TensorEntry
    from ckptctl.convert.planner import make_plan

    chunks = []
    for i in range(src_parts):
        ro, rs = chunk_span(rows, src_parts, i)
        for j in range(ncol_parts):
            co, cs = chunk_span(cols, ncol_parts, j)
            if rs and cs:
                chunks.append(Chunk((ro, co), (rs, cs), Extent(f"f{i}_{j}", 0, 1)))
    t = TensorEntry("model.w", DTYPES["float32"], (rows, cols), chunks)
    plan = make_plan(Checkpoint("x", "dcp", tensors={"model.w": t}),
                     preset("fsdp", parse_mesh(f"dp={dst_parts}")))
    whole = np.arange(rows * cols).reshape(rows, cols)
    for tc in plan.chunks:
        got = np.full(tc.sizes, -1)
        for p in tc.pieces:
            part = whole[region(p.src.offsets, p.src.sizes)][region(p.src_offsets, p.sizes)]
            dst = region(p.dst_offsets, p.sizes)
            assert (got[dst] == -1).all()  # no element written twice
            got[dst] = part
        want = whole[region(tc.offsets, tc.sizes)]
        assert (got == want).all()


@st.composite
def flat_ranges(draw):
    """(shape, a, b): a shape of 1 to 4 dims (sizes 0 to 6) and a flat range inside it."""
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=4)))
    n = int(np.prod(shape))
    a = draw(st.integers(0, n))
    return shape, a, draw(st.integers(a, n))


@settings(max_examples=500, deadline=None)
@given(flat_ranges())
def test_flat_range_boxes_tile_the_range_in_flat_order(case):
    """The boxes of a ZeRO partition's flat piece [a, b): each box's elements are one run
    of consecutive flat indices starting at the box's base, the runs follow each other in
    order and make up exactly [a, b), no box is empty, and there are at most 2*ndim-1."""
    from ckptctl.boxes import flat_range_boxes

    shape, a, b = case
    grid = np.arange(int(np.prod(shape))).reshape(shape)
    boxes = flat_range_boxes(shape, a, b)
    assert len(boxes) <= 2 * len(shape) - 1
    runs = []
    for (offsets, sizes), base in boxes:
        assert len(offsets) == len(sizes) == len(shape) and numel((offsets, sizes)) > 0
        assert all(o >= 0 and o + s <= d for o, s, d in zip(offsets, sizes, shape))
        got = grid[region(offsets, sizes)].ravel()  # row-major: the box's flat order
        assert (got == np.arange(base, base + got.size)).all()
        runs.append(got)
    flat = np.concatenate(runs) if runs else np.arange(0)
    assert (flat == np.arange(a, b)).all()


def test_flat_range_boxes_refuses_a_range_outside_the_tensor():
    from ckptctl.boxes import flat_range_boxes

    for a, b in ((0, 13), (-1, 2), (5, 4)):
        with pytest.raises(ValueError):
            flat_range_boxes((3, 4), a, b)
