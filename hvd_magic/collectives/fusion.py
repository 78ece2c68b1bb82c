"""Fusion planning: which ready allreduces are reduced together in one buffer
(:func:`plan_fusion`, :class:`Bucket`), and the buffer bytes each takes (:func:`nbytes`).
Pure: it groups the negotiation's :class:`~.negotiation.Response` list, nothing more.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .negotiation import Ann
from .ops import ReduceOp

_ADASUM = int(ReduceOp.ADASUM)


_ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
             "float16": 4, "bfloat16": 4, "float32": 4, "float64": 8}


def buffer_itemsize(dtype: str) -> int:
    """Bytes per element in a reduction buffer (half types reduce in float32)."""
    size = _ITEMSIZE.get(dtype)
    return size if size is not None else np.dtype(dtype).itemsize


def nbytes(ann: Ann) -> int:
    return math.prod(ann.shape or ()) * buffer_itemsize(ann.dtype or "uint8")


@dataclass
class Bucket:
    """Allreduces carried out as one reduction over one fusion buffer."""

    responses: list
    key: tuple

    @property
    def names(self) -> list:
        return [r.name for r in self.responses]


def plan_fusion(responses: list, threshold: int, alone: int = 0) -> list:
    """Group ready allreduces that share dtype, op, scale factors, device and joined ranks
    into buckets of at most ``threshold`` bytes (a larger tensor gets a bucket of its own;
    ``threshold`` 0 disables fusion). Other responses pass through unchanged, in order;
    a bucket takes the place of its first member.

    A CPU tensor of at least ``alone`` bytes (when > 0) also gets a bucket of its own and
    leaves the open bucket open: the MPI backend reduces a big tensor in cache-sized pieces
    in its own memory, where fusing it would only add a pass to pack it and one to unpack.
    So does every Adasum allreduce: Adasum combines each tensor as one vector.
    """
    plan: list = []
    open_buckets: dict[tuple, tuple[Bucket, int]] = {}
    for resp in responses:
        if resp.kind != "allreduce" or resp.error is not None:
            plan.append(resp)
            continue
        a = next(iter(resp.anns.values()))      # resp.first, without the property call
        key = (a.dtype, a.op, a.prescale, a.postscale, a.device, resp.joined)   # fusion key
        size = nbytes(a)
        if a.op == _ADASUM or 0 < alone <= size and a.device == "cpu":
            plan.append(Bucket([resp], key))
            continue
        current = open_buckets.get(key)
        if threshold > 0 and current is not None and current[1] + size <= threshold:
            current[0].responses.append(resp)
            open_buckets[key] = (current[0], current[1] + size)
            continue
        bucket = Bucket([resp], key)
        plan.append(bucket)
        open_buckets[key] = (bucket, size)
    return plan
