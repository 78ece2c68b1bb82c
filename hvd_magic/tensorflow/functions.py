"""Start every rank from the root's variables (``broadcast_variables``), plus the object
collectives, re-exported from the runtime."""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

import hvd_magic.collectives as C
from hvd_magic.collectives import allgather_object, broadcast_object

from ._compat import import_tf
from .mpi_ops import host_call

tf = import_tf()

__all__ = ["broadcast_variables", "broadcast_object", "allgather_object"]


def _variables(variables: Any) -> list:
    if isinstance(variables, dict):
        variables = [v for _, v in sorted(variables.items())]
    try:
        vs = list(variables)
    except TypeError:
        raise TypeError("broadcast_variables takes a list of variables, e.g. model.variables or "
                        f"optimizer.variables, not {type(variables).__name__}") from None
    out = []
    for v in vs:
        inner = getattr(v, "value", None)   # a Keras 3 Variable wraps a tf.Variable
        if not isinstance(v, tf.Variable) and isinstance(inner, tf.Variable):
            v = inner
        if not isinstance(v, tf.Variable):
            raise TypeError(f"broadcast_variables takes variables, got a {type(v).__name__}; use "
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
