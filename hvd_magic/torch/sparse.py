"""Allreduce of a sparse COO tensor, as ``horovod.torch.sparse_allreduce_async`` does it."""
from __future__ import annotations

from typing import Any, Optional

import torch

import hvd_magic.collectives as C
from hvd_magic.collectives import Average, Handle, ProcessSet, Sum, global_process_set
from hvd_magic.collectives.ops import to_op
from hvd_magic.collectives.process_sets import engine_of


class SparseHandle:
    """What :func:`sparse_allreduce_async` returns: ``synchronize(handle)``, or ``handle()``
    as in Horovod, gives the sparse result."""

    def __init__(self, size: torch.Size, indices: Handle, values: Handle, divisor: int):
        self.size, self.indices, self.values, self.divisor = size, indices, values, divisor

    def done(self) -> bool:
        return self.indices.done() and self.values.done()

    def wait(self) -> torch.Tensor:
        values, indices = self.values.wait(), self.indices.wait()
        if self.divisor > 1:
            values = values / self.divisor
        return torch.sparse_coo_tensor(indices.t(), values, self.size, check_invariants=False)

    __call__ = wait


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str], op: Any,
                           process_set: ProcessSet = global_process_set) -> SparseHandle:
    """Start an allreduce of a sparse COO tensor, as Horovod does it: every rank's indices and
    values are allgathered (``name.indices``, ``name.values``) into one uncoalesced sparse
    tensor (duplicate indices add up when used or coalesced); Average divides the values by
    the number of ranks. ``synchronize(handle)`` or ``handle()`` gives the result.

    Example, 2 ranks, op=Sum (dense view of the result)::

        rank 0: sparse [0, 5, 0] -> [1, 5, 2]
        rank 1: sparse [1, 0, 2] -> [1, 5, 2]
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"hvd_magic.torch.sparse_allreduce_async takes a torch tensor, not "
                        f"{type(tensor).__name__}")
    t = tensor
    if t.layout != torch.sparse_coo:
        raise TypeError(f"sparse_allreduce_async takes a sparse COO tensor, not a {t.layout} one; "
                        "use allreduce_async for dense tensors")
    op = to_op(op)
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce_async supports op=hvd.Average or hvd.Sum, not {op.name}: "
                         "it allgathers the entries; densify with tensor.to_dense() for other ops")
    base = C.api.request_name("sparse_allreduce", name, engine_of(process_set))
    t = t.detach()
    indices = C.allgather_async(t._indices().t().contiguous(), name=f"{base}.indices",
                                process_set=process_set)
    values = C.allgather_async(t._values().contiguous(), name=f"{base}.values",
                               process_set=process_set)
    n = process_set.size()
    return SparseHandle(t.size(), indices, values, n if op == Average else 1)


def reduce_sparse_grad_async(grad: Optional[torch.Tensor], param: torch.Tensor, name: str, op: Any,
                             sparse_dim: int, as_dense: bool, compression: Any,
                             process_set: ProcessSet, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0) -> Any:
    """Start reducing one parameter's sparse gradient on its own, outside the gradient buckets,
    as Horovod's ``DistributedOptimizer`` does: by :func:`sparse_allreduce_async` (allgather
    of the entries), or with ``as_dense`` (``sparse_as_dense=True``) by a dense allreduce
    (with the scale factors, as in Horovod) whose result is made sparse again. ``grad=None``
    (parameter unused on this rank this step) sends no entries. Returns a function that
    waits and gives the reduced sparse gradient.
    Example, 2 ranks, op=Average, an embedding of 3 rows of width 1::

        rank 0: grad = sparse rows {0: [2.]}   ->  rows {0: [1.], 2: [2.]}
        rank 1: grad = sparse rows {2: [4.]}   ->  rows {0: [1.], 2: [2.]}
    """
    if grad is None:
        grad = torch.sparse_coo_tensor(
            torch.zeros((sparse_dim, 0), dtype=torch.long, device=param.device),
            torch.zeros((0, *param.shape[sparse_dim:]), dtype=param.dtype, device=param.device),
            param.shape, check_invariants=False)
    elif not grad.is_sparse:
        grad = grad.to_sparse(sparse_dim)
    if not as_dense:
        return sparse_allreduce_async(grad, name=name, op=op, process_set=process_set).wait
    sent, ctx = compression.compress(grad.to_dense())
    handle = C.allreduce_async_(sent, name=name, op=op, prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, process_set=process_set)
    return lambda: compression.decompress(handle.wait(), ctx).to_sparse(sparse_dim)
