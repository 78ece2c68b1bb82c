"""``SyncBatchNormalization``: Keras batch normalization with statistics over every rank's batch.

In training, each rank's per-channel count, sum and sum of squares are summed over the
ranks by one differentiable :func:`allreduce`, so the output, the moving statistics and the
gradients are those of ``keras.layers.BatchNormalization`` run on all ranks' batches
concatenated. Example, 2 ranks, one channel, ``epsilon=0``::

    rank 0: x = [[1.], [3.]]          rank 1: x = [[5.], [7.], [9.]]
    -> mean 5, variance 8 on both ranks (rank 1's three rows weigh more than rank 0's two)
    rank 0: y = [[-1.41], [-0.71]]    rank 1: y = [[0.], [0.71], [1.41]]
"""
from __future__ import annotations

from typing import Any

import hvd_magic.collectives as C
from hvd_magic.collectives import Sum
from hvd_magic.collectives.elastic import fault_tolerant

from ._compat import import_keras, import_tf
from .mpi_ops import allreduce

tf = import_tf()
keras = import_keras()


def local_totals(x: Any, axis: int, mask: Any) -> Any:
    """This rank's ``[count, sum, sum of squares]`` per channel (shape ``(3, C)``, float64);
    ``mask`` (the input's shape less the last axis) drops the positions it marks False."""
    x = tf.cast(x, tf.float64)
    rank = len(x.shape)
    axes = [i for i in range(rank) if i != axis % rank]
    if mask is None:
        s, ss = tf.reduce_sum(x, axes), tf.reduce_sum(x * x, axes)
        n = tf.cast(tf.size(x), tf.float64) / tf.cast(tf.maximum(tf.shape(x)[axis], 1), tf.float64)
        count = tf.fill(tf.shape(s), n)
    else:
        w = tf.broadcast_to(tf.cast(tf.cast(mask, tf.bool), tf.float64)[..., None], tf.shape(x))
        count = tf.reduce_sum(w, axes)
        s, ss = tf.reduce_sum(x * w, axes), tf.reduce_sum(x * x * w, axes)
    return tf.stack([count, s, ss])


def moments_from_totals(totals: Any) -> tuple:
    """``(mean, variance)`` per channel from ``[count, sum, sum of squares]`` summed over the
    ranks (population variance, as Keras computes it; 0 where a channel has no values)."""
    count, s, ss = tf.unstack(totals)
    mean = tf.math.divide_no_nan(s, count)
    var = tf.maximum(tf.math.divide_no_nan(ss, count) - mean * mean, 0.0)
    return mean, var


@keras.saving.register_keras_serializable(package="hvd_magic")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose training statistics cover every rank's batch
    (as ``horovod.tensorflow.SyncBatchNormalization``). Same arguments as Horovod's:
    ``fused=False`` and then those of ``keras.layers.BatchNormalization``.

    Only the moments hook ``BatchNormalization._moments(inputs, mask)`` is overridden: in
    training (``training=True`` and the layer trainable) every rank's count, sum and sum of
    squares per channel are allreduced with ``Sum``, in float64, so ranks may feed batches of
    different sizes and each sample weighs the same (Horovod averages the ranks' moments,
    which is the same only for equal batch sizes). The allreduce is differentiable: the
    backward pass sums the statistics' gradients over the ranks, so ``tape.gradient`` of
    this rank's loss is that of the sum of all ranks' losses, as in Horovod. Masks (the input's
    shape less the last axis, as Keras takes them) count only the unmasked positions.

    Example, 2 ranks, ``SyncBatchNormalization(epsilon=0.0)`` in training::

        rank 0: x = [[1.], [3.]]          -> [[-1.41], [-0.71]]
        rank 1: x = [[5.], [7.], [9.]]    -> [[0.], [0.71], [1.41]]
        both ranks: moving_mean 0.99 * 0 + 0.01 * 5, moving_variance 0.99 * 1 + 0.01 * 8

    Eagerly, inside ``tf.function`` (not ``jit_compile=True``) and in ``model.fit``; every rank
    must run the training step together. Without ``hvd.init()``, at one rank (not in an
    elastic job, which may grow), or outside training it is ``BatchNormalization`` exactly
    (inside ``tf.function`` this is decided when it is traced). Keras names the first one ``sync_batch_normalization``, as Horovod does,
    and the next ones ``sync_batch_normalization_1``, ... (a Keras 3 model wants unique names).
    """

    def __init__(self, fused: Any = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError(f"SyncBatchNormalization does not support fused={fused}: pass "
                             "fused=False (the default), as with Horovod's")
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> tuple:
        # Alone in an elastic job the statistics are still allreduced (over one rank): the
        # job may grow, and a train function traced now must combine them with the new ranks.
        if not C.is_initialized() or (C.size() == 1 and not fault_tolerant()):
            return super()._moments(inputs, mask)
        totals = allreduce(local_totals(inputs, self.axis, mask), op=Sum)
        mean, var = moments_from_totals(totals)
        return tf.cast(mean, inputs.dtype), tf.cast(var, inputs.dtype)
