"""Carrying out one cycle's decisions on this rank (:class:`Executor`).

The engine decides, in the same order on every rank, which requests are ready (the
``Response`` list of one cycle and its fusion plan); the executor takes this rank's
requests for them out of the table of requests in flight, calls the backend (MPI for CPU
tensors by default; for CUDA tensors torch.distributed with NCCL, or the host path where
NCCL cannot run), records the negotiate/queue spans in the timeline, and resolves each
request's :class:`~.handles.Handle`.
"""
from __future__ import annotations

import itertools
import operator
import time
from typing import Callable, Optional

from mpi4py import MPI

from .. import config as env
from .config import Config
from .errors import HvdError, JoinedRankError, ShutdownError, StallError, TensorMismatchError, \
    rank_lost_error
from .fusion import Bucket
from .handles import Handle, LocalReq
from .negotiation import Response
from .timeline import NEGOTIATE, QUEUE, Timeline, now_us, request_args

_ANN_OF = operator.attrgetter("ann")
_NAME_OF = operator.attrgetter("name")
_ERRORS = {"mismatch": TensorMismatchError, "stall": StallError,
           "joined": JoinedRankError, "shutdown": ShutdownError}


class Executor:
    """Executes decided responses for one rank.

    ``inflight`` (name -> :class:`LocalReq`) and ``cancelled`` (names whose requests the
    stall check cancelled) are the engine's own table and set, shared, not copied;
    ``take(name)`` removes a request from the table (and forgets its cancel);
    ``take_join()`` removes this rank's pending join handle (or returns None); ``me``: this
    rank's hvd rank; ``set_id``: the process set it runs (errors name both; only the global
    set, 0, takes device tensors)."""

    def __init__(self, comm: MPI.Comm, config: Config, timeline: Timeline, inflight: dict,
                 cancelled: set, take: Callable[[str], Optional[LocalReq]],
                 take_join: Callable[[], Optional[Handle]], me: int = -1, set_id: int = 0):
        from .backends.mpi import MPIBackend
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.set_id = set_id
        self.where = f" in process set {set_id}" if set_id else ""
        self.who = f"rank {self.rank if me < 0 else me}{self.where}"
        self.tag = f" (process set {set_id})" if set_id else ""
        self.tl = timeline
        # Under the gloo controller (a torch.distributed communicator) every tensor goes
        # through torch.distributed: there is no MPI to carry any.
        self.mpi_free = hasattr(comm, "data_group")
        self.cpu_mpi = config.cpu_operations == "mpi" and not self.mpi_free
        self.gpu_operations = env.get("HOROVOD_GPU_OPERATIONS")
        self.mpi_backend = (None if self.mpi_free else
                            MPIBackend(comm, timeline, config.allreduce_chunk))
        self._torch_backend = None
        self._host_path = None   # CUDA tensors: None until chosen, False: NCCL, else a HostPath
        self._inflight = inflight
        self._cancelled = cancelled
        self._take = take
        self._take_join = take_join

    def backend(self, device: str, req: Optional[LocalReq] = None):
        """The backend for tensors on ``device``; ``req``: this rank's request (None on a
        joined rank), whose tensor's GPU the first CUDA call uses to choose the path."""
        if device == "cpu" and self.cpu_mpi:
            return self.mpi_backend
        if self.set_id and not (self.mpi_free and device == "cpu"):
            raise HvdError("process sets other than the global one run on CPU tensors over "
                           "MPI or gloo only in hvd_magic; use hvd.global_process_set for "
                           f"{device} tensors")
        if device == "cuda":
            if self._host_path is None:
                self._host_path = self._choose_cuda_path(req)
            if self._host_path:
                return self._host_path
        return self._torch()

    def _torch(self):
        if self._torch_backend is None:
            from .backends.torch_dist import TorchBackend
            self._torch_backend = TorchBackend(self.comm, self.tl)
        return self._torch_backend

    def _choose_cuda_path(self, req: Optional[LocalReq]):
        """The host path (a :class:`HostPath`), or False for NCCL (:func:`cuda_path`: NCCL
        needs every rank on a GPU of its own); once per executor, at its first CUDA call,
        which every rank makes at the same point of the same cycle (collective: one
        allgather of each rank's setting and GPU)."""
        from .backends.torch_dist import HostPath, cuda_path, gpu_identity
        device = getattr(req.tensor, "device", None) if req is not None else None
        try:
            gpu = gpu_identity(device)
        except Exception:  # noqa: BLE001 - counted as a rank without NCCL: host path
            gpu = None     # (and every rank still reaches the allgather below)
        if cuda_path(self.comm.allgather((self.gpu_operations, gpu))) == "nccl":
            return False
        # (under the gloo controller the host copies go through gloo)
        return HostPath(self.mpi_backend or self._torch(), self.tl)

    def close(self) -> None:
        """Release the shared-memory segment and the torch.distributed group, if one was
        made (best effort)."""
        if self.mpi_backend is not None:
            self.mpi_backend.close()
        if self._torch_backend is not None:
            try:
                self._torch_backend.close()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass

    def execute(self, responses: list, decided: float, plan: Optional[list]) -> bool:
        """Carry out one cycle's decisions; ``plan`` is their fusion plan (None for one).
        True: the ranks agreed to shut down."""
        if len(responses) == 1:       # nothing to fuse
            resp = responses[0]
            if resp.kind == "allreduce" and resp.error is None:
                self._reduce([resp], decided)
                return False
            return self._execute_one(resp, decided)
        stop = False
        for item in plan:
            if isinstance(item, Bucket):
                self._reduce(item.responses, decided)
            else:
                stop = self._execute_one(item, decided) or stop
        return stop

    def _reduce(self, responses: list, decided: float) -> None:
        """One allreduce call for ``responses`` (a fusion bucket, or a single request)."""
        if len(responses) == 1 and not self._cancelled:
            # a lone request (most blocking calls): no comprehensions, ~0.6 us less
            req = self._inflight.pop(responses[0].name, None)
            reqs = [req]
            entries = [(req, req.ann if req is not None else responses[0].first)]
        else:
            if self._cancelled:
                reqs = [self._take(resp.name) for resp in responses]
            else:   # (the dict lookups alone, in C: ~0.35 us a request less than take)
                reqs = list(map(self._inflight.pop, map(_NAME_OF, responses),
                                itertools.repeat(None)))
            entries = (list(zip(reqs, map(_ANN_OF, reqs))) if None not in reqs else
                       [(req, req.ann if req is not None else resp.first)
                        for req, resp in zip(reqs, responses)])
        if self.tl.active:
            self._queue_events(entries, decided)
        try:
            # joined ranks count as zeros: Average divides by every rank, as Horovod's does
            self.backend(entries[0][1].device, reqs[0]).allreduce(entries, self.size)
            err = None
        except Exception as exc:  # noqa: BLE001
            err = self.failed("allreduce of " + ", ".join(r.name for r in responses), exc)
        for req in reqs:
            if req is not None:
                req.handle.resolve(req.result, err)

    def failed(self, what: str, exc: BaseException) -> HvdError:
        """The error a request gets when its collective raised ``exc``: RankLostError when
        a rank was lost (then ``hvd.elastic.run`` starts again on the others), else what
        failed where."""
        return (rank_lost_error(exc, self.who, self.comm)
                or HvdError(f"{what} failed on {self.who}: {exc!r}"))

    def _queue_events(self, entries: list, decided: float) -> None:
        if not self.tl.active:
            return
        t = now_us()
        mono = time.monotonic()
        for req, ann in entries:
            if req is None:
                continue
            start = t - (mono - req.t_submit) * 1e6
            self.tl.add(ann.name, NEGOTIATE, start, (decided - req.t_submit) * 1e6,
                        request_args(ann))
            self.tl.add(ann.name, QUEUE, t - (mono - decided) * 1e6, (mono - decided) * 1e6)

    def _execute_one(self, resp: Response, decided: float) -> bool:
        if resp.kind == "shutdown":
            return True
        if resp.kind == "join":
            handle = self._take_join()
            if handle is not None:
                handle.resolve(resp.last_joined)
            return False
        req = self._take(resp.name)
        if resp.error is not None:
            if req is not None:
                req.handle.resolve(error=_ERRORS.get(resp.error_kind, HvdError)(resp.error + self.tag))
            return False
        if self.tl.active:
            self._queue_events([(req, resp.first)], decided)
        if req is None:
            return False   # a joined rank has nothing to do for a barrier
        try:
            kind = resp.kind
            device = (req.ann if req is not None else resp.first).device
            if kind == "barrier":
                req.result = None
            elif kind == "allgather":
                self.backend(device, req).allgather(req, resp.anns, self.size)
            elif kind in ("broadcast", "broadcast_object"):
                self.backend(device, req).broadcast(req, resp.anns)
            elif kind == "alltoall":
                self.backend(device, req).alltoall(req, resp.anns)
            elif kind == "reducescatter":
                self.backend(device, req).reducescatter(req, resp.anns)
            else:
                raise HvdError(f"unknown operation {kind!r}")
            err = None
        except Exception as exc:  # noqa: BLE001
            err = self.failed(f"{resp.kind} of tensor '{resp.name}'", exc)
        if req is not None:
            req.handle.resolve(req.result, err)
        return False
