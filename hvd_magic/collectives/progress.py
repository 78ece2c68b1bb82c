"""Samples this rank has processed, for throughput and scaling efficiency in the live
``%%hvd`` panel: call ``hvd.report(n)`` once a step. Standard library only; nothing is sent
from here (the pool's telemetry reads :func:`progress` while a cell runs)."""
from __future__ import annotations

import time
from typing import Optional, Tuple

_count = 0
_last: Optional[float] = None
_first: Optional[Tuple[float, int]] = None    # (time, cumulative count) of the first report
_reports = 0                                  # report() calls: training steps
#: Bytes this rank's allreduces carried since the cell started (the allreduce calls add
#: each tensor's bytes: one integer add a call). With the steps, the gradient bytes per
#: step that the live panel's predicted efficiency needs.
allreduce_bytes = 0


def report(samples: int) -> None:
    """Count ``samples`` processed by this rank since the cell started. Costs ~0.2 us."""
    global _count, _last, _first, _reports
    _count += samples
    _reports += 1
    _last = time.time()
    if _first is None:
        _first = (_last, _count)


def progress() -> Tuple[int, Optional[float]]:
    """``(samples counted, time.time() of the latest report or None)``."""
    return _count, _last


def first_report() -> Optional[Tuple[float, int]]:
    """``(time.time(), samples counted)`` at the first report of the cell, or None: the start
    of the whole-run rate, however short the cell (a telemetry batch may never see it)."""
    return _first


def traffic() -> Tuple[int, int]:
    """``(report() calls, bytes allreduced)`` since the cell started."""
    return _reports, allreduce_bytes


def reset_progress() -> None:
    """Start counting from zero (a new cell)."""
    global _count, _last, _first, _reports, allreduce_bytes
    _count, _last, _first, _reports, allreduce_bytes = 0, None, None, 0, 0
