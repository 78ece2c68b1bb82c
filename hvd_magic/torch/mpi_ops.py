"""Collectives on torch tensors with ``horovod.torch``'s signatures and autograd support.

The out-of-place collectives (:func:`allreduce`, :func:`grouped_allreduce`,
:func:`allgather`, :func:`grouped_allgather`, :func:`broadcast`,
:func:`grouped_reducescatter`) are differentiable: their backward pass runs the matching
collective on the gradient, so every rank must call ``backward`` too:

- allreduce: the gradient is allreduced with the same op and scale factors;
- allgather: the gradient is averaged over the ranks and each rank keeps its own rows;
- broadcast: the gradient is averaged over the ranks; the root keeps it, others get zeros
  (allgather and broadcast average as ``horovod.torch`` does);
- alltoall: the gradient goes back to where its rows came from (an alltoall with the
  received splits);
- reducescatter, grouped_reducescatter (Average or Sum): the gradient is allgathered,
  times the scale factors, and times the number of ranks for Sum (Horovod's rule).

The in-place twins (``allreduce_``, ``broadcast_``, ``*_async_``) are not differentiable.
"""
from __future__ import annotations

import operator
from typing import Any, Optional, Sequence

import torch

import hvd_magic.collectives as C
from hvd_magic.collectives import Average, Handle, ProcessSet, Sum, global_process_set
from hvd_magic.collectives.api import run_allreduce
from hvd_magic.collectives.grouped import grouped_allgather_rows
from hvd_magic.collectives.ops import resolve_op, to_op

from .compression import Compression, Compressor
from .sparse import SparseHandle, sparse_allreduce_async


_op = resolve_op   # Horovod's average=/op= rule, shared by the faces
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _tensor(x: Any, fn: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"hvd_magic.torch.{fn} takes a torch tensor, not {type(x).__name__}; "
                        "for numpy arrays use hvd_magic.collectives")
    return x


def _tensors(xs: Any, fn: str) -> list:
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"hvd_magic.torch.{fn} takes a list of torch tensors, not {type(xs).__name__}")
    if not xs:
        raise ValueError(f"hvd_magic.torch.{fn} got an empty list; pass at least one tensor")
    return [_tensor(x, fn) for x in xs]


# ---------------------------------------------------------------- autograd functions

class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, ps):  # type: ignore[override]
        ctx.op, ctx.prescale, ctx.postscale, ctx.ps = op, prescale, postscale, ps
        return C.allreduce(tensor.detach(), name=name, op=op, prescale_factor=prescale,
                           postscale_factor=postscale, process_set=ps)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        g = C.allreduce(grad.contiguous(), op=ctx.op, prescale_factor=ctx.prescale,
                        postscale_factor=ctx.postscale, process_set=ctx.ps)
        return g, None, None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, ps, *tensors):  # type: ignore[override]
        ctx.op, ctx.prescale, ctx.postscale, ctx.ps = op, prescale, postscale, ps
        return tuple(C.grouped_allreduce([t.detach() for t in tensors], name=name, op=op,
                                         prescale_factor=prescale, postscale_factor=postscale,
                                         process_set=ps))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        out = C.grouped_allreduce([g.contiguous() for g in grads], op=ctx.op,
                                  prescale_factor=ctx.prescale, postscale_factor=ctx.postscale,
                                  process_set=ctx.ps)
        return (None, None, None, None, None, *out)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, ps):  # type: ignore[override]
        handle = C.allgather_async(tensor.detach(), name=name, process_set=ps)
        out = handle.wait()
        rows = handle.extra
        if rows is None:   # backend did not report rows per rank: ask
            rows = [int(r) for r in C.allgather_object(int(tensor.shape[0]) if tensor.dim() else 1,
                                                       process_set=ps)]
        ctx.rows = [int(r) for r in rows]
        ctx.scalar = tensor.dim() == 0
        ctx.ps = ps
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        g = C.allreduce(grad.contiguous(), op=Average, process_set=ctx.ps)
        r = ctx.ps.rank()      # where this rank's rows sit in the gathered tensor
        start = sum(ctx.rows[:r])
        mine = g.narrow(0, start, ctx.rows[r])
        return (mine.reshape(()) if ctx.scalar else mine), None, None


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, ps, *tensors):  # type: ignore[override]
        outs, ctx.rows = grouped_allgather_rows([t.detach() for t in tensors], name, ps)
        ctx.scalars = [t.dim() == 0 for t in tensors]
        ctx.ps = ps
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        avg = C.grouped_allreduce([g.contiguous() for g in grads], op=Average, process_set=ctx.ps)
        r = ctx.ps.rank()      # where this rank's rows sit in the gathered tensor
        mine = [g.narrow(0, sum(rows[:r]), rows[r]) for g, rows in zip(avg, ctx.rows)]
        return (None, None, *[m.reshape(()) if s else m for m, s in zip(mine, ctx.scalars)])


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, ps, *tensors):  # type: ignore[override]
        ctx.op, ctx.prescale, ctx.postscale, ctx.ps = op, prescale, postscale, ps
        return tuple(C.grouped_reducescatter([t.detach() for t in tensors], name=name, op=op,
                                             prescale_factor=prescale, postscale_factor=postscale,
                                             process_set=ps))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        if ctx.op not in (Average, Sum):
            raise ValueError(f"the gradient of grouped_reducescatter is only defined for op=hvd.Average "
                             f"or hvd.Sum, not {ctx.op.name}; detach the inputs for other ops")
        gathered = C.grouped_allgather([g.contiguous() for g in grads], process_set=ctx.ps)
        scale = _reducescatter_grad_scale(ctx)
        return (None, None, None, None, None, *[g * scale if scale != 1.0 else g for g in gathered])


def _reducescatter_grad_scale(ctx: Any) -> float:
    """Horovod's factor on a reducescatter's allgathered gradient: the scale factors, times
    the number of ranks for Sum."""
    n = ctx.ps.size()
    return float(ctx.prescale) * float(ctx.postscale) * (n if ctx.op == Sum else 1)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, ps):  # type: ignore[override]
        ctx.op, ctx.prescale, ctx.postscale, ctx.ps = op, prescale, postscale, ps
        return C.reducescatter(tensor.detach(), name=name, op=op, prescale_factor=prescale,
                               postscale_factor=postscale, process_set=ps)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if ctx.op not in (Average, Sum):
            raise ValueError(f"the gradient of reducescatter is only defined for op=hvd.Average "
                             f"or hvd.Sum, not {ctx.op.name}; detach the input for other ops")
        g = C.allgather(grad.contiguous(), process_set=ctx.ps)
        scale = _reducescatter_grad_scale(ctx)
        return (g * scale if scale != 1.0 else g), None, None, None, None, None


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, ps):  # type: ignore[override]
        out, received = C.alltoall(tensor.detach(), splits=_split_list(tensor, splits, ps),
                                   name=name, process_set=ps)
        ctx.received, ctx.ps = received, ps
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, *_):  # type: ignore[override]
        g, _ = C.alltoall(grad.contiguous(), splits=ctx.received, process_set=ctx.ps)
        return g, None, None, None


def _split_list(tensor: torch.Tensor, splits: Any, ps: ProcessSet) -> Any:
    """``splits`` as given, or the equal shares Horovod uses when it is None (so that the
    received splits, needed by the gradient, come back either way)."""
    if splits is not None:
        return splits
    n = ps.size()
    rows = int(tensor.shape[0]) if tensor.dim() else 0
    if tensor.dim() == 0 or rows % n:
        return None        # (the runtime raises its usual error)
    return [rows // n] * n


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, ps):  # type: ignore[override]
        ctx.root, ctx.ps = root_rank, ps
        return C.broadcast(tensor.detach(), root_rank, name=name, process_set=ps)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        g = C.allreduce(grad.contiguous(), op=Average, process_set=ctx.ps)
        if C.rank() != ctx.root:
            g = torch.zeros_like(g)
        return g, None, None, None


# ---------------------------------------------------------------- allreduce

def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: type[Compressor] = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (of ``process_set``; Average unless ``op`` says
    otherwise); differentiable.

    Example, 2 ranks::

        rank 0: allreduce(torch.tensor([1., 2.]))              -> tensor([2., 3.])
        rank 1: allreduce(torch.tensor([3., 4.]))              -> tensor([2., 3.])
        rank 0: allreduce(torch.tensor([1., 2.]), op=hvd.Sum)  -> tensor([4., 6.])
    """
    op = _op(average, op, "allreduce")
    compressed, ctx = compression.compress(_tensor(tensor, "allreduce"))
    out = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start :func:`allreduce` (not differentiable); ``synchronize(handle)`` returns the result."""
    return C.allreduce_async(_tensor(tensor, "allreduce_async"), name=name,
                             op=_op(average, op, "allreduce_async"),
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             process_set=process_set)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Any = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`allreduce`: ``tensor`` holds the result on every rank and is returned."""
    return run_allreduce(_tensor(tensor, "allreduce_"), tensor, name, _op(average, op, "allreduce_"),
                         prescale_factor, postscale_factor, process_set)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place allreduce; ``tensor`` holds the result once ``synchronize(handle)`` returns."""
    return C.allreduce_async_(_tensor(tensor, "allreduce_async_"), name=name,
                              op=_op(average, op, "allreduce_async_"),
                              prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                              process_set=process_set)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: type[Compressor] = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`allreduce` of every tensor of the list, negotiated and fused together; differentiable.

    Example, 2 ranks, op=Sum::

        rank 0: grouped_allreduce([torch.ones(2), torch.zeros(1)], op=hvd.Sum) -> [tensor([2., 2.]), tensor([1.])]
        rank 1: grouped_allreduce([torch.ones(2), torch.ones(1)], op=hvd.Sum)  -> [tensor([2., 2.]), tensor([1.])]
    """
    op = _op(average, op, "grouped_allreduce")
    if compression is Compression.none:
        ts = [_tensor(t, "grouped_allreduce") for t in tensors]
        if not (torch.is_grad_enabled() and any(map(_REQUIRES_GRAD, ts))):
            # nothing to differentiate (gradients themselves): no autograd node to build
            return C.grouped_allreduce(ts, name=name, op=op, prescale_factor=prescale_factor,
                                       postscale_factor=postscale_factor, process_set=process_set)
        return list(_GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor,
                                            process_set, *ts))
    pairs = [compression.compress(_tensor(t, "grouped_allreduce")) for t in tensors]
    outs = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set,
                                   *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Any:
    """Start :func:`grouped_allreduce`; ``synchronize(handle)`` returns the list of results."""
    return C.grouped_allreduce_async(list(tensors), name=name, op=_op(average, op, "grouped_allreduce_async"),
                                     prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                     process_set=process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place :func:`grouped_allreduce`."""
    return C.grouped_allreduce_(list(tensors), name=name, op=_op(average, op, "grouped_allreduce_"),
                                prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                process_set=process_set)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Any:
    """Start an in-place :func:`grouped_allreduce`; ``synchronize(handle)`` returns the tensors."""
    return C.grouped_allreduce_async_(list(tensors), name=name,
                                      op=_op(average, op, "grouped_allreduce_async_"),
                                      prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                      process_set=process_set)


# ---------------------------------------------------------------- allgather, broadcast

def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's tensor along dimension 0 (sizes may differ); differentiable.

    Example, 2 ranks::

        rank 0: allgather(torch.tensor([[1, 2]]))          -> tensor([[1, 2], [3, 4], [5, 6]])
        rank 1: allgather(torch.tensor([[3, 4], [5, 6]]))  -> tensor([[1, 2], [3, 4], [5, 6]])
    """
    return _Allgather.apply(_tensor(tensor, "allgather"), name, process_set)


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start :func:`allgather` (not differentiable)."""
    return C.allgather_async(_tensor(tensor, "allgather_async"), name=name, process_set=process_set)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`allgather` of every tensor of the list, negotiated together (tensor i is named
    ``f"{name}.{i}"``); differentiable.

    Example, 2 ranks::

        rank 0: grouped_allgather([torch.tensor([1]), torch.tensor([5])])     -> [tensor([1, 2, 3]), tensor([5, 6])]
        rank 1: grouped_allgather([torch.tensor([2, 3]), torch.tensor([6])])  -> [tensor([1, 2, 3]), tensor([5, 6])]
    """
    return list(_GroupedAllgather.apply(name, process_set, *_tensors(tensors, "grouped_allgather")))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> Any:
    """Start :func:`grouped_allgather` (not differentiable); ``synchronize(handle)`` returns the list."""
    return C.grouped_allgather_async(_tensors(tensors, "grouped_allgather_async"), name=name,
                                     process_set=process_set)


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank gets a copy of ``root_rank``'s tensor (a new tensor); differentiable.

    Example, 2 ranks::

        rank 0: broadcast(torch.tensor([1, 2]), root_rank=0)  -> tensor([1, 2])
        rank 1: broadcast(torch.tensor([0, 0]), root_rank=0)  -> tensor([1, 2])
    """
    return _Broadcast.apply(_tensor(tensor, "broadcast"), root_rank, name, process_set)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start :func:`broadcast` (not differentiable)."""
    return C.broadcast_async(_tensor(tensor, "broadcast_async"), root_rank, name=name,
                             process_set=process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`broadcast` (not differentiable). Works on parameters: writes their data."""
    return C.broadcast_(_tensor(tensor, "broadcast_").data, root_rank, name=name,
                        process_set=process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place :func:`broadcast`."""
    return C.broadcast_async_(_tensor(tensor, "broadcast_async_").data, root_rank, name=name,
                              process_set=process_set)


# ---------------------------------------------------------------- alltoall, reducescatter

def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[j]`` rows to rank j and concatenate what arrives; with ``splits``, also
    the rows received from each rank. Differentiable.

    Example, 2 ranks::

        rank 0: alltoall(torch.tensor([1, 2]))  -> tensor([1, 3])
        rank 1: alltoall(torch.tensor([3, 4]))  -> tensor([2, 4])
    """
    t = _tensor(tensor, "alltoall")
    if _split_list(t, splits, process_set) is None:      # argument errors, as the runtime words them
        return C.alltoall(t, splits=splits, name=name, process_set=process_set)
    return _Alltoall.apply(t, splits, name, process_set)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    return C.alltoall_async(_tensor(tensor, "alltoall_async"), splits=splits, name=name,
                            process_set=process_set)


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: type[Compressor] = Compression.none, op: Any = Average,
                  process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over all ranks and give each rank its share of dimension 0; differentiable for
    Average and Sum."""
    compressed, ctx = compression.compress(_tensor(tensor, "reducescatter"))
    out = _Reducescatter.apply(compressed, name, to_op(op), prescale_factor, postscale_factor,
                               process_set)
    return compression.decompress(out, ctx)


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: Any = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    return C.reducescatter_async(_tensor(tensor, "reducescatter_async"), name=name, op=op,
                                 prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                 process_set=process_set)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: type[Compressor] = Compression.none, op: Any = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """:func:`reducescatter` of every tensor of the list, negotiated together (tensor i is
    named ``f"{name}.{i}"``); differentiable for Average and Sum.

    Example, 2 ranks, op=Sum::

        rank 0: grouped_reducescatter([torch.tensor([1, 2, 3]), torch.ones(2)], op=hvd.Sum) -> [tensor([2, 4]), tensor([2.])]
        rank 1: grouped_reducescatter([torch.tensor([1, 2, 3]), torch.ones(2)], op=hvd.Sum) -> [tensor([6]), tensor([2.])]
    """
    pairs = [compression.compress(t) for t in _tensors(tensors, "grouped_reducescatter")]
    outs = _GroupedReducescatter.apply(name, to_op(op), prescale_factor, postscale_factor,
                                       process_set, *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: Any = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
    """Start :func:`grouped_reducescatter` (not differentiable); ``synchronize(handle)`` returns the list."""
    return C.grouped_reducescatter_async(_tensors(tensors, "grouped_reducescatter_async"), name=name,
                                         op=op, prescale_factor=prescale_factor,
                                         postscale_factor=postscale_factor, process_set=process_set)


# ---------------------------------------------------------------- handles, join, barrier

def poll(handle: Handle) -> bool:
    """True once ``handle``'s operation has finished (:func:`hvd_magic.collectives.poll`:
    an unfinished one answers after 0.2 ms, leaving the engine thread the GIL)."""
    if isinstance(handle, SparseHandle):
        return C.poll(handle.indices) and C.poll(handle.values)
    return C.poll(handle)


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle``'s operation and return its output tensor."""
    return handle.wait() if isinstance(handle, SparseHandle) else C.synchronize(handle)


def join(device: int = -1) -> int:
    """This rank is out of data: serve the others' allreduces with zeros until every rank
    has joined. Returns the last rank to join. ``device`` is accepted for Horovod
    compatibility (the runtime picks the device per tensor)."""
    return C.join()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank (of ``process_set``) has called barrier."""
    C.barrier(process_set=process_set)
