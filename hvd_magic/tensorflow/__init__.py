"""``horovod.tensorflow`` for hvd_magic (TensorFlow >= 2.16, CPU): port a Horovod script
by changing its import::

    import hvd_magic.tensorflow as hvd

    hvd.init()
    model = make_model()
    opt = tf.keras.optimizers.SGD(0.01 * hvd.size())

    @tf.function
    def step(x, y, first):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)          # gradients averaged over ranks
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first:                                           # start every rank from rank 0
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

The collectives take tf.Tensor / tf.Variable, run eagerly or inside ``tf.function`` (not
under ``jit_compile=True``) and are differentiable; each takes ``process_set=`` (a
:class:`ProcessSet`) to run among some of the ranks. Tensors travel over MPI through the
runtime in :mod:`hvd_magic.collectives`. For Keras ``model.fit`` see :mod:`hvd_magic.keras`.
"""
from __future__ import annotations

from ._compat import import_tf

import_tf()   # ImportError with what to install before anything else touches TensorFlow

from hvd_magic.collectives import (Adasum, Average, HorovodInternalError, HvdError,  # noqa: E402
                                   Max, Min, ProcessSet, Product, ReduceOp, StallError, Sum,
                                   TensorMismatchError, add_process_set, ccl_built, cross_rank,
                                   cross_size, cuda_built, gloo_built, gloo_enabled,
                                   global_process_set, init, is_initialized, local_rank,
                                   local_size, mpi_built, mpi_enabled, mpi_threads_supported,
                                   nccl_built, rank, remove_process_set, rocm_built, shutdown,
                                   size, start_timeline, stop_timeline)

from .compression import Compression, Compressor  # noqa: E402
from .functions import (allgather_object, broadcast_, broadcast_global_variables,  # noqa: E402
                        broadcast_object, broadcast_object_fn, broadcast_variables, grouped_allgather,
                        grouped_reducescatter, local_rank_op, local_size_op,
                        process_set_included_op, rank_op, size_op)
from .gradient_tape import DistributedGradientTape  # noqa: E402
from .gradient_aggregation import LocalGradientAggregationHelper  # noqa: E402
from .optimizer import DistributedOptimizer  # noqa: E402
from .mpi_ops import (allgather, allreduce, alltoall, barrier, broadcast,  # noqa: E402
                      grouped_allreduce, join, reducescatter)


def ddl_built() -> bool:
    """IBM DDL is not part of hvd_magic."""
    return False


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    return local_size() * cross_size() == size()


def __getattr__(name: str) -> object:
    """``SyncBatchNormalization`` is loaded on first use: it needs Keras 3 on the TensorFlow
    backend, which plain ``import hvd_magic.tensorflow`` does not."""
    if name == "SyncBatchNormalization":
        from .sync_batch_norm import SyncBatchNormalization
        return SyncBatchNormalization
    raise AttributeError(f"module 'hvd_magic.tensorflow' has no attribute {name!r}")


from . import elastic  # noqa: E402 - hvd.elastic.run, TensorFlowKerasState
from . import util  # noqa: E402 - hvd.util._executing_eagerly, as in Horovod
from ._bridge import CollectiveMismatchError  # noqa: E402
from .util import _executing_eagerly  # noqa: E402,F401 - Horovod exports it here too
from .util import gpu_available  # noqa: E402

__all__ = [n for n in dir() if not n.startswith("_") and n != "annotations"] + ["SyncBatchNormalization"]
