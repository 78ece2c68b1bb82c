"""Gradient compression, as in ``horovod.torch.compression``: the casts over torch tensors
(the interface: :mod:`hvd_magic.collectives.compression`)."""
from __future__ import annotations

from typing import Any

import torch

from hvd_magic.collectives.compression import Compressor, NoneCompressor


class _CastCompressor(Compressor):
    """Floating-point tensors travel as ``wire``; other dtypes are left alone."""

    wire: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype != cls.wire:
            return tensor.to(cls.wire), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16 (half the bytes; about 3 significant digits)."""

    wire = torch.float16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16 (float32's range, about 2 significant digits)."""

    wire = torch.bfloat16


class Compression:
    """The compressors, by Horovod's names: ``Compression.none``, ``.fp16``, ``.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
