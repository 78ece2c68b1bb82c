"""Which way a big allreduce moves its data: chosen by measuring, the same on every rank.

On one host a big CPU allreduce can go these ways: through the shared-memory segment in
pieces of ``HVD_MAGIC_ALLREDUCE_CHUNK_MB`` (``shm``), the same with each rank's input written
with streaming stores (``shm-stream``, where the ``_stream`` extension is built), through a
second segment in pieces of up to ``HVD_MAGIC_SHM_BIG_MB`` (``shm-big``, above the chunk),
as MPI calls of the chunk (``chunks``, where there is no segment), or as one MPI call
(``one``). Which is fastest depends on the size and on the machine's state, which on this
2-core VM changes from launch to launch (``benchmarks/README.md``, 2026-11-24): in most
launches ``shm`` is fastest at every size (16 MiB at 2 ranks: 2.4 ms, chunks 3.4, one call
3.0), in others cache-to-cache traffic between the cores is ~4x slower; then 1 MiB pieces
are the slowest way and pieces read from memory the fastest: ``shm-stream`` (seventh
session, same job: 1 MiB 0.11 ms against 0.54 for shm and 0.57 for raw MPI; 16 MiB
1.7-2.0 ms against 7.6-8.1 for shm and 5.3-5.9 for 1 MiB MPI calls), and before it whole
pieces read from the shared cache (in place, one job, five such launches: 16 MiB shm
7.3-11.0 ms, shm-big 2.4-3.3, one call 3.1-3.9; 64 MiB shm 30.6-33.1, shm-big 10.4-11.5,
chunks 9.6-19.6, one call 25.0-26.2).

:class:`PathTuner` is pure (no communication, no clock): every rank keeps one and feeds it
the same calls in the same order, so every rank asks for the same path at the same call.
Per size class (a power of two) it first tries each candidate ``TRIALS`` times in turn;
then the caller broadcasts rank 0's verdict (the path with the least median time per byte
among rank 0's own trials) and every rank settles on it. After ``REVISIT`` calls on the
settled path (25 the first time, then twice as many each time up to 400: a verdict from a
noisy moment is soon looked at again, and so is one from a round that a drift check
started and that changed the path) it tries every candidate ``RETRIALS`` times again,
since the machine's state may have changed; the settled path gives way only to one
``MARGIN`` faster. Between rounds settled calls are timed too: each ``WATCH`` calls
(more for small sizes, so that at least ``WATCH_BYTES`` pass between checks; of those, only
``WATCH`` evenly spaced ones are timed) the caller asks rank 0 whether the median of the
timed calls is ``DRIFT`` times what the settled path gave (in its trials, or in any window
since), and if so a round of trials starts at once, in which the settled path counts as
slow as those calls were. The VM's state can change in
the middle of a job: in four of twenty benchmark runs with the check (2026-11-24, sixth
session) 16 MiB calls on the settled 1 MiB pieces went from 1.7-1.9 ms to 4.6-9.3 ms, and
the check moved them to one MPI call or shm-big (2.5-3.2 ms) after 8 such calls. Without
it, two of twelve runs kept 64 MiB on 1 MiB pieces at ~1.0x raw bandwidth for the rest
of the run (2.0-2.2x on shm-big). Example,
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
WATCH = 8           # settled calls per drift check, at least,
WATCH_BYTES = 64 << 20  # and at least this many bytes (a check is one small broadcast)
DRIFT = 1.4         # a settled path this much slower than it was: try every path again


def size_class(nbytes: int) -> int:
    """The power of two at or below ``nbytes`` (its bit length - 1).

    >>> size_class(1 << 20), size_class((1 << 21) - 1)
    (20, 20)
    """
    return max(0, nbytes.bit_length() - 1)


class _Class:
    __slots__ = ("plan", "left", "calls", "every", "times", "settled", "ref", "seen", "stride",
                 "alarm", "alarms", "quiet")

    def __init__(self, candidates: tuple, repeats: int, every: int, watch: int) -> None:
        self.every = every        # settled calls before the next round of trials
        self.settled: Optional[str] = None
        self.ref = float("inf")   # the settled path's least typical seconds per byte
        # Of the ``watch`` settled calls per drift check every stride-th is timed: WATCH
        # of them. Timing and recording a call costs ~1 us of Python, 1-2% of a 1 MiB
        # call; a median of WATCH calls is what the big sizes' checks use anyway
        self.stride = max(1, watch // WATCH)
        self.alarms = 0           # rounds started by drift checks since the last scheduled one
        self.start_round(candidates, repeats)

    def start_round(self, candidates: tuple, repeats: int, alarm: float = 0.0) -> None:
        self.plan = list(candidates) * repeats   # paths still to try, in order
        # left: trials of this round not yet measured; times: path -> seconds per byte
        # measured in this round; seen: seconds per byte of settled calls since the last
        # check; calls: settled calls since the path was settled; alarm > 0: this round was
        # started by a drift check, which measured the settled path at this many seconds
        # per byte; quiet: no drift checks until the next scheduled round
        self.left, self.times, self.seen, self.calls = len(self.plan), {}, [], 0
        self.alarm, self.alarms = alarm, self.alarms + 1 if alarm else 0
        self.quiet = False

    def due(self) -> str:
        """What the ranks must agree on now: "verdict" right after the last trial of a
        round, "drift" when enough settled calls were watched, else ""."""
        if self.left:
            return ""
        return "verdict" if self.times else "drift" if len(self.seen) >= WATCH else ""

    def typical(self, path: str) -> float:
        """Median seconds per byte of ``path`` in this round of trials (in the first round
        the first trial of each is left out: first touches of memory)."""
        xs = self.times.get(path) or [float("inf")]
        t = statistics.median(xs[1:] if self.settled is None and len(xs) > 2 else xs)
        # in a round that a drift check started, the calls that set it off count for the
        # settled path too: on this VM one MPI call right after the other ways' trials ran
        # 1.2-1.5x faster than it then did call after call (16 MiB, slow launches)
        return max(t, self.alarm) if path == self.settled else t


class PathTuner:
    """Per size class and set of candidate paths: trials, a verdict, the settled path."""

    def __init__(self, trials: int = TRIALS, retrials: int = RETRIALS, revisit: int = REVISIT,
                 first_revisit: int = FIRST_REVISIT) -> None:
        self.trials, self.retrials, self.revisit = trials, retrials, revisit
        self.first_revisit = min(first_revisit, revisit)
        self.classes: dict = {}

    def _get(self, nbytes: int, candidates: tuple, what: str) -> _Class:
        return self.classes[(size_class(nbytes), candidates, what)]

    def choose(self, nbytes: int, candidates: tuple, what: str = "") -> tuple:
        """``(path, timed)`` for the next call of ``nbytes``: a timed call is to be measured
        (:meth:`record`), after which a verdict (:meth:`due`) or a drift check
        (:meth:`check_due`) may be due. ``what`` keeps calls that cost differently apart
        (an out-of-place result is one more pass over the data on some paths and none on
        others)."""
        if len(candidates) == 1:
            return candidates[0], False
        key = (size_class(nbytes), candidates, what)
        c = self.classes.get(key)
        if c is None:
            watch = max(WATCH, -(-WATCH_BYTES >> key[0]))
            c = self.classes[key] = _Class(candidates, self.trials, self.first_revisit, watch)
        if c.plan:
            return c.plan.pop(0), True
        c.calls += 1
        if c.calls >= c.every:
            c.every = min(2 * c.every, self.revisit)
            c.start_round(candidates, self.retrials)
            return c.plan.pop(0), True
        return c.settled, not c.quiet and c.calls % c.stride == 0

    def record(self, nbytes: int, candidates: tuple, what: str, path: str, seconds: float) -> str:
        """This rank's time for a timed call: a trial, or a settled call being watched.
        Returns what the ranks must agree on now: "verdict" (:meth:`verdict` on rank 0,
        then :meth:`settle`), "drift" (:meth:`drifted` on rank 0, then :meth:`checked`),
        or "" (nothing)."""
        c = self._get(nbytes, candidates, what)
        if c.left:
            c.times.setdefault(path, []).append(seconds / max(1, nbytes))
            c.left -= 1
        else:
            c.seen.append(seconds / max(1, nbytes))
        return c.due()

    def due(self, nbytes: int, candidates: tuple, what: str = "") -> bool:
        """True right after the last trial of a round: the ranks must agree on a verdict."""
        c = self.classes.get((size_class(nbytes), candidates, what))
        return c is not None and c.due() == "verdict"

    def verdict(self, nbytes: int, candidates: tuple, what: str = "") -> str:
        """The path with the least median time per byte in this rank's trials. A settled
        path stays unless another is faster by ``MARGIN``: trials on this VM are noisy,
        and flapping between paths of about the same speed gains nothing."""
        c = self._get(nbytes, candidates, what)
        best = min(candidates, key=c.typical)
        if c.settled is not None and c.typical(best) > (1 - MARGIN) * c.typical(c.settled):
            return c.settled
        return best

    def settle(self, nbytes: int, candidates: tuple, what: str, path: str) -> None:
        """Use ``path`` (rank 0's verdict) from now on. After a round that a drift check
        started and that kept the same path (it is slower now, and still the best), or
        after the second such round, no more checks until the next scheduled round: a
        false alarm costs a round of trials, and two paths each slower call after call
        than in trials must not take turns."""
        c = self._get(nbytes, candidates, what)
        c.quiet = bool(c.alarm) and (path == c.settled or c.alarms >= 2)
        if c.alarm and path != c.settled:
            # the new path may owe its win to a passing slow moment of the old one (the
            # window that set the check off, which the old path counts as): look again
            # soon, not after up to REVISIT calls (2026-11-24, eighth session: after such a
            # round, 1 MiB stayed on shm-stream at 0.90x raw bandwidth against 1.32x for shm)
            c.every = self.first_revisit
        c.ref = c.typical(path)
        c.settled, c.times, c.calls, c.seen, c.alarm = path, {}, 0, [], 0.0

    def check_due(self, nbytes: int, candidates: tuple, what: str = "") -> bool:
        """True when enough settled calls were watched: the ranks must agree whether the
        settled path has become slower (:meth:`drifted` on rank 0, then :meth:`checked`)."""
        c = self.classes.get((size_class(nbytes), candidates, what))
        return c is not None and c.due() == "drift"

    def drifted(self, nbytes: int, candidates: tuple, what: str = "") -> bool:
        """Whether the watched calls' median time per byte is ``DRIFT`` times what the
        settled path gave before (the least of its trials and the windows since)."""
        c = self._get(nbytes, candidates, what)
        return statistics.median(c.seen) > DRIFT * c.ref

    def checked(self, nbytes: int, candidates: tuple, what: str, drifted: bool) -> None:
        """Act on rank 0's answer: try every path again at once, or watch on."""
        c = self._get(nbytes, candidates, what)
        if drifted:
            c.start_round(candidates, self.retrials, alarm=statistics.median(c.seen))
        else:
            c.ref = min(c.ref, statistics.median(c.seen))
            c.seen = []

    def settled(self) -> dict:
        """(size class, candidates, what) -> settled path (None while trying): for tests
        and the benchmark, which print the choice."""
        return {k: c.settled for k, c in self.classes.items()}
