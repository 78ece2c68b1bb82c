"""Process-wide runtime state: init/shutdown, topology, build facts."""
from __future__ import annotations

import atexit
import importlib.util
import os
import sys
import threading
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .. import config as env
from .errors import NOT_INITIALIZED


@dataclass
class Runtime:
    """This process's runtime (one per process: :data:`runtime`); the collectives' modules
    read it, :func:`start` and :func:`shutdown` change it."""

    comm: Any = None          # the communicator hvd trains on (world or a subset)
    engine: Any = None
    timeline: Any = None
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    threads: bool = False
    config: Any = None
    control: Any = None       # for registering process sets (user thread only)
    sets: dict = field(default_factory=dict)    # process set id -> its ranks and engine
    next_set_id: int = 1
    dynamic: bool = False     # process sets may be added and removed after init
    world: Any = None         # COMM_WORLD, or what a spawned elastic rank shares with the others
    controller: str = "mpi"   # what coordinates the ranks: "mpi", or "gloo" (torch.distributed)
    links: list = field(default_factory=list)   # intercomms of elastic spawns (kept, never freed)

    def make_engine(self, comm: Any, ranks: list, set_id: int) -> Any:
        """An engine for a process set on ``comm`` (its members only)."""
        from .engine import Engine
        cfg = dataclasses.replace(self.config, cpu_operations="mpi" if self.controller == "mpi"
                                  else "gloo")
        return Engine(comm, cfg, self.timeline, ranks=ranks, set_id=set_id)


runtime = Runtime()
#: Held while the runtime starts, stops or registers a process set.
lock = threading.Lock()


def _mpi():
    from mpi4py import MPI
    return MPI


def start(comm: Optional[Any] = None) -> bool:
    """Start the runtime on this rank (``hvd.init``); False when it runs already.

    ``comm`` may be an mpi4py communicator, or a list of world ranks to train on a subset
    (only the ranks in the list call ``init``). Calling ``init`` again while initialized
    does nothing; after ``shutdown`` it starts a fresh runtime.
    """
    with lock:
        if runtime.engine is not None and runtime.engine.dead is None:
            return False
        from . import controller
        if not _is_mpi_comm(comm) and controller.choose() == "gloo":
            _start_gloo(comm)
            return True
        MPI = _mpi()
        if runtime.world is None:   # a rank that elastic.resize spawned joins its spawners
            parent = MPI.Comm.Get_parent()
            if parent == MPI.COMM_NULL:
                runtime.world = MPI.COMM_WORLD
            else:
                runtime.world = parent.Merge(high=True)
                # the spawners' settings: a rank started on another host has a bare environment
                os.environ.update(runtime.world.bcast(None, root=0))
        world = runtime.world
        if comm is None:
            base = world
        elif isinstance(comm, MPI.Comm):
            if comm == MPI.COMM_NULL:
                raise ValueError("init(comm=...) got MPI.COMM_NULL: this process is not in that "
                                 "communicator; only its members call hvd.init(comm)")
            base = comm
        elif isinstance(comm, Sequence) and not isinstance(comm, (str, bytes)):
            ranks = [int(r) for r in comm]
            if len(set(ranks)) != len(ranks) or not ranks:
                raise ValueError(f"init(comm={ranks}): ranks must be a non-empty list without repeats")
            bad = [r for r in ranks if not 0 <= r < world.Get_size()]
            if bad:
                raise ValueError(f"init(comm={ranks}): rank(s) {bad} do not exist; the world has "
                                 f"{world.Get_size()} ranks")
            if world.Get_rank() not in ranks:
                raise ValueError(f"init(comm={ranks}): this process is world rank {world.Get_rank()}, "
                                 "which is not in the list; only the listed ranks call hvd.init")
            group = world.Get_group().Incl(ranks)
            base = world.Create_group(group)
            group.Free()
        else:
            raise TypeError(f"init(comm=...) takes an mpi4py communicator or a list of ranks, "
                            f"not {type(comm).__name__}")
        from .config import Config

        cfg = Config.from_env()
        _set_switch_interval()
        mine = base.Dup()
        local = mine.Split_type(MPI.COMM_TYPE_SHARED, key=mine.Get_rank())
        cross = mine.Split(color=local.Get_rank(), key=mine.Get_rank())
        # Settings that every rank must share, or the ranks would pair different MPI calls
        # (fusion buckets, backends, chunk boundaries) or read each other's announcement
        # tables differently: rank 0's values hold. Chunking is for ranks that share memory
        # (measured there; see backends/mpi.py).
        (cfg.fusion_threshold, cfg.cpu_operations, chunk, cfg.cache_capacity) = mine.bcast(
            (cfg.fusion_threshold, cfg.cpu_operations, cfg.allreduce_chunk, cfg.cache_capacity),
            root=0)
        cfg.allreduce_chunk = chunk if local.Get_size() == mine.Get_size() else 0
        runtime.controller = "mpi"
        runtime.comm = base
        runtime.rank, runtime.size = mine.Get_rank(), mine.Get_size()
        runtime.local_rank, runtime.local_size = local.Get_rank(), local.Get_size()
        runtime.cross_rank, runtime.cross_size = cross.Get_rank(), cross.Get_size()
        runtime.threads = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        local.Free()
        cross.Free()
        _start_engine(mine, cfg, control=base.Dup())
        return True


def _start_engine(mine: Any, cfg: Any, control: Any) -> None:
    """What both controllers' starts end with, once the runtime knows its rank: the
    timeline (keeping its subscribers across a restart), no process sets yet, the engine."""
    from .engine import Engine
    from .timeline import Timeline, TimelineWriter
    old = runtime.timeline
    tl = Timeline(runtime.rank, old.subscribers if old is not None else None)
    runtime.config = cfg
    runtime.control = control
    runtime.sets, runtime.next_set_id = {}, 1
    runtime.timeline = tl
    if cfg.timeline:
        tl.recording = True
        tl.mark_cycles = cfg.timeline_mark_cycles
    engine = Engine(mine, cfg, tl)
    if cfg.timeline and runtime.rank == 0:
        engine.writer = TimelineWriter(cfg.timeline, cfg.timeline_mark_cycles)
    runtime.engine = engine


def _is_mpi_comm(comm: Any) -> bool:
    return comm is not None and type(comm).__module__.startswith("mpi4py")


def _start_gloo(comm: Any) -> None:
    """:func:`start` over torch.distributed (the gloo controller: no MPI world). The
    default process group comes from torchrun's variables unless the user initialized it;
    negotiation runs on gloo groups of its own, data on the default group (gloo for CPU
    tensors, NCCL for CUDA tensors where available)."""
    from . import controller
    if comm is not None:
        raise ValueError("init(comm=...) needs the MPI controller (a job started by hvdrun or "
                         "mpiexec); under torch.distributed (torchrun, hvdrun --gloo) every rank "
                         "calls hvd.init() and subsets of ranks are process sets "
                         "(hvd.init(process_sets=[...]))")
    controller.no_mpi_init()
    controller.init_process_group()
    from .config import Config

    cfg = Config.from_env()
    _set_switch_interval()
    mine = controller.TorchComm.world()
    # Settings every rank must share (see the MPI path): rank 0's values hold. Every tensor
    # goes through torch.distributed, in one call each (no MPI pieces, no shared memory).
    cfg.fusion_threshold, cfg.cache_capacity = mine.bcast(
        (cfg.fusion_threshold, cfg.cache_capacity), root=0)
    cfg.cpu_operations, cfg.allreduce_chunk = "gloo", 0
    runtime.controller = "gloo"
    runtime.world = runtime.comm = mine
    runtime.rank, runtime.size = mine.Get_rank(), mine.Get_size()
    (runtime.local_rank, runtime.local_size,
     runtime.cross_rank, runtime.cross_size) = controller.topology(runtime.rank, runtime.size)
    runtime.threads = True        # (each engine thread has process groups of its own)
    _start_engine(mine, cfg, control=mine.Dup())


def _set_switch_interval() -> None:
    """``HVD_MAGIC_SWITCH_INTERVAL_MS``: set the interpreter's GIL switch interval (opt-in).

    Measured at 2 ranks: 0.5 ms (against Python's 5 ms) doubled a 4 KiB allreduce's latency
    (56-66 us -> 110-116 us) and changed bucketed training throughput within noise, so the
    default leaves the interpreter alone."""
    ms = env.get("HVD_MAGIC_SWITCH_INTERVAL_MS")
    if ms is None:
        return
    if ms > 0:
        sys.setswitchinterval(ms / 1000.0)


def shutdown(timeout: Optional[float] = None) -> None:
    """Stop the runtime on this rank once every rank has called ``shutdown`` (waits up to
    ``timeout`` s, default ``HVD_MAGIC_SHUTDOWN_TIMEOUT`` or 30). Pending work fails."""
    with lock:
        engine = runtime.engine
        if engine is None:
            return
        if timeout is None:
            timeout = env.get("HVD_MAGIC_SHUTDOWN_TIMEOUT")
        for entry in runtime.sets.values():       # process sets first, each among its ranks
            if entry.engine is not None and entry.engine.shutdown(timeout):
                entry.engine.comm.Free()
        runtime.sets = {}
        finished = engine.shutdown(timeout)
        if finished:
            engine.comm.Free()
            runtime.control.Free()
        else:
            import sys
            sys.stderr.write(f"[hvd_magic rank {runtime.rank}] shutdown: the other ranks did not call "
                             f"shutdown() within {timeout:g} s; leaving without them\n")
        runtime.engine = None


def _at_exit() -> None:
    if runtime.engine is not None and runtime.engine.dead is None:
        try:
            shutdown(timeout=env.get("HVD_MAGIC_EXIT_TIMEOUT"))
        except Exception:
            pass
    if env.get("HVD_MAGIC_EXIT_REPORT") and runtime.world is not None:
        # read by hvdrun (runner/launch.py); the interpreter sets sys.last_value when the
        # script ended with an uncaught exception
        ok = 0 if getattr(sys, "last_value", None) is not None else 1
        sys.stderr.write(f"{env.EXIT_MARK} rank={runtime.rank} size={runtime.size} ok={ok}\n")
        sys.stderr.flush()


atexit.register(_at_exit)


def engine():
    e = runtime.engine
    if e is None:
        raise ValueError(NOT_INITIALIZED)
    return e


def is_initialized() -> bool:
    return runtime.engine is not None


def require() -> Runtime:
    """The runtime, or ValueError saying ``hvd.init()`` has not been called."""
    if runtime.engine is None:
        raise ValueError(NOT_INITIALIZED)
    return runtime


def size() -> int:
    """Number of ranks training together."""
    return require().size


def rank() -> int:
    """This process's rank, 0 .. size()-1."""
    return require().rank


def local_size() -> int:
    """Number of ranks on this host."""
    return require().local_size


def local_rank() -> int:
    """This rank's index among the ranks on its host (use it to pick a GPU)."""
    return require().local_rank


def cross_size() -> int:
    """Number of hosts (ranks with the same local rank across hosts)."""
    return require().cross_size


def cross_rank() -> int:
    """This host's index among the hosts."""
    return require().cross_rank


def mpi_threads_supported() -> bool:
    """True when MPI runs with MPI_THREAD_MULTIPLE (False under the gloo controller)."""
    if runtime.engine is not None:
        return runtime.threads and runtime.controller == "mpi"
    MPI = _mpi()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_built() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """MPI is available, and coordinates the ranks once ``hvd.init()`` ran."""
    if runtime.engine is not None:
        return runtime.controller == "mpi"
    return mpi_built()


def gloo_built() -> bool:
    """torch.distributed with gloo is available (the CPU path of the torch backend)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch.distributed as dist
    return dist.is_available() and dist.is_gloo_available()


def gloo_enabled() -> bool:
    """gloo is available, and coordinates the ranks once ``hvd.init()`` ran (the gloo
    controller: torchrun, ``hvdrun --gloo``)."""
    if runtime.engine is not None:
        return runtime.controller == "gloo"
    return gloo_built()


def nccl_built() -> bool:
    """torch.distributed with NCCL is available (needs a CUDA build of torch)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch.distributed as dist
    return dist.is_available() and dist.is_nccl_available()


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    return False
