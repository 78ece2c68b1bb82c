"""Which way a big allreduce moves its data: chosen by measuring, the same on every rank.

On one host a big CPU allreduce can go these ways: through the shared-memory segment in
pieces of ``HVD_MAGIC_ALLREDUCE_CHUNK_MB`` (``shm``), through a second segment in pieces of
up to ``HVD_MAGIC_SHM_BIG_MB`` (``shm-big``, above the chunk), as MPI calls of the chunk
(``chunks``, where there is no segment), or as one MPI call (``one``). Which is fastest
depends on the size and on the machine's state, which on this 2-core VM changes from launch
to launch (``benchmarks/README.md``, 2026-11-24): in most launches ``shm`` is fastest at
every size (16 MiB at 2 ranks: 2.4 ms, chunks 3.4, one call 3.0), in others cache-to-cache
traffic between the cores is ~4x slower; then 1 MiB pieces are the slowest way and whole
pieces, read from the shared cache rather than the other core's, the fastest above 1 MiB
(in place, one job, five such launches: 16 MiB shm 7.3-11.0 ms, shm-big 2.4-3.3, one call
3.1-3.9; 64 MiB shm 30.6-33.1, shm-big 10.4-11.5, chunks 9.6-19.6, one call 25.0-26.2).

:class:`PathTuner` is pure (no communication, no clock): every rank keeps one and feeds it
the same calls in the same order, so every rank asks for the same path at the same call.
Per size class (a power of two) it first tries each candidate ``TRIALS`` times in turn;
then the caller broadcasts rank 0's verdict (the path with the least median time per byte
among rank 0's own trials) and every rank settles on it. After ``REVISIT`` calls on the
settled path (25 the first time, then twice as many each time up to 400: a verdict from a
noisy moment is soon looked at again) it tries every candidate ``RETRIALS`` times again,
since the machine's state may have changed; the settled path gives way only to one
``MARGIN`` faster. Example,
candidates (shm, shm-big, one), TRIALS 2::

    calls 0-5: shm shm-big one shm shm-big one   (measured)     after call 5: verdict due
    calls 6..: the verdict, e.g. shm, for FIRST_REVISIT calls, then a shorter round of trials
"""
from __future__ import annotations

import statistics
from typing import Optional

TRIALS = 5          # calls per candidate when a size class is first seen
RETRIALS = 4        # calls per candidate when a settled class is looked at again
REVISIT = 400       # calls on the settled path before looking again (FIRST_REVISIT the
FIRST_REVISIT = 25  # first time, then twice as many each time up to REVISIT)
MARGIN = 0.1        # a settled path gives way only to one this much faster


def size_class(nbytes: int) -> int:
    """The power of two at or below ``nbytes`` (its bit length - 1).

    >>> size_class(1 << 20), size_class((1 << 21) - 1)
    (20, 20)
    """
    return max(0, nbytes.bit_length() - 1)


class _Class:
    __slots__ = ("plan", "left", "calls", "every", "times", "settled")

    def __init__(self, plan: list, every: int) -> None:
        self.plan = plan          # paths still to try, in order
        self.left = len(plan)     # trials of this round not yet measured
        self.calls = 0
        self.every = every        # settled calls before the next round of trials            # calls on the settled path since it was settled
        self.times: dict = {}     # path -> seconds per byte measured in this round of trials
        self.settled: Optional[str] = None


class PathTuner:
    """Per size class and set of candidate paths: trials, a verdict, the settled path."""

    def __init__(self, trials: int = TRIALS, retrials: int = RETRIALS, revisit: int = REVISIT,
                 first_revisit: int = FIRST_REVISIT) -> None:
        self.trials, self.retrials, self.revisit = trials, retrials, revisit
        self.first_revisit = min(first_revisit, revisit)
        self.classes: dict = {}

    def choose(self, nbytes: int, candidates: tuple, what: str = "") -> tuple:
        """``(path, trial)`` for the next call of ``nbytes``: a trial is to be measured
        (:meth:`record`) and may make a verdict due (:meth:`due`). ``what`` keeps calls
        that cost differently apart (an out-of-place result is one more pass over the data
        on some paths and none on others)."""
        if len(candidates) == 1:
            return candidates[0], False
        key = (size_class(nbytes), candidates, what)
        c = self.classes.get(key)
        if c is None:
            c = self.classes[key] = _Class(list(candidates) * self.trials, self.first_revisit)
        if c.plan:
            return c.plan.pop(0), True
        c.calls += 1
        if c.calls >= c.every:
            c.calls = 0
            c.every = min(2 * c.every, self.revisit)
            c.plan = list(candidates) * self.retrials
            c.left = len(c.plan)
            c.times = {}
        return c.settled, False

    def record(self, nbytes: int, candidates: tuple, what: str, path: str, seconds: float) -> None:
        """This rank's time for a trial call."""
        c = self.classes[(size_class(nbytes), candidates, what)]
        c.times.setdefault(path, []).append(seconds / max(1, nbytes))
        c.left -= 1

    def due(self, nbytes: int, candidates: tuple, what: str = "") -> bool:
        """True right after the last trial of a round: the ranks must agree on a verdict."""
        c = self.classes.get((size_class(nbytes), candidates, what))
        return c is not None and c.left == 0 and bool(c.times)

    def verdict(self, nbytes: int, candidates: tuple, what: str = "") -> str:
        """The path with the least median time per byte in this rank's trials (in the first
        round the first trial of each is left out: first touches of memory). A settled
        path stays unless another is faster by ``MARGIN``: trials on this VM are noisy,
        and flapping between paths of about the same speed gains nothing."""
        c = self.classes[(size_class(nbytes), candidates, what)]
        first = c.settled is None

        def typical(path: str) -> float:
            xs = c.times.get(path) or [float("inf")]
            return statistics.median(xs[1:] if first and len(xs) > 2 else xs)

        best = min(candidates, key=typical)
        if not first and typical(best) > (1 - MARGIN) * typical(c.settled):
            return c.settled
        return best

    def settle(self, nbytes: int, candidates: tuple, what: str, path: str) -> None:
        """Use ``path`` (rank 0's verdict) from now on."""
        c = self.classes[(size_class(nbytes), candidates, what)]
        c.settled, c.times, c.calls = path, {}, 0

    def settled(self) -> dict:
        """(size class, candidates, what) -> settled path (None while trying): for tests
        and the benchmark, which print the choice."""
        return {k: c.settled for k, c in self.classes.items()}
