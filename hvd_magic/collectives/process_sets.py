"""Process sets: collectives among a subset of the ranks, as in Horovod.

A :class:`ProcessSet` names some ranks (hvd ranks, as ``hvd.rank()`` numbers them). Once
registered, by ``hvd.init(process_sets=[...])`` or :func:`add_process_set`, every collective
takes it as ``process_set=``; only its ranks call those collectives. Each set negotiates on
its own communicator with its own engine thread, so a collective in one set never waits for
another set's ranks. Registering and removing sets are collective over all ranks, in the same
order everywhere. ``root_rank`` stays the global rank, as in Horovod.

Example, 3 ranks::

    hvd.init(process_sets="dynamic")                 # or HOROVOD_DYNAMIC_PROCESS_SETS=1
    evens = hvd.add_process_set([0, 2])              # every rank calls it
    if evens.included():                             # ranks 0 and 2
        hvd.allreduce(np.array([hvd.rank()]), op=hvd.Sum, process_set=evens)   # -> [2]
    evens.rank(), evens.size()                       # rank 2: (1, 2); rank 1: (None, 2)
    hvd.remove_process_set(evens)                    # every rank calls it
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence, Union

from .. import config as env
from .state import lock, require, runtime, start


class ProcessSet:
    """Some ranks that run collectives together: ``ProcessSet([0, 2])`` (any iterable of
    ranks, kept sorted: ``ProcessSet(reversed(range(1, n)))`` is ranks 1..n-1) or
    ``ProcessSet(mpi_comm)`` (an mpi4py communicator over some of the ranks; each rank passes
    its own). ``process_set_id`` is set once the set is registered."""

    process_set_id: Optional[int] = None
    ranks: Optional[list] = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Union[Iterable[int], Any]):
        try:      # any iterable of ranks, sorted (as Horovod's): range, generator, set...
            given = list(ranks_or_comm)
        except TypeError:      # (an mpi4py communicator is not iterable)
            from mpi4py import MPI
            if not isinstance(ranks_or_comm, MPI.Comm):
                raise ValueError("ProcessSet takes an iterable of int ranks or an mpi4py "
                                 f"communicator, not {type(ranks_or_comm).__name__}") from None
            self.mpi_comm = ranks_or_comm
            return
        if any(isinstance(r, bool) or not isinstance(r, int) for r in given):
            raise ValueError("ProcessSet takes an iterable of int ranks or an mpi4py "
                             f"communicator, got {given!r}")
        ranks = sorted(given)
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet({given!r}): a rank appears twice")
        self.ranks = ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> Optional[int]:
        """Number of ranks in the set (None until it is registered)."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return require().size
        return len(_ranks_of(self.process_set_id))

    def rank(self) -> Optional[int]:
        """This rank's index within the set (None when not registered or not a member).
        Collectives still take global ranks (``root_rank``), as in Horovod."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return require().rank
        ranks = _ranks_of(self.process_set_id)
        me = require().rank
        return ranks.index(me) if me in ranks else None

    def included(self) -> Optional[bool]:
        """Whether this rank is in the set (None when its ranks are not known yet)."""
        if self.process_set_id == 0:
            return runtime.engine is not None
        if self.ranks is None:
            return None
        return require().rank in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _ranks_of(set_id: int) -> list:
    st = require()
    if set_id == 0:
        return list(range(st.size))
    entry = st.sets.get(set_id)
    if entry is None:
        raise ValueError(f"process set {set_id} was removed (or belongs to an earlier "
                         "hvd.init()); add it again with hvd.add_process_set")
    return entry.ranks


def init(comm: Optional[Any] = None, process_sets: Any = None) -> None:
    """Start the runtime on this rank (see :func:`.state.start` for ``comm``).
    ``process_sets``: a list of :class:`ProcessSet` to register now (the same sets on every
    rank, or communicators each rank is in), or ``"dynamic"`` to allow
    :func:`add_process_set` later (as ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` does).

    An entry with the same ranks as an earlier one, or as the global set, raises
    ``ValueError`` naming it, after the runtime and the other sets have started (as in
    Horovod, whose C++ core registers the sets before the check)."""
    dynamic = isinstance(process_sets, str) and process_sets == "dynamic"
    sets: Optional[list] = []
    if process_sets is not None and not dynamic:
        try:            # any iterable of ProcessSet, as Horovod's
            sets = None if isinstance(process_sets, str) else list(process_sets)
        except TypeError:
            sets = None
        if sets is None or not all(isinstance(ps, ProcessSet) for ps in sets):
            raise TypeError('init(process_sets=...) takes a list of ProcessSet or "dynamic", '
                            f"not {process_sets!r}")
    if start(comm):
        runtime.dynamic = dynamic or env.get("HOROVOD_DYNAMIC_PROCESS_SETS")
        global_process_set.ranks = list(range(runtime.size))
        if sets:
            _register(sets)
            for i, ps in enumerate(sets):
                if ps.process_set_id is None:
                    first = next((j for j, o in enumerate(sets[:i]) if o.ranks == ps.ranks), None)
                    like = ("the global process set" if first is None
                            else f"entry number {first}")
                    raise ValueError(
                        f"process_sets entry number {i} is a duplicate: {ps.ranks} are the "
                        f"ranks of {like}; pass each set once to hvd.init (the runtime has "
                        "started, with the other sets registered)")


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a new set after ``hvd.init()`` and return it (every rank calls it, with the
    same ranks). Needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` or ``init(process_sets="dynamic")``."""
    st = require()
    if not st.dynamic:
        raise ValueError("add_process_set needs dynamic process sets: set "
                         "HOROVOD_DYNAMIC_PROCESS_SETS=1 or call hvd.init(process_sets=\"dynamic\")")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise ValueError("add_process_set takes a list of ranks; a set made from an MPI "
                         "communicator can only be registered by hvd.init(process_sets=[...])")
    _register([process_set], adding=True)
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (every rank calls it); False for the global set or a set
    that is not registered. Its ranks' pending requests on it fail."""
    st = require()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"remove_process_set takes a ProcessSet, not {type(process_set).__name__}")
    set_id = process_set.process_set_id
    if not st.dynamic:
        raise ValueError("remove_process_set needs dynamic process sets: set "
                         "HOROVOD_DYNAMIC_PROCESS_SETS=1 or call hvd.init(process_sets=\"dynamic\")")
    ids = st.control.allgather(set_id)
    if len(set(ids)) != 1:
        raise ValueError(f"remove_process_set: the ranks named different sets ({ids}); every "
                         "rank removes the same set, in the same order")
    if set_id is None or set_id == 0 or set_id not in st.sets:
        return False
    with lock:
        entry = st.sets.pop(set_id)
    if entry.engine is not None:
        entry.engine.shutdown(env.get("HVD_MAGIC_SHUTDOWN_TIMEOUT"))
        entry.engine.comm.Free()
    process_set._invalidate()
    return True


def _register(sets: list, adding: bool = False) -> None:
    """Give ``sets`` ids and engines (collective over every rank, on the control
    communicator). Every rank's list may differ only where sets come from communicators."""
    st = require()
    if not st.threads:
        raise ValueError("process sets need MPI with MPI_THREAD_MULTIPLE (each set's engine "
                         "thread calls MPI); this MPI runs with a lower thread level")
    mine = [tuple(ps.ranks) if ps.ranks is not None else _comm_ranks(ps.mpi_comm, st)
            for ps in sets]
    every = st.control.allgather(mine)    # (every rank decides from the same lists)
    for r, lists in enumerate(every):
        if any(not t or not all(0 <= x < st.size for x in t) for t in lists):
            raise ValueError(f"process set ranks must be a non-empty list of ranks "
                             f"0..{st.size - 1}; rank {r} passed {[list(t) for t in lists]}")
    if adding and len({tuple(x) for x in every}) != 1:
        raise ValueError("add_process_set: the ranks passed different sets: "
                         + "; ".join(f"rank {r}: {list(x[0])}" for r, x in enumerate(every)))
    known = {tuple(e.ranks): i for i, e in st.sets.items()}
    known[tuple(range(st.size))] = 0
    if adding and mine[0] in known:
        raise ValueError(f"add_process_set: a process set with ranks {list(mine[0])} exists "
                         f"already (id {known[mine[0]]})")
    order: list = []
    for lists in every:
        for t in lists:
            if t not in known and t not in order:
                order.append(t)
    for t in order:
        comm = _subcomm(st.control, list(t))
        with lock:
            set_id = st.next_set_id
            st.next_set_id += 1
            st.sets[set_id] = _Entry(list(t), None)
            known[t] = set_id
        if comm is not None:
            st.sets[set_id].engine = st.make_engine(comm, list(t), set_id)
    seen = {0}
    for ps, t in zip(sets, mine):
        ps.ranks = list(t)
        ps.process_set_id = known[t]
        if ps.process_set_id in seen:
            ps._invalidate()     # a second object for the same ranks (as Horovod)
        seen.add(known[t])


def _subcomm(control: Any, ranks: list) -> Any:
    """A communicator over ``ranks`` (collective over every rank of ``control``); None on
    the ranks not in it."""
    if hasattr(control, "subset"):      # the gloo controller's (its members only create it)
        return control.subset(ranks)
    from mpi4py import MPI
    group = control.Get_group().Incl(ranks)
    comm = control.Create(group)
    group.Free()
    return None if comm == MPI.COMM_NULL else comm


def _comm_ranks(comm: Any, st: Any) -> tuple:
    """The hvd ranks of a communicator's members, in the communicator's order."""
    from mpi4py import MPI
    if comm == MPI.COMM_NULL:
        return ()
    group = comm.Get_group()
    ours = st.control.Get_group()
    ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), ours)
    group.Free()
    ours.Free()
    if any(r == MPI.UNDEFINED for r in ranks):
        raise ValueError("ProcessSet(mpi_comm): the communicator has ranks that hvd_magic "
                         "does not run on (hvd.init's communicator)")
    return tuple(sorted(ranks))


class _Entry:
    """A registered set: its ranks and, on its members, its engine."""

    def __init__(self, ranks: list, engine: Any):
        self.ranks = ranks
        self.engine = engine


def engine_of(process_set: Any):
    """The engine that runs collectives of ``process_set`` on this rank (ValueError when
    the set is unknown or this rank is not in it)."""
    st = require()
    set_id = getattr(process_set, "process_set_id", "?")
    if set_id == 0:
        return st.engine
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, not {type(process_set).__name__}")
    entry = st.sets.get(set_id)
    if entry is None:
        raise ValueError(f"{process_set} is not registered: pass it to hvd.init(process_sets=[...]) "
                         "or hvd.add_process_set first")
    if entry.engine is None:
        raise ValueError(f"rank {st.rank} is not in process set {set_id} (ranks "
                         f"{', '.join(map(str, entry.ranks))}); only its ranks call its "
                         "collectives (check ps.included() first)")
    return entry.engine
