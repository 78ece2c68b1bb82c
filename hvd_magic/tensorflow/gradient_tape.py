"""``DistributedGradientTape`` and the gradient reduction it shares with the Keras optimizer.

Dense gradients are averaged in one grouped allreduce (one request per dtype and group, one
host call per step inside ``tf.function``); ``tf.IndexedSlices`` (embedding lookups, gathers)
are allgathered as values and indices, or densified first with ``sparse_as_dense=True``::

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)   # averaged over all ranks
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import hvd_magic.collectives as C
from hvd_magic.collectives import Adasum, Average, ProcessSet, Sum, global_process_set
from hvd_magic.collectives.elastic import fault_tolerant
from hvd_magic.collectives.ops import to_op

from ._compat import import_tf
from .compression import Compression, Compressor, check_compression
from ._bridge import host_call, is_static, read_when_run
from .mpi_ops import grouped, sparse_allreduce

tf = import_tf()


class GradientReducer:
    """Checked settings of a gradient reduction, and the reduction itself."""

    def __init__(self, compression: Any, op: Any, gradient_predivide_factor: float,
                 sparse_as_dense: bool, num_groups: int, groups: Any, name: str, who: str,
                 process_set: ProcessSet = global_process_set):
        op = to_op(op)
        if op not in (Average, Sum, Adasum):
            raise ValueError(f"{who} reduces gradients with op=hvd.Average, hvd.Sum or hvd.Adasum, "
                             f"not {op.name}")
        try:
            factor = float(gradient_predivide_factor)
        except (TypeError, ValueError):
            raise TypeError(f"gradient_predivide_factor must be a number, got "
                            f"{gradient_predivide_factor!r}") from None
        if factor <= 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {factor}")
        if factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor is only meaningful with op=hvd.Average")
        check_compression(compression)
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
            raise ValueError(f"num_groups must be an int >= 0, got {num_groups!r}")
        if groups is not None and num_groups:
            raise ValueError("pass either num_groups or groups, not both")
        if groups is not None:
            if isinstance(groups, bool) or not isinstance(groups, (int, list, tuple)):
                raise TypeError("groups must be an int (number of groups) or a list of lists of "
                                "variables")
            if isinstance(groups, int):
                if groups < 1:
                    raise ValueError(f"groups must be >= 1, got {groups}")
                num_groups, groups = groups, None
        self.compression = compression
        self.op = op
        # Horovod's predivide: divide by f before the sum and by size/f after.
        self.prescale = 1.0 / factor
        self.postscale = factor
        self.sparse_as_dense = bool(sparse_as_dense)
        self.num_groups = num_groups
        self.groups = groups
        self.name = name
        if not isinstance(process_set, ProcessSet):
            raise TypeError(f"process_set must be a ProcessSet, not {type(process_set).__name__}")
        self.ps = process_set

    def size(self) -> int:
        """Number of ranks the gradients are reduced over (1 on a rank outside the set: its
        gradients stay local, as Horovod's)."""
        if self.ps.process_set_id == 0:
            return C.size()
        return self.ps.size() if self.ps.included() else 1

    def size_when_run(self) -> Any:
        """:meth:`size`, read each time a graph runs in an elastic job (an int otherwise)."""
        return read_when_run(self.size, "hvd_size")

    def reduces(self) -> bool:
        """Whether the gradients go through the reduction: with other ranks in the set, and
        also alone in an elastic job (MPI fault tolerance on), which may grow at a commit: a
        function traced on one rank must still reduce once a rank joined (the PyTorch
        optimizer does the same)."""
        return self.size() > 1 or (self.ps.process_set_id == 0 and fault_tolerant())

    def _buckets(self, n: int, variables: Optional[Sequence[Any]]) -> list:
        """Lists of indices (into the dense gradients) reduced together."""
        idx = list(range(n))
        if self.groups is not None and variables is not None:
            where = {id(_ref(v)): i for i, v in zip(idx, variables)}
            taken: set = set()
            out = []
            for g in self.groups:
                bucket = [where[id(_ref(v))] for v in g if id(_ref(v)) in where]
                if taken.intersection(bucket):
                    raise ValueError("a variable appears in more than one of `groups`")
                taken.update(bucket)
                if bucket:
                    out.append(sorted(bucket))
            rest = [i for i in idx if i not in taken]
            return out + ([rest] if rest else [])
        if self.num_groups and n:
            k = min(self.num_groups, n)
            per = -(-n // k)
            return [idx[i:i + per] for i in range(0, n, per)]
        return [idx] if idx else []

    @tf.autograph.experimental.do_not_convert
    def reduce(self, grads: Sequence[Any], variables: Optional[Sequence[Any]] = None) -> list:
        """Averaged (or summed, or Adasum-combined) gradients, in the order given; None stays
        None."""
        if not self.reduces() and self.prescale * self.postscale == 1.0:
            return [tf.convert_to_tensor(g) if self.sparse_as_dense and isinstance(g, tf.IndexedSlices)
                    else g for g in grads]
        out: list = list(grads)
        dense_pos, dense_vars = [], []
        for i, g in enumerate(grads):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense and self.op == Adasum:
                    raise ValueError("op=hvd.Adasum does not take sparse gradients (tf.IndexedSlices), "
                                     "as in Horovod; pass sparse_as_dense=True")
                if not self.sparse_as_dense:
                    out[i] = sparse_allreduce(g, f"{self.name}.sparse.{i}", self.op, self.ps)
                    continue
                g = tf.convert_to_tensor(g)
            out[i] = g
            dense_pos.append(i)
            dense_vars.append(variables[i] if variables is not None else None)
        if self.op == Adasum:     # Adasum is per tensor: one request per gradient
            pairs = [self.compression.compress(out[p]) for p in dense_pos]
            reduced = _adasum([c for c, _ in pairs], f"{self.name}.adasum", self.ps)
            for p, r, (_, ctx) in zip(dense_pos, reduced, pairs):
                out[p] = self.compression.decompress(r, ctx)
            return out
        for b, bucket in enumerate(self._buckets(len(dense_pos), dense_vars if variables is not None
                                                 else None)):
            pos = [dense_pos[j] for j in bucket]
            pairs = [self.compression.compress(out[p]) for p in pos]
            reduced = grouped([c for c, _ in pairs], f"{self.name}.{b}", self.op, self.prescale,
                               self.postscale, self.ps)
            for p, r, (_, ctx) in zip(pos, reduced, pairs):
                out[p] = self.compression.decompress(r, ctx)
        return out


def _adasum(xs: list, name: str, ps: ProcessSet) -> list:
    """Adasum of each tensor over the set's ranks, in one host call (one request per tensor)."""
    if not xs:
        return []

    def run(*arrays: Any) -> list:
        handles = [C.allreduce_async(a, name=f"{name}.{i}", op=Adasum, process_set=ps)
                   for i, a in enumerate(arrays)]
        return [h.wait() for h in handles]
    return host_call(run, xs, [x.dtype for x in xs], [x.shape for x in xs], "adasum")


def divide_gradient(g: Any, n: Any) -> Any:
    """``g`` (a tensor or tf.IndexedSlices) divided by ``n`` (the number of ranks: an int, or
    a tensor read when the graph runs); unchanged when ``n`` is 1."""
    if is_static(n) and n == 1:
        return g
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values / tf.cast(n, g.values.dtype), g.indices, g.dense_shape)
    return g / tf.cast(n, g.dtype)


def _ref(v: Any) -> Any:
    """The tf.Variable behind a Keras 3 Variable (so either can name a group member)."""
    inner = getattr(v, "value", None)
    return inner if isinstance(inner, tf.Variable) and not isinstance(v, tf.Variable) else v


class _DistributedGradientTape:
    """Mixin placed before the wrapped tape's class in a dynamic subclass."""

    _hvd_reducer: GradientReducer
    _hvd_local: set
    _hvd_scale_local: bool

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = None) -> Any:
        """The wrapped tape's gradients, averaged (or summed) over all ranks; same structure
        as ``sources``. Sources registered with ``register_local_source`` are not reduced (with
        ``scale_local_gradients``, the default, they are divided by the number of ranks, as
        Horovod does)."""
        kw = {} if unconnected_gradients is None else {"unconnected_gradients": unconnected_gradients}
        grads = super().gradient(target, sources, output_gradients=output_gradients, **kw)  # type: ignore[misc]
        flat_src = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads)
        shared = [i for i, s in enumerate(flat_src) if id(_ref(s)) not in self._hvd_local]
        reduced = self._hvd_reducer.reduce([flat[i] for i in shared], [flat_src[i] for i in shared])
        for i, r in zip(shared, reduced):
            flat[i] = r
        if self._hvd_scale_local and len(shared) < len(flat):
            n = self._hvd_reducer.size_when_run()
            for i, s in enumerate(flat_src):
                g = flat[i]
                if id(_ref(s)) in self._hvd_local and g is not None:
                    flat[i] = divide_gradient(g, n)
        return tf.nest.pack_sequence_as(sources, flat)

    def register_local_source(self, source: Any) -> None:
        """Do not reduce the gradient of ``source`` (a variable that is local to this rank)."""
        self._hvd_local.add(id(_ref(source)))


def DistributedGradientTape(gradtape: Any, device_dense: str = "", device_sparse: str = "",
                            compression: type[Compressor] = Compression.none,
                            sparse_as_dense: bool = False, op: Any = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None, process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True) -> Any:
    """Wrap ``gradtape`` so that ``gradient()`` returns gradients averaged over all ranks.

    Works on a tape that recorded already or one not yet entered
    (``with hvd.DistributedGradientTape(tf.GradientTape()) as tape:``). ``compression``
    (hvd.Compression.fp16/bf16) casts on the wire; ``op`` is hvd.Average, hvd.Sum or
    hvd.Adasum (each gradient Adasum-combined on its own, as Horovod does; dense only);
    ``gradient_predivide_factor=f`` divides by f before the sum and by size/f after;
    ``sparse_as_dense`` densifies tf.IndexedSlices (else their values and indices are
    allgathered); ``num_groups`` / ``groups`` (list of lists of variables) split the single
    grouped allreduce into several; ``process_set`` reduces over its ranks only;
    ``scale_local_gradients`` divides the gradients of ``register_local_source`` sources by
    the number of ranks. ``device_dense``/``device_sparse`` are accepted for Horovod
    compatibility (CPU only here).

    Example, 2 ranks, loss = w * x with x = 1 on rank 0 and x = 3 on rank 1::

        tape.gradient(loss, w)  -> 2.0 on both ranks (plain tf.GradientTape: 1.0 and 3.0)
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, not {type(gradtape).__name__}")
    if isinstance(gradtape, _DistributedGradientTape):
        raise ValueError("this tape is already a DistributedGradientTape; wrap the plain tape once")
    reducer = GradientReducer(compression, op, gradient_predivide_factor, sparse_as_dense,
                              num_groups, groups, "DistributedGradientTape.grads",
                              "DistributedGradientTape", process_set)
    base = type(gradtape)
    cls = type(base.__name__, (_DistributedGradientTape, base), {"__module__": base.__module__})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._hvd_reducer = reducer
    tape._hvd_local = set()
    tape._hvd_scale_local = bool(scale_local_gradients)
    return tape
