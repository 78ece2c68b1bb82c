"""The stall check (``HOROVOD_STALL_CHECK_TIME_SECONDS``, ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``).

A request is stalled when some ranks submitted it and others have not after the check time:
rank 0 warns, naming the tensors and the missing ranks; after the shutdown time (when > 0)
the ranks that submitted it cancel it on every rank. A rank whose negotiation itself has not
completed for that long (the other ranks stopped negotiating) warns about, and then fails,
its own requests. :class:`StallCheck` decides; the engine reads its tables under its locks
and carries out what it returns. A rank that warns then gathers every rank's stack (on a
thread of its own, at most :data:`hvd_magic.stacks.dump.TIMEOUT` seconds) and writes them
below the warning, each rank's line of the user's code first (:mod:`hvd_magic.stacks`).
"""
from __future__ import annotations

import sys
import threading
from typing import Iterable, Optional, Sequence

from .errors import StallError
from .negotiation import StallInfo


class StallCheck:
    def __init__(self, check_s: float, shutdown_s: float, rank: int, where: str = "",
                 lead: Optional[bool] = None, ranks: Sequence[int] = ()) -> None:
        """``rank``: this rank as messages name it; ``where``: which process set, in words
        (" in process set 1"); ``lead``: this rank warns for everyone (default: rank 0);
        ``ranks``: the hvd ranks whose stacks a warning shows (none: no stacks)."""
        self.check, self.kill, self.rank, self.where = check_s, shutdown_s, rank, where
        self.lead = rank == 0 if lead is None else lead
        self.ranks = list(ranks)
        self.last_warn = 0.0
        self.reported: frozenset = frozenset()   # the stalled tensors stacks were shown for
        self.noted: tuple = ()                   # this rank's waiting requests, as written
        limits = [x for x in (check_s, shutdown_s) if x > 0]
        self.first = min(limits) if limits else 0.0
        # how often an idle engine thread wakes up to check (None: never)
        self.heartbeat_s: Optional[float] = max(0.25, min(15.0, self.first / 4)) if limits else None

    def stuck(self, now: float, in_cycle_since: float) -> bool:
        """This rank's negotiation has waited longer than a limit for the other ranks."""
        return bool(in_cycle_since) and now - in_cycle_since > self.first

    def warn_due(self, now: float, stuck: bool) -> bool:
        return self.check > 0 and now - self.last_warn >= self.check and (self.lead or stuck)

    def warn(self, now: float, infos: list, mine: Iterable, in_cycle_since: float) -> None:
        """Write one warning for the stalled requests ``infos`` and, while this rank is
        stuck, for this rank's own requests ``mine`` that waited the check time."""
        lines = [i.describe(now) for i in infos]
        lines += [f"{r.ann.kind} of tensor '{r.ann.name}' has waited {now - r.t_submit:.1f} s "
                  f"on rank {self.rank}{self.where}; other ranks have not negotiated for "
                  f"{now - in_cycle_since:.1f} s" for r in mine if now - r.t_submit >= self.check]
        if not lines:
            self.reported = frozenset()      # the next stall shows the stacks again
            return
        self.last_warn = now
        sys.stderr.write(
            f"[hvd_magic rank {self.rank}] WARNING: stall{self.where}: one or more tensors were submitted "
            f"by some ranks and have waited more than {self.check:g} s for the others. Ranks that "
            "submit different tensors, or only some ranks submitting, cause this.\n  "
            + "\n  ".join(lines) + "\n")
        sys.stderr.flush()
        names = frozenset([i.name for i in infos] + [r.ann.name for r in mine])
        if self.ranks and names != self.reported:
            self.reported = names
            threading.Thread(target=self.write_stacks, name="hvd_magic-stacks",
                             daemon=True).start()

    def note_submitted(self, now: float, mine: Iterable, sites: dict) -> None:
        """Write down this rank's requests that waited half the check time, and where the
        user's code submitted them, for the stall report of whichever rank warns."""
        if self.check <= 0:
            return
        lines = tuple(f"{r.ann.kind} '{r.ann.name}' at {sites[r.ann.name]}" for r in mine
                      if r.ann.name in sites and now - r.t_submit >= self.check / 2)
        if lines != self.noted:
            self.noted = lines
            from ..stacks import dump
            dump.write_submitted(self.rank, lines)

    def write_stacks(self) -> None:
        """Gather every rank's stack and write them to stderr under the warning."""
        from ..stacks import dump, group
        try:
            stacks = dump.gather(dump.job_dir(), self.ranks)
            text = group.render(stacks, title=f"stall{self.where}: the stacks")
            if any(s.missing for s in stacks) and dump.ask_launcher():
                text += ("\n  (hvdrun gathers the stacks of the ranks on other hosts: "
                         "'hvdrun: the stacks' below)")
        except Exception as exc:  # noqa: BLE001 - the warning itself is out already
            text = f"stall{self.where}: the ranks' stacks could not be gathered: {exc!r}"
        sys.stderr.write(f"[hvd_magic rank {self.rank}] {text}\n")
        sys.stderr.flush()

    def to_fail(self, now: float, infos: dict, mine: Iterable, cancelled: set, stuck: bool,
                in_cycle_since: float) -> tuple:
        """``(cancels, local)`` after the shutdown time: ``(name, message)`` for this rank to
        announce (it submitted a request the others have not), and this rank's requests to
        fail here (the other ranks stopped negotiating). ``infos``: name -> StallInfo."""
        cancels, local = [], []
        for r in mine:
            name = r.ann.name
            if name in cancelled or now - r.t_submit < self.kill:
                continue
            info = infos.get(name)
            if info is not None and self.rank in info.ready_ranks:
                cancels.append((name, stall_message(info, now, self.kill)))
            elif stuck and now - in_cycle_since > self.kill:
                local.append(r)
        return cancels, local

    def local_error(self, r, now: float, in_cycle_since: float) -> StallError:
        return StallError(
            f"{r.ann.kind} of tensor '{r.ann.name}' was submitted on rank {self.rank}{self.where} but the "
            f"other ranks have not taken part in negotiation for {now - in_cycle_since:.1f} s "
            f"(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={self.kill:g}); check that every rank runs the "
            "same collectives")


def stall_message(info: StallInfo, now: float, limit: float) -> str:
    return (f"{info.describe(now)}; gave up after HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={limit:g}. "
            "Make every rank submit the same tensors (same names, same order of collectives).")
