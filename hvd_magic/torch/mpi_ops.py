"""Collectives on torch tensors with ``horovod.torch``'s signatures and autograd support.

The out-of-place collectives (:func:`allreduce`, :func:`grouped_allreduce`,
:func:`allgather`, :func:`broadcast`) are differentiable: their backward pass runs the
matching collective on the gradient, so every rank must call ``backward`` too:

- allreduce: the gradient is allreduced with the same op and scale factors;
- allgather: the gradient is Sum-allreduced and each rank keeps its own rows;
- broadcast: the gradient is Sum-allreduced; the root keeps it, other ranks get zeros.

The in-place twins (``allreduce_``, ``broadcast_``, ``*_async_``) are not differentiable.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

import hvd_magic.collectives as C
from hvd_magic.collectives import Average, Handle, Sum
from hvd_magic.collectives.ops import resolve_op

from .compression import Compression, Compressor


_op = resolve_op   # Horovod's average=/op= rule, shared by the faces


def _tensor(x: Any, fn: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"hvd_magic.torch.{fn} takes a torch tensor, not {type(x).__name__}; "
                        "for numpy arrays use hvd_magic.collectives")
    return x


# ---------------------------------------------------------------- autograd functions

class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale):  # type: ignore[override]
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        return C.allreduce(tensor.detach(), name=name, op=op, prescale_factor=prescale,
                           postscale_factor=postscale)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        g = C.allreduce(grad.contiguous(), op=ctx.op, prescale_factor=ctx.prescale,
                        postscale_factor=ctx.postscale)
        return g, None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, *tensors):  # type: ignore[override]
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        return tuple(C.grouped_allreduce([t.detach() for t in tensors], name=name, op=op,
                                         prescale_factor=prescale, postscale_factor=postscale))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        out = C.grouped_allreduce([g.contiguous() for g in grads], op=ctx.op,
                                  prescale_factor=ctx.prescale, postscale_factor=ctx.postscale)
        return (None, None, None, None, *out)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):  # type: ignore[override]
        handle = C.allgather_async(tensor.detach(), name=name)
        out = handle.wait()
        rows = handle.extra
        if rows is None:   # backend did not report rows per rank: ask
            rows = [int(r) for r in C.allgather_object(int(tensor.shape[0]) if tensor.dim() else 1)]
        ctx.rows = [int(r) for r in rows]
        ctx.scalar = tensor.dim() == 0
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        g = C.allreduce(grad.contiguous(), op=Sum)
        r = C.rank()
        start = sum(ctx.rows[:r])
        mine = g.narrow(0, start, ctx.rows[r])
        return (mine.reshape(()) if ctx.scalar else mine), None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name):  # type: ignore[override]
        ctx.root = root_rank
        return C.broadcast(tensor.detach(), root_rank, name=name)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        g = C.allreduce(grad.contiguous(), op=Sum)
        if C.rank() != ctx.root:
            g = torch.zeros_like(g)
        return g, None, None


# ---------------------------------------------------------------- allreduce

def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: type[Compressor] = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (Average unless ``op`` says otherwise); differentiable.

    Example, 2 ranks::

        rank 0: allreduce(torch.tensor([1., 2.]))              -> tensor([2., 3.])
        rank 1: allreduce(torch.tensor([3., 4.]))              -> tensor([2., 3.])
        rank 0: allreduce(torch.tensor([1., 2.]), op=hvd.Sum)  -> tensor([4., 6.])
    """
    op = _op(average, op, "allreduce")
    compressed, ctx = compression.compress(_tensor(tensor, "allreduce"))
    out = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0) -> Handle:
    """Start :func:`allreduce` (not differentiable); ``synchronize(handle)`` returns the result."""
    return C.allreduce_async(_tensor(tensor, "allreduce_async"), name=name,
                             op=_op(average, op, "allreduce_async"),
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Any = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0) -> torch.Tensor:
    """In-place :func:`allreduce`: ``tensor`` holds the result on every rank and is returned."""
    return C.allreduce_(_tensor(tensor, "allreduce_"), name=name, op=_op(average, op, "allreduce_"),
                        prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0) -> Handle:
    """Start an in-place allreduce; ``tensor`` holds the result once ``synchronize(handle)`` returns."""
    return C.allreduce_async_(_tensor(tensor, "allreduce_async_"), name=name,
                              op=_op(average, op, "allreduce_async_"),
                              prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: type[Compressor] = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """:func:`allreduce` of every tensor of the list, negotiated and fused together; differentiable.

    Example, 2 ranks, op=Sum::

        rank 0: grouped_allreduce([torch.ones(2), torch.zeros(1)], op=hvd.Sum) -> [tensor([2., 2.]), tensor([1.])]
        rank 1: grouped_allreduce([torch.ones(2), torch.ones(1)], op=hvd.Sum)  -> [tensor([2., 2.]), tensor([1.])]
    """
    op = _op(average, op, "grouped_allreduce")
    pairs = [compression.compress(_tensor(t, "grouped_allreduce")) for t in tensors]
    outs = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0) -> Any:
    """Start :func:`grouped_allreduce`; ``synchronize(handle)`` returns the list of results."""
    return C.grouped_allreduce_async(list(tensors), name=name, op=_op(average, op, "grouped_allreduce_async"),
                                     prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """In-place :func:`grouped_allreduce`."""
    return C.grouped_allreduce_(list(tensors), name=name, op=_op(average, op, "grouped_allreduce_"),
                                prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0) -> Any:
    """Start an in-place :func:`grouped_allreduce`; ``synchronize(handle)`` returns the tensors."""
    return C.grouped_allreduce_async_(list(tensors), name=name,
                                      op=_op(average, op, "grouped_allreduce_async_"),
                                      prescale_factor=prescale_factor, postscale_factor=postscale_factor)


# ---------------------------------------------------------------- allgather, broadcast

def allgather(tensor: torch.Tensor, name: Optional[str] = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dimension 0 (sizes may differ); differentiable.

    Example, 2 ranks::

        rank 0: allgather(torch.tensor([[1, 2]]))          -> tensor([[1, 2], [3, 4], [5, 6]])
        rank 1: allgather(torch.tensor([[3, 4], [5, 6]]))  -> tensor([[1, 2], [3, 4], [5, 6]])
    """
    return _Allgather.apply(_tensor(tensor, "allgather"), name)


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None) -> Handle:
    """Start :func:`allgather` (not differentiable)."""
    return C.allgather_async(_tensor(tensor, "allgather_async"), name=name)


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> torch.Tensor:
    """Every rank gets a copy of ``root_rank``'s tensor (a new tensor); differentiable.

    Example, 2 ranks::

        rank 0: broadcast(torch.tensor([1, 2]), root_rank=0)  -> tensor([1, 2])
        rank 1: broadcast(torch.tensor([0, 0]), root_rank=0)  -> tensor([1, 2])
    """
    return _Broadcast.apply(_tensor(tensor, "broadcast"), root_rank, name)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> Handle:
    """Start :func:`broadcast` (not differentiable)."""
    return C.broadcast_async(_tensor(tensor, "broadcast_async"), root_rank, name=name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> torch.Tensor:
    """In-place :func:`broadcast` (not differentiable). Works on parameters: writes their data."""
    return C.broadcast_(_tensor(tensor, "broadcast_").data, root_rank, name=name)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> Handle:
    """Start an in-place :func:`broadcast`."""
    return C.broadcast_async_(_tensor(tensor, "broadcast_async_").data, root_rank, name=name)


# ---------------------------------------------------------------- alltoall, reducescatter

def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None) -> Any:
    """Send ``splits[j]`` rows to rank j and concatenate what arrives (see hvd_magic.collectives)."""
    return C.alltoall(_tensor(tensor, "alltoall"), splits=splits, name=name)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None) -> Handle:
    return C.alltoall_async(_tensor(tensor, "alltoall_async"), splits=splits, name=name)


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: type[Compressor] = Compression.none, op: Any = Average,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over all ranks and give each rank its share of dimension 0."""
    compressed, ctx = compression.compress(_tensor(tensor, "reducescatter"))
    out = C.reducescatter(compressed, name=name, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor)
    return compression.decompress(out, ctx)


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: Any = Average,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    return C.reducescatter_async(_tensor(tensor, "reducescatter_async"), name=name, op=op,
                                 prescale_factor=prescale_factor, postscale_factor=postscale_factor)


# ---------------------------------------------------------------- handles, join, barrier

def poll(handle: Handle) -> bool:
    """True once ``handle``'s operation has finished (never blocks)."""
    return C.poll(handle)


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle``'s operation and return its output tensor."""
    return C.synchronize(handle)


def join(device: int = -1) -> int:
    """This rank is out of data: serve the others' allreduces with zeros until every rank
    has joined. Returns the last rank to join. ``device`` is accepted for Horovod
    compatibility (the runtime picks the device per tensor)."""
    return C.join()


def barrier() -> None:
    """Return once every rank has called barrier."""
    C.barrier()
