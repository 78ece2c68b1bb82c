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

An exception that ``func`` raises on some ranks (bad data on one worker, a failing device)
is those ranks' failure, as in Horovod: each revokes the communicators as a dead rank would,
every live rank meets in :func:`shrink`, the survivors learn who failed and why, the failed
ranks print their traceback and leave, and the others go on as after a loss (rank 0 names
them: ``rank 1 failed: ValueError: bad batch``). When every rank failed, each raises its own
exception. The runtime's own errors (a shape mismatch, a stall) are raised as before: they
hit every rank, and running ``func`` again would only repeat them. Fewer ranks left than
``HVD_MAGIC_ELASTIC_MIN_NP`` is an error that says so; so is a reset beyond
``HVD_MAGIC_ELASTIC_RESET_LIMIT``.

How the job grows or shrinks on purpose (``hvdrun --max-np M --host-discovery-script S``):
at a commit, rank 0 runs the discovery script (at most once a second, as Horovod's driver
polls it) and every rank learns the size the job should have: the slots the script lists,
between ``--min-np`` and ``--max-np``. When it differs from the size now, every rank raises
:class:`HostsUpdatedInterrupt` from that commit and :func:`resize` runs: to grow, the ranks
start the missing ones with ``MPI_Comm_spawn`` (the same command line as theirs; the script's
hosts handed to Open MPI, which starts them in free slots there, on new hosts too) and merge
with them into one communicator; to shrink, the highest ranks leave. The new ranks' first
``state.sync()`` gives them the committed state from rank 0 before their first step.
"""
from __future__ import annotations

import copy
import functools
import os
import random
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from .. import config as env
from .errors import HvdError, RankLostError, rank_lost_error
from .state import runtime, shutdown, start

#: Seconds between two runs of the host discovery script (Horovod's driver polls it as often).
DISCOVERY_INTERVAL_S = 1.0

class FailedRankExit(SystemExit):
    """Raised on a rank whose training function raised inside :func:`run` while enough ranks
    go on: the rank leaves the job (exit status 0, so that ``mpiexec`` keeps the others
    running); ``str()`` says what failed. In a ``%%hvd`` pool the engine then exits and
    the pool goes on without it (:func:`on_leave`)."""

    def __init__(self, text: str) -> None:
        super().__init__(0)
        self.text = text

    def __str__(self) -> str:
        return self.text


#: Called (no arguments) on a rank just before it leaves the job (:func:`on_leave`).
_leave_hooks: List[Callable[[], None]] = []


def on_leave(hook: Callable[[], None]) -> None:
    """Run ``hook()`` on this rank when it leaves an elastic job after its own failure (a
    pool engine uses it to exit once its cell has answered)."""
    _leave_hooks.append(hook)


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed; ``skip_sync``: the state needs no new broadcast.
    ``size``: the number of ranks the job changes to (None when raised by user code)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("hosts were updated")
        self.skip_sync = skip_sync
        self.size: Optional[int] = None


def fault_tolerant() -> bool:
    """Whether this MPI job can survive a lost rank (Open MPI 5 started with ULFM on)."""
    from mpi4py import MPI
    return (os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true")
            and hasattr(MPI.Comm, "Shrink"))


def shrink(failure: Optional[BaseException] = None) -> tuple:
    """After a lost rank or a rank's exception in ``func``, on every rank still running:
    start the runtime again on the ranks that go on. ``failure``: the exception this rank's
    ``func`` raised (None: this rank saw another's loss or failure).

    A rank that failed revokes the communicators, as a lost rank's death does, so the others'
    collectives fail at once and every live rank meets here; the survivors then learn which
    ranks failed and why, and those ranks leave. Returns (the lost ranks, numbered as before;
    ``{rank: "Type: message"}`` of the ranks that failed; the number of ranks that go on).
    Raises :class:`HvdError` on the ranks that go on when fewer than
    ``HVD_MAGIC_ELASTIC_MIN_NP`` would; a rank that failed then returns with the size left,
    and raises its own exception (see :func:`run_fn`)."""
    from mpi4py import MPI
    st = runtime
    eng, base = st.engine, st.comm
    for comm in [eng.comm, st.control] + [e.engine.comm for e in st.sets.values() if e.engine]:
        try:
            comm.Revoke()
        except Exception:  # noqa: BLE001 - already revoked or freed
            pass
    eng.shutdown(10.0)    # a live engine (this rank failed) meets the revoke and stops
    survivors = base.Shrink()
    st.engine = None
    _skip_finalize_fence()
    n = survivors.Get_size()
    # the lost ranks are those the survivors' group lacks (ULFM's Get_failed() can still be
    # empty at this point)
    group, old_group = survivors.Get_group(), base.Get_group()
    old_ranks = group.Translate_ranks(list(range(n)), old_group)
    group.Free()
    old_group.Free()
    lost = [r for r in range(base.Get_size()) if r not in set(old_ranks)]
    # which live ranks failed, and how: every rank says, over the survivors' communicator
    said = survivors.allgather(None if failure is None else failure_text(failure))
    failed = {old_ranks[i]: text for i, text in enumerate(said) if text is not None}
    _note_failed_hosts(lost + sorted(failed))
    left = n - len(failed)
    min_np = env.get("HVD_MAGIC_ELASTIC_MIN_NP")
    if left < max(min_np, 1):
        if failure is not None:
            return lost, failed, left      # run_fn raises this rank's own exception
        raise HvdError(f"{what_happened(lost, failed, past=True)} and {left} rank(s) are left, "
                       f"fewer than the minimum of {min_np} (hvdrun --min-np); stopping")
    going_on = survivors if not failed else survivors.Split(
        MPI.UNDEFINED if failure is not None else 0, survivors.Get_rank())
    if failure is not None:
        return lost, failed, left          # this rank is out of the job
    _restart(going_on)
    return lost, failed, left


def failure_text(exc: BaseException) -> str:
    """How the other ranks name a rank's exception: ``"ValueError: bad batch"``."""
    text = str(exc).strip().splitlines()
    return type(exc).__name__ + (f": {text[0]}" if text else "")


def what_happened(lost: List[int], failed: Dict[int, str], past: bool = False) -> str:
    """``"lost rank(s) 2"``, ``"rank 1 failed: ValueError: bad batch"`` or both; with ``past``:
    ``"rank(s) 2 were lost"`` and ``"rank 1 failed (ValueError: bad batch)"``."""
    parts = []
    if lost:
        ranks = ", ".join(map(str, lost))
        parts.append(f"rank(s) {ranks} were lost" if past else f"lost rank(s) {ranks}")
    for rank, text in sorted(failed.items()):
        parts.append(f"rank {rank} failed ({text})" if past else f"rank {rank} failed: {text}")
    return ", ".join(parts) if past else "; ".join(parts)


def _skip_finalize_fence() -> None:
    """On a rank that survived a loss: MPI_Finalize skips its closing PMIx fence over the
    whole job. In Open MPI 5.0.11 that fence still counts the dead rank and sometimes never
    completes, so survivors that finished training would hang at exit. Open MPI keeps the
    switch for it in libmpi (``ompi_async_mpi_finalize``, no MCA name). Other MPIs: nothing
    to do."""
    import ctypes
    from mpi4py import MPI
    if MPI.get_vendor()[0] != "Open MPI":
        return
    try:
        ctypes.c_bool.in_dll(ctypes.CDLL("libmpi.so.40"), "ompi_async_mpi_finalize").value = True
    except (OSError, ValueError):
        pass


def _restart(comm: Any) -> None:
    from .process_sets import global_process_set
    start(comm)
    global_process_set.ranks = list(range(runtime.size))
    _generation[0] += 1


#: How many times the ranks changed (a loss or a resize); a State that last ran in an
#: earlier generation calls its reset callbacks before it runs again.
_generation = [0]
#: Each change of the ranks this process lived through, in order: a dict with ``t0`` (the
#: failure or host update caught), ``t1`` (the state synced again, training resumes; None
#: until then), ``generation``, ``lost`` (ranks numbered as before), ``joined``, ``left``,
#: ``size`` (after) and ``commit`` (the commits the state had). Read by the notebook panel
#: (:func:`changes`).
_changes: List[Dict[str, Any]] = []
#: True while a rank that joined a notebook pool runs the pool's earlier cells (see
#: :func:`catching_up`): functions wrapped by ``run`` return at once there.
_catching_up = [False]


def changes(since: float = float("-inf")) -> List[Dict[str, Any]]:
    """The changes of the ranks (a lost rank, hosts updated) whose reset began at ``since``
    (``time.time()``) or later; the same list, with the same ``generation`` numbers, on every
    rank that lived through them. A lost rank 2 of 3, after commit 4::

        [{"t0": 1700000000.12, "t1": 1700000000.51, "generation": 1, "lost": [2],
          "joined": 0, "left": 0, "size": 2, "commit": 4}]
    """
    return [dict(c) for c in _changes if c["t0"] >= since]


def catching_up(on: bool) -> None:
    """A rank that joined a ``%%hvd`` pool runs the pool's earlier cells to define what they
    defined (the model, the state, the training function); the training those cells did
    (``hvd.elastic.run`` calls) is not run again: ``sync()`` in the next call gives it the
    state the others reached."""
    _catching_up[0] = on


def spawned() -> bool:
    """Whether :func:`resize` started this rank to join a running job. Such a rank skips the
    checks the others made once at start (they will not make them again for it)."""
    if runtime.controller != "mpi":
        return False              # (the gloo controller starts no ranks; MPI is not running)
    from mpi4py import MPI
    return MPI.Comm.Get_parent() != MPI.COMM_NULL


def parse_discovery(text: str) -> Dict[str, int]:
    """A host discovery script's output, one ``host`` or ``host:slots`` per line, as
    ``{host: slots}`` (a host without slots has 1). ``"a:2\\nb\\n"`` -> ``{"a": 2, "b": 1}``."""
    hosts: Dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, slots = line.partition(":")
        try:
            count = int(slots) if slots else 1
        except ValueError:
            count = -1
        if not name or count < 0:
            raise ValueError(f"host discovery script, line {n}: {line!r} is not 'host' or "
                             "'host:slots' (slots a whole number >= 0)")
        hosts[name] = hosts.get(name, 0) + count
    return hosts


def target_size(size: int, slots: int, min_np: int, max_np: Optional[int]) -> int:
    """The size the job should have with ``slots`` slots discovered: as many ranks as slots,
    at most ``max_np``; never fewer than ``min_np`` (too few slots: stay as is)."""
    want = min(slots, max_np) if max_np else slots
    return size if want < min_np else want


def add_host_info(hosts: Dict[str, int]) -> str:
    """The value of Open MPI's ``PMIX_ADD_HOST`` spawn key for the discovered ``hosts``:
    ``{"a": 2, "b": 1}`` -> ``"a:2,b:1"``. Hosts the job has already are kept as they are,
    and the new ranks go to free slots, so they start on the hosts the script added."""
    return ",".join(f"{host}:{slots}" for host, slots in hosts.items() if slots > 0)


#: Horovod's bounds on ``--blacklist-cooldown-range`` (seconds).
COOLDOWN_LOWEST_S, COOLDOWN_HIGHEST_S = 1, 3600


def check_cooldown_range(cooldown: tuple) -> None:
    """ValueError unless ``(MIN, MAX)`` lies within Horovod's bounds, 1 s to an hour."""
    low, high = cooldown
    if not COOLDOWN_LOWEST_S <= low <= high <= COOLDOWN_HIGHEST_S:
        raise ValueError(f"--blacklist-cooldown-range {low} {high}: must be MIN MAX seconds with "
                         f"{COOLDOWN_LOWEST_S} <= MIN <= MAX <= {COOLDOWN_HIGHEST_S}")


def cooldown_seconds(cooldown: tuple, failures: int, jitter: float) -> float:
    """How long a host that failed for the ``failures``-th time stays out, as Horovod's
    driver computes it: MIN * 2**failures plus ``jitter`` (0 to 1) times MIN, within
    [MIN, MAX]."""
    low, high = cooldown
    return max(low, min(high, low * (1 << failures) + jitter * low))


class Blacklist:
    """Hosts where a rank was lost or failed: the host discovery script's hosts without them
    decide the size the job grows or shrinks to. With no cooldown range a host stays out for
    the rest of the job (Horovod's default); with one, until its cooldown has passed, and a
    host that fails again waits twice as long (a failure during the cooldown adds nothing)."""

    def __init__(self, cooldown: Optional[tuple] = None):
        self.cooldown = cooldown
        self.until: Dict[str, float] = {}
        self.failures: Dict[str, int] = {}

    def add(self, host: str, now: float, jitter: Optional[float] = None) -> None:
        if self.until.get(host, float("-inf")) > now:
            return
        if self.cooldown is None:
            self.until[host] = float("inf")
            return
        self.failures[host] = self.failures.get(host, 0) + 1
        if jitter is None:     # the same on every rank (any may become rank 0)
            jitter = random.Random(f"{host}:{self.failures[host]}").random()
        self.until[host] = now + cooldown_seconds(self.cooldown, self.failures[host], jitter)

    def usable(self, hosts: Dict[str, int], now: float) -> Dict[str, int]:
        """``hosts`` ({host: slots}) without those still out at ``now``."""
        return {h: n for h, n in hosts.items() if self.until.get(h, float("-inf")) <= now}


def _cooldown_setting() -> Optional[tuple]:
    text = env.get("HVD_MAGIC_BLACKLIST_COOLDOWN_RANGE").split()
    return (int(text[0]), int(text[1])) if len(text) == 2 else None


#: Every rank's record of the hosts that failed (the same on each: rank 0 may be lost), and
#: the host each rank runs on (gathered at a commit once per generation, when a host
#: discovery script is set): ``[generation, [host of rank 0, ...]]``.
_blacklist: List[Blacklist] = []
_rank_hosts: List[Any] = [-1, []]


def _note_failed_hosts(ranks: List[int]) -> None:
    """Blacklist the hosts of ``ranks`` (numbered as before the reset), where known."""
    gen, hosts = _rank_hosts
    if gen != _generation[0] or not hosts:
        return
    if not _blacklist:
        _blacklist.append(Blacklist(_cooldown_setting()))
    from mpi4py import MPI
    here = MPI.Get_processor_name()
    for r in ranks:
        if r < len(hosts):
            # a script for one machine names it localhost: the same host to this survivor
            names = [hosts[r]] + (["localhost", "127.0.0.1"] if hosts[r] == here else [])
            for name in names:
                _blacklist[0].add(name, time.time())


def _discover(script: str) -> Optional[int]:
    """Rank 0: the size the discovery script asks for now (None: not time to ask yet); the
    hosts it listed are kept for the spawn (:data:`_discovered`)."""
    now = time.monotonic()
    if now - _discovered[0] < DISCOVERY_INTERVAL_S:
        return None
    _discovered[0] = now
    try:
        out = subprocess.run([script], capture_output=True, text=True, timeout=10, check=True).stdout
        hosts = parse_discovery(out)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        sys.stderr.write(f"[hvd_magic] elastic: host discovery script {script} failed ({exc}); "
                         "keeping the current size\n")
        return None
    if _blacklist:
        hosts = _blacklist[0].usable(hosts, time.time())
    _discovered[1] = hosts
    return target_size(runtime.size, sum(hosts.values()), env.get("HVD_MAGIC_ELASTIC_MIN_NP"),
                       env.get("HVD_MAGIC_ELASTIC_MAX_NP"))


#: Rank 0: when the discovery script last ran, and the hosts it listed ({host: slots}).
_discovered: List[Any] = [float("-inf"), {}]


def host_update() -> Optional[int]:
    """Every rank, at a commit: the size the job should change to, or None (no change, or
    no ``HVD_MAGIC_HOST_DISCOVERY_SCRIPT``)."""
    script = env.get("HVD_MAGIC_HOST_DISCOVERY_SCRIPT")
    if not script or runtime.engine is None:
        return None
    if _rank_hosts[0] != _generation[0]:
        from mpi4py import MPI
        _rank_hosts[:] = [_generation[0], runtime.control.allgather(MPI.Get_processor_name())]
    want = _discover(script) if runtime.rank == 0 else None
    want = runtime.control.bcast(want, root=0)
    return None if want in (None, runtime.size) else want


def resize(want: int) -> tuple:
    """Every rank, at the same commit: grow the job to ``want`` ranks (spawning the new ones)
    or shrink it (ranks ``want`` and up leave the job: they exit, out of ``func`` and the
    script). Returns (joined, left)."""
    from mpi4py import MPI
    base, size, rank = runtime.comm, runtime.size, runtime.rank
    shutdown()
    if want > size:
        argv = list(getattr(sys, "orig_argv", [sys.executable] + sys.argv))
        info = MPI.Info.Create()
        if rank == 0 and _discovered[1]:     # the spawn's root: place the ranks on the hosts
            info.Set("PMIX_ADD_HOST", add_host_info(_discovered[1]))
        inter = base.Spawn(sys.executable, args=argv[1:], maxprocs=want - size, info=info)
        info.Free()
        merged = inter.Merge(high=False)
        merged.bcast(env.settings(), root=0)     # to the new ranks (see state.start)
        runtime.links.append(inter)   # kept: freeing it left the spawned rank hanging in MPI_Finalize
        _restart(merged)
        return want - size, 0
    keep = base.Split(0 if rank < want else MPI.UNDEFINED, rank)
    if keep == MPI.COMM_NULL:
        sys.stderr.write(f"[hvd_magic] elastic: rank {rank} leaves the job (hosts updated: "
                         f"{want} rank(s) now)\n")
        # out of func and the script; MPI_Finalize at exit waits for the others to finish
        raise SystemExit(0)
    _restart(keep)
    return 0, size - want


class State:
    """What training must not lose, kept in host memory: ``commit()`` saves it, ``restore()``
    goes back to the last commit, ``sync()`` makes every rank equal to rank 0."""

    def __init__(self, bcast_object: Callable, get_rank: Callable[[], int]):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: List[Callable[[], None]] = []
        self._hvd_commits = 0
        self._hvd_generation = _generation[0]

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Functions to call after each reset (e.g. to scale the learning rate by size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._hvd_generation = _generation[0]
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (a copy in host memory), then check for host changes."""
        self.save()
        self._hvd_commits += 1
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank when the host discovery script
        asks for another size (every rank calls it at the same commit)."""
        want = host_update()
        if want is not None:
            exc = HostsUpdatedInterrupt(skip_sync=False)
            exc.size = want
            raise exc

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


def _note_change(t0: float, lost: List[int], joined: int, left: int,
                 commit: int) -> Dict[str, Any]:
    """Append a change to :data:`_changes`; its ``t1`` is set once the state synced again."""
    change = {"t0": t0, "t1": None, "generation": _generation[0], "lost": list(lost),
              "joined": joined, "left": left, "size": runtime.size, "commit": commit}
    _changes.append(change)
    return change


def _lost(exc: BaseException) -> bool:
    """Whether ``exc`` came of a lost rank: a RankLostError, or anything a framework made of
    one (TensorFlow re-raises errors of its host ops as its own) while the runtime died so."""
    eng = runtime.engine
    return isinstance(exc, RankLostError) or rank_lost_error(exc, "") is not None or (
        eng is not None and isinstance(eng.dead, RankLostError))


def reset_limit_reached() -> bool:
    """Whether the job was reset (a lost or failed rank, hosts updated) as many times as
    ``HVD_MAGIC_ELASTIC_RESET_LIMIT`` (hvdrun ``--reset-limit``) allows: with limit N, N
    resets happen and the next need for one ends the job, as in Horovod's elastic driver."""
    limit = env.get("HVD_MAGIC_ELASTIC_RESET_LIMIT")
    return limit is not None and _generation[0] >= limit


def check_reset_limit(cause: BaseException) -> None:
    """Raise :class:`HvdError` when the reset that ``cause`` asks for is past the limit."""
    if reset_limit_reached():
        raise HvdError(f"elastic: the job has been reset {_generation[0]} time(s), the most "
                       f"hvdrun --reset-limit {env.get('HVD_MAGIC_ELASTIC_RESET_LIMIT')} allows, "
                       f"and needs another ({cause}); stopping. Raise --reset-limit, or find "
                       "why ranks keep failing") from cause


def run_fn(func: Callable, reset: Callable[[], tuple]) -> Callable:
    """Horovod's ``elastic.run`` around ``func(state, ...)``, with ``reset`` the face's way to
    start again on the survivors (:func:`shrink`, then its own set-up)."""
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if runtime.controller != "mpi":
            raise HvdError("elastic training needs the MPI controller (MPI fault tolerance); this "
                           "job runs over torch.distributed (torchrun, hvdrun --gloo): start it "
                           "with `hvdrun --min-np N -np M ...`")
        if not fault_tolerant():
            raise HvdError("elastic training needs MPI fault tolerance (ULFM), and this job was "
                           "started without it: run it with `hvdrun --min-np N -np M ...` or "
                           "`mpiexec --with-ft ulfm ...` (Open MPI 5)")
        if _catching_up[0]:
            return None
        skip_sync = False
        if getattr(state, "_hvd_generation", _generation[0]) != _generation[0]:
            state.on_reset()        # the pool was resized between two calls (%hvd resize)
        change: Optional[Dict[str, Any]] = None
        while True:
            try:
                if not skip_sync:
                    state.sync()
                if change is not None:
                    change["t1"], change = time.time(), None
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                t0 = time.time()
                skip_sync = exc.skip_sync
                want = getattr(exc, "size", None)   # None: raised by user code, no resize
                if want is not None:
                    check_reset_limit(exc)
                joined, left = resize(want) if want is not None else (0, 0)
                if want is not None and runtime.rank == 0:
                    what = f"{joined} rank(s) joined" if joined else f"{left} rank(s) left"
                    sys.stderr.write(f"[hvd_magic] elastic: hosts updated, {what}; continuing on "
                                     f"{runtime.size} rank(s) from commit {state._hvd_commits}\n")
                if want is not None:
                    change = _note_change(t0, [], joined, left, state._hvd_commits)
            except HvdError as exc:
                if not _lost(exc):
                    raise     # the runtime's own errors (a mismatch, a stall) hit every rank
                t0 = time.time()
                check_reset_limit(exc)
                state.restore()
                skip_sync = False
                change = _after_loss(state, reset, t0, None)
            except Exception as exc:  # noqa: BLE001 - a framework may wrap RankLostError
                t0 = time.time()
                failure = None if _lost(exc) else exc
                if failure is None:
                    check_reset_limit(exc)
                    state.restore()
                elif reset_limit_reached():
                    raise
                skip_sync = False
                change = _after_loss(state, reset, t0, failure)
            state.on_reset()
    return wrapper


def _after_loss(state: State, reset: Callable, t0: float,
                failure: Optional[BaseException]) -> Dict[str, Any]:
    """In ``run``'s handler, after a lost rank or a rank's exception (``failure``, this
    rank's own): start again on the ranks that go on. A rank that failed leaves the job (its
    traceback and a line on its stderr, then ``SystemExit(0)``: Open MPI's mpiexec would end
    the whole job for a non-zero exit, and Horovod's launcher ends with the survivors' result);
    where too few ranks would be left, it raises its own exception instead."""
    lost, failed, n = reset(failure)
    if failure is not None:         # this rank is out of the job (run on n ranks or none)
        if n < max(env.get("HVD_MAGIC_ELASTIC_MIN_NP"), 1):
            raise failure
        traceback.print_exception(type(failure), failure, failure.__traceback__)
        text = f"failed ({failure_text(failure)})"
        sys.stderr.write(f"[hvd_magic] elastic: rank {runtime.rank} {text} and leaves the job; "
                         f"{n} rank(s) go on without it\n")
        sys.stderr.flush()
        for hook in _leave_hooks:
            hook()
        raise FailedRankExit(f"{text} and left the job")
    change = _note_change(t0, lost + sorted(failed), 0, 0, state._hvd_commits)
    change["failed"] = dict(failed)
    if runtime.rank == 0:
        sys.stderr.write(f"[hvd_magic] elastic: {what_happened(lost, failed)}; continuing on "
                         f"{n} rank(s) from commit {state._hvd_commits}\n")
    return change



