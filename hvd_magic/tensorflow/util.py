"""``horovod.tensorflow.util``'s helper that Horovod's own scripts and tests import."""
from __future__ import annotations

from ._compat import import_tf


def _executing_eagerly() -> bool:
    """True when TensorFlow runs eagerly here (not while tracing a tf.function or building a
    TF1 graph)."""
    return bool(import_tf().executing_eagerly())
