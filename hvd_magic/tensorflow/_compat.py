"""Import TensorFlow (and Keras 3) with clear messages when they are missing or too old.

The floor is TensorFlow 2.16: it is the first release whose ``tf.keras`` is Keras 3 (the
Keras face needs Keras 3's optimizer API: ``apply``/``build``, ``keras.ops``), and the
oldest release hvd_magic's graph-mode collectives (``tf.numpy_function`` carrying
ml_dtypes' bfloat16, ``tf.custom_gradient`` on several inputs) are written for. Older
TensorFlow is served by Horovod itself (up to TF 2.15).
"""
from __future__ import annotations

from typing import Any

MIN_TF = (2, 16)
INSTALL_HINT = "pip install 'tensorflow-cpu>=2.16'"   # tensorflow-cpu: no multi-GB CUDA wheels


def _version_tuple(version: str) -> tuple:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def import_tf() -> Any:
    """``import tensorflow`` or an ImportError saying what to install."""
    try:
        import tensorflow as tf
    except ImportError as exc:
        raise ImportError(f"hvd_magic.tensorflow needs TensorFlow, which is not installed: "
                          f"{INSTALL_HINT} (or `pip install hvd_magic[tensorflow]`)") from exc
    if _version_tuple(tf.__version__) < MIN_TF:
        raise ImportError(
            f"hvd_magic.tensorflow needs TensorFlow >= {MIN_TF[0]}.{MIN_TF[1]} (the first release "
            f"with Keras 3 as tf.keras); found {tf.__version__}. Upgrade with {INSTALL_HINT}, or "
            "use Horovod itself for TensorFlow <= 2.15")
    return tf


def import_keras() -> Any:
    """``import keras`` (Keras 3 on the TensorFlow backend) or a clear error."""
    import_tf()
    try:
        import keras
    except ImportError as exc:
        raise ImportError("hvd_magic.keras needs Keras 3: pip install 'keras>=3'") from exc
    if _version_tuple(keras.__version__) < (3, 0):
        raise ImportError(f"hvd_magic.keras needs Keras 3, found {keras.__version__}: "
                          "pip install 'keras>=3'")
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ImportError(f"hvd_magic.keras runs Keras on the TensorFlow backend, but Keras is using "
                          f"'{backend}'; set KERAS_BACKEND=tensorflow before importing keras (for "
                          "PyTorch training use hvd_magic.torch)")
    return keras
