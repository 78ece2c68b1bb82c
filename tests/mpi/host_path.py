"""The host path of CUDA tensors (backends/torch_dist.py HostPath: copy to a host buffer,
the collective over the MPI backend, copy back to the tensor's device), run on CPU torch
tensors over real MPI, where the copies are host copies. Run by tests/test_gpu_path.py;
what only a GPU shows (the copies to and from the device) is in tests/test_cuda.py.

Every check must give the collective's values, leave an out-of-place call's input as it
was, write an in-place call's result into the caller's tensor, and record Horovod's
MEMCPY_IN_HOST_BUFFER / MEMCPY_OUT_HOST_BUFFER spans around the MPI ones. Prints
``[rank R] FAIL ...`` per failure and exits 1 if any."""
import sys

import torch
from mpi4py import MPI

from checklib import FAILS, check, close
from hvd_magic.collectives.backends.mpi import MPIBackend
from hvd_magic.collectives.backends.torch_dist import HostPath
from hvd_magic.collectives.handles import Handle, LocalReq
from hvd_magic.collectives.negotiation import Ann
from hvd_magic.collectives.ops import ReduceOp
from hvd_magic.collectives.timeline import Timeline

COMM = MPI.COMM_WORLD.Dup()
R, N = COMM.Get_rank(), COMM.Get_size()
TL = Timeline(R)
TL.recording = True
HOST = HostPath(MPIBackend(COMM, TL), TL)


def request(ann, tensor, out=None):
    return LocalReq(ann, tensor, Handle(ann.name, ann.kind, None), out=out)


def every_rank(ann):
    """Each rank's Ann of this request, by rank (what negotiation hands the backends)."""
    return dict(enumerate(COMM.allgather(ann)))


def same_tensor(label, got, want_obj):
    if got is not want_obj:
        FAILS.append(f"{label}: the result is not the caller's tensor")


@check("allreduce out of place, Sum, float32")
def _():
    x = torch.full((3, 4), float(R + 1))
    req = request(Ann("ar", "allreduce", "float32", (3, 4), int(ReduceOp.SUM)), x)
    HOST.allreduce([(req, req.ann)], N)
    close("result", req.result, torch.full((3, 4), float(N * (N + 1) // 2)))
    close("input unchanged", x, torch.full((3, 4), float(R + 1)))


@check("allreduce in place, Average, bfloat16")
def _():
    x = torch.full((5,), float(2 * R + 2), dtype=torch.bfloat16)
    req = request(Ann("ar_", "allreduce", "bfloat16", (5,), int(ReduceOp.AVERAGE)), x, out=x)
    HOST.allreduce([(req, req.ann)], N)
    same_tensor("result", req.result, x)
    close("values", x.float(), torch.full((5,), float(N + 1)))


@check("fused allreduce of two tensors, Sum, float16 and an in-place one")
def _():
    a = torch.full((2, 3), float(R), dtype=torch.float16)
    b = torch.arange(4, dtype=torch.float16) * (R + 1)
    ra = request(Ann("fa", "allreduce", "float16", (2, 3), int(ReduceOp.SUM)), a)
    rb = request(Ann("fb", "allreduce", "float16", (4,), int(ReduceOp.SUM)), b, out=b)
    HOST.allreduce([(ra, ra.ann), (rb, rb.ann)], N)
    close("a", ra.result.float(), torch.full((2, 3), float(N * (N - 1) // 2)))
    close("a unchanged", a.float(), torch.full((2, 3), float(R)))
    same_tensor("b", rb.result, b)
    close("b", b.float(), torch.arange(4.0) * (N * (N + 1) // 2))


@check("allgather, rows differ per rank, int64")
def _():
    x = torch.full((R + 1, 2), R, dtype=torch.int64)
    req = request(Ann("ag", "allgather", "int64", (R + 1, 2)), x)
    HOST.allgather(req, every_rank(req.ann), N)
    want = torch.cat([torch.full((r + 1, 2), r, dtype=torch.int64) for r in range(N)])
    close("result", req.result, want)
    if req.handle.extra != [r + 1 for r in range(N)]:
        FAILS.append(f"allgather rows per rank: {req.handle.extra}")


@check("broadcast from the last rank, in place and out of place")
def _():
    root = N - 1
    x = torch.full((3,), float(R))
    req = request(Ann("bc_", "broadcast", "float32", (3,), root=root), x, out=x)
    HOST.broadcast(req, every_rank(req.ann))
    same_tensor("in place", req.result, x)
    close("in place", x, torch.full((3,), float(root)))
    y = torch.full((2, 2), float(R))
    req = request(Ann("bc", "broadcast", "float32", (2, 2), root=root), y)
    HOST.broadcast(req, every_rank(req.ann))
    close("out of place", req.result, torch.full((2, 2), float(root)))
    close("input unchanged", y, torch.full((2, 2), float(R)))


@check("alltoall, one row to each rank")
def _():
    x = torch.tensor([[float(R * N + d)] for d in range(N)])
    req = request(Ann("a2a", "alltoall", "float32", (N, 1), splits=(1,) * N), x)
    HOST.alltoall(req, every_rank(req.ann))
    close("result", req.result, torch.tensor([[float(r * N + R)] for r in range(N)]))
    if req.handle.extra != [1] * N:
        FAILS.append(f"alltoall rows received: {req.handle.extra}")


@check("reducescatter, Sum, float32")
def _():
    x = torch.ones(2 * N, 3) * (R + 1)
    req = request(Ann("rs", "reducescatter", "float32", (2 * N, 3), int(ReduceOp.SUM)), x)
    HOST.reducescatter(req, every_rank(req.ann))
    close("result", req.result, torch.full((2, 3), float(N * (N + 1) // 2)))


@check("timeline: the host copies around the MPI call")
def _():
    phases = {}
    for _rank, tensor, phase, _start, _dur, _args in TL.take():
        phases.setdefault(tensor, []).append(phase)
    want = {"ar": "MPI_ALLREDUCE", "ag": "MPI_ALLGATHER", "bc": "MPI_BCAST",
            "a2a": "MPI_ALLTOALL", "rs": "MPI_REDUCESCATTER"}
    for tensor, op in want.items():
        got = phases.get(tensor, [])
        if got[:1] != ["MEMCPY_IN_HOST_BUFFER"] or got[-1:] != ["MEMCPY_OUT_HOST_BUFFER"] \
                or op not in got:
            FAILS.append(f"timeline of {tensor}: {got}")


COMM.Barrier()
for f in FAILS:
    print(f"[rank {R}] FAIL {f}", flush=True)
print(f"[rank {R}] done, {len(FAILS)} failures", flush=True)
HOST.mpi.close()
sys.exit(1 if FAILS else 0)
