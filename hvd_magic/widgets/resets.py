"""The changes of an elastic cell's ranks, as the panel shows them. Pure: fed with the
``elastic`` entries of the ranks' telemetry batches (see
:func:`hvd_magic.collectives.elastic.changes`), no UI, no clock.

The ranks renumber themselves at each change (survivors 0..n-1 in their old order; ranks that
join come last), while the panel keeps the numbers the cell started with. :class:`Resets`
keeps the map between the two: 3 ranks, rank 1 lost, then the new rank 1 lost::

    members [0, 1, 2] --lost [1]--> [0, 2] --lost [1]--> [0]   (cell ranks 1, then 2, lost)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence


@dataclass
class Reset:
    """One change of the ranks; ``lost`` and ``left`` in the cell's numbering."""

    generation: int
    t0: float                      # the failure (or host update) caught, wall clock s
    t1: Optional[float]            # training resumed (None: still resetting)
    size: int                      # ranks after it
    commit: int                    # the commits the state had: training went on from there
    lost: List[int] = field(default_factory=list)
    left: List[int] = field(default_factory=list)
    joined: int = 0

    def what(self) -> str:
        """``"rank 2 lost"``, ``"1 rank joined"``, ..."""
        what = []
        if self.lost:
            what.append(f"rank{'s' if len(self.lost) > 1 else ''} "
                        f"{', '.join(map(str, self.lost))} lost")
        if self.left:
            what.append(f"rank{'s' if len(self.left) > 1 else ''} "
                        f"{', '.join(map(str, self.left))} left")
        if self.joined:
            what.append(f"{self.joined} rank{'s' if self.joined > 1 else ''} joined")
        return "; ".join(what) or "hosts updated"

    def text(self, origin: Optional[float] = None) -> str:
        """``"elastic reset at 3.2 s: rank 2 lost; 2 ranks went on from commit 4 (0.41 s)"``;
        ``origin``: the cell's start (times are then given from it)."""
        when = f" at {self.t0 - origin:.1f} s" if origin is not None else ""
        took = f" ({self.t1 - self.t0:.2f} s)" if self.t1 is not None else " (resetting ...)"
        return (f"elastic reset{when}: {self.what()}; {self.size} "
                f"rank{'s' if self.size != 1 else ''} went on from commit {self.commit}{took}")


class Resets:
    """The resets of one cell, each once, whichever ranks' batches report them."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self.members: List[Optional[int]] = list(ranks)   # rank now -> the cell's rank
        self.by_generation: Dict[int, Reset] = {}

    def __iter__(self):
        return iter(sorted(self.by_generation.values(), key=lambda r: r.generation))

    def __bool__(self) -> bool:
        return bool(self.by_generation)

    def add(self, change: Mapping[str, Any]) -> Optional[Reset]:
        """One reported change; the :class:`Reset` when it is new or has just finished
        (``t1`` now known), else None (seen already)."""
        gen = int(change["generation"])
        t1 = change.get("t1")
        known = self.by_generation.get(gen)
        if known is not None:
            if known.t1 is None and t1 is not None:
                known.t1 = float(t1)
                return known
            return None
        size = int(change["size"])
        gone = {int(r) for r in change.get("lost") or []}
        lost = [m for i, m in enumerate(self.members) if i in gone and m is not None]
        kept = [m for i, m in enumerate(self.members) if i not in gone]
        left = [m for m in kept[size:] if m is not None]
        joined = int(change.get("joined") or 0)
        self.members = kept[:size] + [None] * max(size - len(kept), 0)
        reset = Reset(gen, float(change["t0"]), None if t1 is None else float(t1), size,
                      int(change.get("commit") or 0), lost, left, joined)
        self.by_generation[gen] = reset
        return reset

    def finished(self) -> List[Reset]:
        """The resets after which training resumed (``t1`` known), in order."""
        return [r for r in self if r.t1 is not None]

    def last_resume(self) -> Optional[float]:
        """When training last resumed after a reset (None: no finished reset)."""
        done = self.finished()
        return done[-1].t1 if done else None
