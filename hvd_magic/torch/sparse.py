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
