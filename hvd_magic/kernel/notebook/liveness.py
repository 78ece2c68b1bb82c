"""Runs in the notebook kernel. Whether the pool's ranks are alive: the one place where a rank
is declared lost, paused or survived, and where the pool is told to stop.

The pool only observes and carries out. It gathers what it saw into a :class:`Seen` (the
heartbeat's silent ranks, how ``mpiexec`` and the controller are doing, the rank exits
``mpiexec`` logged, the ranks whose task ended with ipyparallel's ``EngineError``, and, once
the cell is over, each rank's failure) and :func:`judge` returns a :class:`Verdict`: go on
waiting, stop waiting (and how long to let ``mpiexec`` report first), go on without the lost
ranks (an elastic pool), or stop the pool, with the words the user sees. Nothing here
touches a process, so every sequence of events is tested without one
(``tests/test_liveness.py``).

The rules, in order:

* ``mpiexec`` or the controller exited: the MPI job is over. The ranks it names are dead,
  else the ranks whose engine was lost, else the first rank of the cell.
* A rank stopped answering the heartbeat: on an elastic pool, a rank whose process exited
  is lost and the others go on; otherwise it is *paused* (a debugger, SIGSTOP, a frozen
  host or a cut link), the cell ends naming it and the pool stops.
* A rank's engine was lost (its task ended with ``EngineError``), or its training raised
  inside ``hvd.elastic.run`` and it left the job (``FailedRankExit``): on an elastic pool
  whose every other failure is also a lost rank, and with at least ``--min-np`` ranks
  left, they go on, renumbered; else the pool stops.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .output import RankFailure, n_ranks
from .procs import RankExit

#: Verdict actions.
WAIT = "wait"            # all well (or an elastic pool's survivors go on): keep waiting
SETTLE = "settle"        # a rank is gone: stop waiting (after ``grace`` s) and judge the end
GO_ON = "go on"          # an elastic pool: the lost ranks are dropped, the others go on
STOP = "stop"            # the pool must stop; raise the verdict's failures
OK = "ok"                # the cell ended and every rank is alive

#: The exception of a rank whose training raised inside ``hvd.elastic.run`` and that left
#: the job while the others go on (``hvd_magic.collectives.elastic.FailedRankExit``).
LEFT = "FailedRankExit"

#: After ``mpiexec`` exited, its ranks' results are already on their way: wait this long.
RESULTS_GRACE_S = 0.1
#: After a lost engine, ``mpiexec`` says which rank ended and how within about this long.
REPORT_GRACE_S = 1.0


@dataclass(frozen=True)
class Seen:
    """What the pool observed at one moment."""

    size: int                               # ranks in the pool
    heartbeat_s: float                      # silence after which the controller drops a rank
    elastic: bool = False                   # --min-np pool whose MPI job still runs
    min_np: int = 1
    job_ended: Optional[str] = None         # "mpiexec exited with code 1"; None while it runs
    exits: Sequence[RankExit] = ()          # ranks mpiexec reported ended, by engine id
    unheard: Sequence[int] = ()             # ranks the controller dropped (heartbeat)
    unheard_exited: bool = False            # ... and their processes are known to have exited
    engines_lost: Sequence[int] = ()        # ranks whose task ended with EngineError
    where: Dict[int, str] = field(default_factory=dict)     # rank -> "pid 12 on host"
    engines: Sequence[int] = ()             # rank -> engine id (an elastic pool renumbers)
    cell: Optional[Sequence[RankFailure]] = None    # None while the cell runs, then failures
    targets: Sequence[int] = ()             # the ranks the cell ran on
    job: str = "the MPI job"                # what a rank's end ends ("the Ray job" on Ray)


@dataclass(frozen=True)
class Verdict:
    action: str
    lost: Tuple[int, ...] = ()              # ranks declared lost (GO_ON, STOP)
    failures: Tuple[RankFailure, ...] = ()  # what to raise (STOP)
    grace: float = 0.0                      # SETTLE: let mpiexec report for this long first
    ended: str = ""                         # STOP: why the pool is gone, in words
    text: str = ""                          # the line the user sees (GO_ON) or the note (STOP)
    how: Dict[int, str] = field(default_factory=dict)   # GO_ON: lost rank -> how it ended


def judge(seen: Seen) -> Verdict:
    """The verdict on what the pool saw (see the module's rules)."""
    if seen.cell is None:
        return _while_running(seen)
    return _after_cell(seen, list(seen.cell))


def _while_running(seen: Seen) -> Verdict:
    if seen.job_ended is not None:
        return Verdict(SETTLE, grace=RESULTS_GRACE_S)
    if seen.unheard:
        if seen.elastic and seen.unheard_exited:
            return Verdict(WAIT)    # dead ranks of an elastic pool: the others go on
        return Verdict(SETTLE)      # paused or unreachable: the cell ends naming it
    if seen.engines_lost:
        return Verdict(SETTLE, grace=REPORT_GRACE_S)
    return Verdict(WAIT)


def _after_cell(seen: Seen, failures: List[RankFailure]) -> Verdict:
    died = [f.rank for f in failures if f.kind == "died"]
    if died and seen.elastic and seen.job_ended is None:
        left = [r for r in range(seen.size) if r not in died]
        if len(died) == len(failures) and len(left) >= max(1, seen.min_np):
            exits = _exits_by_engine(seen)
            how = {f.rank: f.evalue if f.ename == LEFT else exits.get(_engine(seen, f.rank), "died")
                   for f in failures}
            text = (f"hvd: {'; '.join(f'rank {r} {how[r]}' for r in died)}; the pool goes on "
                    f"with {n_ranks(len(left))}, renumbered 0..{len(left) - 1}")
            return Verdict(GO_ON, lost=tuple(died), how=how, text=text)
    if died or seen.job_ended is not None or seen.unheard:
        return stop(seen, failures)
    return Verdict(OK)


def stop(seen: Seen, failures: Sequence[RankFailure] = ()) -> Verdict:
    """The pool must stop: which ranks to name as dead, and why, in words."""
    job_over = bool(seen.exits) or seen.job_ended is not None
    unheard = [] if job_over else list(seen.unheard)
    targets = list(seen.targets) or [0]
    ended = ended_text(seen)
    dead = [RankFailure(e.rank, "died", "", e.how) for e in seen.exits] or [
        RankFailure(r, "died", "", ended) for r in unheard] or [
        f for f in failures if f.kind == "died"] or [RankFailure(targets[0], "died", "", ended)]
    note = (f"{seen.job} ended, so " if job_over else "") + (
        "the pool was stopped; the next %%hvd cell starts a new one")
    return Verdict(STOP, lost=tuple(f.rank for f in dead), failures=tuple(dead), ended=ended,
                   text=note)


def ended_text(seen: Seen) -> str:
    """How the pool ended, in words: the ranks mpiexec reported, else how mpiexec or the
    controller exited, else the ranks that stopped answering."""
    if seen.exits:
        return "; ".join(f"rank {e.rank} {e.how}" for e in seen.exits)
    if seen.job_ended is not None:
        return seen.job_ended
    if seen.unheard:
        return unheard_text(seen)
    return "the ranks stopped answering"


def unheard_text(seen: Seen) -> str:
    """Why the unheard ranks count as gone, where they ran, and what to do next."""
    where = ", ".join(f"rank {r} ({seen.where.get(r, 'pid ? on ?')})" for r in seen.unheard)
    limit = f"{seen.heartbeat_s:g} s"
    return (f"{where} stopped answering the heartbeat for {limit}: paused (a debugger, "
            f"Ctrl-Z, SIGSTOP), or its host froze or lost the network (a rank that only "
            f"computes still answers; resume a paused one within {limit})")


def _engine(seen: Seen, rank: int) -> int:
    return seen.engines[rank] if rank < len(seen.engines) else rank


def _exits_by_engine(seen: Seen) -> Dict[int, str]:
    return {e.rank: e.how for e in seen.exits}
