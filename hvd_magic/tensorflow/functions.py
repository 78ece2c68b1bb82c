"""Built on the collectives of :mod:`.mpi_ops`: the grouped allgather / reducescatter
(one request per tensor, differentiable like the single ops: the allgather gradient is
averaged over the ranks and each rank keeps its rows, the reducescatter gradient is
allgathered and scaled as Horovod does), starting every rank from the root's variables
(``broadcast_variables``, ``broadcast_``), the object collectives and the rank/size ops.
Each takes ``process_set=`` where Horovod's does, in Horovod's position."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

import hvd_magic.collectives as C
from hvd_magic.collectives import Average, ProcessSet, global_process_set
from hvd_magic.collectives.grouped import grouped_allgather_rows
from hvd_magic.collectives.ops import to_op
from hvd_magic.collectives.process_sets import engine_of

from ._compat import import_tf
from .compression import Compression, Compressor, check_compression
from ._bridge import host_call, is_static, movable, read_when_run
from .mpi_ops import (check_grad_op, grouped, my_rows, own_rows, placement, place_when_run,
                      as_tensor, scale_like_horovod)

tf = import_tf()
plain = tf.autograph.experimental.do_not_convert

__all__ = ["grouped_allgather", "grouped_reducescatter", "broadcast_variables", "broadcast_",
           "broadcast_global_variables", "broadcast_object", "broadcast_object_fn", "allgather_object", "size_op",
           "process_set_included_op", "local_size_op", "rank_op", "local_rank_op"]


# ---------------------------------------------------------------- grouped allgather, reducescatter

def _dense_list(tensors: Any, fn: str) -> list:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"hvd_magic.tensorflow.{fn} takes a list of tensors, not {type(tensors).__name__}")
    xs = [as_tensor(t, fn) for t in tensors]
    if any(isinstance(x, tf.IndexedSlices) for x in xs):
        raise TypeError(f"{fn} takes dense tensors; densify tf.IndexedSlices with tf.convert_to_tensor")
    return xs


@plain
def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list:
    """:func:`allgather` of every tensor of the list (over ``process_set``), negotiated
    together (tensor i is named ``f"{name}.{i}"``); differentiable.

    Example, 2 ranks::

        rank 0: grouped_allgather([tf.constant([1]), tf.constant([[1, 2]])])     -> [[1, 2, 3], [[1, 2], [3, 4]]]
        rank 1: grouped_allgather([tf.constant([2, 3]), tf.constant([[3, 4]])])  -> [[1, 2, 3], [[1, 2], [3, 4]]]
    """
    xs = _dense_list(tensors, "grouped_allgather")
    if not xs:
        raise ValueError("grouped_allgather got an empty list; pass at least one tensor")
    r, _ = place_when_run(process_set)
    k, scalars = len(xs), [x.shape.rank == 0 for x in xs]

    def host(*arrays: Any) -> list:
        outs, rows = grouped_allgather_rows([movable(a) for a in arrays], name, process_set)
        return outs + [np.asarray(rw, dtype=np.int64) for rw in rows]

    @tf.custom_gradient
    def f(*ts: Any) -> Any:
        shapes = [tf.TensorShape([None]).concatenate(t.shape[1:] if t.shape.rank else []) for t in ts]
        outs = host_call(host, ts, [t.dtype for t in ts] + [tf.int64] * k,
                         shapes + [tf.TensorShape([None])] * k, "grouped_allgather", name)
        ys, rows = outs[:k], outs[k:]

        def grad(*dys: Any) -> Any:
            avg = grouped([tf.convert_to_tensor(d) for d in dys], None, Average, 1.0, 1.0, process_set)
            return [own_rows(g, rw, r, sc) for g, rw, sc in zip(avg, rows, scalars)]
        return ys, grad
    return list(f(*xs))


@plain
def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: type[Compressor] = Compression.none, op: Any = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: Optional[str] = None) -> list:
    """:func:`reducescatter` of every tensor of the list (over ``process_set``), negotiated
    together (tensor i is named ``f"{name}.{i}"``); differentiable for Average and Sum. An
    empty list comes back as it is, as in Horovod.

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
    placement(process_set)
    pairs = [compression.compress(x) for x in xs]
    outs = _grouped_reducescatter([p[0] for p in pairs], name, op, float(prescale_factor),
                                  float(postscale_factor), process_set)
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def _grouped_reducescatter(xs: list, name: Optional[str], op: Any, pre: float, post: float,
                           ps: ProcessSet) -> list:
    r, n = place_when_run(ps)

    @tf.custom_gradient
    def f(*ts: Any) -> Any:
        shapes = [tf.TensorShape([my_rows(t.shape[0], n, r)]).concatenate(t.shape[1:]) for t in ts]
        outs = host_call(lambda *a: C.grouped_reducescatter(list(a), name=name, op=op, prescale_factor=pre,
                                                            postscale_factor=post, process_set=ps),
                         ts, [t.dtype for t in ts], shapes, "grouped_reducescatter", name)

        def grad(*dys: Any) -> Any:
            check_grad_op(op, "grouped_reducescatter")
            gs = grouped_allgather([tf.convert_to_tensor(d) for d in dys], process_set=ps)
            return [scale_like_horovod(g, op, pre, post, n) for g in gs]
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


def _packed_broadcast(arrays: list, root_rank: int, name: str, ps: ProcessSet) -> list:
    """One broadcast per dtype: pack same-dtype arrays into one flat buffer."""
    groups: dict = {}
    for i, a in enumerate(arrays):
        groups.setdefault(a.dtype.str, []).append(i)
    out: list = [None] * len(arrays)
    for key, idxs in sorted(groups.items()):
        flat = movable(np.concatenate([np.asarray(arrays[i]).reshape(-1) for i in idxs]))
        got = C.broadcast(flat, root_rank, name=f"{name}.{key}", process_set=ps)
        got = np.asarray(got).view(flat.dtype) if got.dtype != flat.dtype else np.asarray(got)
        off = 0
        for i in idxs:
            n = arrays[i].size
            out[i] = got[off:off + n].reshape(arrays[i].shape)
            off += n
    return out


def _broadcast_values(vs: list, root_rank: int, name: Optional[str], ps: ProcessSet, kind: str) -> list:
    """The root's values of ``vs`` (tensors; one host call, one broadcast per dtype). An
    unnamed call takes its name when it runs, not when a graph is traced: every run of a
    traced function then numbers its broadcasts as the other ranks do, a rank that joined an
    elastic job since included."""
    engine_of(ps)    # ValueError now for a set this rank is not in

    def run(*arrays: Any) -> list:
        base = C.api.request_name(kind, name, engine_of(ps))
        return _packed_broadcast(list(arrays), root_rank, base, ps)
    return host_call(run,
                     [v.read_value() for v in vs], [v.dtype for v in vs], [v.shape for v in vs], kind)


@tf.autograph.experimental.do_not_convert
def broadcast_variables(variables: Iterable[Any], root_rank: int = 0,
                        process_set: ProcessSet = global_process_set, inplace: bool = False) -> Any:
    """Overwrite every rank's variables (every rank of ``process_set``) with ``root_rank``'s
    values (call on every rank with the same variables in the same order). Eagerly it returns
    None; inside ``tf.function`` it returns the grouped assign op. Variables of one dtype
    travel as one buffer. ``inplace`` is accepted for Horovod compatibility: the variables
    are always assigned in place here.

    Example, 2 ranks::

        rank 0: w = [[0.1, 0.2]]  ->  [[0.1, 0.2]]
        rank 1: w = [[0.7, 0.3]]  ->  [[0.1, 0.2]]
    """
    vs = _variables(variables)
    C.api.check_root(root_rank, engine_of(process_set))   # ValueError off the set or its ranks
    if not vs:
        return None
    values = _broadcast_values(vs, root_rank, None, process_set, "broadcast_variables")
    assigns = [v.assign(x) for v, x in zip(vs, values)]
    if tf.executing_eagerly():
        return None
    return tf.group(*assigns)


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1 graph mode: :func:`broadcast_variables` of ``tf.compat.v1.global_variables()``
    (returns the op to run). Eagerly there are no global variables: RuntimeError, as Horovod.

    Example, 2 ranks, graph mode, one global variable ``w``::

        rank 0: w = [0.1]  ->  [0.1]  (after session.run(broadcast_global_variables(0)))
        rank 1: w = [0.7]  ->  [0.1]
    """
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() works in TF1 graph mode only: eager "
                           "TensorFlow keeps no global variables. Use hvd.broadcast_variables("
                           "model.variables, root_rank) (and optimizer.variables) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


@plain
def broadcast_(variables: Iterable[Any], root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> list:
    """In-place broadcast: every rank's ``variables`` (every rank of ``process_set``) are
    assigned ``root_rank``'s values (variables of one dtype travel as one buffer); returns
    their new values, as Horovod does.

    Example, 2 ranks::

        rank 0: v = tf.Variable([1., 2.]); broadcast_([v], root_rank=0)  -> [[1., 2.]]; v holds [1., 2.]
        rank 1: v = tf.Variable([0., 0.]); broadcast_([v], root_rank=0)  -> [[1., 2.]]; v holds [1., 2.]
    """
    vs = _variables(variables, "broadcast_")
    C.api.check_root(root_rank, engine_of(process_set))   # ValueError off the set or its ranks
    if not vs:
        return []
    values = _broadcast_values(vs, root_rank, name, process_set, "broadcast_")
    assigns = [v.assign(x) for v, x in zip(vs, values)]
    with tf.control_dependencies(assigns):
        return [tf.identity(v.read_value()) for v in vs]


# ---------------------------------------------------------------- objects

def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Every rank (of ``process_set``) gets ``root_rank``'s picklable object. ``session``
    (TensorFlow 1) is accepted and not used.

    Example, 2 ranks::

        rank 0: broadcast_object({"lr": 0.1})  -> {"lr": 0.1}
        rank 1: broadcast_object(None)         -> {"lr": 0.1}
    """
    return C.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function ``f(obj)`` that returns ``root_rank``'s ``obj`` on every rank (see
    :func:`broadcast_object`). ``session`` (TensorFlow 1) is accepted and not used.

    Example, 2 ranks::

        rank 0: broadcast_object_fn(root_rank=0)({"epoch": 3})  -> {"epoch": 3}
        rank 1: broadcast_object_fn(root_rank=0)(None)          -> {"epoch": 3}
    """
    def bcast(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)
    return bcast


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """List of every rank's picklable object (every rank of ``process_set``, in set order).
    ``session`` (TensorFlow 1) is accepted and not used.

    Example, 2 ranks::

        rank 0: allgather_object("a")  -> ["a", "b"]
        rank 1: allgather_object("b")  -> ["a", "b"]
    """
    return C.allgather_object(obj, name=name, process_set=process_set)


# ---------------------------------------------------------------- rank and size as tensors

def _int_op(read: Callable[[], int], name: Optional[str]) -> Any:
    value = read_when_run(read, name)
    return tf.constant(value, dtype=tf.int32, name=name) if is_static(value) else value


def _registered(process_set_id: Any, fn: str) -> ProcessSet:
    """The registered set ``process_set_id`` names (ValueError when there is none)."""
    if isinstance(process_set_id, bool) or not isinstance(process_set_id, (int, np.integer)):
        raise TypeError(f"{fn}: process_set_id must be an int (a set's .process_set_id), "
                        f"not {process_set_id!r}")
    if process_set_id == 0:
        return global_process_set
    ps = ProcessSet([])          # a handle on the registered id, as Horovod's ops take ids
    ps.process_set_id = int(process_set_id)
    try:
        ps.size()
    except ValueError:
        raise ValueError(f"{fn}(process_set_id={process_set_id}): no process set with that id is "
                         "registered (0 is the global set; hvd.add_process_set or "
                         "hvd.init(process_sets=[...]) give the others theirs)") from None
    return ps


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> Any:
    """The number of ranks (of the process set with id ``process_set_id``) as an int32 scalar
    tensor. In an elastic job, inside ``tf.function`` or a TF1 graph, it is read each time the
    op runs, as Horovod's (the job may have grown or shrunk since the function was traced);
    otherwise it is a constant, taken when the op is made.

    Example, 3 ranks, ``odds = hvd.add_process_set([1])``: every rank: ``size_op()`` -> 3,
    ``size_op(odds.process_set_id)`` -> 1.
    """
    ps = _registered(process_set_id, "size_op")
    return _int_op(ps.size, name)


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> Any:
    """1 where this rank is in the process set with id ``process_set_id``, else 0, as an int32
    scalar tensor (see :func:`size_op`). Example, 3 ranks, ``odds = hvd.add_process_set([1])``:
    rank 1 -> 1, ranks 0 and 2 -> 0; ``process_set_included_op()`` -> 1 everywhere."""
    ps = _registered(process_set_id, "process_set_included_op")
    return _int_op(lambda: 1 if ps.process_set_id == 0 or ps.rank() is not None else 0, name)


def local_size_op(name: Optional[str] = None) -> Any:
    """The number of ranks on this host, as an int32 scalar tensor (see :func:`size_op`).
    Example, 2 ranks on one host: every rank -> 2."""
    return _int_op(C.local_size, name)


def rank_op(name: Optional[str] = None) -> Any:
    """This rank, as an int32 scalar tensor (see :func:`size_op`).
    Example, 2 ranks: rank 0 -> 0, rank 1 -> 1."""
    return _int_op(C.rank, name)


def local_rank_op(name: Optional[str] = None) -> Any:
    """This rank's number on its host, as an int32 scalar tensor (see :func:`size_op`).
    Example, 2 ranks on one host: rank 0 -> 0, rank 1 -> 1."""
    return _int_op(C.local_rank, name)
