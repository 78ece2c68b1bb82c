"""Runs in the notebook kernel.

After an interrupt or a ``--timeout``: stop the cell on every busy rank, then reset the
hvd runtime everywhere, or stop the pool when a rank does not stop (:func:`settle`)."""
from __future__ import annotations

import time
from typing import Any, List

from .cells import rank_done
from .output import ranks_text


def settle(pool: Any, ar: Any, pump: Any, targets: List[int], why: str) -> str:
    """Stop the cell on every busy rank (SIGINT through the nannies), then reset the
    runtime on every rank; if a rank does not stop, stop the pool. Returns what happened."""
    try:
        t0 = time.monotonic()
        busy = [r for i, r in enumerate(targets) if not rank_done(ar, i)]
        if busy:
            pool.interrupt(busy)
        while not ar.ready() and time.monotonic() - t0 < 2.5:
            ar.wait(0.05)
            pump.flush()
            if time.monotonic() - t0 > 1.0 and busy:
                pool.interrupt([r for i, r in enumerate(targets) if not rank_done(ar, i)])
                busy = []
        if not ar.ready():
            stuck = [r for i, r in enumerate(targets) if not rank_done(ar, i)]
            pool.ended = f"{ranks_text(stuck)} did not stop when interrupted"
            pool.stop()
            return (f"{why}; {pool.ended}, so the pool was stopped; the next %%hvd cell "
                    "starts a new one")
        stopped = time.monotonic() - t0
        ar.wait_for_output(0.3)
        pump.flush()
        note = pool.reset_runtime()
        return f"{why}: stopped on {ranks_text(targets)} in {stopped:.2f} s; {note}"
    except KeyboardInterrupt:     # interrupted again while settling: stop hard
        pool.ended = "interrupted twice"
        pool.stop()
        return "interrupted again; the pool was stopped, the next %%hvd cell starts a new one"
