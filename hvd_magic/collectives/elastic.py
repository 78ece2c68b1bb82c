"""Elastic training that survives a lost rank: Horovod's ``State`` / ``ObjectState`` /
``run`` model on MPI's fault tolerance (ULFM) instead of Horovod's Gloo rendezvous.

How a loss is survived (scripts under ``hvdrun --min-np N`` or ``mpiexec --with-ft ulfm``):

1. A rank dies. The survivors' pending collectives fail within milliseconds (ULFM reports
   ``MPI_ERR_PROC_FAILED`` to the engine thread, which fails all pending work with
   :class:`RankLostError`, a ``HorovodInternalError``).
2. :func:`run_fn`'s wrapper catches it, restores the last committed state, and calls
   :func:`shrink`: the old communicators are revoked, the survivors agree on a new one
   (``MPI_Comm_shrink``), ranks are renumbered 0..n-1, and the runtime starts again on it.
3. ``state.sync()`` broadcasts the committed state from the new rank 0 and ``func`` runs
   again, now on n-1 ranks; one line on rank 0's stderr names the lost ranks, the new size
   and the commit training resumed from.

Errors that are not a lost rank (a shape mismatch, a stall) are raised as before: running
``func`` again would only repeat them. Fewer survivors than ``HVD_MAGIC_ELASTIC_MIN_NP`` is
an error that says so.
"""
from __future__ import annotations

import copy
import functools
import sys
from typing import Any, Callable, List, Optional

from .. import config as env
from .errors import HvdError, RankLostError
from .state import _state, start

class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed; ``skip_sync``: the state needs no new broadcast."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("hosts were updated")
        self.skip_sync = skip_sync


def fault_tolerant() -> bool:
    """Whether this MPI job can survive a lost rank (Open MPI 5 started with ULFM on)."""
    import os
    from mpi4py import MPI
    return (os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true")
            and hasattr(MPI.Comm, "Shrink"))


def shrink() -> tuple:
    """After a lost rank, on every survivor: start the runtime again on the survivors.
    Returns (the lost ranks, numbered as before, the new size)."""
    st = _state
    eng, base = st.engine, st.comm
    for comm in [eng.comm, st.control] + [e.engine.comm for e in st.sets.values() if e.engine]:
        try:
            comm.Revoke()
        except Exception:  # noqa: BLE001 - already revoked or freed
            pass
    eng.stopped.wait(10.0)
    failed = base.Get_failed()
    lost = failed.Translate_ranks(list(range(failed.Get_size())), base.Get_group())
    failed.Free()
    survivors = base.Shrink()
    st.engine = None
    n = survivors.Get_size()
    min_np = env.get("HVD_MAGIC_ELASTIC_MIN_NP")
    if n < min_np:
        raise HvdError(f"rank(s) {', '.join(map(str, lost))} were lost and {n} rank(s) are left, "
                       f"fewer than the minimum of {min_np} (hvdrun --min-np); stopping")
    start(survivors)
    return lost, n


class State:
    """What training must not lose, kept in host memory: ``commit()`` saves it, ``restore()``
    goes back to the last commit, ``sync()`` makes every rank equal to rank 0."""

    def __init__(self, bcast_object: Callable, get_rank: Callable[[], int]):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: List[Callable[[], None]] = []
        self.commits = 0

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Functions to call after each reset (e.g. to scale the learning rate by size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (a copy in host memory), then check for host changes."""
        self.save()
        self.commits += 1
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Hosts come and go with the MPI job here: nothing to check between commits."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called after a reset, before ``sync()``."""


class ObjectState(State):
    """Picklable Python objects as attributes: ``ObjectState(bcast, rank, epoch=0, batch=0)``."""

    def __init__(self, bcast_object: Callable, get_rank: Callable[[], int], **kwargs: Any):
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    def save(self) -> None:
        self._saved_state = copy.deepcopy({k: getattr(self, k) for k in self._saved_state})

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for k, v in copy.deepcopy(self._saved_state).items():
            setattr(self, k, v)


def _lost(exc: BaseException) -> bool:
    """Whether ``exc`` came of a lost rank: a RankLostError, or anything a framework made of
    one (TensorFlow re-raises errors of its host ops as its own) while the runtime died so."""
    eng = _state.engine
    return isinstance(exc, RankLostError) or (
        eng is not None and isinstance(eng.dead, RankLostError))


def run_fn(func: Callable, reset: Callable[[], tuple]) -> Callable:
    """Horovod's ``elastic.run`` around ``func(state, ...)``, with ``reset`` the face's way to
    start again on the survivors (:func:`shrink`, then its own set-up)."""
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not fault_tolerant():
            raise HvdError("elastic training needs MPI fault tolerance (ULFM), and this job was "
                           "started without it: run it with `hvdrun --min-np N -np M ...` or "
                           "`mpiexec --with-ft ulfm ...` (Open MPI 5)")
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - a framework may wrap RankLostError
                if not _lost(exc):
                    raise
                state.restore()
                skip_sync = False
                lost, n = reset()
                if _state.rank == 0:
                    sys.stderr.write(f"[hvd_magic] elastic: lost rank(s) {', '.join(map(str, lost))}"
                                     f"; continuing on {n} rank(s) from commit {state.commits}\n")
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            state.on_reset()
    return wrapper
