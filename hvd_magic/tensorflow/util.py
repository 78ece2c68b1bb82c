"""``horovod.tensorflow.util``'s helper that Horovod's own scripts and tests import, and
``gpu_available`` (Horovod's ``horovod.common.util.gpu_available``, which
``horovod.tensorflow`` exports)."""
from __future__ import annotations

from ._compat import import_tf


def _executing_eagerly() -> bool:
    """True when TensorFlow runs eagerly here (not while tracing a tf.function or building a
    TF1 graph)."""
    return bool(import_tf().executing_eagerly())


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether the extension ``ext_base_name`` ("tensorflow", "torch", "mxnet") runs its
    collectives on GPUs: never in hvd_magic, whose runtime moves tensors through host memory
    over MPI, so a GPU-only check skips. ``verbose`` prints what was checked and found, as
    Horovod's does.

    Example: ``gpu_available("tensorflow")`` -> ``False``."""
    if verbose:
        print(f"Checking whether extension {ext_base_name} was running with GPU.")
        print(f"Extension {ext_base_name} was NOT running with GPU.")
    return False
