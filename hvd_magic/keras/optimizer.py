"""``DistributedOptimizer`` for Keras 3 optimizers (TensorFlow backend).

The wrapper is an instance of a dynamic subclass of the optimizer's class whose ``apply``
(called by ``apply_gradients`` and by ``model.fit``'s train step) first averages the
gradients over all ranks, then runs the wrapped optimizer's update::

    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(x_shard, y_shard, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

With ``backward_passes_per_step=k`` the gradients of k steps are summed locally (or
averaged, with ``average_aggregated_gradients=True``) and reduced and applied every k-th
step; the optimizer's ``iterations`` then counts applied updates.
"""
from __future__ import annotations

from typing import Any, Optional

from hvd_magic.collectives import Adasum, Average, ProcessSet, global_process_set
from hvd_magic.collectives.ops import to_op
from hvd_magic.tensorflow._compat import import_keras, import_tf
from hvd_magic.tensorflow.compression import Compression, Compressor
from hvd_magic.tensorflow.gradient_tape import GradientReducer

tf = import_tf()
keras = import_keras()


class _Accumulation:
    """Local gradient accumulators (plain tf.Variables, kept out of Keras' tracking so
    that saved models and optimizer.variables look like the wrapped optimizer's)."""

    def __init__(self) -> None:
        self.sums: list = []
        self.count: Any = None


class _DistributedOptimizer:
    """Mixin placed before the wrapped optimizer's class in a dynamic subclass."""

    _hvd_reducer: GradientReducer
    _hvd_passes: int
    _hvd_average_aggregated: bool
    _hvd_acc: _Accumulation

    def build(self, variables: Any) -> None:
        super().build(variables)  # type: ignore[misc]
        if self._hvd_passes > 1 and not self._hvd_acc.sums:
            with tf.init_scope():
                self._hvd_acc.sums = [
                    tf.Variable(tf.zeros(v.shape, dtype=v.dtype), trainable=False,
                                name=f"hvd_accumulated_{i}")
                    for i, v in enumerate(variables)]
                self._hvd_acc.count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                                  name="hvd_accumulated_count")

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        """Average ``grads`` over all ranks, then apply them with the wrapped optimizer."""
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        if not grads:
            return super().apply(grads, trainable_variables)  # type: ignore[misc]
        base_apply = super().apply  # type: ignore[misc]
        if self._hvd_passes == 1:
            return base_apply(self._hvd_reducer.reduce(grads, trainable_variables),
                              trainable_variables)
        variables = trainable_variables if trainable_variables is not None \
            else list(self._trainable_variables)  # type: ignore[attr-defined]
        if not self.built:  # type: ignore[attr-defined]
            self.build(variables)
            self.built = True
        return self._hvd_accumulate(grads, variables, base_apply)

    def _hvd_accumulate(self, grads: list, variables: list, base_apply: Any) -> Any:
        acc = self._hvd_acc
        index = {self._var_key(v): i for i, v in enumerate(self._trainable_variables)}  # type: ignore[attr-defined]
        slots = [acc.sums[index[self._var_key(v)]] for v in variables]  # type: ignore[attr-defined]
        for g, s in zip(grads, slots):
            if g is not None:
                s.assign_add(tf.cast(tf.convert_to_tensor(g), s.dtype))
        count = acc.count.assign_add(1)
        k = self._hvd_passes

        def apply_now() -> Any:
            scale = 1.0 / k if self._hvd_average_aggregated else 1.0
            summed = [None if g is None else (s.read_value() * scale if scale != 1.0 else s.read_value())
                      for g, s in zip(grads, slots)]
            base_apply(self._hvd_reducer.reduce(summed, variables), variables)
            for s in slots:
                s.assign(tf.zeros_like(s))
            return tf.constant(True)

        if tf.executing_eagerly():
            if int(count) % k == 0:
                apply_now()
            return None
        tf.cond(tf.equal(count % k, 0), apply_now, lambda: tf.constant(False))
        return None


def _check_passes(backward_passes_per_step: Any) -> int:
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got "
                         f"{backward_passes_per_step!r}")
    return backward_passes_per_step


def is_distributed(optimizer: Any) -> bool:
    """True when ``optimizer`` is already wrapped by :func:`DistributedOptimizer`."""
    return isinstance(optimizer, _DistributedOptimizer)


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, device_dense: str = "",
                         device_sparse: str = "", compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: Any = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap a Keras 3 ``optimizer`` so that its updates use gradients averaged over all ranks.

    The result is an instance of a subclass of the optimizer's class sharing its state
    (variables, learning rate, config), so ``isinstance``, ``get_config``, saving and the
    learning-rate callbacks work. ``name`` names the allreduces (default: the optimizer's
    name); ``compression``, ``sparse_as_dense``, ``op``, ``gradient_predivide_factor``,
    ``num_groups``, ``groups`` and ``process_set`` are as in
    :func:`hvd_magic.tensorflow.DistributedGradientTape` (``scale_local_gradients`` is accepted:
    this optimizer has no local variables to scale);
    ``backward_passes_per_step=k`` accumulates k steps locally before each reduction and
    update (summed, or averaged with ``average_aggregated_gradients=True``).
    ``device_dense``/``device_sparse`` are accepted for Horovod compatibility (CPU only here).

    Use it with ``model.compile(..., jit_compile=False)`` where XLA would be chosen (it is
    not on CPU-only machines): XLA cannot call back into the MPI runtime.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a Keras 3 optimizer (keras.optimizers.*), not "
                        f"{type(optimizer).__name__}; for a custom loop with tf.GradientTape use "
                        "hvd_magic.tensorflow.DistributedGradientTape")
    if is_distributed(optimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
    if name is not None and (not isinstance(name, str) or not name):
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    if to_op(op) == Adasum:
        raise ValueError("hvd_magic.keras.DistributedOptimizer does not take op=hvd.Adasum (nor does "
                         "Horovod's Keras optimizer); use op=hvd.Average, or a custom training loop "
                         "with hvd_magic.tensorflow.DistributedGradientTape(tape, op=hvd.Adasum)")
    passes = _check_passes(backward_passes_per_step)
    if passes > 1 and optimizer.built:
        raise ValueError("backward_passes_per_step > 1 needs an optimizer that has not been built "
                         "yet (wrap it before model.compile / the first apply)")
    reducer = GradientReducer(compression, op, gradient_predivide_factor, sparse_as_dense,
                              num_groups, groups, f"DistributedOptimizer.{name or optimizer.name}",
                              "DistributedOptimizer", process_set)
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    opt = cls.__new__(cls)
    opt.__dict__.update(optimizer.__dict__)
    opt._hvd_reducer = reducer
    opt._hvd_passes = passes
    opt._hvd_average_aggregated = bool(average_aggregated_gradients)
    opt._hvd_acc = _Accumulation()
    return opt
