"""``horovod.tensorflow.keras`` for hvd_magic: ``tf.keras`` on TensorFlow >= 2.16, that is Keras 3
(the default), or Keras 2 (``pip install tf-keras``, ``TF_USE_LEGACY_KERAS=1``)::

    import keras
    import hvd_magic.keras as hvd

    hvd.init()
    model = make_model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x_shard, y_shard, epochs=5,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback()],
              verbose=1 if hvd.rank() == 0 else 0)

The collectives are those of :mod:`hvd_magic.tensorflow` (tf.Tensor in, tf.Tensor out).
``DistributedOptimizer`` wraps Keras 3 and Keras 2 optimizers alike; the callbacks subclass
the Callback of the Keras that ``tf.keras`` is.
"""
from __future__ import annotations

from typing import Any, Optional

from hvd_magic.tensorflow._compat import import_tf, import_tf_keras

import_tf_keras()   # ImportError with what to install / which backend to pick
tf = import_tf()

import hvd_magic.tensorflow as _tf_face  # noqa: E402
from hvd_magic.tensorflow import (Adasum, Average, Compression, Compressor,  # noqa: E402
                                  HorovodInternalError, HvdError, Max, Min, ProcessSet, Product,
                                  ReduceOp, StallError, Sum, TensorMismatchError,
                                  add_process_set, allgather_object,
                                  alltoall, barrier, broadcast_object,
                                  broadcast_variables, ccl_built, cross_rank, cross_size,
                                  cuda_built, ddl_built, gloo_built, gloo_enabled,
                                  global_process_set, grouped_allreduce, init, is_homogeneous,
                                  is_initialized, join, local_rank, local_size, mpi_built,
                                  mpi_enabled, mpi_threads_supported, nccl_built, rank,
                                  remove_process_set, rocm_built, shutdown, size,
                                  start_timeline, stop_timeline)

from . import callbacks, elastic  # noqa: E402
from .callbacks import optimizer_built as _optimizer_built  # noqa: E402
from .optimizer import (DistributedOptimizer, PartialDistributedOptimizer,  # noqa: E402
                        is_distributed, keras_optimizer_types as _optimizer_types)


def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: Any = None,
              compression: type[Compressor] = Compression.none) -> Any:
    """Reduce a tensor-compatible ``value`` (number, list, array, tensor) over all ranks
    (Average unless ``op`` or ``average=False`` says otherwise): Horovod's Keras signature,
    ``name`` second. Example, 2 ranks: rank 0: 1.0, rank 1: 3.0 -> 2.0 on both."""
    return _tf_face.allreduce(tf.convert_to_tensor(value), average=average, compression=compression,
                              op=op, prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor, name=name)


def allgather(value: Any, name: Optional[str] = None) -> Any:
    """Concatenate every rank's ``value`` along dimension 0. Example, 2 ranks: rank 0: [1],
    rank 1: [2, 3] -> [1, 2, 3] on both."""
    return _tf_face.allgather(tf.convert_to_tensor(value), name=name)


def broadcast(value: Any, root_rank: int, name: Optional[str] = None) -> Any:
    """``root_rank``'s ``value`` on every rank. Example, 2 ranks, root 0: rank 0: 5, rank 1: 7
    -> 5 on both."""
    return _tf_face.broadcast(tf.convert_to_tensor(value), root_rank, name=name)


def reducescatter(value: Any, name: Optional[str] = None, op: Any = Average) -> Any:
    """Reduce ``value`` over all ranks, each rank keeping its share of dimension 0. Example,
    2 ranks, Average: rank 0: [1, 2], rank 1: [3, 4] -> rank 0: [2], rank 1: [3]."""
    return _tf_face.reducescatter(tf.convert_to_tensor(value), op=op, name=name)


def broadcast_global_variables(root_rank: int = 0, model: Any = None) -> None:
    """Overwrite every rank's ``model`` variables (and its optimizer's) with ``root_rank``'s.
    TensorFlow 2's Keras has no global variable collection, so the model must be given."""
    if model is None:
        raise ValueError("broadcast_global_variables needs the model in TensorFlow 2 (there is no "
                         "global variable collection): broadcast_global_variables(0, model=model), "
                         "or use hvd.callbacks.BroadcastGlobalVariablesCallback(0) in fit()")
    broadcast_variables(model.variables, root_rank)
    opt = getattr(model, "optimizer", None)
    if opt is not None and _optimizer_built(opt):
        broadcast_variables(opt.variables, root_rank)


def load_model(filepath: Any, custom_optimizers: Optional[list] = None,
               custom_objects: Optional[dict] = None,
               compression: type[Compressor] = Compression.none) -> Any:
    """``keras.models.load_model`` whose compiled optimizer comes back wrapped in
    :func:`DistributedOptimizer` (with ``compression``), its state (slots, iterations)
    restored. ``custom_optimizers`` lists optimizer classes of your own to make loadable,
    ``custom_objects`` is passed on to Keras.

    Every rank may load the same file; or load on rank 0 and broadcast with
    ``BroadcastGlobalVariablesCallback``.
    """
    keras = import_tf_keras()
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        if not (isinstance(cls, type) and issubclass(cls, _optimizer_types())):
            raise TypeError(f"custom_optimizers takes Keras optimizer classes, got {cls!r}")
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    opt = getattr(model, "optimizer", None)
    if opt is not None and isinstance(opt, _optimizer_types()) and not is_distributed(opt):
        model.optimizer = DistributedOptimizer(opt, compression=compression)
        model.train_function = None   # rebuild the train step around the wrapped optimizer
    return model


__all__ = [n for n in dir() if not n.startswith("_") and n not in ("annotations", "Any", "Optional", "tf")]
