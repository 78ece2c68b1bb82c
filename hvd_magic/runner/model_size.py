"""Gradient bytes of a model named as torchvision or Keras applications name it, counted
from its parameters: the model is built with random weights (nothing is downloaded), its
trainable parameters counted, and it is dropped. For ``%hvd doctor --what-if --model NAME``.
"""
from __future__ import annotations

from typing import List, Optional, Tuple


def _torchvision(name: str) -> Optional[Tuple[float, int]]:
    try:
        import torchvision.models as tvm
    except ImportError:
        return None
    try:
        model = tvm.get_model(name, weights=None)
    except ValueError:
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    return float(sum(p.numel() * p.element_size() for p in params)), len(params)


def _keras(name: str) -> Optional[Tuple[float, int]]:
    try:
        from keras import applications
    except ImportError:
        return None
    build = getattr(applications, name, None)
    if not callable(build) or not name[:1].isupper():
        return None
    model = build(weights=None)
    weights = model.trainable_weights
    total = 0.0
    for w in weights:
        count = 1
        for d in w.shape:
            count *= int(d)
        total += count * _itemsize(str(w.dtype))
    return total, len(weights)


def _itemsize(dtype: str) -> int:
    import numpy as np
    return np.dtype(dtype).itemsize


def available() -> List[str]:
    """Which model families this environment can build (for error messages)."""
    out = []
    try:
        import torchvision  # noqa: F401
        out.append("torchvision")
    except ImportError:
        pass
    try:
        import keras  # noqa: F401
        out.append("keras.applications")
    except ImportError:
        pass
    return out


def model_bytes(name: str) -> Tuple[float, int, str]:
    """``name`` -> (gradient bytes per step, trainable tensors, which library built it).
    torchvision's names (``resnet50``) first, then Keras applications' (``ResNet50``).
    Raises ValueError naming what is installed when no library knows the name."""
    for lib, fn in (("torchvision", _torchvision), ("keras.applications", _keras)):
        found = fn(name)
        if found is not None:
            return found[0], found[1], lib
    have = available()
    missing = [lib for lib in ("torchvision", "keras.applications") if lib not in have]
    raise ValueError(
        f"--model {name}: no such model in {', '.join(have) or 'any installed library'}"
        + (f" ({' and '.join(missing)} not installed here)" if missing else "")
        + "; give a torchvision name (resnet50) or a Keras applications one (ResNet50), or "
        "--model-bytes B")
