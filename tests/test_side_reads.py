"""The layer stack's side reads (kernels/cpu_team.h: a later op's lines fetched a line at a time
beside an earlier loop's weight stream): the cursor gives every line of every range once, in
order, from each range's first line to the line holding its last byte; and a step's next
parallel loop takes the reads (every item of it runs with a cursor), the one after does not.
Prefetches change no value, so this is where a walk that skipped lines would show (the layer
stack's equality with the model covers the values with them on, tests/test_native_stack.py)."""

from __future__ import annotations

import ctypes

import pytest

from banyan.kernels import native

pytestmark = pytest.mark.skipif(
    native.load() is None, reason="native CPU kernels unavailable (no C++ compiler?)"
)


def walk(ranges: list[tuple[int, int]], ticks: int) -> tuple[int, list[int]]:
    lib = native.load()
    n = len(ranges)
    starts = (ctypes.c_int64 * max(n, 1))(*(s for s, _ in ranges))
    sizes = (ctypes.c_int64 * max(n, 1))(*(b for _, b in ranges))
    out = (ctypes.c_int64 * ticks)()
    fn = lib.banyan_side_reads_walk
    fn.restype = ctypes.c_int64
    given = fn(starts, sizes, ctypes.c_int64(n), ctypes.c_int64(ticks), out)
    return given, list(out)


def expected_lines(ranges: list[tuple[int, int]]) -> list[int]:
    lines = []
    for start, size in ranges:
        if size <= 0:
            continue
        lines += range(start // 64 * 64, start + size, 64)
    return lines


@pytest.mark.parametrize("ranges", [
    [(4096, 64)],                            # one aligned line
    [(4096 + 10, 1)],                        # one byte inside a line
    [(4096 + 60, 8)],                        # two bytes' lines across a line edge
    [(8192, 384 * 16), (65536, 384 * 16)],   # a K block and a V block (16 slots of 3 x 64 bf16)
    [(100_000 + 3, 1000), (0x10000, 0), (200_000, 777), (300_032, 64)],  # ragged, one empty
])
def test_cursor_gives_each_line_once_in_order(ranges: list[tuple[int, int]]) -> None:
    want = expected_lines(ranges)
    given, lines = walk(ranges, len(want) + 5)  # ticks past the end give nothing
    assert given == len(want)
    assert lines[:given] == want
    assert lines[given:] == [0] * 5


def test_fewer_ticks_than_lines_stop_where_they_are() -> None:
    ranges = [(4096, 64 * 10), (1 << 20, 64 * 10)]
    given, lines = walk(ranges, 13)
    assert given == 13
    assert lines == expected_lines(ranges)[:13]


@pytest.mark.parametrize("threads,items", [(2, 7), (2, 1), (1, 5)])
def test_next_loop_takes_the_reads(threads: int, items: int) -> None:
    lib = native.load()
    seen = (ctypes.c_int64 * 3)()
    lib.banyan_side_reads_loops(ctypes.c_int64(threads), ctypes.c_int64(items), seen)
    if threads > 1:  # a team: the first loop's items all carry them, the second's none
        assert list(seen) == [items, 0, 0]
    else:  # one thread runs the step without a team: no side reads at all
        assert list(seen) == [0, 0, 0]
