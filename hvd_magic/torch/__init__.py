"""``horovod.torch`` for hvd_magic: port a Horovod script by changing its import::

    import hvd_magic.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for x, y in shard_of_my_data:          # each rank trains on its own shard
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()    # gradients are averaged in the background
        optimizer.step()

CPU tensors travel over MPI; CUDA tensors over torch.distributed (NCCL). Pick the GPU
with ``torch.cuda.set_device(hvd.local_rank())``, as with Horovod.
"""
from __future__ import annotations

from hvd_magic.collectives import (Adasum, Average, Handle, HorovodInternalError, HvdError, Max, Min,
                                   Product, ReduceOp, StallError, Sum, TensorMismatchError,
                                   ccl_built, cross_rank, cross_size, cuda_built, gloo_built,
                                   gloo_enabled, init, is_initialized, local_rank, local_size,
                                   mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                                   rocm_built, shutdown, size, start_timeline, stop_timeline,
                                   ProcessSet, add_process_set, global_process_set,
                                   remove_process_set)

from .compression import Compression, Compressor
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .mpi_ops import (allgather, allgather_async, allreduce, allreduce_, allreduce_async,
                      allreduce_async_, alltoall, alltoall_async, barrier, broadcast, broadcast_,
                      broadcast_async, broadcast_async_, grouped_allgather, grouped_allgather_async,
                      grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                      grouped_allreduce_async_, grouped_reducescatter, grouped_reducescatter_async,
                      join, poll, reducescatter, reducescatter_async, sparse_allreduce_async,
                      synchronize)
from .optimizer import DistributedOptimizer
from hvd_magic.collectives import report  # live throughput for the %%hvd panel
from .sync_batch_norm import SyncBatchNorm
from . import elastic  # noqa: E402 - hvd.elastic.run, TorchState, ElasticSampler


def ddl_built() -> bool:
    """IBM DDL is not part of hvd_magic."""
    return False


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    return local_size() * cross_size() == size()


__all__ = [n for n in dir() if not n.startswith("_") and n != "annotations"]
