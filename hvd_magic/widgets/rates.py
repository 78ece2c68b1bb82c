"""The arithmetic of the panel's numbers: samples/s per rank (:class:`Throughput`), scaling
efficiency, the share of time in collectives, and how they and autotune's setting are
written. Pure: no UI, no clock.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Deque, Mapping, Optional, Tuple


class Throughput:
    """Samples/s of one rank from its cumulative ``hvd_magic.report(samples=n)`` counts.

    ``add(t, cumulative)`` takes the time of the latest report and the samples counted so
    far. ``rate()`` is over the last ``window`` seconds of reports; ``average()`` over the
    whole run (from the first report to the last, the first report's samples excluded),
    or since :meth:`restart`.
    """

    def __init__(self, window: float = 3.0) -> None:
        self.window = window
        self.points: Deque[Tuple[float, float]] = deque()
        self.first: Optional[Tuple[float, float]] = None
        self.last: Optional[Tuple[float, float]] = None
        self.since = float("-inf")

    def restart(self, t: float) -> None:
        """Count again from ``t`` on (an elastic reset): reports before it are ignored."""
        self.since = t
        self.points.clear()
        self.first = self.last = None

    def add(self, t: float, cumulative: float) -> None:
        if (self.last is not None and t <= self.last[0]) or t < self.since:
            return
        if self.first is None:
            self.first = (t, cumulative)
        self.last = (t, cumulative)
        self.points.append((t, cumulative))
        while len(self.points) > 2 and self.points[0][0] < t - self.window:
            self.points.popleft()

    def rate(self) -> Optional[float]:
        if len(self.points) < 2:
            return None
        (t0, c0), (t1, c1) = self.points[0], self.points[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else None

    def average(self) -> Optional[float]:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return None
        return (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])


def autotune_text(status: Optional[Mapping[str, Any]]) -> str:
    """HOROVOD_AUTOTUNE's state in words ("" without autotune)."""
    if not status:
        return ""
    setting = f"fusion threshold {status['fusion_mb']:g} MiB, cycle time {status['cycle_ms']:g} ms"
    if status.get("active"):
        return f"autotune: trying {setting} (trial {status.get('trial')})"
    return f"autotune: settled on {setting} after {status.get('trial')} trials"


def efficiency(total_rate: Optional[float], n_ranks: int, single_rate: Optional[float]) -> Optional[float]:
    """Scaling efficiency: total samples/s over ``n_ranks`` times the 1-rank samples/s."""
    if not total_rate or not single_rate or n_ranks < 1 or single_rate <= 0:
        return None
    return total_rate / (n_ranks * single_rate)


def comm_fraction(busy_us: float, wall_us: float) -> Optional[float]:
    """Share of the wall time with a collective in flight (0..1)."""
    if wall_us <= 0:
        return None
    return max(0.0, min(1.0, busy_us / wall_us))


def fmt_rate(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f} M"
    if x >= 1e4:
        return f"{x / 1e3:.1f} k"
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def fmt_pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


# ---------------------------------------------------------------------------- one cell
