"""Alias of :mod:`hvd_magic.keras`, for scripts written as ``import horovod.tensorflow.keras as hvd``."""
from hvd_magic.keras import *  # noqa: F401,F403
from hvd_magic.keras import __all__, callbacks, elastic, load_model  # noqa: F401
