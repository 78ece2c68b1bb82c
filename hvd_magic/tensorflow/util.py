"""``horovod.tensorflow.util``'s helper that Horovod's own scripts and tests import, and
``gpu_available`` (Horovod's ``horovod.common.util.gpu_available``, which
``horovod.tensorflow`` exports)."""
from __future__ import annotations

import functools
import importlib.util

from ._compat import import_tf


def _executing_eagerly() -> bool:
    """True when TensorFlow runs eagerly here (not while tracing a tf.function or building a
    TF1 graph)."""
    return bool(import_tf().executing_eagerly())


@functools.lru_cache(maxsize=None)
def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether the framework ``ext_base_name`` ("tensorflow", "torch", "mxnet") sees a GPU
    here, as Horovod's (which asks ``tf.test.is_gpu_available()``,
    ``torch.cuda.is_available()``, ...): False when the framework is not installed, is a CPU
    build, or no GPU is visible, so a GPU-only check skips. ``verbose`` prints what was
    checked and found, as Horovod's does; the answer is cached, as Horovod's.

    Example, tensorflow-cpu: ``gpu_available("tensorflow")`` -> ``False``."""
    if verbose:
        print(f"Checking whether extension {ext_base_name} was running with GPU.")
    found = False
    try:
        if ext_base_name == "tensorflow":
            found = bool(import_tf().config.list_physical_devices("GPU"))
        elif ext_base_name == "torch" and importlib.util.find_spec("torch") is not None:
            import torch
            found = bool(torch.cuda.is_available())
        elif ext_base_name == "mxnet" and importlib.util.find_spec("mxnet") is not None:
            import mxnet
            found = mxnet.context.num_gpus() > 0
    except Exception:  # noqa: BLE001 - a broken install sees no GPU, as Horovod's check
        found = False
    if verbose:
        print(f"Extension {ext_base_name} {'was' if found else 'was NOT'} running with GPU.")
    return found
