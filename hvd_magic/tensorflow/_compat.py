"""Import TensorFlow (and Keras 3) with clear messages when they are missing or too old.

The floor is TensorFlow 2.16: it is the first release whose ``tf.keras`` is Keras 3 (the
Keras face needs Keras 3's optimizer API: ``apply``/``build``, ``keras.ops``), and the
oldest release hvd_magic's graph-mode collectives (``tf.numpy_function`` carrying
ml_dtypes' bfloat16, ``tf.custom_gradient`` on several inputs) are written for. Older
TensorFlow is served by Horovod itself (up to TF 2.15).

``tf.keras`` may instead be Keras 2: with the ``tf-keras`` package installed and
``TF_USE_LEGACY_KERAS=1`` set before TensorFlow is imported (what a Horovod user on TF 2.16+
does to keep Keras 2 code running), ``tf.keras`` is ``tf_keras``. The Keras face follows
``tf.keras`` (:func:`import_tf_keras`); the Keras 3-only parts (SyncBatchNormalization) use
:func:`import_keras`.
"""
from __future__ import annotations

from typing import Any, Optional

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


def legacy_keras() -> Optional[Any]:
    """``tf.keras`` when it is Keras 2 (``tf_keras``, chosen by ``TF_USE_LEGACY_KERAS=1``),
    else None."""
    tf = import_tf()
    try:   # TensorFlow loads tf.keras lazily: its Model class settles which Keras it is
        tk = tf.keras
        module = tk.Model.__module__
    except ImportError as exc:
        raise ImportError(f"tf.keras cannot be imported ({exc}); with TF_USE_LEGACY_KERAS=1 "
                          f"install Keras 2 for TensorFlow: pip install tf-keras=={tf.__version__}, "
                          "or unset TF_USE_LEGACY_KERAS to use Keras 3") from exc
    return tk if module.startswith("tf_keras") else None


def import_tf_keras() -> Any:
    """The Keras that ``tf.keras`` is: ``tf_keras`` (Keras 2) under ``TF_USE_LEGACY_KERAS=1``,
    otherwise Keras 3 on the TensorFlow backend (see :func:`import_keras`)."""
    legacy = legacy_keras()
    return legacy if legacy is not None else import_keras()


def is_keras3_object(obj: Any) -> bool:
    """True when ``obj`` is an instance of a Keras 3 class (not of tf_keras)."""
    return any(c.__module__.startswith("keras.") for c in type(obj).__mro__)
