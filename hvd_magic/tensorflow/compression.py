"""Gradient compression on the wire, with ``horovod.tensorflow``'s names::

    hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16)

A compressor's ``compress(tensor)`` returns ``(wire_tensor, ctx)`` and
``decompress(wire_tensor, ctx)`` gives back a tensor of the original dtype.
"""
from __future__ import annotations

from typing import Any

from hvd_magic.collectives.compression import Compressor, NoneCompressor

from ._compat import import_tf

tf = import_tf()


class _CastCompressor(Compressor):
    """Floating-point tensors travel as ``wire``; other dtypes are left alone."""

    wire: Any = tf.float16

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype.is_floating and tensor.dtype != cls.wire:
            return tf.cast(tensor, cls.wire), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None else tf.cast(tensor, ctx)


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16 (half the bytes; about 3 significant digits)."""

    wire = tf.float16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16 (float32's range, about 2 significant digits)."""

    wire = tf.bfloat16


class Compression:
    """The compressors, by Horovod's names: ``Compression.none``, ``.fp16``, ``.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def check_compression(compression: Any) -> None:
    """TypeError unless ``compression`` has compress/decompress."""
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError("compression must be hvd.Compression.none, .fp16, .bf16 or a class with "
                        f"compress/decompress, not {compression!r}")
