"""hvd_magic's per-rank collective runtime, with Horovod's API on numpy arrays and CPU
torch tensors. ``import hvd_magic.collectives as hvd``; the framework faces
(``hvd_magic.torch``, ...) build on it.
"""
from .api import (allgather, allgather_async, allgather_object, allreduce, allreduce_,
                  allreduce_async, allreduce_async_, alltoall, alltoall_async, autotune_status,
                  barrier, broadcast, broadcast_, broadcast_async, broadcast_async_,
                  broadcast_object, join, pending, poll, reducescatter, reducescatter_async,
                  start_timeline, stop_timeline, subscribe, synchronize)
from .grouped import (grouped_allgather, grouped_allgather_async, grouped_allreduce,
                      grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
                      grouped_reducescatter, grouped_reducescatter_async)
from .handles import GroupHandle, Handle
from .errors import (HorovodInternalError, HvdError, JoinedRankError, ShutdownError, StallError,
                     TensorMismatchError)
from .ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .process_sets import (ProcessSet, add_process_set, global_process_set, init,
                           remove_process_set)
from .state import (ccl_built, cross_rank, cross_size, cuda_built, gloo_built, gloo_enabled,
                    is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                    mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size)

from .progress import report

__all__ = [n for n in dir() if not n.startswith("_")]
