"""The eager / graph bridge of the TensorFlow face: run a numpy collective on tf tensors, and
raise Horovod's TensorFlow error classes.

Horovod's TF ops fail with ``tf.errors.FailedPreconditionError`` when the ranks disagree on a
collective (shape, dtype, root rank), and with ``tf.errors.InvalidArgumentError`` on bad
splits or a process set the rank is not in. Eagerly, hvd_magic raises :class:`CollectiveMismatchError` (a FailedPreconditionError
and a :class:`~hvd_magic.collectives.TensorMismatchError`). In a graph, an exception raised
inside ``tf.numpy_function`` always reaches the caller as ``tf.errors.UnknownError``; so the
host op reports a mismatch through a status output instead, and a graph op that fails with
FailedPrecondition (reading a resource variable that was never created, named after the
failure) runs when the status says so. Each rank prints the full mismatch message to stderr.
"""
from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Optional, Sequence

import numpy as np

from hvd_magic.collectives import TensorMismatchError
from hvd_magic.collectives.elastic import fault_tolerant

from ._compat import import_tf

tf = import_tf()
plain = tf.autograph.experimental.do_not_convert   # no autograph rewriting of these


class CollectiveMismatchError(tf.errors.FailedPreconditionError, TensorMismatchError):
    """The ranks disagree on a collective: Horovod's ``tf.errors.FailedPreconditionError``,
    and hvd_magic's TensorMismatchError."""

    # Built from a message alone, with Exception's __init__: autograph then re-raises this
    # class from inside tf.function (not its StagingError)
    __init__ = Exception.__init__

    def __new__(cls, message: str = "", *rest: Any) -> Any:
        self = Exception.__new__(cls, message)
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)
        return self


class ArgumentError(tf.errors.InvalidArgumentError, ValueError):
    """An argument Horovod's TF ops refuse with ``tf.errors.InvalidArgumentError`` (rows that
    do not split, a process set this rank is not in); also a ValueError."""

    # Built from a message alone, with Exception's __init__: autograph then re-raises this
    # class from inside tf.function (not its StagingError)
    __init__ = Exception.__init__

    def __new__(cls, message: str = "", *rest: Any) -> Any:
        self = Exception.__new__(cls, message)
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)
        return self


def read_when_run(read: Callable[[], int], name: Optional[str] = None) -> Any:
    """``read()`` (the size, a rank, ...) where a traced function must see its value when it
    runs: in an elastic job (MPI fault tolerance on), inside a graph, an int32 scalar tensor
    that calls ``read`` each time the graph runs, as Horovod's ``size_op`` does; the job may
    have grown or shrunk since the graph was traced. Otherwise (eagerly, or a job whose size
    never changes) the int itself.

    Example, a tf.function traced on 1 rank of an elastic job that then grew to 2: the value
    is 2 in its later runs (a plain ``hvd.size()`` in it stays 1)."""
    if tf.executing_eagerly() or not fault_tolerant():
        return read()
    out = tf.numpy_function(lambda: np.int32(read()), [], tf.int32, stateful=True,
                            name=name or "hvd_read")
    out.set_shape([])
    return out


def is_static(value: Any) -> bool:
    """Whether ``value`` from :func:`read_when_run` is a plain int (known when traced)."""
    return isinstance(value, (int, np.integer))


def _in_xla() -> bool:
    try:
        from tensorflow.python.ops import control_flow_util
        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
    except Exception:  # noqa: BLE001 - private API moved: assume no XLA
        return False


# Unsigned integers the runtime does not carry travel as the signed type of the same width
# (same bits) through the collectives that only move data (allgather, broadcast, alltoall).
_SIGNED_TWIN = {np.dtype(np.uint16): np.dtype(np.int16), np.dtype(np.uint32): np.dtype(np.int32),
                np.dtype(np.uint64): np.dtype(np.int64)}


def movable(a: np.ndarray) -> np.ndarray:
    """``a`` as bits the runtime carries: uint16/32/64 viewed as int16/32/64.

    Example: ``movable(np.array([65535], np.uint16))`` -> ``array([-1], dtype=int16)``."""
    twin = _SIGNED_TWIN.get(a.dtype)
    return a if twin is None else a.view(twin)


def _as_dtype(arr: Any, dtype: Any) -> np.ndarray:
    """``arr`` as the numpy dtype TensorFlow expects for ``dtype`` (bfloat16 comes back from
    the runtime as its int16 bits, unsigned integers as their signed twins)."""
    want = np.dtype(dtype.as_numpy_dtype)
    a = np.asarray(arr)
    if a.dtype == want:
        return a
    if a.dtype.itemsize == want.itemsize and a.dtype.kind in "iu" and \
            (dtype == tf.bfloat16 or want.kind in "iu"):
        return a.view(want)
    return a.astype(want)


def _graph_failure(what: str, name: Optional[str]) -> Any:
    """An op that fails with FailedPreconditionError, its message naming the collective."""
    label = f"{what} of tensor '{name}'" if name else what
    why = (f" [hvd_magic TensorMismatchError: the ranks disagree on the {label} (shape, dtype, "
           "op, root rank or scale factors; each rank printed the details to stderr); this is "
           "no real variable] ")
    handle = tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[], shared_name=why)
    return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int32)


_LAST_HOST_OP: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # graph -> last op


@plain
def host_call(fn: Callable[..., Sequence[Any]], inputs: Sequence[Any], touts: Sequence[Any],
              shapes: Sequence[Any], what: str, name: Optional[str] = None) -> list:
    """Run ``fn`` (numpy arrays in, a list of numpy arrays out) on ``inputs``: directly when
    executing eagerly, as a stateful ``tf.numpy_function`` inside a graph. ``name`` (the
    request's name, if given) goes into the message of a mismatch."""
    touts = list(touts)
    if tf.executing_eagerly():
        try:
            outs = fn(*[np.asarray(x.numpy()) for x in inputs])
        except TensorMismatchError as exc:
            raise CollectiveMismatchError(str(exc)) from exc
        return [tf.convert_to_tensor(_as_dtype(o, d), dtype=d) for o, d in zip(outs, touts)]
    if _in_xla():
        raise ValueError(f"hvd_magic.tensorflow.{what} cannot run inside an XLA-compiled function "
                         "(jit_compile=True): XLA cannot call back into Python. Use "
                         "tf.function(jit_compile=False), or model.compile(..., jit_compile=False)")

    def run(*arrays: Any) -> list:   # 0-d inputs arrive as numpy scalars
        try:
            outs = fn(*[np.asarray(a) for a in arrays])
        except TensorMismatchError as exc:
            print(f"hvd_magic: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return [np.zeros(0, np.dtype(d.as_numpy_dtype)) for d in touts] + [np.int32(1)]
        return [_as_dtype(o, d) for o, d in zip(outs, touts)] + [np.int32(0)]

    # A TF1-style session graph (not tf.function, whose stateful ops run in program order)
    # runs independent ops in any order, which differs by rank: chain the collectives in the
    # order they were built, the same on every rank.
    graph = None if tf.inside_function() else tf.compat.v1.get_default_graph()
    last = _LAST_HOST_OP.get(graph) if graph is not None else None
    with tf.control_dependencies([last] if last is not None else []):
        raw = tf.numpy_function(run, list(inputs), touts + [tf.int32], stateful=True,
                                name=f"hvd_{what}")
    raw = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    status = raw.pop()
    if graph is not None:
        _LAST_HOST_OP[graph] = status.op
    ok = tf.cond(status > 0, lambda: _graph_failure(what, name), lambda: status)
    with tf.control_dependencies([ok]):
        outs = [tf.identity(o) for o in raw]
    for o, s in zip(outs, shapes):
        if s is not None:
            o.set_shape(s)
    return outs
