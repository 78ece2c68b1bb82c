"""``LocalGradientAggregationHelper``: sum gradients locally over ``backward_passes_per_step``
passes and reduce them over the ranks only on every k-th pass, as Horovod's helper does.

Each call of :meth:`~LocalGradientAggregationHelper.compute_gradients` adds the pass's
gradients to local accumulators and counts the pass in ``counter``; on the k-th pass it
returns the accumulators reduced over the ranks (divided by k with
``average_aggregated_gradients``) and clears them, on other passes the running local sums.
:meth:`~LocalGradientAggregationHelper.apply_gradients` applies on the reducing pass only
and otherwise just counts the optimizer's ``iterations`` up. Works eagerly and inside
``tf.function`` (the decision is a ``tf.cond`` on ``counter``).

Example, 2 ranks, k = 2, gradient 1.0 on rank 0 and 3.0 on rank 1 at every pass::

    pass 1: compute_gradients -> rank 0: 1.0, rank 1: 3.0 (local sums; nothing applied)
    pass 2: compute_gradients -> 4.0 on both ranks (mean of 2.0 and 6.0); applied; counter 0
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from hvd_magic.collectives import ProcessSet, global_process_set

from ._bridge import read_when_run
from ._compat import import_tf
from .gradient_tape import divide_gradient

tf = import_tf()


def var_key(v: Any) -> int:
    """One key for a Keras 3 Variable and the tf.Variable behind it."""
    inner = getattr(v, "value", None)
    return id(inner if isinstance(inner, tf.Variable) and not isinstance(v, tf.Variable) else v)


def reduce_with_locals(allreduce_func: Callable, grads: Sequence[Any], variables: Sequence[Any],
                       local_keys: set, scale_local: bool, size: Callable[[], Any]) -> list:
    """Reduce the gradients of shared variables with ``allreduce_func``; keep those of
    variables in ``local_keys`` (divided by the number of ranks, ``size()``, when
    ``scale_local``, as Horovod does; in an elastic job a tensor read when the graph runs)."""
    shared = [i for i, v in enumerate(variables) if var_key(v) not in local_keys]
    out = list(grads)
    for i, r in zip(shared, allreduce_func([grads[i] for i in shared], [variables[i] for i in shared])):
        out[i] = r
    if scale_local and len(shared) < len(out):
        n = size()
        for i, v in enumerate(variables):
            g = out[i]
            if var_key(v) in local_keys and g is not None:
                out[i] = divide_gradient(g, n)
    return out


class ReducesGradients:
    """What the TF1 and the Keras ``DistributedOptimizer`` share: gradients of variables
    local to this rank kept out of the reduction, and the reduction itself, aggregated over
    ``backward_passes_per_step`` or not. The optimizer sets ``_agg_helper`` (None without
    aggregation), ``_local_vars``, ``_hvd_reducer`` and ``scale_local_gradients``."""

    _agg_helper: Optional["LocalGradientAggregationHelper"]
    _local_vars: set
    _hvd_reducer: Any
    scale_local_gradients: bool

    def register_local_var(self, var: Any) -> None:
        """Keep the gradient of ``var`` (a variable local to this rank) out of the reduction;
        with ``scale_local_gradients`` it is divided by the number of ranks, as Horovod does."""
        if self._agg_helper is not None:
            self._agg_helper.register_local_var(var)
        else:
            self._local_vars.add(var_key(var))

    def _hvd_reduce_gradients(self, grads: list, variables: list) -> list:
        """Reduced gradients (with aggregation: the local sums, or their reduction every k-th
        pass)."""
        if self._agg_helper is not None:
            return self._agg_helper.compute_gradients(grads, variables)
        return reduce_with_locals(self._hvd_reducer.reduce, grads, variables, self._local_vars,
                                  self.scale_local_gradients, self._hvd_reducer.size_when_run)


class LocalGradientAggregationHelper:
    """Horovod's local gradient aggregation (see the module docstring).

    ``allreduce_func(grads, vars)`` reduces a list of gradients; ``rank`` and
    ``optimizer_type`` are accepted for Horovod compatibility (one implementation serves
    Keras and plain optimizers here).
    """

    _OPTIMIZER_TYPE_KERAS = "optimizer_type_keras"
    _OPTIMIZER_TYPE_LEGACY = "optimizer_type_legacy"

    def __init__(self, backward_passes_per_step: int, allreduce_func: Callable,
                 sparse_as_dense: bool, average_aggregated_gradients: bool, rank: int = 0,
                 optimizer_type: str = _OPTIMIZER_TYPE_KERAS,
                 process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True):
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an int >= 1, got "
                             f"{backward_passes_per_step!r}")
        if not callable(allreduce_func):
            raise TypeError("allreduce_func must be a function (grads, vars) -> reduced grads")
        self.backward_passes_per_step = backward_passes_per_step
        self.allreduce_grads = allreduce_func
        self.sparse_as_dense = bool(sparse_as_dense)
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self.rank = rank
        self.optimizer_type = optimizer_type
        self.process_set = process_set
        self.scale_local_gradients = bool(scale_local_gradients)
        self.locally_aggregated_grads: dict = {}
        self._local_vars: set = set()
        with tf.init_scope():
            self.counter = tf.Variable(0, dtype=tf.int32, trainable=False, name="hvd_aggregation_counter")

    def register_local_var(self, var: Any) -> None:
        """Keep the gradient of ``var`` (a variable local to this rank) out of the reduction."""
        self._local_vars.add(var_key(var))

    def _size(self) -> Any:
        """The number of ranks, read when the graph runs in an elastic job."""
        ps = self.process_set
        return read_when_run(lambda: ps.size() if ps.included() else 1, "hvd_size")

    def _accumulator(self, idx: int, grad: Any) -> Any:
        acc = self.locally_aggregated_grads.get(idx)
        if acc is None:
            with tf.init_scope():
                acc = tf.Variable(tf.zeros(grad.shape, dtype=grad.dtype), trainable=False,
                                  name=f"hvd_aggregated_{idx}")
            self.locally_aggregated_grads[idx] = acc
        return acc

    @tf.autograph.experimental.do_not_convert
    def compute_gradients(self, grads: Sequence[Any], vars: Sequence[Any]) -> list:
        """Add ``grads`` to the local sums; on the k-th pass return them reduced over the
        ranks (and clear them), on other passes the local sums. None stays None."""
        grads, vars = list(grads), list(vars)
        if len(grads) != len(vars):
            raise ValueError(f"compute_gradients got {len(grads)} gradients for {len(vars)} variables")
        # Explicit control dependencies order the updates: a TF1 graph (Session) has no
        # automatic ones, as eager code and tf.function have.
        adds, accs = [], []
        for idx, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    raise ValueError("backward_passes_per_step > 1 does not take sparse gradients "
                                     "(tf.IndexedSlices), as in Horovod; pass sparse_as_dense=True")
                g = tf.convert_to_tensor(g)
            if g is None:
                accs.append(None)
                continue
            acc = self._accumulator(idx, g)
            adds.append(acc.assign_add(tf.cast(g, acc.dtype)))
            accs.append(acc)
        with tf.control_dependencies(adds):
            sums = [None if acc is None else acc.read_value() for acc in accs]
            count = self.counter.assign_add(1)
        present = [i for i, s in enumerate(sums) if s is not None]

        def reduce_and_clear() -> list:
            reduced = reduce_with_locals(self.allreduce_grads, [sums[i] for i in present],
                                         [vars[i] for i in present], self._local_vars,
                                         self.scale_local_gradients, self._size)
            if self.average_aggregated_gradients:
                reduced = [r / self.backward_passes_per_step for r in reduced]
            reduced = [tf.convert_to_tensor(r) for r in reduced]
            with tf.control_dependencies(reduced):
                clears = [self.counter.assign(0)] + [
                    acc.assign(tf.zeros_like(acc)) for acc in self.locally_aggregated_grads.values()]
            with tf.control_dependencies(clears):
                return [tf.identity(r) for r in reduced]

        if not present:
            return sums
        chosen = tf.cond(tf.equal(count, self.backward_passes_per_step), reduce_and_clear,
                         lambda: [tf.identity(sums[i]) for i in present])
        out = list(sums)
        for i, r in zip(present, chosen if isinstance(chosen, (list, tuple)) else [chosen]):
            out[i] = r
        return out

    def apply_gradients(self, apply_grads_closure: Callable, optimizer: Any, *args: Any,
                        **kwargs: Any) -> Any:
        """Run ``apply_grads_closure`` on the pass that reduced (``counter`` back at 0); on other
        passes only count ``optimizer.iterations`` up, as Horovod does."""
        def apply() -> Any:
            apply_grads_closure()
            return tf.constant(True)

        def skip() -> Any:
            its = getattr(optimizer, "iterations", None)
            if its is not None:
                its.assign_add(1)
            return tf.constant(False)

        return tf.cond(tf.equal(self.counter, 0), apply, skip)

    def apply_legacy(self, apply_op_closure: Callable, grads: Sequence[Any],
                     global_step: Any = None) -> Any:
        """TF1 graph mode: an op that runs ``apply_op_closure()`` (which returns the wrapped
        optimizer's apply op) on the pass that reduced, after ``grads`` (so after this pass's
        :meth:`compute_gradients`); on other passes it counts ``global_step`` up, as Horovod
        does."""
        deps = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]

        def apply() -> Any:
            with tf.control_dependencies([apply_op_closure()]):
                return tf.constant(True)

        def skip() -> Any:
            if global_step is None:
                return tf.constant(False)
            with tf.control_dependencies([global_step.assign_add(tf.cast(1, global_step.dtype))]):
                return tf.constant(False)

        with tf.control_dependencies(deps):
            applied = tf.cond(tf.equal(self.counter, 0), apply, skip)
        return tf.group(applied)
