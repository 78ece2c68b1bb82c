"""torch.distributed backend: NCCL for CUDA tensors, gloo for CPU tensors; and the host
path for CUDA tensors where NCCL cannot run (:class:`HostPath`, chosen by :func:`cuda_path`).

The process group is set up from the engine's MPI communicator: rank 0 opens a
``TCPStore`` (on 127.0.0.1 when every rank is on one host, else at
:func:`rendezvous_addr`) and sends its address over MPI, so no launcher variables are
needed. The same code runs with gloo on
CPU tensors (``HOROVOD_CPU_OPERATIONS=gloo``), which is how the tests exercise the
path that NCCL takes on GPUs. What only a GPU can show (NCCL itself, CUDA streams)
is marked in the tests as ``gpu``.

NCCL needs a GPU of its own for every rank: it refuses two ranks on one device (a 2-rank
job on a 1-GPU machine). There, or with ``HOROVOD_GPU_OPERATIONS=MPI``, CUDA tensors are
copied into host memory, go through the MPI backend, and come back to their device, as
Horovod's MPI GPU operations do with their host buffer.
"""
from __future__ import annotations

import datetime
import math
import os
import socket
from typing import Any, Optional, Sequence

import numpy as np

from ... import config as env
from .. import ops
from ..handles import LocalReq
from ..ops import ReduceOp
from ..timeline import MEMCPY_IN, MEMCPY_OUT, now_us
from .common import row_elems, scatter_rows


def _torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise ImportError("the torch.distributed backend needs PyTorch: pip install torch "
                          "(or set HOROVOD_CPU_OPERATIONS=mpi)") from None
    if not dist.is_available():
        raise RuntimeError("this PyTorch build has no torch.distributed; use HOROVOD_CPU_OPERATIONS=mpi")
    return torch, dist


_SIOCGIFADDR = 0x8915


def interface_ipv4(name: str) -> Optional[str]:
    """The IPv4 address of network interface ``name`` (Linux), or None."""
    import fcntl
    import struct
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except (OSError, ValueError):
        return None


def rendezvous_addr() -> str:
    """Rank 0's address for the other hosts: ``HVD_MAGIC_RENDEZVOUS_ADDR``; else that of the
    first interface in ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` (hvdrun
    ``--network-interface``); else what the hostname resolves to, unless that is loopback
    (Debian's 127.0.1.1 entry)."""
    given = env.get("HVD_MAGIC_RENDEZVOUS_ADDR").strip()
    if given:
        return given
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        for name in os.environ.get(var, "").split(","):
            name = name.strip().lstrip("^=")
            addr = interface_ipv4(name) if name else None
            if addr:
                return addr
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        why = f"this host's name {socket.gethostname()!r} does not resolve ({exc})"
    else:
        if not addr.startswith("127."):
            return addr
        why = f"this host's name resolves to the loopback address {addr}"
    raise RuntimeError(f"torch.distributed across hosts needs an address of rank 0 that the "
                       f"other hosts reach, and {why}; set HVD_MAGIC_RENDEZVOUS_ADDR, or "
                       "GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME (hvdrun --network-interface eth0)")


def cuda_path(ranks: Sequence[tuple]) -> str:
    """How CUDA tensors travel: ``"nccl"`` (torch.distributed) when every rank has a GPU of
    its own and none has ``HOROVOD_GPU_OPERATIONS=MPI``, else ``"host"`` (:class:`HostPath`).
    ``ranks``: each rank's (``HOROVOD_GPU_OPERATIONS`` value, "nccl" or "mpi"; its
    :func:`gpu_identity`, None for a rank that cannot run NCCL). Every rank decides from the
    same list, so all decide alike."""
    gpus = [gpu for _, gpu in ranks]
    if any(ops == "mpi" for ops, _ in ranks) or None in gpus or len(set(gpus)) < len(gpus):
        return "host"
    return "nccl"


def gpu_identity(device: Any = None) -> Optional[tuple]:
    """(host name, GPU UUID) of ``device`` (a ``torch.device``; default: this thread's
    current CUDA device), or None where NCCL cannot run (no CUDA GPU, or no NCCL in this
    PyTorch build). Without the UUID (older PyTorch) the device index stands in for it:
    ranks whose different GPUs have the same index then take the host path, which is slower
    but never wrong."""
    try:
        torch, dist = _torch()
    except (ImportError, RuntimeError):
        return None
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    index = device.index if device is not None else None
    if index is None:
        index = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return (socket.gethostname(), str(uuid) if uuid is not None else f"cuda:{index}")


#: Horovod's timeline names of the copies between a GPU tensor and its host buffer.
MEMCPY_IN_HOST = "MEMCPY_IN_HOST_BUFFER"
MEMCPY_OUT_HOST = "MEMCPY_OUT_HOST_BUFFER"


class HostPath:
    """Collectives of device tensors through host memory: each tensor is copied into a host
    buffer, ``mpi`` (the MPI backend) runs the collective on it (in place for allreduce and
    broadcast), and the result is copied back to the tensor's device, or into the caller's
    tensor for an in-place call. Nothing here is specific to CUDA: a CPU tensor's copies
    are plain host copies."""

    def __init__(self, mpi: Any, timeline: Any):
        self.mpi = mpi
        self.tl = timeline

    @staticmethod
    def _in(req: Any, inplace: bool) -> LocalReq:
        """A request on a host copy of ``req``'s tensor, with ``req``'s handle (allgather and
        alltoall leave the rows per rank on it); ``inplace``: the result goes into that copy."""
        t = req.tensor.detach()
        host = t.new_empty(t.shape, device="cpu").copy_(t)
        return LocalReq(req.ann, host, req.handle, out=host if inplace else None)

    @staticmethod
    def _out(req: Any, host_req: LocalReq) -> None:
        """``host_req``'s result to ``req``: into the caller's tensor, else on its device."""
        res = host_req.result
        if req.out is not None:
            req.out.copy_(res.reshape(req.out.shape))
            req.result = req.out
        else:
            req.result = res.to(req.tensor.device)

    def _run(self, name: str, req: Any, inplace: bool, call: Any) -> None:
        """One request: copy in, ``call(host request)``, copy out, with their timeline spans
        (each recorded before the next phase starts: the timeline file keeps them in the
        order they were recorded)."""
        tl = self.tl.active
        t0 = now_us() if tl else 0.0
        host_req = self._in(req, inplace)
        if tl:
            self.tl.add(name, MEMCPY_IN_HOST, t0, now_us() - t0)
        call(host_req)
        t2 = now_us() if tl else 0.0
        self._out(req, host_req)
        if tl:
            self.tl.add(name, MEMCPY_OUT_HOST, t2, now_us() - t2)

    def allreduce(self, entries: list, n_contrib: int) -> None:
        tl = self.tl.active
        t0 = now_us() if tl else 0.0
        host = [(None if req is None else self._in(req, True), ann) for req, ann in entries]
        if tl:
            t1 = now_us()
            for _, ann in entries:
                self.tl.add(ann.name, MEMCPY_IN_HOST, t0, t1 - t0)
        self.mpi.allreduce(host, n_contrib)
        t2 = now_us() if tl else 0.0
        for (req, _), (host_req, _) in zip(entries, host):
            if req is not None:
                self._out(req, host_req)
        if tl:
            t3 = now_us()
            for _, ann in entries:
                self.tl.add(ann.name, MEMCPY_OUT_HOST, t2, t3 - t2)

    def allgather(self, req: Any, anns: dict, n_ranks: int) -> None:
        self._run(req.ann.name, req, False, lambda h: self.mpi.allgather(h, anns, n_ranks))

    def broadcast(self, req: Any, anns: dict) -> None:
        self._run(req.ann.name, req, True, lambda h: self.mpi.broadcast(h, anns))

    def alltoall(self, req: Any, anns: dict) -> None:
        self._run(req.ann.name, req, False, lambda h: self.mpi.alltoall(h, anns))

    def reducescatter(self, req: Any, anns: dict) -> None:
        self._run(req.ann.name, req, False, lambda h: self.mpi.reducescatter(h, anns))


class TorchBackend:
    """Collectives through torch.distributed (one process group for the engine)."""

    def __init__(self, comm: Any, timeline: Any):
        torch, dist = _torch()
        self.torch, self.dist = torch, dist
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.tl = timeline
        self.group = self._setup(comm)
        self._ops = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVERAGE: dist.ReduceOp.SUM,
                     ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX,
                     ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT}

    # -------------------------------------------------------------- set-up
    def _setup(self, comm: Any) -> Any:
        torch, dist = self.torch, self.dist
        if hasattr(comm, "data_group"):
            return comm.data_group()    # the gloo controller's: torch.distributed is up
        if dist.is_initialized():
            if dist.get_world_size() == self.size and dist.get_rank() == self.rank:
                return None   # the user's default group matches: share it
            raise RuntimeError(
                f"torch.distributed is already initialized with world size {dist.get_world_size()} "
                f"and rank {dist.get_rank()}, but hvd_magic runs {self.size} ranks (this one is "
                f"{self.rank}); destroy that process group or initialize it with the same ranks")
        hosts = comm.allgather(socket.gethostname())
        single_host = len(set(hosts)) == 1
        if single_host:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        timeout = datetime.timedelta(seconds=env.get("HVD_MAGIC_TORCH_INIT_TIMEOUT"))
        addr, port, error = "", 0, None
        if self.rank == 0:
            try:   # a failure here is sent to every rank, which would otherwise wait forever
                addr = "127.0.0.1" if single_host else rendezvous_addr()
                store = dist.TCPStore(addr, 0, self.size, is_master=True, timeout=timeout,
                                      wait_for_workers=False)
                port = store.port
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                error = f"{type(exc).__name__}: {exc}"
        addr, port, error = comm.bcast((addr, port, error), root=0)
        if error is not None:
            raise RuntimeError(f"setting up torch.distributed failed on rank 0: {error}")
        if self.rank != 0:
            store = dist.TCPStore(addr, port, self.size, is_master=False, timeout=timeout)
        backend = "cpu:gloo,cuda:nccl" if (torch.cuda.is_available() and dist.is_nccl_available()) else "gloo"
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.size,
                                timeout=timeout)
        self._store = store
        self._owns_group = True
        comm.Barrier()
        return None

    def close(self) -> None:
        """Destroy the process group this backend created (its threads must not outlive Python)."""
        if getattr(self, "_owns_group", False) and self.dist.is_initialized():
            self.dist.destroy_process_group()
            self._owns_group = False

    # -------------------------------------------------------------- helpers
    def _tensor(self, x: Any, dtype: str) -> Any:
        """A torch view of the user's tensor; numpy arrays are wrapped without a copy where
        they can be (contiguous, native byte order, writeable) and bfloat16 bits (int16 in
        numpy) are viewed as bfloat16."""
        torch = self.torch
        if isinstance(x, np.ndarray):
            a = ops.as_numpy(x)
            if not a.flags.writeable:
                a = a.copy()
            t = torch.from_numpy(a)
            return t.view(torch.bfloat16) if dtype == "bfloat16" else t
        return x.detach()

    def _numpy(self, t: Any) -> np.ndarray:
        """numpy of a result for a numpy caller (bfloat16 travels as int16 bits, as on MPI)."""
        t = t.cpu()
        return (t.view(self.torch.int16) if t.dtype == self.torch.bfloat16 else t).numpy()

    @staticmethod
    def _scale(buf: Any, factor: float) -> None:
        """``buf *= factor`` in place; integer buffers are scaled in float and truncated, as
        the MPI backend does."""
        if buf.is_floating_point():
            buf.mul_(factor)
        else:
            buf.copy_(buf * factor)

    def _device(self, req: Any, ann: Any) -> Any:
        """Where this rank's buffers go: its CUDA tensor's device, made the engine thread's
        current device as well (``torch.cuda.set_device`` holds per thread, so the user's
        choice on the main thread does not reach this one); a rank without a tensor (joined)
        keeps this thread's current device, set by the tensors before."""
        torch = self.torch
        if ann.device != "cuda":
            return torch.device("cpu")
        if req is not None and isinstance(req.tensor, torch.Tensor):
            torch.cuda.set_device(req.tensor.device)
            return req.tensor.device
        return torch.device("cuda", torch.cuda.current_device())

    @staticmethod
    def _prefix(device: Any) -> str:
        """The timeline's name of the library that carries tensors on ``device`` (Horovod's
        ``NCCL_ALLREDUCE``, ``GLOO_ALLREDUCE``, ...)."""
        return "NCCL" if device.type == "cuda" else "GLOO"

    def _dtype(self, name: str) -> Any:
        return getattr(self.torch, name)

    def _red_dtype(self, name: str, device: str) -> Any:
        torch = self.torch
        if name == "bool":
            return torch.uint8
        if name in ops.HALF and device == "cpu":
            return torch.float32     # gloo reduces half types poorly; do it in float32
        return self._dtype(name)

    def _out(self, req: Any, t: Any) -> None:
        """Hand ``t`` (torch, the request's dtype) back in the user's type."""
        user = req.tensor
        if req.out is not None:
            if isinstance(req.out, np.ndarray):
                np.copyto(req.out, self._numpy(t).reshape(req.out.shape), casting="unsafe")
            else:
                req.out.copy_(t.reshape(req.out.shape))
            req.result = req.out
        elif isinstance(user, np.ndarray):
            req.result = self._numpy(t)
        else:
            req.result = t

    def _finish(self, buf: Any, op: ReduceOp, postscale: float, n_contrib: int) -> None:
        if buf.is_floating_point():
            f = postscale / n_contrib if op == ReduceOp.AVERAGE else postscale
            if f != 1.0:
                buf.mul_(f)
            return
        if op == ReduceOp.AVERAGE and n_contrib != 1:
            buf.div_(n_contrib, rounding_mode="trunc")     # (toward zero, as Horovod's)
        if postscale != 1.0:
            self._scale(buf, postscale)

    def _identity(self, op: ReduceOp, dtype: Any) -> Any:
        torch = self.torch
        if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
            return 0
        if op == ReduceOp.PRODUCT:
            return 1
        if dtype.is_floating_point:
            return float("inf") if op == ReduceOp.MIN else float("-inf")
        info = torch.iinfo(dtype)
        return info.max if op == ReduceOp.MIN else info.min

    def _dist_op(self, op: ReduceOp, dtype_name: str) -> Any:
        if op == ReduceOp.ADASUM:
            if hasattr(self.comm, "data_group"):
                raise ValueError("Adasum runs on CPU tensors only under the gloo controller; "
                                 "reduce a CPU copy (tensor.cpu()), or use hvd.Average")
            raise ValueError("Adasum on GPU tensors is not supported by hvd_magic yet (nor through "
                             "torch.distributed with HOROVOD_CPU_OPERATIONS=gloo); reduce a CPU "
                             "copy (tensor.cpu()) over MPI, or use hvd.Average")
        if dtype_name == "bool" and op == ReduceOp.PRODUCT:
            return self.dist.ReduceOp.MIN
        return self._ops[ReduceOp(op)]

    # -------------------------------------------------------------- allreduce
    def allreduce(self, entries: list, n_contrib: int) -> None:
        torch, dist = self.torch, self.dist
        ann0 = entries[0][1]
        op = ReduceOp(ann0.op)
        if op == ReduceOp.ADASUM and ann0.device == "cpu" and hasattr(self.comm, "data_group"):
            # the gloo controller's CPU tensors: the same Adasum as MPI's, over its
            # communicator (each tensor alone: the fusion plan never fuses Adasum)
            from .mpi import adasum_request
            for req, ann in entries:
                adasum_request(self.comm, self.tl, "GLOO", req, ann)
            return
        self._dist_op(op, ann0.dtype)           # (Adasum: a ValueError before any work)
        device = self._device(next((req for req, _ in entries if req is not None), None), ann0)
        red = self._red_dtype(ann0.dtype, ann0.device)
        if len(entries) == 1 and self._reduce_in_place(entries[0][0], ann0, op, red, device,
                                                       n_contrib):
            return
        sizes = [math.prod(a.shape) for _, a in entries]
        tl = self.tl.active
        t0 = now_us() if tl else 0.0
        buf = torch.empty(sum(sizes), dtype=red, device=device)
        off = 0
        for (req, ann), n in zip(entries, sizes):
            part = buf[off:off + n]
            if req is None:
                part.fill_(self._identity(op, red))
            else:
                part.copy_(self._tensor(req.tensor, ann.dtype).reshape(-1))
            off += n
        if ann0.prescale != 1.0:
            self._scale(buf, ann0.prescale)
        t1 = now_us() if tl else 0.0
        dist.all_reduce(buf, op=self._dist_op(op, ann0.dtype), group=self.group)
        t2 = now_us() if tl else 0.0
        self._finish(buf, op, ann0.postscale, n_contrib)
        out_dtype = self._dtype(ann0.dtype)
        off = 0
        for (req, ann), n in zip(entries, sizes):
            if req is not None:
                self._out(req, buf[off:off + n].to(out_dtype).reshape(ann.shape).clone())
            off += n
        if tl:
            t3 = now_us()
            args = {"bytes": int(buf.numel() * buf.element_size()), "tensors": [a.name for _, a in entries]}
            for _, ann in entries:
                if len(entries) > 1:
                    self.tl.add(ann.name, MEMCPY_IN, t0, t1 - t0)
                self.tl.add(ann.name, f"{self._prefix(device)}_ALLREDUCE", t1, t2 - t1, args)
                if len(entries) > 1:
                    self.tl.add(ann.name, MEMCPY_OUT, t2, t3 - t2)

    def _reduce_in_place(self, req: Any, ann: Any, op: ReduceOp, red: Any, device: Any,
                         n_contrib: int) -> bool:
        """One in-place request whose tensor torch can reduce as it is (contiguous, of the
        reduction's dtype, on ``device``; a numpy array through a torch view of its memory):
        reduced in its own memory, with no buffer to fill and empty (a fused bucket from
        ``DistributedOptimizer`` is such a tensor: 1.7 MB under torchrun took 2.6 ms a call
        through the buffer, its two copies and two fresh allocations). False: not such a
        request, nothing done."""
        out = None if req is None else req.out
        if isinstance(out, self.torch.Tensor):
            t = out.detach()
        elif isinstance(out, np.ndarray) and out is req.tensor and out.flags.writeable \
                and ops.as_numpy(out) is out:        # (contiguous, native: no copy made)
            t = self.torch.from_numpy(out)
        else:
            return False
        if not (t.is_contiguous() and t.dtype == red and t.device == device):
            return False
        if ann.prescale != 1.0:
            self._scale(t, ann.prescale)
        t0 = now_us() if self.tl.active else 0.0
        self.dist.all_reduce(t, op=self._dist_op(op, ann.dtype), group=self.group)
        if self.tl.active:
            self.tl.add(ann.name, f"{self._prefix(device)}_ALLREDUCE", t0, now_us() - t0,
                        {"bytes": int(t.numel() * t.element_size()), "tensors": [ann.name]})
        self._finish(t, op, ann.postscale, n_contrib)
        req.result = out
        return True

    # -------------------------------------------------------------- allgather
    def allgather(self, req: Any, anns: dict, n_ranks: int) -> None:
        """(Every rank takes part: an allgather never runs while a rank has joined.)"""
        torch, dist = self.torch, self.dist
        ann0 = next(iter(anns.values()))
        dev = self._device(req, ann0)
        dt = torch.uint8 if ann0.dtype == "bool" else self._dtype(ann0.dtype)
        tail = tuple(ann0.shape[1:]) if ann0.shape else ()
        rows = [anns[r].shape[0] if anns[r].shape else 0 for r in range(self.size)]
        most = max(rows)
        send = torch.zeros((most,) + tail, dtype=dt, device=dev)
        if rows[self.rank]:
            send[:rows[self.rank]].copy_(self._tensor(req.tensor, ann0.dtype).reshape((rows[self.rank],) + tail).to(dt))
        recv = [torch.empty_like(send) for _ in range(self.size)]
        t0 = now_us() if self.tl.active else 0.0
        dist.all_gather(recv, send, group=self.group)
        if self.tl.active:
            self.tl.add(ann0.name, f"{self._prefix(dev)}_ALLGATHER", t0, now_us() - t0)
        out = torch.cat([recv[r][:rows[r]] for r in range(self.size)], dim=0).to(self._dtype(ann0.dtype))
        req.handle.extra = rows
        self._out(req, out)

    # -------------------------------------------------------------- broadcast
    def broadcast(self, req: Any, anns: dict) -> None:
        torch, dist = self.torch, self.dist
        ann0 = next(iter(anns.values()))
        root = ann0.root
        shape = anns[root].shape
        dev = self._device(req, ann0)
        dt = torch.uint8 if ann0.dtype == "bool" else self._dtype(ann0.dtype)
        if self.rank == root:
            buf = self._tensor(req.tensor, ann0.dtype).reshape(shape).to(dt).clone()
        else:
            buf = torch.empty(shape, dtype=dt, device=dev)
        t0 = now_us() if self.tl.active else 0.0
        # (torch.distributed names the root by its world rank; a process set's communicator
        # under the gloo controller lists its members' world ranks)
        src = self.comm.ranks[root] if hasattr(self.comm, "ranks") else root
        dist.broadcast(buf, src=src, group=self.group)
        if self.tl.active:
            self.tl.add(ann0.name, f"{self._prefix(dev)}_BCAST", t0, now_us() - t0)
        self._out(req, buf.to(self._dtype(ann0.dtype)))

    # -------------------------------------------------------------- alltoall
    def alltoall(self, req: Any, anns: dict) -> None:
        torch, dist = self.torch, self.dist
        ann0 = anns[self.rank]
        dt = torch.uint8 if ann0.dtype == "bool" else self._dtype(ann0.dtype)
        self._device(req, ann0)
        send = self._tensor(req.tensor, ann0.dtype).to(dt).contiguous()
        send_rows = list(ann0.splits)
        recv_rows = [anns[r].splits[self.rank] for r in range(self.size)]
        out = torch.empty((sum(recv_rows),) + tuple(ann0.shape[1:]), dtype=dt, device=send.device)
        t0 = now_us() if self.tl.active else 0.0
        dist.all_to_all_single(out, send, output_split_sizes=recv_rows, input_split_sizes=send_rows,
                               group=self.group)
        if self.tl.active:
            self.tl.add(ann0.name, f"{self._prefix(send.device)}_ALLTOALL", t0, now_us() - t0)
        req.handle.extra = recv_rows
        self._out(req, out.to(self._dtype(ann0.dtype)))

    # -------------------------------------------------------------- reducescatter
    def reducescatter(self, req: Any, anns: dict) -> None:
        """Allreduce, then keep this rank's rows (gloo has no reduce_scatter)."""
        ann0 = anns[self.rank]
        op = ReduceOp(ann0.op)
        self._device(req, ann0)
        t = self._tensor(req.tensor, ann0.dtype)
        red = self._red_dtype(ann0.dtype, ann0.device)
        buf = t.to(red).clone().reshape(-1)
        if ann0.prescale != 1.0:
            self._scale(buf, ann0.prescale)
        t0 = now_us() if self.tl.active else 0.0
        self.dist.all_reduce(buf, op=self._dist_op(op, ann0.dtype), group=self.group)
        if self.tl.active:
            self.tl.add(ann0.name, f"{self._prefix(buf.device)}_REDUCESCATTER", t0, now_us() - t0)
        self._finish(buf, op, ann0.postscale, self.size)
        rows = scatter_rows(ann0.shape[0], self.size)
        re = row_elems(ann0.shape)
        start = sum(rows[:self.rank]) * re
        mine = buf[start:start + rows[self.rank] * re].reshape((rows[self.rank],) + tuple(ann0.shape[1:]))
        self._out(req, mine.to(self._dtype(ann0.dtype)).clone())
