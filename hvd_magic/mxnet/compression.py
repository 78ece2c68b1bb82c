"""Gradient compression, as in ``horovod.mxnet.compression``.

A compressor turns an NDArray into what travels (``compress``) and back (``decompress``)::

    compressed, ctx = Compression.fp16.compress(grad)     # float32 grad -> float16 copy
    reduced = hvd.allreduce(compressed)
    grad = Compression.fp16.decompress(reduced, ctx)      # back to float32

Only floating-point NDArrays are cast; integer ones travel as they are.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def _is_float(dtype: Any) -> bool:
    return np.dtype(dtype).kind == "f"


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx) -> tensor``."""

    @staticmethod
    def compress(tensor: Any) -> tuple:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: the NDArray travels as it is."""

    @staticmethod
    def compress(tensor: Any) -> tuple:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(Compressor):
    """Floating-point NDArrays travel as float16 (half the bytes; about 3 significant digits).

    Example: ``compress(mx.nd.ones(3))`` -> (float16 [1. 1. 1.], float32);
    ``decompress`` of that -> float32 [1. 1. 1.]."""

    @staticmethod
    def compress(tensor: Any) -> tuple:
        if _is_float(tensor.dtype):
            return tensor.astype("float16", copy=False), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        if ctx is not None and _is_float(ctx):
            return tensor.astype(ctx, copy=False)
        return tensor


class Compression:
    """Optional gradient compression used during allreduce: ``none`` (the default) or ``fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
