"""IPython magics for the pool: ``%load_ext hvd_magic`` registers ``%%hvd``, ``%hvd`` and
``%autohvd`` (see :class:`.magics.HvdMagics`); arguments are parsed by :mod:`.args`."""
from __future__ import annotations

from typing import Any, Optional

from .args import CellRequest, HvdUsageError, LineRequest, parse_cell_args, parse_line_args

_LOADED: Optional[Any] = None


def load_ipython_extension(ip: Any) -> None:
    """Register the magics on ``ip`` (once); ``HVD_MAGIC_AUTOHVD=1`` turns %autohvd on."""
    global _LOADED
    from .magics import HvdMagics, autohvd_from_env, default_manager
    if _LOADED is not None and _LOADED.shell is ip:
        return
    magics = HvdMagics(ip, default_manager())
    ip.register_magics(magics)
    _LOADED = magics
    autohvd_from_env(magics)


def unload_ipython_extension(ip: Any) -> None:
    """Stop autohvd and the pool."""
    global _LOADED
    if _LOADED is not None:
        _LOADED.close()
        _LOADED = None


__all__ = ["CellRequest", "HvdUsageError", "LineRequest", "load_ipython_extension",
           "parse_cell_args", "parse_line_args", "unload_ipython_extension"]
