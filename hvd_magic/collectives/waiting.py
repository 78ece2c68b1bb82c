"""How the engine thread waits for a non-blocking MPI request without burning a core.
(A request whose ``spin`` is False, the gloo controller's, is progressed by threads of its
backend: it is only ever polled with sleeps.)

- while a user thread waits on a result (the rank has nothing else to run) it polls
  without sleeping for at most ``SPIN_S``;
- otherwise, or after that, it sleeps between polls with exponential backoff from
  ``MIN_SLEEP_S`` up to ``MAX_POLL_S``, running a callback (the stall check) now and then.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Optional

from mpi4py import MPI

# Poll without sleeping this long, only while a user thread waits (so the rank has nothing
# else to run). On the 2-core VM a training step's wait is mostly under a few ms, and a
# sleep-poll there gives the core away and comes back late: 2-rank training ran ~20% faster
# with 5 ms than with 0.2 ms (benchmarks/README.md). A long wait still costs ~3% of a core.
SPIN_S = 5e-3
INLINE_SPIN_S = 200e-6  # a waiting caller runs the cycle itself for at most this long
MIN_SLEEP_S = 20e-6
MAX_POLL_S = 1e-3      # longest sleep between polls while waiting for other ranks
TICK_S = 0.25          # how often ``tick`` runs during a long wait


def next_cycle_in(news: bool, polling: bool, empty_streak: int, waited_s: float,
                  heartbeat_s: Optional[float]) -> Optional[float]:
    """Seconds until the engine thread's next negotiation cycle (0: now; None: only when a
    user thread rings). ``news``: this rank has something to send; ``polling``: it waits
    on the other ranks (a join, or requests they have not all submitted), so it asks again
    with a backoff that grows with ``empty_streak``, the cycles in a row that brought
    nothing; otherwise an idle rank cycles once per ``heartbeat_s`` (the stall check's
    heartbeat; None: never). ``waited_s``: how long it has waited already."""
    if news or (polling and empty_streak == 0):
        return 0.0
    if polling:
        return max(0.0, min(MAX_POLL_S, MIN_SLEEP_S * 2 ** min(empty_streak, 10)) - waited_s)
    return None if heartbeat_s is None else max(0.0, heartbeat_s - waited_s)


def wait_request(req: MPI.Request, waiting: Callable[[], bool],
                 tick: Callable[[float], None]) -> None:
    """Wait for ``req``; ``waiting()``: a user thread is blocked on a result now;
    ``tick(now)`` runs about every ``TICK_S`` seconds of a long wait."""
    if req.Test():
        return
    spin = getattr(req, "spin", True)      # False: the backend's own threads progress it
    if spin and waiting():
        # Someone is blocked on a result, so the cores are not needed for training:
        # poll without sleeping for a moment (sleep-and-wake would cost tens of us).
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < SPIN_S:
            if req.Test():
                return
    delay = MIN_SLEEP_S
    last_tick = time.monotonic()
    spun = not spin or waiting()
    while not req.Test():
        if not spun and waiting():
            # A user thread started waiting while this thread slept: from now on the
            # rank has nothing else to run, so poll without sleeping for a moment
            # (the backoff would otherwise answer the peers up to MAX_POLL_S late).
            spun = True
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < SPIN_S:
                if req.Test():
                    return
            continue
        time.sleep(delay)
        delay = min(delay * 2, MAX_POLL_S)
        now = time.monotonic()
        if now - last_tick > TICK_S:
            last_tick = now
            tick(now)


def tight_timer_slack() -> None:
    """Make this thread's short sleeps accurate: Linux rounds them up by the timer slack
    (50 us by default), which would add that much latency to every poll while waiting."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 us
        except Exception:  # noqa: BLE001 - an optimisation only
            pass
