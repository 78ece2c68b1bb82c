"""Grouped collectives. Grouped allreduce: many tensors negotiated and reduced as one
request per (dtype, device, framework) group, packed into one flat buffer and handed back as
views (or copied into the inputs, in place). Grouped allgather / reducescatter: one request
per tensor (``name.0``, ``name.1``, ...), all submitted before any is waited on, so they
are negotiated in the same cycle. The results are those of the single op on each tensor."""
from __future__ import annotations

import itertools
import operator
import time
from typing import Any, Optional, Sequence

import numpy as np

from . import ops, progress
from .api import (allgather_async, allgather_object, check_tensor, reducescatter_async,
                  request_name, scale_factor, submit_allreduce)
from .errors import HvdError, OpNotSupportedError
from .handles import NOT_TAKEN, GroupHandle, Handle, poll_first
from .negotiation import Ann
from .ops import Average
from .process_sets import ProcessSet, engine_of, global_process_set

_DTYPE_OF = operator.attrgetter("dtype")
_SHAPE_OF = operator.attrgetter("shape")
_SIZE_OF = operator.attrgetter("size")
_NDIM_OF = operator.attrgetter("ndim")
_NUMEL_OF = operator.methodcaller("numel")     # torch tensors
_IS_CPU = operator.attrgetter("is_cpu")


def _grouped(tensors: Sequence[Any], name: Optional[str], op: Any, prescale: float,
             postscale: float, inplace: bool, urgent: bool, process_set: Any) -> GroupHandle:
    """Pack each (dtype, framework) group into one flat buffer negotiated and reduced as one
    request, then hand back views (or copy into the inputs when in place)."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError("grouped_allreduce takes a list of tensors")
    eng = engine_of(process_set)
    base = request_name("grouped_allreduce", name, eng)
    groups: dict[tuple, list[int]] = {}
    first = tensors[0] if tensors else None
    types = set(map(type, tensors))
    single_dtype = (types == {np.ndarray} and len(set(map(_DTYPE_OF, tensors))) == 1)
    if single_dtype:
        # the common case (numpy arrays of one dtype): one check, not one per tensor
        dtype, _, _ = check_tensor(first, "grouped_allreduce")
        groups[(dtype, "cpu", False)] = list(range(len(tensors)))
    elif (types and all(map(ops.is_torch_type, types)) and len(set(map(_DTYPE_OF, tensors))) == 1
            and set(map(_IS_CPU, tensors)) == {True}):
        # CPU torch tensors of one dtype (a model's gradients): likewise
        dtype, _, _ = check_tensor(first, "grouped_allreduce")
        groups[(dtype, "cpu", True)] = list(range(len(tensors)))
    else:
        for i, t in enumerate(tensors):
            dtype, _, device = check_tensor(t, "grouped_allreduce")
            groups.setdefault((dtype, device, ops.is_torch(t)), []).append(i)
    parts = []
    for (dtype, device, is_t), idxs in groups.items():
        label = base if len(groups) == 1 else f"{base}.{dtype}"
        if is_t and (dtype, device, False) in groups:
            label += ".torch"   # numpy and torch tensors of one dtype: two requests, two names
        if device != "cpu" or ops.to_op(op) == ops.Adasum:
            # device tensors, and Adasum (per tensor, as Horovod's): one request each
            for i in idxs:
                t = tensors[i]
                h = submit_allreduce(t, t if inplace else None, f"{label}.{i}", op, prescale,
                                     postscale, urgent, process_set)
                parts.append((_Single(h), [i]))
            continue
        members = list(tensors) if len(idxs) == len(tensors) else [tensors[i] for i in idxs]
        # (map over C-level getters: ~15 us less than Python loops for 100 tensors; the
        # shapes only when some input is not 1-D: ~5 us)
        flat_1d = set(map(_NDIM_OF, members)) == {1}
        shapes = None if flat_1d else list(map(_SHAPE_OF, members))
        if not is_t:
            flat = _pack(members, single_dtype)
            if not flat.dtype.isnative:
                flat = flat.astype(flat.dtype.newbyteorder("="))
            ends = list(itertools.accumulate(map(_SIZE_OF, members)))
        else:
            flat = ops.flatten_torch(members, flat_1d)
            ends = list(itertools.accumulate(map(_NUMEL_OF, members)))
        starts = [0, *ends]       # (zip stops at the shorter: one more start is harmless)

        def split(result: Any, _extra: Any, members=members, shapes=shapes, dtype=dtype,
                  is_t=is_t, starts=starts, ends=ends, flat_1d=flat_1d) -> list:
            if is_t and inplace:
                # torch views of the result, one torch call for them all, copied in
                views = ops.wrap_like(result, dtype, members[0]).split(
                    [b - a for a, b in zip(starts, ends)])
                for t, v in zip(members, views):
                    t.copy_(v if flat_1d else v.view(t.shape))
                return list(members)
            if flat_1d:        # the usual gradients: the slices already have their shapes
                pieces = [result[a:b] for a, b in zip(starts, ends)]
            else:
                pieces = [result[a:b].reshape(sh) for a, b, sh in
                          zip(starts, ends, shapes or map(_SHAPE_OF, members))]
            if is_t:           # (tensors of their own, not torch views: autograd's outputs)
                return ops.torch_from_numpy(pieces, dtype)
            if inplace:
                for t, piece in zip(members, pieces):
                    np.copyto(t, piece, casting="unsafe")
                return list(members)
            return pieces

        op_ = ops.to_op(op)
        ops.check_op_dtype(op_, dtype)
        ann = Ann(label, "allreduce", dtype, flat.shape, int(op_), -1,
                  scale_factor(prescale, "prescale_factor"), scale_factor(postscale, "postscale_factor"), device)
        # ``flat`` is our own buffer: reduce it in place (no result allocation, no copy)
        progress.allreduce_bytes += flat.nbytes     # the live panel's gradient bytes per step
        if urgent and len(groups) == 1 and eng.short_path:
            # a blocking call of one group: on the engine's short path when it can take it
            # (Engine.run_now), as a blocking allreduce is
            res = eng.run_now(ann, flat, flat)
            if res is not NOT_TAKEN:
                return GroupHandle([(_Then(res, split), idxs)], len(tensors))
        parts.append((eng.submit(ann, flat, out=flat, post=split, urgent=urgent), idxs))
    return GroupHandle(parts, len(tensors))


def _pack(arrays: list, one_dtype: bool) -> np.ndarray:
    """The arrays' elements one after another, in a new writable 1-D array. Arrays of one
    dtype, all C-contiguous, are joined as bytes: 6 us for 100 x 4 KiB where np.concatenate
    takes 16 (its cost goes per input array). Otherwise (or when some array has no flat
    buffer to join) np.concatenate, which flattens each input in C order as well."""
    if one_dtype:
        try:
            return np.frombuffer(bytearray().join(arrays), arrays[0].dtype)
        except TypeError:       # an array that is not C-contiguous exports no flat buffer
            pass
    return np.concatenate(arrays, axis=None)


class _Then:
    """GroupHandle part of a group that ran on the short path: its result (or the handle
    that brings it), split into the group's results."""

    def __init__(self, res: Any, split: Any):
        self.res, self.split = res, split

    def done(self) -> bool:
        return type(self.res) is not Handle or self.res.done()

    def poll(self, wait_s: float) -> bool:
        return type(self.res) is not Handle or self.res.poll(wait_s)

    def wait(self, timeout: Optional[float] = None) -> list:
        res = self.res.wait(timeout) if type(self.res) is Handle else self.res
        return self.split(res, None)


class _Single:
    """Adapts a one-tensor handle to the list protocol of GroupHandle parts."""

    def __init__(self, handle: Handle):
        self.h = handle

    def done(self) -> bool:
        return self.h.done()

    def poll(self, wait_s: float) -> bool:
        return self.h.poll(wait_s)

    def wait(self, timeout: Optional[float] = None) -> list:
        return [self.h.wait(timeout)]


def grouped_allreduce_async(tensors: Sequence[Any], name: Optional[str] = None, op: Any = Average,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> GroupHandle:
    """Start a grouped allreduce; ``synchronize(handle)`` returns the list of results."""
    return _grouped(tensors, name, op, prescale_factor, postscale_factor, False, False, process_set)


def grouped_allreduce_async_(tensors: Sequence[Any], name: Optional[str] = None, op: Any = Average,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> GroupHandle:
    """In-place :func:`grouped_allreduce_async`."""
    return _grouped(tensors, name, op, prescale_factor, postscale_factor, True, False, process_set)


def grouped_allreduce(tensors: Sequence[Any], name: Optional[str] = None, op: Any = Average,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list:
    """:func:`allreduce` of each tensor in the list, negotiated and reduced together: tensors
    of one dtype travel as one flat buffer (one request, one reduction).

    Example, 2 ranks, op=Sum::

        rank 0: grouped_allreduce([np.ones(2), np.zeros(1)], op=hvd.Sum)  -> [[2., 2.], [1.]]
        rank 1: grouped_allreduce([np.ones(2), np.ones(1)], op=hvd.Sum)   -> [[2., 2.], [1.]]
    """
    return _grouped(tensors, name, op, prescale_factor, postscale_factor, False, True, process_set).wait()


def grouped_allreduce_(tensors: Sequence[Any], name: Optional[str] = None, op: Any = Average,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list:
    """In-place :func:`grouped_allreduce`: each tensor holds its result."""
    return _grouped(tensors, name, op, prescale_factor, postscale_factor, True, True, process_set).wait()


# ---------------------------------------------------------------- grouped allgather, reducescatter

def _check_list(tensors: Any, what: str) -> None:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{what} takes a list of tensors, not {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{what} got an empty list; pass at least one tensor "
                         "(every rank the same number, in the same order)")


class _Members:
    """GroupHandle part: one request per tensor, waited on together. A member that failed on
    every rank (an HvdError) is raised once the others have finished."""

    def __init__(self, handles: list):
        self.handles = handles

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def poll(self, wait_s: float) -> bool:
        return poll_first(self.handles, wait_s)

    def wait(self, timeout: Optional[float] = None) -> list:
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list = []
        error: Optional[BaseException] = None
        for h in self.handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                out.append(h.wait(left))
            except HvdError as exc:
                error = error or exc
        if error is not None:
            raise error
        return out


def _group(handles: list) -> GroupHandle:
    return GroupHandle([(_Members(handles), list(range(len(handles))))], len(handles))


def _submit_allgathers(tensors: Sequence[Any], name: Optional[str], process_set: Any) -> list:
    _check_list(tensors, "grouped_allgather")
    for t in tensors:        # every tensor checked before any request goes out
        check_tensor(t, "grouped_allgather")
    base = request_name("grouped_allgather", name, engine_of(process_set))
    return [allgather_async(t, f"{base}.{i}", process_set) for i, t in enumerate(tensors)]


def grouped_allgather_async(tensors: Sequence[Any], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> GroupHandle:
    """Start a grouped allgather; ``synchronize(handle)`` returns the list of results."""
    return _group(_submit_allgathers(tensors, name, process_set))


def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list:
    """:func:`allgather` of each tensor in the list (its first dimension may differ by rank),
    negotiated together: tensor ``i`` travels as ``f"{name}.{i}"``.

    Example, 2 ranks::

        rank 0: grouped_allgather([np.array([1]), np.array([[1, 2]])])  -> [[1, 2, 3], [[1, 2], [3, 4]]]
        rank 1: grouped_allgather([np.array([2, 3]), np.array([[3, 4]])]) -> [[1, 2, 3], [[1, 2], [3, 4]]]
    """
    return grouped_allgather_async(tensors, name, process_set).wait()


def grouped_allgather_rows(tensors: Sequence[Any], name: Optional[str] = None,
                           process_set: ProcessSet = global_process_set) -> tuple:
    """:func:`grouped_allgather`, plus each tensor's rows per rank (for the faces' gradients):
    ``(results, [[rows of rank 0, rows of rank 1, ...] per tensor])``."""
    handles = _submit_allgathers(tensors, name, process_set)
    out = _Members(handles).wait()
    rows = [h.extra for h in handles]
    if any(r is None for r in rows):   # the backend did not report rows per rank: ask
        firsts = allgather_object([int(t.shape[0]) if len(t.shape) else 1 for t in tensors],
                                  process_set=process_set)
        rows = [[f[i] for f in firsts] for i in range(len(tensors))]
    return out, [[int(x) for x in r] for r in rows]


def grouped_reducescatter_async(tensors: Sequence[Any], name: Optional[str] = None, op: Any = Average,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                process_set: ProcessSet = global_process_set) -> GroupHandle:
    """Start a grouped reducescatter; ``synchronize(handle)`` returns the list of results."""
    _check_list(tensors, "grouped_reducescatter")
    op_ = ops.to_op(op)
    if op_ == ops.Adasum:
        raise OpNotSupportedError("grouped_reducescatter does not take op=hvd.Adasum (Adasum is an "
                         "allreduce); use hvd.Average or hvd.Sum")
    for i, t in enumerate(tensors):   # every tensor checked before any request goes out
        dtype, shape, _ = check_tensor(t, "grouped_reducescatter")
        if shape == ():
            raise ValueError(f"grouped_reducescatter needs tensors with at least one dimension; "
                             f"tensor {i} is 0-d (reshape it to (1,))")
        ops.check_op_dtype(op_, dtype)
    pre = scale_factor(prescale_factor, "prescale_factor")
    post = scale_factor(postscale_factor, "postscale_factor")
    base = request_name("grouped_reducescatter", name, engine_of(process_set))
    return _group([reducescatter_async(t, f"{base}.{i}", op_, pre, post, process_set)
                   for i, t in enumerate(tensors)])


def grouped_reducescatter(tensors: Sequence[Any], name: Optional[str] = None, op: Any = Average,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set: ProcessSet = global_process_set) -> list:
    """:func:`reducescatter` of each tensor in the list, negotiated together: each rank gets
    its share of every tensor's first dimension (the first ranks one more row when it does not
    divide). Tensor ``i`` travels as ``f"{name}.{i}"``.

    Example, 2 ranks, op=Sum::

        rank 0: grouped_reducescatter([np.array([1, 2, 3]), np.ones((2, 2))], op=hvd.Sum) -> [[2, 4], [[2., 2.]]]
        rank 1: grouped_reducescatter([np.array([1, 2, 3]), np.ones((2, 2))], op=hvd.Sum) -> [[6], [[2., 2.]]]
    """
    return grouped_reducescatter_async(tensors, name, op, prescale_factor, postscale_factor,
                                       process_set).wait()
