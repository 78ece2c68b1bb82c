"""``DistributedOptimizer`` for Keras optimizers on TensorFlow: Keras 3's, and Keras 2's
(``tf_keras``, what ``tf.keras`` is under ``TF_USE_LEGACY_KERAS=1``; its current and its
``legacy`` optimizers).

The wrapper is an instance of a dynamic subclass of the optimizer's class whose ``apply``
(Keras 3: called by ``apply_gradients`` and by ``model.fit``'s train step) or
``apply_gradients`` (Keras 2) first averages the gradients over all ranks, then runs the
wrapped optimizer's update::

    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(x_shard, y_shard, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

Horovod's own entry points work as well: ``opt.compute_gradients(loss, var_list, tape)`` /
``opt._compute_gradients(...)`` and ``opt.get_gradients(loss, params)`` return reduced
gradients, which ``apply_gradients`` then applies without reducing them again.

With ``backward_passes_per_step=k`` the gradients of k passes are summed locally (averaged
with ``average_aggregated_gradients=True``) and reduced and applied on every k-th pass by
``opt._agg_helper`` (a :class:`hvd_magic.tensorflow.LocalGradientAggregationHelper`); as in
Horovod, ``iterations`` counts every pass.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

from hvd_magic.collectives import Adasum, Average, ProcessSet, Sum, global_process_set
from hvd_magic.collectives.ops import to_op
from hvd_magic.tensorflow._compat import import_keras, import_tf, is_keras3_object
from hvd_magic.tensorflow.compression import Compression, Compressor
from hvd_magic.tensorflow.gradient_aggregation import (LocalGradientAggregationHelper,
                                                       ReducesGradients)
from hvd_magic.tensorflow.gradient_tape import GradientReducer

tf = import_tf()
keras = import_keras()

# Keras 2 arguments of apply_gradients that Keras 3 dropped; accepted and ignored here
_KERAS2_APPLY_KWARGS = ("name", "experimental_aggregate_gradients", "skip_gradients_aggregation")


def _keras2() -> Any:
    """The ``tf_keras`` package when it is loaded (a Keras 2 optimizer or layer exists only then)."""
    return sys.modules.get("tf_keras")


def keras_optimizer_types() -> tuple:
    tk = _keras2()
    extra = (tk.optimizers.Optimizer, tk.optimizers.legacy.Optimizer) if tk is not None else ()
    return (keras.optimizers.Optimizer,) + extra


def _layer_types() -> tuple:
    tk = _keras2()
    return (keras.layers.Layer,) + ((tk.layers.Layer,) if tk is not None else ())


def _optimizer_name(optimizer: Any) -> str:
    # Keras 2's legacy optimizers keep their name in _name only
    return getattr(optimizer, "name", None) or getattr(optimizer, "_name", type(optimizer).__name__)


class _CallableList(list):
    """``opt.variables`` that also answers ``opt.variables()`` (Keras 2 style), as Horovod's."""

    def __call__(self) -> list:
        return self


class _DistributedOptimizer(ReducesGradients):
    """Mixin placed before the wrapped optimizer's class in a dynamic subclass."""

    _HAS_AGGREGATE_GRAD = True
    _hvd_settings: dict          # class attribute: DistributedOptimizer's arguments, for from_config
    _hvd_reducer: GradientReducer
    _agg_helper: Optional[LocalGradientAggregationHelper]
    _local_vars: set
    _hvd_reduced: list           # the gradients last returned reduced by _compute_gradients

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> Any:
        """A new DistributedOptimizer of the same settings around the wrapped class built from
        ``config``."""
        base = cls.__bases__[1]          # (the dynamic class is (_DistributedOptimizer, base))
        return DistributedOptimizer(base.from_config(config, custom_objects=custom_objects),
                                    **cls._hvd_settings)

    @property
    def variables(self) -> list:
        found = super().variables  # type: ignore[misc]
        if callable(found) and not isinstance(found, list):   # Keras 2's legacy optimizers
            found = found()
        return _CallableList(found)

    def _allreduce(self, grads: Any, vars: Any) -> list:
        """Reduced gradients (with aggregation: the local sums, or their reduction every k-th
        pass)."""
        self._aggregated_gradients = True
        return self._hvd_reduce_gradients(list(grads), list(vars))

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> list:
        """``[(reduced gradient, variable), ...]`` of ``loss`` (a tensor recorded on ``tape``,
        or a function of no arguments) with respect to ``var_list``."""
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None,
                           tape: Any = None) -> list:
        if callable(var_list):
            var_list = var_list()
        var_list = list(tf.nest.flatten(var_list))
        tape = tf.GradientTape() if tape is None else tape
        if callable(loss):
            with tape:
                for v in var_list:
                    tape.watch(v)
                loss = loss()
        elif tape is None or not isinstance(tape, tf.GradientTape):
            raise TypeError("compute_gradients of a loss tensor needs the tf.GradientTape that "
                            "recorded it (tape=...), or pass the loss as a function")
        grads = tape.gradient(loss, var_list, output_gradients=grad_loss)
        reduced = self._allreduce(grads, var_list)
        self._hvd_reduced = [g for g in reduced if g is not None]
        return list(zip(reduced, var_list))

    def get_gradients(self, loss: Any, params: Any) -> list:
        """The wrapped optimizer's ``get_gradients``, reduced over the ranks (Keras 3 optimizers
        have no ``get_gradients``; a subclass of yours may)."""
        base = super()
        if not hasattr(base, "get_gradients"):
            raise ValueError("Keras 3 optimizers have no get_gradients(loss, params); use "
                             "opt.compute_gradients(loss_fn, var_list) or model.fit")
        reduced = self._allreduce(base.get_gradients(loss, params), params)  # type: ignore[attr-defined]
        self._hvd_reduced = [g for g in reduced if g is not None]
        return reduced

    def _came_reduced(self, grads: list) -> bool:
        done, self._hvd_reduced = self._hvd_reduced, []
        present = [g for g in grads if g is not None]
        return bool(present) and all(any(g is r for r in done) for g in present)

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        """Keras 3's ``apply_gradients`` (Keras 2's extra arguments ``name``,
        ``experimental_aggregate_gradients``, ... are accepted and ignored), or Keras 2's: the
        gradients reduced over the ranks unless they came reduced from compute_gradients."""
        unknown = [k for k in kwargs if k not in _KERAS2_APPLY_KWARGS]
        if unknown or len(args) > 1:
            raise TypeError(f"apply_gradients(grads_and_vars) got unexpected arguments "
                            f"{unknown or list(args)}")
        if is_keras3_object(self):
            return super().apply_gradients(list(grads_and_vars))  # type: ignore[misc]
        return self._apply_keras2(list(grads_and_vars), super().apply_gradients, args, kwargs)

    def _apply_keras2(self, pairs: list, base_apply: Any, args: tuple, kwargs: dict) -> Any:
        if not pairs:
            return base_apply(pairs, *args, **kwargs)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if not self._came_reduced(grads):
            grads = self._allreduce(grads, variables)
        if self._agg_helper is None:
            return base_apply(list(zip(grads, variables)), *args, **kwargs)
        with tf.init_scope():   # slots exist before the tf.cond that applies on every k-th pass
            if hasattr(self, "_create_all_weights"):
                self._create_all_weights(variables)   # type: ignore[attr-defined]
            else:
                self.build(variables)  # type: ignore[attr-defined]
        return self._agg_helper.apply_gradients(
            lambda: base_apply(list(zip(grads, variables)), *args, **kwargs), self)

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        """Reduce ``grads`` over the ranks (unless they came reduced from compute_gradients),
        then apply them with the wrapped optimizer (every k-th pass with aggregation)."""
        grads = list(grads)
        base_apply = super().apply  # type: ignore[misc]
        if not grads:
            return base_apply(grads, trainable_variables)
        variables = list(trainable_variables) if trainable_variables is not None \
            else list(self._trainable_variables)  # type: ignore[attr-defined]
        if not self._came_reduced(grads):
            grads = self._allreduce(grads, variables)
        if self._agg_helper is None:
            return base_apply(grads, trainable_variables)
        if not self.built:  # type: ignore[attr-defined]
            self.build(variables)  # type: ignore[attr-defined]
        return self._agg_helper.apply_gradients(lambda: base_apply(grads, variables), self)


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
    """Wrap a Keras ``optimizer`` (Keras 3's, or tf_keras's under ``TF_USE_LEGACY_KERAS=1``) so
    that its updates use gradients averaged over all ranks.

    The result is an instance of a subclass of the optimizer's class sharing its state
    (variables, learning rate, config), so ``isinstance``, ``get_config``/``from_config``,
    saving and the learning-rate callbacks work. ``name`` names the allreduces (default: the
    optimizer's name); ``compression``, ``sparse_as_dense``, ``op``,
    ``gradient_predivide_factor``, ``num_groups``, ``groups`` and ``process_set`` are as in
    :func:`hvd_magic.tensorflow.DistributedGradientTape`; ``opt.register_local_var(v)`` keeps
    ``v``'s gradient local (divided by the number of ranks with ``scale_local_gradients``);
    ``backward_passes_per_step=k`` accumulates k passes locally before each reduction and
    update (summed, or averaged with ``average_aggregated_gradients=True``).
    ``device_dense``/``device_sparse`` are accepted for Horovod compatibility (CPU only here).

    Example, 2 ranks, one weight w, gradient 1.0 on rank 0 and 3.0 on rank 1, SGD(0.1)::

        rank 0: w 0.0 -> -0.2    rank 1: w 0.0 -> -0.2    (plain SGD: -0.1 and -0.3)

    Use it with ``model.compile(..., jit_compile=False)`` where XLA would be chosen (it is
    not on CPU-only machines): XLA cannot call back into the MPI runtime.
    """
    if not isinstance(optimizer, keras_optimizer_types()):
        raise TypeError(f"DistributedOptimizer wraps a Keras optimizer (keras.optimizers.*, or "
                        f"tf.keras.optimizers.* with TF_USE_LEGACY_KERAS=1), not "
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
    reducer = GradientReducer(compression, op, gradient_predivide_factor, sparse_as_dense,
                              num_groups, groups,
                              f"DistributedOptimizer.{name or _optimizer_name(optimizer)}",
                              "DistributedOptimizer", process_set)
    settings = dict(name=name, device_dense=device_dense, device_sparse=device_sparse,
                    compression=compression, sparse_as_dense=sparse_as_dense,
                    gradient_predivide_factor=gradient_predivide_factor, op=op,
                    backward_passes_per_step=passes,
                    average_aggregated_gradients=average_aggregated_gradients,
                    num_groups=num_groups, groups=groups, process_set=process_set,
                    scale_local_gradients=scale_local_gradients)
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base),
               {"__module__": base.__module__, "_hvd_settings": settings})
    opt = cls.__new__(cls)
    opt.__dict__.update(optimizer.__dict__)
    opt._hvd_reducer = reducer
    opt._local_vars = set()
    opt._hvd_reduced = []
    opt._aggregated_gradients = False
    opt.process_set = process_set
    opt.scale_local_gradients = bool(scale_local_gradients)
    opt._agg_helper = None if passes == 1 else LocalGradientAggregationHelper(
        passes, reducer.reduce, sparse_as_dense, average_aggregated_gradients,
        optimizer_type=LocalGradientAggregationHelper._OPTIMIZER_TYPE_KERAS,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    return opt


def PartialDistributedOptimizer(optimizer: Any, name: Optional[str] = None, device_dense: str = "",
                                device_sparse: str = "",
                                compression: type[Compressor] = Compression.none,
                                sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                                op: Any = Average, backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False, groups: Any = None,
                                process_set: ProcessSet = global_process_set,
                                local_layers: Any = None, scale_local_gradients: bool = True) -> Any:
    """:func:`DistributedOptimizer` whose ``local_layers`` (a Keras layer or a list of them)
    keep their gradients local: not reduced, divided by the number of ranks with
    ``scale_local_gradients``. ``op`` is hvd.Average or hvd.Sum, as in Horovod.

    Example, 2 ranks, a local layer's gradient 1.0 on rank 0 and 3.0 on rank 1::

        rank 0: 1.0 -> 0.5    rank 1: 3.0 -> 1.5    (shared layers: 2.0 on both)
    """
    if to_op(op) not in (Average, Sum):
        raise ValueError(f"PartialDistributedOptimizer takes op=hvd.Average or hvd.Sum, not "
                         f"{to_op(op).name}")
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, _layer_types()):
        local_layers = [local_layers]
    elif not all(isinstance(layer, _layer_types()) for layer in local_layers):
        raise ValueError("local_layers must be a Keras layer or a list of Keras layers")
    opt = DistributedOptimizer(optimizer, name=name, device_dense=device_dense,
                               device_sparse=device_sparse, compression=compression,
                               sparse_as_dense=sparse_as_dense,
                               gradient_predivide_factor=gradient_predivide_factor, op=op,
                               backward_passes_per_step=backward_passes_per_step,
                               average_aggregated_gradients=average_aggregated_gradients,
                               groups=groups, process_set=process_set,
                               scale_local_gradients=scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            opt.register_local_var(var)
    return opt
