"""``horovod.mxnet`` (0.28, MXNet 1.x) for hvd_magic: port a Horovod script by changing its
import::

    import mxnet as mx
    import hvd_magic.mxnet as hvd

    hvd.init()
    net = build_net()
    net.initialize(ctx=mx.cpu())
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)      # deferred-initialised ones too
    trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": 0.01 * hvd.size()})
    for x, y in shard_of_my_data:                       # each rank trains on its own shard
        with mx.autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])                        # gradients averaged over the ranks

MXNet 1.9.1 needs numpy<1.24, so it lives in an environment of its own (docs/mxnet.md).
NDArrays travel over MPI from the CPU. mxnet itself is imported when first needed:
``import hvd_magic.mxnet`` works without it; ``DistributedOptimizer`` and
``DistributedTrainer`` import it.
"""
from __future__ import annotations

from typing import Any

from hvd_magic.collectives import (Adasum, Average, HorovodInternalError, HvdError, Max, Min,
                                   Product, ProcessSet, StallError, Sum, TensorMismatchError,
                                   add_process_set, ccl_built, cross_rank, cross_size, cuda_built,
                                   global_process_set, gloo_built, gloo_enabled, is_initialized,
                                   local_rank, local_size, mpi_built, mpi_enabled,
                                   mpi_threads_supported, nccl_built, rank, remove_process_set,
                                   rocm_built, shutdown, size, start_timeline, stop_timeline)
from hvd_magic.collectives import report  # live throughput for the %%hvd panel

from .compression import Compression, Compressor
from .functions import allgather_object, broadcast_object, broadcast_parameters
from .mpi_ops import (allgather, allreduce, allreduce_, alltoall, broadcast, broadcast_,
                      grouped_allgather, grouped_allreduce, grouped_allreduce_,
                      grouped_reducescatter, init, reducescatter)

_LAZY = ("DistributedOptimizer", "DistributedTrainer")


def ddl_built() -> bool:
    """IBM DDL is not part of hvd_magic."""
    return False


def __getattr__(name: str) -> Any:
    if name in _LAZY:                     # these subclass mxnet's classes: import mxnet now
        from . import optimizer
        return getattr(optimizer, name)
    raise AttributeError(f"module 'hvd_magic.mxnet' has no attribute {name!r}")


__all__ = sorted([n for n in dir() if not n.startswith("_") and n not in ("annotations", "Any")]
                 + list(_LAZY))
