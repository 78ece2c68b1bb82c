"""Collectives on ``tf.Tensor`` / ``tf.Variable`` with ``horovod.tensorflow``'s signatures.

They run eagerly, or inside ``tf.function`` as a ``tf.numpy_function`` with the static
output shape set where it is known (not under ``jit_compile=True``: XLA cannot call back
into Python). The reductions, gathers and broadcasts are differentiable, as in Horovod:

- allreduce / grouped_allreduce: the gradient is allreduced with the same op and factors;
- allgather: the gradient is averaged over the ranks and each rank keeps its own rows;
- broadcast: the gradient is averaged over the ranks; the root keeps it, others get zeros
  (allgather and broadcast average as ``horovod.tensorflow`` does);
- reducescatter: the gradient is allgathered, times the scale factors and, for Sum, the
  number of ranks (Horovod's convention);
- alltoall: the gradient travels back with ``alltoall(grad, splits=received_splits)``.

Every rank must run the same collectives (and so the same backward passes) in the same order,
or pass the same ``name`` for matching calls. With ``process_set=``, only the set's ranks call
the collective, its backward pass runs in the same set, shapes follow the set's size and this
rank's place in it, and ``root_rank`` stays the global rank. ``ignore_name_scope`` has no
effect: requests are named by ``name`` or by call order, never by TensorFlow name scopes.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

import hvd_magic.collectives as C
from hvd_magic.collectives import Average, ProcessSet, Sum, global_process_set
from hvd_magic.collectives.ops import resolve_op, to_op
from hvd_magic.collectives.process_sets import engine_of

from ._bridge import ArgumentError, plain, host_call, is_static, movable, read_when_run, tf
from .compression import Compression, Compressor, check_compression


def as_tensor(x: Any, fn: str) -> Any:
    """``x`` as a tf.Tensor (Variables are read), or a TypeError naming ``fn``."""
    if isinstance(x, tf.IndexedSlices):
        return x
    try:
        return tf.convert_to_tensor(x)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"hvd_magic.tensorflow.{fn} takes a tf.Tensor or tf.Variable (or something "
                        f"tf.convert_to_tensor accepts), not {type(x).__name__}") from exc


_op = resolve_op   # Horovod's average=/op= rule, shared by the faces


def placement(process_set: ProcessSet) -> tuple:
    """``(rank within, size of)`` ``process_set`` for this rank; ValueError naming the set when
    this rank is not in it (or it is not registered), TypeError when it is no ProcessSet."""
    try:
        engine_of(process_set)
    except ValueError as exc:   # Horovod's TF ops: InvalidArgumentError
        raise ArgumentError(str(exc)) from exc
    if process_set.process_set_id == 0:
        return C.rank(), C.size()
    return process_set.rank(), process_set.size()


def place_when_run(process_set: ProcessSet) -> tuple:
    """:func:`placement`, read each time a graph runs in an elastic job (see
    :func:`~._bridge.read_when_run`): a graph traced before the job grew or shrank then takes
    this rank's place and the size as they are now."""
    placement(process_set)
    if process_set.process_set_id == 0:
        return read_when_run(C.rank, "hvd_rank"), read_when_run(C.size, "hvd_size")
    return (read_when_run(process_set.rank, "hvd_set_rank"),
            read_when_run(process_set.size, "hvd_set_size"))


def check_grad_op(op: Any, fn: str) -> None:
    if op not in (Average, Sum):
        raise ValueError(f"the gradient of {fn} is only defined for op=hvd.Average or hvd.Sum, not "
                         f"{to_op(op).name}; stop the gradient (tf.stop_gradient) before {fn}")


# ---------------------------------------------------------------- allreduce

def _allreduce(x: Any, name: Optional[str], op: Any, pre: float, post: float,
               ps: ProcessSet = global_process_set) -> Any:
    @tf.custom_gradient
    def f(t: Any) -> Any:
        (y,) = host_call(lambda a: [C.allreduce(a, name=name, op=op, prescale_factor=pre,
                                                postscale_factor=post, process_set=ps)],
                         [t], [t.dtype], [t.shape], "allreduce", name)

        def grad(dy: Any) -> Any:
            check_grad_op(op, "allreduce")
            return _allreduce(tf.convert_to_tensor(dy), None, op, pre, post, ps)
        return y, grad
    return f(x)


class SparseOpError(NotImplementedError, ValueError):
    """An op or option tf.IndexedSlices cannot take: a ValueError, and the
    NotImplementedError Horovod raises."""


@plain
def sparse_allreduce(s: Any, name: Optional[str], op: Any,
                      ps: ProcessSet = global_process_set) -> Any:
    """Horovod's allreduce of tf.IndexedSlices: allgather values and indices (Average divides
    the values by the number of ranks); duplicates are summed when the slices are applied."""
    if op not in (Average, Sum):
        raise SparseOpError(f"allreduce of tf.IndexedSlices supports op=hvd.Average or hvd.Sum, not "
                            f"{to_op(op).name}; densify with tf.convert_to_tensor first (for "
                            "DistributedOptimizer/GradientTape: sparse_as_dense=True)")
    values = allgather(s.values, name=None if name is None else f"{name}.values", process_set=ps)
    indices = allgather(s.indices, name=None if name is None else f"{name}.indices", process_set=ps)
    if op == Average:
        values = values / tf.cast(place_when_run(ps)[1], values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=s.dense_shape)


@plain
def allreduce(tensor: Any, average: Optional[bool] = None, device_dense: str = "",
              device_sparse: str = "", compression: type[Compressor] = Compression.none,
              op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: Optional[str] = None, process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` over all ranks, or those of ``process_set`` (Average unless ``op``
    says otherwise); differentiable. A ``tf.IndexedSlices`` is allgathered (values and
    indices) instead.

    Example, 2 ranks::

        rank 0: allreduce(tf.constant([1., 2.]))              -> [2., 3.]
        rank 1: allreduce(tf.constant([3., 4.]))              -> [2., 3.]
        rank 0: allreduce(tf.constant([1., 2.]), op=hvd.Sum)  -> [4., 6.]

    Example, 3 ranks, ``evens = hvd.add_process_set([0, 2])`` (only ranks 0 and 2 call it)::

        rank 0: allreduce(tf.constant([1.]), op=hvd.Sum, process_set=evens)  -> [4.]
        rank 2: allreduce(tf.constant([3.]), op=hvd.Sum, process_set=evens)  -> [4.]

    ``device_dense``/``device_sparse`` are accepted for Horovod compatibility (CPU only here).
    """
    op = _op(average, op, "allreduce")
    check_compression(compression)
    tensor = as_tensor(tensor, "allreduce")
    placement(process_set)
    if isinstance(tensor, tf.IndexedSlices):
        if float(prescale_factor) != 1.0 or float(postscale_factor) != 1.0:
            raise SparseOpError("allreduce of tf.IndexedSlices takes no prescale_factor/"
                                "postscale_factor (as in Horovod); scale the values yourself")
        return sparse_allreduce(tensor, name, op, process_set)
    compressed, ctx = compression.compress(tensor)
    out = _allreduce(compressed, name, op, float(prescale_factor), float(postscale_factor),
                     process_set)
    return compression.decompress(out, ctx)


def grouped(xs: list, name: Optional[str], op: Any, pre: float, post: float,
            ps: ProcessSet = global_process_set) -> list:
    @tf.custom_gradient
    def f(*ts: Any) -> Any:
        outs = host_call(lambda *a: C.grouped_allreduce(list(a), name=name, op=op, prescale_factor=pre,
                                                        postscale_factor=post, process_set=ps),
                         ts, [t.dtype for t in ts], [t.shape for t in ts], "grouped_allreduce", name)

        def grad(*dys: Any) -> Any:
            check_grad_op(op, "grouped_allreduce")
            return grouped([tf.convert_to_tensor(d) for d in dys], None, op, pre, post, ps)
        return outs, grad
    return list(f(*xs))


@plain
def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: type[Compressor] = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False, name: Optional[str] = None) -> list:
    """:func:`allreduce` of every tensor of the list as one request per dtype (one flat
    buffer, one reduction); differentiable. Returns the list of results. ``tf.IndexedSlices``
    in the list are allgathered one by one, as :func:`allreduce` does.

    Example, 2 ranks, op=Sum::

        rank 0: grouped_allreduce([tf.ones(2), tf.zeros(1)], op=hvd.Sum)  -> [[2., 2.], [1.]]
        rank 1: grouped_allreduce([tf.ones(2), tf.ones(1)], op=hvd.Sum)   -> [[2., 2.], [1.]]
    """
    if not isinstance(tensors, (list, tuple)):
        raise TypeError("grouped_allreduce takes a list of tensors")
    op = _op(average, op, "grouped_allreduce")
    check_compression(compression)
    placement(process_set)
    if not tensors:
        return []
    ts = [as_tensor(t, "grouped_allreduce") for t in tensors]
    sparse = [i for i, t in enumerate(ts) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(ts) if not isinstance(t, tf.IndexedSlices)]
    results: list = [None] * len(ts)
    if sparse:   # as Horovod: each is allgathered (values and indices), refused like allreduce's
        if float(prescale_factor) != 1.0 or float(postscale_factor) != 1.0:
            raise SparseOpError("grouped_allreduce of tf.IndexedSlices takes no prescale_factor/"
                                "postscale_factor (as in Horovod); scale the values yourself")
        for k, i in enumerate(sparse):
            results[i] = sparse_allreduce(ts[i], None if name is None else f"{name}.sparse{k}",
                                           op, process_set)
    if dense:
        pairs = [compression.compress(ts[i]) for i in dense]
        outs = grouped([p[0] for p in pairs], name, op, float(prescale_factor),
                        float(postscale_factor), process_set)
        for i, o, p in zip(dense, outs, pairs):
            results[i] = compression.decompress(o, p[1])
    return results


# ---------------------------------------------------------------- allgather, broadcast

def _gather_host(a: np.ndarray, name: Optional[str], ps: ProcessSet) -> list:
    handle = C.allgather_async(movable(a), name=name, process_set=ps)
    out, rows = handle.wait(), handle.extra
    if rows is None:   # the backend did not report rows per rank: ask
        rows = C.allgather_object(int(a.shape[0]) if a.ndim else 1, process_set=ps)
    return [out, np.asarray([int(r) for r in rows], dtype=np.int64)]


def own_rows(g: Any, rows: Any, r: int, scalar: bool) -> Any:
    """This rank's rows (rank ``r`` of the set) of a gathered gradient ``g``."""
    start = tf.reduce_sum(rows[:r])
    mine = g[start:start + rows[r]]
    return tf.reshape(mine, []) if scalar else mine


@plain
def allgather(tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every rank's tensor (of ``process_set``, in set order) along dimension 0
    (sizes may differ by rank); differentiable.

    Example, 2 ranks::

        rank 0: allgather(tf.constant([[1, 2]]))          -> [[1, 2], [3, 4], [5, 6]]
        rank 1: allgather(tf.constant([[3, 4], [5, 6]]))  -> [[1, 2], [3, 4], [5, 6]]
    """
    x = as_tensor(tensor, "allgather")
    if isinstance(x, tf.IndexedSlices):
        raise TypeError("allgather takes a dense tensor; use allreduce for tf.IndexedSlices")
    scalar = x.shape.rank == 0
    r, _ = place_when_run(process_set)

    @tf.custom_gradient
    def f(t: Any) -> Any:
        shape = tf.TensorShape([None]).concatenate(t.shape[1:]) if t.shape.rank else tf.TensorShape([None])
        y, rows = host_call(lambda a: _gather_host(a, name, process_set), [t], [t.dtype, tf.int64],
                            [shape, tf.TensorShape([None])], "allgather", name)

        def grad(dy: Any) -> Any:
            g = _allreduce(tf.convert_to_tensor(dy), None, Average, 1.0, 1.0, process_set)
            return own_rows(g, rows, r, scalar)
        return y, grad
    return f(x)


@plain
def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None,
              ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set) -> Any:
    """Every rank (of ``process_set``) gets a copy of ``root_rank``'s tensor; differentiable.
    ``root_rank`` is a global rank, one of the set's.

    Example, 2 ranks::

        rank 0: broadcast(tf.constant([1, 2]), root_rank=0)  -> [1, 2]
        rank 1: broadcast(tf.constant([0, 0]), root_rank=0)  -> [1, 2]
    """
    x = as_tensor(tensor, "broadcast")
    if isinstance(x, tf.IndexedSlices):
        x = tf.convert_to_tensor(x)
    C.api.check_root(root_rank, engine_of(process_set))

    @tf.custom_gradient
    def f(t: Any) -> Any:
        (y,) = host_call(lambda a: [C.broadcast(movable(a), root_rank, name=name,
                                                process_set=process_set)],
                         [t], [t.dtype], [t.shape], "broadcast", name)

        def grad(dy: Any) -> Any:
            g = _allreduce(tf.convert_to_tensor(dy), None, Average, 1.0, 1.0, process_set)
            me = read_when_run(C.rank, "hvd_rank")
            if not is_static(me):
                return tf.where(tf.equal(me, root_rank), g, tf.zeros_like(g))
            if me == root_rank:
                return g
            with tf.control_dependencies([g]):   # a graph must still run the allreduce here
                return tf.identity(tf.zeros_like(g))
        return y, grad
    return f(x)


# ---------------------------------------------------------------- alltoall, reducescatter

@plain
def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None,
             ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[j]`` rows of ``tensor`` to rank j of ``process_set`` (equal shares when
    None) and concatenate what arrives. Returns the output, or ``(output, received_splits)``
    when ``splits`` is given, as horovod.tensorflow does; differentiable with respect to
    ``tensor``.

    Example, 2 ranks::

        rank 0: alltoall(tf.constant([1, 2]))                       -> [1, 3]
        rank 1: alltoall(tf.constant([3, 4]))                       -> [2, 4]
        rank 0: alltoall(tf.constant([1, 2, 3]), splits=[1, 2])     -> ([1, 4], [1, 1])
        rank 1: alltoall(tf.constant([4, 5, 6]), splits=[1, 2])     -> ([2, 3, 5, 6], [2, 2])
    """
    x = as_tensor(tensor, "alltoall")
    _, n = place_when_run(process_set)
    if x.shape.rank == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    if splits is None:
        if is_static(n) and x.shape[0] is not None and x.shape[0] % n:
            raise ArgumentError(f"alltoall without splits needs the first dimension ({x.shape[0]}) to "
                             f"be divisible by the number of ranks ({n}); pass splits=[rows per rank]")
        sp = tf.fill([n], tf.cast(tf.shape(x)[0] // n, tf.int32))
    else:
        sp = tf.cast(tf.convert_to_tensor(splits), tf.int32)
    out, received = _alltoall(x, sp, name, process_set)
    return out if splits is None else (out, received)


def _alltoall(x: Any, sp: Any, name: Optional[str], ps: ProcessSet) -> tuple:
    received: list = []
    n = place_when_run(ps)[1]

    @tf.custom_gradient
    def f(t: Any) -> Any:
        shape = tf.TensorShape([None]).concatenate(t.shape[1:])
        y, rs = host_call(lambda a, s: list(C.alltoall(movable(a), splits=s, name=name, process_set=ps)),
                          [t, sp], [t.dtype, tf.int32], [shape, tf.TensorShape([n if is_static(n) else None])], "alltoall", name)
        received.append(rs)

        def grad(dy: Any) -> Any:
            return _alltoall(tf.convert_to_tensor(dy), rs, None, ps)[0]
        return y, grad
    out = f(x)
    return out, tf.stop_gradient(received[0])


def my_rows(rows: Optional[int], n: Any, r: Any) -> Optional[int]:
    """Rows of ``rows`` that rank ``r`` of ``n`` gets from a reducescatter (None: unknown,
    also when ``n`` or ``r`` is read only when the graph runs)."""
    if rows is None or not (is_static(n) and is_static(r)):
        return None
    return rows // n + (1 if r < rows % n else 0)


@plain
def reducescatter(tensor: Any, device_dense: str = "", compression: type[Compressor] = Compression.none,
                  op: Any = Average, name: Optional[str] = None,
                  process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
    """Reduce over all ranks (of ``process_set``), then give each its share of dimension 0 (the
    first ranks of the set get one more row when it does not divide); differentiable for
    Average and Sum.

    Example, 2 ranks, op=Sum::

        rank 0: reducescatter(tf.constant([1, 2, 3]), op=hvd.Sum)  -> [2, 4]
        rank 1: reducescatter(tf.constant([1, 2, 3]), op=hvd.Sum)  -> [6]
    """
    op = to_op(Average if op is None else op)
    check_compression(compression)
    x = as_tensor(tensor, "reducescatter")
    if x.shape.rank == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    placement(process_set)
    compressed, ctx = compression.compress(x)
    out = _reducescatter(compressed, name, op, float(prescale_factor), float(postscale_factor),
                         process_set)
    return compression.decompress(out, ctx)


def _reducescatter(x: Any, name: Optional[str], op: Any, pre: float, post: float,
                   ps: ProcessSet) -> Any:
    r, n = place_when_run(ps)

    @tf.custom_gradient
    def f(t: Any) -> Any:
        shape = tf.TensorShape([my_rows(t.shape[0], n, r)]).concatenate(t.shape[1:])
        (y,) = host_call(lambda a: [C.reducescatter(a, name=name, op=op, prescale_factor=pre,
                                                    postscale_factor=post, process_set=ps)],
                         [t], [t.dtype], [shape], "reducescatter", name)

        def grad(dy: Any) -> Any:
            check_grad_op(op, "reducescatter")
            g = allgather(tf.convert_to_tensor(dy), process_set=ps)
            return scale_like_horovod(g, op, pre, post, n)
        return y, grad
    return f(x)


def scale_like_horovod(g: Any, op: Any, pre: float, post: float, n: Any) -> Any:
    """The gradient of a reducescatter, ``g`` (allgathered), scaled as Horovod scales it: by
    the factors and, for Sum, by the number of ranks ``n`` (an int, or a tensor read when the
    graph runs)."""
    scale = pre * post
    if op == Sum and not is_static(n):
        return g * (tf.cast(n, g.dtype) * tf.cast(scale, g.dtype))
    scale *= n if op == Sum else 1
    return g * tf.cast(scale, g.dtype) if scale != 1.0 else g


# ---------------------------------------------------------------- barrier, join

def barrier(name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank (of ``process_set``) has called barrier."""
    C.barrier(name=name, process_set=process_set)


def join() -> int:
    """This rank has no more data; serve the others' allreduces until all have joined.
    Returns the last rank to join."""
    return C.join()
