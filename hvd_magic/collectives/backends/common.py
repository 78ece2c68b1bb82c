"""Small helpers shared by the backends (pure arithmetic, no communication)."""
from __future__ import annotations

import math


def row_elems(shape: tuple) -> int:
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def scatter_rows(rows: int, size: int) -> list:
    """Rows each rank gets from reducescatter: equal shares, the first ranks one more.

    >>> scatter_rows(5, 3)
    [2, 2, 1]
    """
    q, rem = divmod(rows, size)
    return [q + (1 if r < rem else 0) for r in range(size)]


def chunk_spans(n: int, itemsize: int, chunk_bytes: int) -> list:
    """Element ranges ``[lo, hi)`` that split an ``n``-element buffer into MPI calls of at
    most ``chunk_bytes`` each (one range when ``chunk_bytes`` is 0 or the buffer fits).

    >>> chunk_spans(10, 4, 16)
    [(0, 4), (4, 8), (8, 10)]
    >>> chunk_spans(10, 4, 0)
    [(0, 10)]
    """
    step = chunk_bytes // itemsize if chunk_bytes > 0 else 0
    if step <= 0 or n <= step:
        return [(0, n)]
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def displacements(counts: list) -> list:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out
