"""Built on the collectives of :mod:`.mpi_ops`: the grouped allgather / reducescatter
(one request per tensor, differentiable like the single ops: the allgather gradient is
Sum-allreduced and each rank keeps its rows, the reducescatter gradient is allgathered and
scaled like the forward pass), starting every rank from the root's variables
(``broadcast_variables``, ``broadcast_``), the object collectives (re-exported from the
runtime, plus ``broadcast_object_fn``) and the rank/size ops."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

import hvd_magic.collectives as C
from hvd_magic.collectives import Average, Sum, allgather_object, broadcast_object
from hvd_magic.collectives.grouped import grouped_allgather_rows
from hvd_magic.collectives.ops import to_op

from ._compat import import_tf
from .compression import Compression, Compressor, check_compression
from .mpi_ops import _check_grad_op, _grouped, _my_rows, _tensor, host_call

tf = import_tf()
_plain = tf.autograph.experimental.do_not_convert

__all__ = ["grouped_allgather", "grouped_reducescatter", "broadcast_variables", "broadcast_",
           "broadcast_object", "broadcast_object_fn", "allgather_object", "size_op",
           "local_size_op", "cross_size_op", "rank_op", "local_rank_op", "cross_rank_op"]


# ---------------------------------------------------------------- grouped allgather, reducescatter

def _dense_list(tensors: Any, fn: str) -> list:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"hvd_magic.tensorflow.{fn} takes a list of tensors, not {type(tensors).__name__}")
    xs = [_tensor(t, fn) for t in tensors]
    if any(isinstance(x, tf.IndexedSlices) for x in xs):
        raise TypeError(f"{fn} takes dense tensors; densify tf.IndexedSlices with tf.convert_to_tensor")
    return xs


@_plain
def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None) -> list:
    """:func:`allgather` of every tensor of the list, negotiated together (tensor i is named
    ``f"{name}.{i}"``); differentiable.

    Example, 2 ranks::

        rank 0: grouped_allgather([tf.constant([1]), tf.constant([[1, 2]])])     -> [[1, 2, 3], [[1, 2], [3, 4]]]
        rank 1: grouped_allgather([tf.constant([2, 3]), tf.constant([[3, 4]])])  -> [[1, 2, 3], [[1, 2], [3, 4]]]
    """
    xs = _dense_list(tensors, "grouped_allgather")
    if not xs:
        raise ValueError("grouped_allgather got an empty list; pass at least one tensor")
    k, scalars = len(xs), [x.shape.rank == 0 for x in xs]

    def host(*arrays: Any) -> list:
        outs, rows = grouped_allgather_rows(list(arrays), name)
        return outs + [np.asarray(r, dtype=np.int64) for r in rows]

    @tf.custom_gradient
    def f(*ts: Any) -> Any:
        shapes = [tf.TensorShape([None]).concatenate(t.shape[1:] if t.shape.rank else []) for t in ts]
        outs = host_call(host, ts, [t.dtype for t in ts] + [tf.int64] * k,
                         shapes + [tf.TensorShape([None])] * k, "grouped_allgather")
        ys, rows = outs[:k], outs[k:]

        def grad(*dys: Any) -> Any:
            summed = _grouped([tf.convert_to_tensor(d) for d in dys], None, Sum, 1.0, 1.0)
            r, mine = C.rank(), []
            for g, rw, scalar in zip(summed, rows, scalars):
                start = tf.reduce_sum(rw[:r])
                m = g[start:start + rw[r]]
                mine.append(tf.reshape(m, []) if scalar else m)
            return mine
        return ys, grad
    return list(f(*xs))




@_plain
def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: type[Compressor] = Compression.none, op: Any = Average,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: Optional[str] = None) -> list:
    """:func:`reducescatter` of every tensor of the list, negotiated together (tensor i is
    named ``f"{name}.{i}"``); differentiable for Average and Sum. An empty list comes back
    as it is, as in Horovod.

    Example, 2 ranks, op=Sum::

        rank 0: grouped_reducescatter([tf.constant([1, 2, 3]), tf.ones([2, 2])], op=hvd.Sum)  -> [[2, 4], [[2., 2.]]]
        rank 1: grouped_reducescatter([tf.constant([1, 2, 3]), tf.ones([2, 2])], op=hvd.Sum)  -> [[6], [[2., 2.]]]
    """
    op = to_op(Average if op is None else op)
    check_compression(compression)
    xs = _dense_list(tensors, "grouped_reducescatter")
    if not xs:
        return []
    if any(x.shape.rank == 0 for x in xs):
        raise ValueError("grouped_reducescatter needs tensors with at least one dimension")
    pairs = [compression.compress(x) for x in xs]
    outs = _grouped_reducescatter([p[0] for p in pairs], name, op, float(prescale_factor),
                                  float(postscale_factor))
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def _grouped_reducescatter(xs: list, name: Optional[str], op: Any, pre: float, post: float) -> list:
    @tf.custom_gradient
    def f(*ts: Any) -> Any:
        n, r = C.size(), C.rank()
        shapes = [tf.TensorShape([_my_rows(t.shape[0], n, r)]).concatenate(t.shape[1:]) for t in ts]
        outs = host_call(lambda *a: C.grouped_reducescatter(list(a), name=name, op=op, prescale_factor=pre,
                                                            postscale_factor=post),
                         ts, [t.dtype for t in ts], shapes, "grouped_reducescatter")

        def grad(*dys: Any) -> Any:
            _check_grad_op(op, "grouped_reducescatter")
            gs = grouped_allgather([tf.convert_to_tensor(d) for d in dys])
            scale = pre * post / (C.size() if op == Average else 1)
            return [g * tf.cast(scale, g.dtype) if scale != 1.0 else g for g in gs]
        return outs, grad
    return list(f(*xs))


# ---------------------------------------------------------------- variables

def _variables(variables: Any, fn: str = "broadcast_variables") -> list:
    if isinstance(variables, dict):
        variables = [v for _, v in sorted(variables.items())]
    try:
        vs = list(variables)
    except TypeError:
        raise TypeError(f"{fn} takes a list of variables, e.g. model.variables or "
                        f"optimizer.variables, not {type(variables).__name__}") from None
    out = []
    for v in vs:
        inner = getattr(v, "value", None)   # a Keras 3 Variable wraps a tf.Variable
        if not isinstance(v, tf.Variable) and isinstance(inner, tf.Variable):
            v = inner
        if not isinstance(v, tf.Variable):
            raise TypeError(f"{fn} takes variables, got a {type(v).__name__}; use "
                            "broadcast() for tensors and broadcast_object() for other values")
        out.append(v)
    return out


def _packed_broadcast(arrays: list, root_rank: int, name: str) -> list:
    """One broadcast per dtype: pack same-dtype arrays into one flat buffer."""
    groups: dict = {}
    for i, a in enumerate(arrays):
        groups.setdefault(a.dtype.str, []).append(i)
    out: list = [None] * len(arrays)
    for key, idxs in sorted(groups.items()):
        flat = np.concatenate([np.asarray(arrays[i]).reshape(-1) for i in idxs])
        got = C.broadcast(flat, root_rank, name=f"{name}.{key}")
        got = np.asarray(got).view(flat.dtype) if got.dtype != flat.dtype else np.asarray(got)
        off = 0
        for i in idxs:
            n = arrays[i].size
            out[i] = got[off:off + n].reshape(arrays[i].shape)
            off += n
    return out


_counter = [0]


@tf.autograph.experimental.do_not_convert
def broadcast_variables(variables: Iterable[Any], root_rank: int = 0) -> Any:
    """Overwrite every rank's variables with ``root_rank``'s values (call on every rank with
    the same variables in the same order). Eagerly it returns None; inside ``tf.function`` it
    returns the grouped assign op. Variables of one dtype travel as one buffer.

    Example, 2 ranks::

        rank 0: w = [[0.1, 0.2]]  ->  [[0.1, 0.2]]
        rank 1: w = [[0.7, 0.3]]  ->  [[0.1, 0.2]]
    """
    vs = _variables(variables)
    C.api.check_root(root_rank)
    if not vs:
        return None
    _counter[0] += 1
    name = f"broadcast_variables.{_counter[0]}"
    values = host_call(lambda *a: _packed_broadcast(list(a), root_rank, name),
                       [v.read_value() for v in vs], [v.dtype for v in vs],
                       [v.shape for v in vs], "broadcast_variables")
    assigns = [v.assign(x) for v, x in zip(vs, values)]
    if tf.executing_eagerly():
        return None
    return tf.group(*assigns)


@_plain
def broadcast_(variables: Iterable[Any], root_rank: int, name: Optional[str] = None) -> list:
    """In-place broadcast: every rank's ``variables`` are assigned ``root_rank``'s values
    (variables of one dtype travel as one buffer); returns their new values, as Horovod does.

    Example, 2 ranks::

        rank 0: v = tf.Variable([1., 2.]); broadcast_([v], root_rank=0)  -> [[1., 2.]]; v holds [1., 2.]
        rank 1: v = tf.Variable([0., 0.]); broadcast_([v], root_rank=0)  -> [[1., 2.]]; v holds [1., 2.]
    """
    vs = _variables(variables, "broadcast_")
    C.api.check_root(root_rank)
    if not vs:
        return []
    base = C.api.request_name("broadcast_", name)
    values = host_call(lambda *a: _packed_broadcast(list(a), root_rank, base),
                       [v.read_value() for v in vs], [v.dtype for v in vs],
                       [v.shape for v in vs], "broadcast_")
    assigns = [v.assign(x) for v, x in zip(vs, values)]
    with tf.control_dependencies(assigns):
        return [tf.identity(v.read_value()) for v in vs]


def broadcast_object_fn(root_rank: int = 0, session: Any = None,
                        name: Optional[str] = None) -> Callable[[Any], Any]:
    """A function ``f(obj)`` that returns ``root_rank``'s ``obj`` on every rank (see
    :func:`broadcast_object`). ``session`` (TensorFlow 1) is accepted and not used.

    Example, 2 ranks::

        rank 0: broadcast_object_fn(root_rank=0)({"epoch": 3})  -> {"epoch": 3}
        rank 1: broadcast_object_fn(root_rank=0)(None)          -> {"epoch": 3}
    """
    def bcast(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, name)
    return bcast


# ---------------------------------------------------------------- rank and size as tensors

def _int_op(value: int, name: Optional[str]) -> Any:
    return tf.constant(value, dtype=tf.int32, name=name)


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> Any:
    """The number of ranks as an int32 scalar tensor. Its value is taken when the op is made
    (inside ``tf.function``: when it is traced). Example, 2 ranks: every rank -> 2."""
    if process_set_id != 0:
        raise ValueError(f"size_op(process_set_id={process_set_id!r}): only the global set (0) is "
                         "supported here; use hvd.size_op() or hvd.size()")
    return _int_op(C.size(), name)


def local_size_op(name: Optional[str] = None) -> Any:
    """The number of ranks on this host, as an int32 scalar tensor (see :func:`size_op`).
    Example, 2 ranks on one host: every rank -> 2."""
    return _int_op(C.local_size(), name)


def cross_size_op(name: Optional[str] = None) -> Any:
    """The number of hosts, as an int32 scalar tensor (see :func:`size_op`).
    Example, 2 ranks on one host: every rank -> 1."""
    return _int_op(C.cross_size(), name)


def rank_op(name: Optional[str] = None) -> Any:
    """This rank, as an int32 scalar tensor (see :func:`size_op`).
    Example, 2 ranks: rank 0 -> 0, rank 1 -> 1."""
    return _int_op(C.rank(), name)


def local_rank_op(name: Optional[str] = None) -> Any:
    """This rank's number on its host, as an int32 scalar tensor (see :func:`size_op`).
    Example, 2 ranks on one host: rank 0 -> 0, rank 1 -> 1."""
    return _int_op(C.local_rank(), name)


def cross_rank_op(name: Optional[str] = None) -> Any:
    """This rank's host number, as an int32 scalar tensor (see :func:`size_op`).
    Example, 2 ranks on one host: every rank -> 0."""
    return _int_op(C.cross_rank(), name)
