"""``hvd.DistributedOptimizer`` of ``horovod.tensorflow``: a TensorFlow 1 style optimizer
(``tf.compat.v1.train.*``) whose ``compute_gradients`` returns the gradients averaged over
all ranks, for graph-mode (``tf.compat.v1.Session``) training::

    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.01 * hvd.size()))
    train_op = opt.minimize(loss)            # compute_gradients (reduced), then apply_gradients
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(hvd.broadcast_global_variables(0))
        sess.run(train_op, feed_dict=...)

Given a Keras optimizer it returns :func:`hvd_magic.keras.DistributedOptimizer` instead, as
Horovod does.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

from hvd_magic.collectives import Adasum, Average, ProcessSet, global_process_set
from hvd_magic.collectives.ops import to_op

from ._compat import import_tf
from .compression import Compression, Compressor
from .gradient_aggregation import LocalGradientAggregationHelper, ReducesGradients, var_key
from .gradient_tape import GradientReducer

tf = import_tf()
_LegacyOptimizer = tf.compat.v1.train.Optimizer


class _DistributedOptimizer(ReducesGradients, _LegacyOptimizer):
    """Wraps a ``tf.compat.v1.train.Optimizer``: its gradients are reduced over the ranks
    before they are applied (Horovod's class of the same name)."""

    def __init__(self, optimizer: Any, name: Optional[str] = None, use_locking: bool = False,
                 device_dense: str = "", device_sparse: str = "",
                 compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
                 op: Any = Average, gradient_predivide_factor: float = 1.0,
                 backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                 groups: Any = None, process_set: ProcessSet = global_process_set,
                 scale_local_gradients: bool = True):
        if name is None:
            name = f"Distributed{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._hvd_reducer = GradientReducer(compression, op, gradient_predivide_factor,
                                            sparse_as_dense, 0, groups, f"{name}.grads",
                                            "DistributedOptimizer", process_set)
        self._local_vars: set = set()
        self.process_set = process_set
        self.scale_local_gradients = bool(scale_local_gradients)
        self._agg_helper: Optional[LocalGradientAggregationHelper] = None
        if backward_passes_per_step > 1:
            if tf.executing_eagerly():
                raise ValueError("backward_passes_per_step > 1 is not supported for a "
                                 "tf.compat.v1.train optimizer under eager execution (as in "
                                 "Horovod); build a graph, or use a Keras optimizer")
            self._agg_helper = LocalGradientAggregationHelper(
                backward_passes_per_step, self._hvd_reducer.reduce, sparse_as_dense,
                average_aggregated_gradients,
                optimizer_type=LocalGradientAggregationHelper._OPTIMIZER_TYPE_LEGACY,
                process_set=process_set, scale_local_gradients=scale_local_gradients)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list:
        """The wrapped optimizer's ``compute_gradients``, each gradient reduced over the ranks
        (with ``backward_passes_per_step=k``: summed locally, reduced on every k-th pass)."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        return list(zip(self._hvd_reduce_gradients(grads, variables), variables))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                        name: Optional[str] = None) -> Any:
        """The wrapped optimizer's ``apply_gradients`` (with ``backward_passes_per_step=k``:
        on every k-th pass; the other passes only count ``global_step`` up)."""
        if self._agg_helper is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                   name=name)
        pairs = list(grads_and_vars)
        return self._agg_helper.apply_legacy(
            lambda: self._optimizer.apply_gradients(pairs, global_step=global_step, name=name),
            [g for g, _ in pairs], global_step)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's ``get_slot``."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's ``get_slot_names``."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's ``variables``."""
        return self._optimizer.variables(*args, **kwargs)


class _DistributedAdasumOptimizer(_LegacyOptimizer):
    """Wraps a ``tf.compat.v1.train.Optimizer`` for ``op=hvd.Adasum``, as Horovod's class of
    the same name: each rank applies its own gradients, then the change of every variable
    since the last communication (its delta) is combined over the ranks with Adasum and
    added to the variable's value at that communication; with ``backward_passes_per_step=k``
    on every k-th step only."""

    def __init__(self, optimizer: Any, name: Optional[str] = None, use_locking: bool = False,
                 device_dense: str = "", device_sparse: str = "",
                 compression: type[Compressor] = Compression.none,
                 backward_passes_per_step: int = 1):
        if name is None:
            name = f"DistributedDelta{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._hvd_reducer = GradientReducer(compression, Adasum, 1.0, True, 0, None,
                                            f"{name}.deltas", "DistributedOptimizer")
        self._passes = backward_passes_per_step
        self._starts: dict = {}       # variable key -> its value at the last communication
        with tf.init_scope():
            self._step_count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                           name="hvd_adasum_step_count")

    def _start(self, var: Any) -> Any:
        key = var_key(var)
        if key not in self._starts:
            with tf.init_scope():
                self._starts[key] = tf.Variable(tf.zeros(var.shape, var.dtype), trainable=False,
                                                name="hvd_delta_start")
        return self._starts[key]

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list:
        """The wrapped optimizer's (local) gradients."""
        return self._optimizer.compute_gradients(*args, **kwargs)

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                        name: Optional[str] = None) -> Any:
        """The wrapped optimizer's update with this rank's gradients, then (every
        ``backward_passes_per_step``-th step) the Adasum of the ranks' deltas."""
        pairs = list(grads_and_vars)
        variables = [v for g, v in pairs if g is not None]
        starts = [self._start(v) for v in variables]
        first = tf.equal(self._step_count, 0)
        init = tf.cond(first, lambda: tf.group(*[s.assign(v) for s, v in zip(starts, variables)]),
                       tf.no_op)
        with tf.control_dependencies([init]):
            update = self._optimizer.apply_gradients(pairs, global_step=global_step, name=name)

        def communicate() -> Any:
            deltas = [tf.convert_to_tensor(v) - s for v, s in zip(variables, starts)]
            combined = self._hvd_reducer.reduce(deltas)
            new = [s.assign_add(c) for s, c in zip(starts, combined)]
            return tf.group(*[v.assign(n) for v, n in zip(variables, new)])

        with tf.control_dependencies([update]):
            is_comm = tf.equal(self._step_count % self._passes, self._passes - 1)
            done = tf.cond(is_comm, communicate, tf.no_op)
        with tf.control_dependencies([done]):
            counted = self._step_count.assign_add(1)
        return None if tf.executing_eagerly() else counted.op

    def get_slot(self, var: Any, name: str) -> Any:
        """The wrapped optimizer's ``get_slot``."""
        return self._optimizer.get_slot(var, name)

    def get_slot_names(self) -> Any:
        """The wrapped optimizer's ``get_slot_names``."""
        return self._optimizer.get_slot_names()

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's ``variables``."""
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap ``optimizer`` so that the gradients it applies are averaged over all ranks.

    A ``tf.compat.v1.train.Optimizer`` (graph mode, or eager with a callable loss) is wrapped
    in an optimizer of that base class: ``compute_gradients`` (and so ``minimize``) returns
    the reduced gradients, ``apply_gradients``, ``get_slot``, ``get_slot_names`` and
    ``variables`` are the wrapped optimizer's. With ``op=hvd.Adasum`` each rank applies its
    own gradients and the variables' changes since the last communication are combined
    with Adasum (every ``backward_passes_per_step``-th step), as Horovod's. A Keras optimizer is handed to
    :func:`hvd_magic.keras.DistributedOptimizer`, as Horovod does (``use_locking`` does not
    apply to it).

    ``name`` defaults to ``"Distributed" + the optimizer's class name``; ``compression``,
    ``sparse_as_dense``, ``op`` (hvd.Average, hvd.Sum or hvd.Adasum), ``gradient_predivide_factor``,
    ``groups`` and ``process_set`` are as in
    :func:`hvd_magic.tensorflow.DistributedGradientTape`; ``num_groups`` is Horovod's
    deprecated name of ``groups=<int>``; ``backward_passes_per_step=k`` sums k passes locally
    (averages them with ``average_aggregated_gradients``) and reduces and applies on every
    k-th; ``opt.register_local_var(v)`` keeps ``v``'s gradient local (divided by the number
    of ranks with ``scale_local_gradients``). ``device_dense``/``device_sparse`` are accepted
    for Horovod compatibility (CPU only here).

    Example, 2 ranks, one weight w = 0, gradient 1.0 on rank 0 and 3.0 on rank 1,
    GradientDescentOptimizer(0.1)::

        rank 0: w -> -0.2    rank 1: w -> -0.2    (plain optimizer: -0.1 and -0.3)
    """
    op = to_op(op)
    if float(gradient_predivide_factor) != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor is only meaningful with op=hvd.Average")
    if op == Adasum and average_aggregated_gradients:
        raise ValueError("op=hvd.Adasum does not take average_aggregated_gradients=True (nor "
                         "does Horovod)")
    if num_groups != 0:
        warnings.warn("DistributedOptimizer: num_groups is deprecated (as in Horovod); pass "
                      "groups=<number of groups> instead", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if isinstance(optimizer, _LegacyOptimizer):
        if op == Adasum:
            if process_set.process_set_id != 0:
                raise NotImplementedError("op=hvd.Adasum does not take a process set (nor does "
                                          "Horovod's DistributedOptimizer); reduce over all ranks")
            return _DistributedAdasumOptimizer(optimizer, name, use_locking, device_dense,
                                               device_sparse, compression,
                                               backward_passes_per_step)
        return _DistributedOptimizer(optimizer, name=name, use_locking=use_locking,
                                     device_dense=device_dense, device_sparse=device_sparse,
                                     compression=compression, sparse_as_dense=sparse_as_dense,
                                     op=op, gradient_predivide_factor=gradient_predivide_factor,
                                     backward_passes_per_step=backward_passes_per_step,
                                     average_aggregated_gradients=average_aggregated_gradients,
                                     groups=groups, process_set=process_set,
                                     scale_local_gradients=scale_local_gradients)
    from hvd_magic.keras.optimizer import DistributedOptimizer as keras_optimizer
    from hvd_magic.keras.optimizer import keras_optimizer_types
    if not isinstance(optimizer, keras_optimizer_types()):
        raise TypeError(f"DistributedOptimizer wraps a tf.compat.v1.train optimizer or a Keras "
                        f"optimizer, not {type(optimizer).__name__}; for a custom loop with "
                        "tf.GradientTape use hvd_magic.tensorflow.DistributedGradientTape")
    return keras_optimizer(optimizer, name=name, device_dense=device_dense,
                           device_sparse=device_sparse, compression=compression,
                           sparse_as_dense=sparse_as_dense,
                           gradient_predivide_factor=gradient_predivide_factor, op=op,
                           backward_passes_per_step=backward_passes_per_step,
                           average_aggregated_gradients=average_aggregated_gradients,
                           groups=groups, process_set=process_set,
                           scale_local_gradients=scale_local_gradients)
