"""Collectives on MXNet NDArrays with ``horovod.mxnet``'s signatures, over
``hvd_magic.collectives``.

Each op copies the NDArray to numpy (``asnumpy``), runs the collective and gives back a new
NDArray on the input's context, or writes the result into the input (the ``*_`` ops). As in
Horovod, the ops take ``priority`` (accepted; the runtime orders by submission) and
``process_set``; errors are ``MXNetError`` too (see :mod:`.tensors`). NDArrays are not
differentiable through these ops (nor are they in Horovod's MXNet face).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

import hvd_magic.collectives as C
from hvd_magic.collectives import Average, ProcessSet, global_process_set
from hvd_magic.collectives.ops import resolve_op, to_op

from .tensors import like, mx, mx_errors, to_numpy, to_numpy_list, write_into


def init(*args: Any, **kwargs: Any) -> None:
    """Start the runtime on this rank: ``init(comm=None, process_sets=None)`` as in Horovod."""
    with mx_errors():
        C.init(*args, **kwargs)


# ---------------------------------------------------------------- allreduce

def allreduce(tensor: Any, average: Optional[bool] = None, name: Optional[str] = None,
              priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set, op: Any = None) -> Any:
    """Reduce ``tensor`` over the ranks (of ``process_set``): Average unless ``op`` says
    otherwise; a new NDArray.

    Example, 2 ranks::

        rank 0: allreduce(mx.nd.array([1, 2]))              -> [2. 3.]
        rank 1: allreduce(mx.nd.array([3, 4]))              -> [2. 3.]
        rank 0: allreduce(mx.nd.array([1, 2]), op=hvd.Sum)  -> [4. 6.]
    """
    with mx_errors():
        out = C.allreduce(to_numpy(tensor, "allreduce"), name=name,
                          op=resolve_op(average, op, "allreduce"), prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=process_set)
    return like(out, tensor)


def allreduce_(tensor: Any, average: Optional[bool] = None, name: Optional[str] = None,
               priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set, op: Any = None) -> Any:
    """In-place :func:`allreduce`: ``tensor`` holds the result and is returned.

    Example, 2 ranks::

        rank 0: t = mx.nd.array([1, 2]); allreduce_(t, op=hvd.Sum)  -> t is [4. 6.]
        rank 1: t = mx.nd.array([3, 4]); allreduce_(t, op=hvd.Sum)  -> t is [4. 6.]
    """
    with mx_errors():
        out = C.allreduce(to_numpy(tensor, "allreduce_"), name=name,
                          op=resolve_op(average, op, "allreduce_"), prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=process_set)
    return write_into(tensor, out)


def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None,
                      name: Optional[str] = None, priority: int = 0, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                      op: Any = None) -> list:
    """:func:`allreduce` of every NDArray of the list, negotiated and reduced together.

    Example, 2 ranks::

        rank 0: grouped_allreduce([mx.nd.array([1]), mx.nd.array([5])], op=hvd.Sum) -> [[3.], [11.]]
        rank 1: grouped_allreduce([mx.nd.array([2]), mx.nd.array([6])], op=hvd.Sum) -> [[3.], [11.]]
    """
    with mx_errors():
        outs = C.grouped_allreduce(to_numpy_list(tensors, "grouped_allreduce"), name=name,
                                   op=resolve_op(average, op, "grouped_allreduce"),
                                   prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                   process_set=process_set)
    return [like(o, t) for o, t in zip(outs, tensors)]


def grouped_allreduce_(tensors: Sequence[Any], average: Optional[bool] = None,
                       name: Optional[str] = None, priority: int = 0, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                       op: Any = None) -> list:
    """In-place :func:`grouped_allreduce`: each NDArray holds its result; the list is returned."""
    with mx_errors():
        outs = C.grouped_allreduce(to_numpy_list(tensors, "grouped_allreduce_"), name=name,
                                   op=resolve_op(average, op, "grouped_allreduce_"),
                                   prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                   process_set=process_set)
    return [write_into(t, o) for o, t in zip(outs, tensors)]


# ---------------------------------------------------------------- allgather, broadcast

def allgather(tensor: Any, name: Optional[str] = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every rank's NDArray along dimension 0 (its size may differ by rank).

    Example, 2 ranks::

        rank 0: allgather(mx.nd.array([[1, 2]]))          -> [[1. 2.] [3. 4.] [5. 6.]]
        rank 1: allgather(mx.nd.array([[3, 4], [5, 6]]))  -> [[1. 2.] [3. 4.] [5. 6.]]
    """
    with mx_errors():
        out = C.allgather(to_numpy(tensor, "allgather"), name=name, process_set=process_set)
    return like(out, tensor)


def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None, priority: int = 0,
                      process_set: ProcessSet = global_process_set) -> list:
    """:func:`allgather` of every NDArray of the list, negotiated together.

    Example, 2 ranks::

        rank 0: grouped_allgather([mx.nd.array([1]), mx.nd.array([5])])     -> [[1. 2. 3.], [5. 6.]]
        rank 1: grouped_allgather([mx.nd.array([2, 3]), mx.nd.array([6])])  -> [[1. 2. 3.], [5. 6.]]
    """
    with mx_errors():
        outs = C.grouped_allgather(to_numpy_list(tensors, "grouped_allgather"), name=name,
                                   process_set=process_set)
    return [like(o, t) for o, t in zip(outs, tensors)]


def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> Any:
    """A new NDArray on every rank holding ``root_rank``'s (a global rank).

    Example, 2 ranks::

        rank 0: broadcast(mx.nd.array([1, 2]), root_rank=0)  -> [1. 2.]
        rank 1: broadcast(mx.nd.array([0, 0]), root_rank=0)  -> [1. 2.]
    """
    with mx_errors():
        out = C.broadcast(to_numpy(tensor, "broadcast"), root_rank, name=name, process_set=process_set)
    return like(out, tensor)


def broadcast_(tensor: Any, root_rank: int, name: Optional[str] = None, priority: int = 0,
               process_set: ProcessSet = global_process_set) -> Any:
    """In-place :func:`broadcast`: ``tensor`` holds ``root_rank``'s values and is returned."""
    with mx_errors():
        out = C.broadcast(to_numpy(tensor, "broadcast_"), root_rank, name=name, process_set=process_set)
    return write_into(tensor, out)


# ---------------------------------------------------------------- alltoall, reducescatter

def _splits(splits: Any) -> Any:
    """Horovod's splits: None, a list of ints, or an int32 NDArray (ValueError otherwise)."""
    if splits is None or not hasattr(splits, "asnumpy"):
        return splits
    if np.dtype(splits.dtype) != np.int32:
        raise ValueError(f"alltoall splits must hold 32-bit integers (int32), got {np.dtype(splits.dtype).name}; "
                         "pass splits.astype('int32') or a list of ints")
    return splits.asnumpy().reshape(-1).tolist()


def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None, priority: int = 0,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[j]`` rows to rank j (equal shares when ``splits`` is None) and
    concatenate what arrives. With ``splits``, also returns the rows received from each
    rank (an int32 NDArray on the CPU), as Horovod does.

    Example, 2 ranks::

        rank 0: alltoall(mx.nd.array([1, 2]))  -> [1. 3.]
        rank 1: alltoall(mx.nd.array([3, 4]))  -> [2. 4.]
        rank 0: alltoall(mx.nd.array([1, 2, 3]), splits=[1, 2]) -> ([1. 4.], [1 1])
        rank 1: alltoall(mx.nd.array([4, 5]), splits=[1, 1])    -> ([2. 3. 5.], [2 1])
    """
    with mx_errors():
        res = C.alltoall(to_numpy(tensor, "alltoall"), splits=_splits(splits), name=name,
                         process_set=process_set)
    if splits is None:
        return like(res, tensor)
    out, received = res
    return like(out, tensor), mx().nd.array(np.asarray(received), ctx=mx().cpu(), dtype="int32")


def reducescatter(tensor: Any, op: Any = Average, name: Optional[str] = None, priority: int = 0,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """Reduce over the ranks, then give each rank its share of dimension 0 (the first
    ranks get one more row when it does not divide).

    Example, 2 ranks, op=Sum::

        rank 0: reducescatter(mx.nd.array([1, 2, 3]), op=hvd.Sum)  -> [2. 4.]
        rank 1: reducescatter(mx.nd.array([1, 2, 3]), op=hvd.Sum)  -> [6.]
    """
    with mx_errors():
        out = C.reducescatter(to_numpy(tensor, "reducescatter"), name=name, op=to_op(op),
                              prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                              process_set=process_set)
    return like(out, tensor)


def grouped_reducescatter(tensors: Sequence[Any], op: Any = Average, name: Optional[str] = None,
                          priority: int = 0, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list:
    """:func:`reducescatter` of every NDArray of the list, negotiated together.

    Example, 2 ranks, op=Sum::

        rank 0: grouped_reducescatter([mx.nd.array([1, 2, 3]), mx.nd.ones(2)], op=hvd.Sum) -> [[2. 4.], [2.]]
        rank 1: grouped_reducescatter([mx.nd.array([1, 2, 3]), mx.nd.ones(2)], op=hvd.Sum) -> [[6.], [2.]]
    """
    with mx_errors():
        outs = C.grouped_reducescatter(to_numpy_list(tensors, "grouped_reducescatter"), name=name,
                                       op=to_op(op), prescale_factor=prescale_factor,
                                       postscale_factor=postscale_factor, process_set=process_set)
    return [like(o, t) for o, t in zip(outs, tensors)]
