"""Ctrl-C while the main thread runs a negotiation cycle itself (``Engine._run_inline``).

An interrupt in the middle of a cycle would leave the ranks' exchange half done, so SIGINT's
Python handler is held back while the cycle runs and called as soon as it ends. Only the
main thread gets SIGINT, and it runs one inline cycle at a time (under the cycle lock), so
one module-level holder is enough.
"""
from __future__ import annotations

import _signal  # the C functions: signal.signal's enum wrapping costs ~3 us a call
import threading
from _thread import get_ident as _get_ident
from typing import Any, Callable, Optional

_MAIN = threading.main_thread().ident
_SIGINT = int(_signal.SIGINT)

HELD: list = []       # SIGINTs that came in while held back


def hold(signum: int, frame: Any) -> None:
    """The handler in place while a cycle runs: remember the signal."""
    HELD.append((signum, frame))


def defer_sigint() -> Optional[Callable]:
    """In the main thread, hold back SIGINT's Python handler and return it (for
    :func:`restore_sigint`); elsewhere, or when there is no Python handler, None."""
    if _get_ident() != _MAIN:
        return None
    old = _signal.getsignal(_SIGINT)
    if not callable(old) or old is hold:
        return None
    _signal.signal(_SIGINT, hold)
    return old


def restore_sigint(old: Optional[Callable]) -> None:
    """Put SIGINT's handler back and run it now for a signal that came in meanwhile."""
    if old is None:
        return
    _signal.signal(_SIGINT, old)
    if HELD:
        signum, frame = HELD[0]
        HELD.clear()
        old(signum, frame)
