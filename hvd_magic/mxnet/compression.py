"""Gradient compression, as in ``horovod.mxnet.compression``: the fp16 cast over NDArrays
(the interface: :mod:`hvd_magic.collectives.compression`). Only floating-point NDArrays are
cast; integer ones travel as they are."""
from __future__ import annotations

from typing import Any

import numpy as np

from hvd_magic.collectives.compression import Compressor, NoneCompressor


def _is_float(dtype: Any) -> bool:
    return np.dtype(dtype).kind == "f"


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
