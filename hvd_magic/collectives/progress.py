"""Samples this rank has processed, for throughput and scaling efficiency in the live
``%%hvd`` panel: call ``hvd.report(n)`` once a step. Standard library only; nothing is sent
from here (the pool's telemetry reads :func:`progress` while a cell runs)."""
from __future__ import annotations

import time
from typing import Optional, Tuple

_count = 0
_last: Optional[float] = None


def report(samples: int) -> None:
    """Count ``samples`` processed by this rank since the cell started. Costs ~0.2 us."""
    global _count, _last
    _count += samples
    _last = time.time()


def progress() -> Tuple[int, Optional[float]]:
    """``(samples counted, time.time() of the latest report or None)``."""
    return _count, _last


def reset_progress() -> None:
    """Start counting from zero (a new cell)."""
    global _count, _last
    _count, _last = 0, None
