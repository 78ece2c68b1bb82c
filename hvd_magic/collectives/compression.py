"""The compressor interface every face shares, as Horovod's ``compression`` modules have it;
each face adds its casts (``Compression.fp16``, ...) over its framework's tensors.

A compressor turns a tensor into what travels (``compress``) and back (``decompress``)::

    compressed, ctx = Compression.fp16.compress(grad)     # float32 grad -> float16 copy
    reduced = hvd.allreduce(compressed)
    grad = Compression.fp16.decompress(reduced, ctx)      # back to float32
"""
from __future__ import annotations

from typing import Any


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx) -> tensor``;
    subclass and override both static methods."""

    @staticmethod
    def compress(tensor: Any) -> tuple:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: the tensor travels as it is."""

    @staticmethod
    def compress(tensor: Any) -> tuple:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor
