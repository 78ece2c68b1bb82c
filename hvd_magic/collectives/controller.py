"""Which controller coordinates the ranks (MPI or torch.distributed), and the
torch.distributed one's communicator.

``hvd.init()`` runs over MPI when this process was started by an MPI launcher (``mpiexec``,
``hvdrun``, ``srun`` with PMI/PMIx), and over torch.distributed when it was started by
``torchrun`` (or ``hvdrun --gloo``) or after the user initialized the default process group;
``HOROVOD_CONTROLLER=mpi|gloo`` forces one (:func:`choose`). The launcher is recognised by its
environment alone, so MPI is never initialized in a job that has no MPI world.

The engine, the exchange of announcements, process sets and Adasum talk to a communicator
through the few methods of mpi4py's ``Comm`` they use. Under MPI that communicator *is*
mpi4py's (nothing in between on the hot path); under torch.distributed it is a
:class:`TorchComm`, which does the same with gloo: the response cache's bit vector is an
all_reduce (BAND) of int64 words, announcements an all_gather of byte slots, objects go
through ``all_gather_object`` / ``broadcast_object_list``, sub-communicators are
``new_group``\\ s created by their members only. Data go over the default process group
(gloo for CPU tensors, NCCL for CUDA tensors): :mod:`.backends.torch_dist`.
"""
from __future__ import annotations

import datetime
import os
import sys
from typing import Any, Optional, Sequence

import numpy as np

from .. import config as env

#: Variables that an MPI launcher sets in every rank it starts (Open MPI, PMIx, MPICH/Hydra,
#: Intel MPI, Slurm's PMI-2): their presence means there is an MPI world to join.
MPI_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE",
                     "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE")
#: torchrun's variables (``hvdrun --gloo`` sets the same).
TORCH_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def choose() -> str:
    """``"mpi"`` or ``"gloo"``: ``HOROVOD_CONTROLLER`` when set; else MPI when an MPI
    launcher started this process, or MPI is already running with more than one rank;
    else gloo when torch.distributed's default group is initialized or torchrun's
    variables are set; else MPI (a single process: MPI's singleton world)."""
    forced = env.get("HOROVOD_CONTROLLER")
    if forced:
        return forced
    if any(v in os.environ for v in MPI_LAUNCHER_VARS):
        return "mpi"
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() \
            and mpi.COMM_WORLD.Get_size() > 1:
        return "mpi"
    if _torch_initialized() or all(os.environ.get(v) for v in TORCH_LAUNCHER_VARS):
        return "gloo"
    return "mpi"


def _torch_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def no_mpi_init() -> None:
    """Let mpi4py be imported (its constants and classes) without initializing MPI: under
    the gloo controller the runtime's modules import it, but no MPI call is made."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False


def _dist():
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise ImportError("the gloo controller (no MPI world: torchrun, hvdrun --gloo) needs "
                          "PyTorch: pip install torch, or start the job with hvdrun/mpiexec") from None
    if not (dist.is_available() and dist.is_gloo_available()):
        raise RuntimeError("this PyTorch build has no torch.distributed with gloo, which the gloo "
                           "controller needs; start the job with hvdrun/mpiexec (MPI) instead")
    return torch, dist


def timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=env.get("HVD_MAGIC_TORCH_INIT_TIMEOUT"))


def init_process_group() -> None:
    """Initialize torch.distributed's default group from torchrun's variables, unless the
    user did already: gloo for CPU tensors, and NCCL for CUDA tensors where this build has
    both CUDA and NCCL. Fails within ``HVD_MAGIC_TORCH_INIT_TIMEOUT`` s when ranks are
    missing."""
    torch, dist = _dist()
    if dist.is_initialized():
        return
    missing = [v for v in TORCH_LAUNCHER_VARS if not os.environ.get(v)]
    if missing:
        raise RuntimeError(
            f"hvd.init() found no MPI world and no torch.distributed environment: "
            f"{', '.join(missing)} not set. Start the job with hvdrun (MPI), hvdrun --gloo, "
            "torchrun, or call torch.distributed.init_process_group() before hvd.init()")
    backend = ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available()
               else "gloo")
    try:
        dist.init_process_group(backend, init_method="env://", timeout=timeout())
    except Exception as exc:  # noqa: BLE001 - said with what to check
        raise RuntimeError(
            f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} could not join the "
            f"torch.distributed rendezvous at {os.environ['MASTER_ADDR']}:"
            f"{os.environ['MASTER_PORT']} within {timeout().total_seconds():g} s "
            f"({type(exc).__name__}: {exc}); check that every rank started and reaches that "
            "address (HVD_MAGIC_TORCH_INIT_TIMEOUT sets the wait)") from exc


def topology(rank: int, size: int) -> tuple:
    """(local_rank, local_size, cross_rank, cross_size) from the launcher's variables
    (torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE; hvdrun --gloo's
    HOROVOD_CROSS_RANK and HOROVOD_CROSS_SIZE first); without them
    (a process group the user set up otherwise) the ranks on one host are those with the
    same host name (one allgather)."""
    e = os.environ
    if e.get("LOCAL_RANK") and e.get("LOCAL_WORLD_SIZE"):
        local_rank, local_size = int(e["LOCAL_RANK"]), int(e["LOCAL_WORLD_SIZE"])
        # Horovod's cross rank (among the ranks with the same local rank) where hvdrun --gloo
        # set it: it differs from torchrun's node rank when hosts run unequal numbers of ranks
        cross_rank = int(e.get("HOROVOD_CROSS_RANK") or e.get("GROUP_RANK")
                         or rank // max(local_size, 1))
        cross_size = int(e.get("HOROVOD_CROSS_SIZE") or e.get("GROUP_WORLD_SIZE")
                         or max(1, size // max(local_size, 1)))
        return local_rank, local_size, cross_rank, cross_size
    import socket
    _, dist = _dist()
    hosts: list = [None] * size
    dist.all_gather_object(hosts, socket.gethostname())
    local = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    local_rank = local.index(rank)
    # the cross communicator: the ranks with the same local rank, one per host
    same = [r for r in range(size)
            if [x for x, h in enumerate(hosts) if h == hosts[r]].index(r) == local_rank]
    return local_rank, len(local), same.index(rank), len(same)


#: What gloo says when a peer's process ended or stopped answering.
_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
         "Timed out waiting")


def lost_peer(exc: RuntimeError) -> Exception:
    """gloo's error for a collective that lost a peer, as :class:`RankLostError` (named
    without gloo's traceback); any other error as it is."""
    from .errors import RankLostError
    text = str(exc)
    if any(s in text for s in _LOST):
        first = text.splitlines()[0] if text else type(exc).__name__
        return RankLostError(f"a rank was lost: a collective over torch.distributed failed "
                             f"({first.split('] ', 1)[-1]})")
    return exc


class _Done:
    """A request that completed when it was made (mpi4py's ``Request`` methods)."""

    def Test(self) -> bool:
        return True

    def Wait(self) -> None:
        return None


class _Work:
    """A torch.distributed ``Work`` as an mpi4py ``Request``; ``then`` runs once it is done.

    Gloo moves the data on threads of its own, so a waiter must not poll without sleeping
    (``spin``): on 2 cores a spinning engine thread took the core gloo's threads needed (a
    4 KiB allreduce took 2.5 to 4 ms instead of about 1)."""

    spin = False

    def __init__(self, work: Any, then: Any = None):
        self.work = work
        self.then = then

    def Test(self) -> bool:
        if not self.work.is_completed():
            return False
        self.Wait()
        return True

    def Wait(self) -> None:
        try:
            self.work.wait()
        except RuntimeError as exc:
            raise lost_peer(exc) from None
        if self.then is not None:
            then, self.then = self.then, None
            then()


class TorchComm:
    """The methods of mpi4py's ``Comm`` that the runtime uses, over a gloo process group.

    ``ranks``: the world ranks of the members, in this communicator's order (rank ``i``
    here is world rank ``ranks[i]``); ``group``: their gloo group (None: the whole world's
    default group)."""

    def __init__(self, group: Any, ranks: Sequence[int]):
        torch, dist = _dist()
        self.torch, self.dist = torch, dist
        self.group = group
        self.ranks = list(ranks)
        self.rank = self.ranks.index(dist.get_rank())
        self.size = len(self.ranks)
        self._band = dist.ReduceOp.BAND
        self._ops: dict = {}
        self._data_group: Any = None

    @classmethod
    def world(cls) -> "TorchComm":
        """A communicator over every rank, on a gloo group of its own (collective)."""
        _, dist = _dist()
        ranks = list(range(dist.get_world_size()))
        return cls(dist.new_group(ranks, backend="gloo", timeout=timeout()), ranks)

    def __eq__(self, other: Any) -> bool:
        return self is other

    __hash__ = object.__hash__

    # ------------------------------------------------------------------ mpi4py's names
    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def Dup(self) -> "TorchComm":
        """A communicator over the same ranks with its own group (collective)."""
        return self.subset(range(self.size))

    def subset(self, members: Sequence[int]) -> Optional["TorchComm"]:
        """A communicator over ``members`` (ranks of this communicator, in that order);
        collective over every rank of this communicator, which must span the world
        (``new_group`` is collective over the world); None on the ranks not in it."""
        if self.size != self.dist.get_world_size():
            raise NotImplementedError("the gloo controller makes communicators of the whole "
                                      "world's ranks only")
        members = list(members)
        world = [self.ranks[m] for m in members]
        group = self.dist.new_group(world, backend="gloo", timeout=timeout())
        return TorchComm(group, world) if self.rank in members else None

    def Split(self, color: int, key: int = 0) -> Optional["_Members"]:
        """mpi4py's ``Split``, for Adasum's level groups: the ranks of each color (ordered
        by ``key``) as a :class:`_Members` that reduces over this communicator's own group
        (no new process group, so it works in a process set too); None for
        ``MPI.UNDEFINED`` (a negative color)."""
        every = self.allgather((color, key))
        if color is None or color < 0:
            return None
        return _Members(self, [r for _, r in sorted((k, r) for r, (c, k) in enumerate(every)
                                                      if c == color)])

    def Free(self) -> None:
        """Nothing to release: the group lives as long as the process group."""

    def Barrier(self) -> None:
        self.dist.barrier(group=self.group)

    def allgather(self, obj: Any) -> list:
        out: list = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def bcast(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        self.dist.broadcast_object_list(box, src=self.ranks[root], group=self.group)
        return box[0]

    def _t(self, a: np.ndarray) -> Any:
        """A torch view of numpy array ``a`` (unsigned 64-bit words as signed: gloo has no
        uint64, and bitwise AND does not care)."""
        if a.dtype == np.uint64:
            a = a.view(np.int64)
        return self.torch.from_numpy(a)

    def Iallreduce(self, send: np.ndarray, recv: np.ndarray, op: Any = None) -> _Work:
        """Nonblocking allreduce; the engine's only use: BAND of the response cache's words."""
        np.copyto(recv, send)
        return _Work(self.dist.all_reduce(self._t(recv), op=self._op(op), group=self.group,
                                          async_op=True))

    def _op(self, op: Any) -> Any:
        from mpi4py import MPI
        if op is None or op == MPI.SUM:
            return self.dist.ReduceOp.SUM
        if op == MPI.BAND:
            return self._band
        raise NotImplementedError(f"the gloo controller has no reduction {op!r}")

    def Allreduce(self, send: Any, recv: np.ndarray, op: Any = None) -> None:
        """In place (``send`` is ``MPI.IN_PLACE``) or from ``send`` into ``recv``."""
        if isinstance(send, np.ndarray):
            np.copyto(recv, send)
        self.dist.all_reduce(self._t(recv), op=self._op(op), group=self.group)

    def Iallgather(self, send: np.ndarray, recv: np.ndarray) -> _Work:
        """Every rank's ``send`` into the rows of ``recv`` (shape ``(size, len(send))``)."""
        outs = [self.torch.from_numpy(recv[r]) for r in range(self.size)]
        return _Work(self.dist.all_gather(outs, self.torch.from_numpy(send), group=self.group,
                                          async_op=True))

    def Iallgatherv(self, send: np.ndarray, spec: list) -> _Done:
        """mpi4py's ``[recvbuf, counts, displs, datatype]`` allgather of byte buffers of
        different lengths (gloo gathers equal ones: padded to the longest). Blocking: only
        a message too long for its slot comes here."""
        big, counts, displs = spec[0], spec[1], spec[2]
        most = max(counts)
        pad = np.zeros(most, dtype=np.uint8)
        pad[:send.size] = send
        rows = np.empty((self.size, most), dtype=np.uint8)
        outs = [self.torch.from_numpy(rows[r]) for r in range(self.size)]
        self.dist.all_gather(outs, self.torch.from_numpy(pad), group=self.group)
        for r, (c, d) in enumerate(zip(counts, displs)):
            big[d:d + c] = rows[r, :c]
        return _Done()

    def Send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        self.dist.send(self._t(buf), dst=self.ranks[dest], group=self.group, tag=tag)

    def Recv(self, buf: np.ndarray, source: int, tag: int = 0) -> None:
        self.dist.recv(self._t(buf), src=self.ranks[source], group=self.group, tag=tag)

    def Sendrecv(self, sendbuf: np.ndarray, dest: int, sendtag: int, recvbuf: np.ndarray,
                 source: int, recvtag: int = 0) -> None:
        dist = self.dist
        works = [dist.isend(self._t(np.ascontiguousarray(sendbuf)), dst=self.ranks[dest],
                            group=self.group, tag=sendtag),
                 dist.irecv(self._t(recvbuf), src=self.ranks[source], group=self.group,
                            tag=recvtag)]
        for w in works:
            w.wait()

    def data_group(self) -> Any:
        """The process group that carries this communicator's tensors: the default group
        (gloo and, where available, NCCL) for the whole world; a process set's own gloo
        group otherwise (process sets run CPU tensors only; the engine never has a
        negotiation in flight while it moves data)."""
        return None if self.size == self.dist.get_world_size() else self.group


#: Tag of :class:`_Members`' point-to-point messages (Adasum's own use the MPI tag).
_MEMBERS_TAG = 7


class _Members:
    """Some ranks of a :class:`TorchComm` that sum small float arrays together (Adasum's
    ``group.Allreduce`` of its dot products), by point-to-point messages over that
    communicator: every member sends to the first, which adds in member order (the same
    bytes on every member) and sends the sum back."""

    def __init__(self, comm: TorchComm, members: list):
        self.comm = comm
        self.members = members
        self.rank = members.index(comm.rank)

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return len(self.members)

    def Allreduce(self, send: Any, recv: np.ndarray, op: Any = None) -> None:
        """Sum into ``recv`` (in place when ``send`` is ``MPI.IN_PLACE``)."""
        if isinstance(send, np.ndarray):
            np.copyto(recv, send)
        comm, first = self.comm, self.members[0]
        if self.rank == 0:
            part = np.empty_like(recv)
            total = recv.copy()
            for m in self.members[1:]:
                comm.Recv(part, source=m, tag=_MEMBERS_TAG)
                total += part
            recv[...] = total
            for m in self.members[1:]:
                comm.Send(recv, dest=m, tag=_MEMBERS_TAG)
        else:
            comm.Send(recv, dest=first, tag=_MEMBERS_TAG)
            comm.Recv(recv, source=first, tag=_MEMBERS_TAG)
