"""Runs in each rank (a pool engine, one MPI process per rank).

Code that runs inside each pool engine (an MPI rank), called through ipyparallel.

:func:`startup` runs before the engine's first cell; the others are small helpers the pool
calls with ``apply``. They return plain data only.
"""
from __future__ import annotations

import os
import socket
import sys
import traceback
from typing import Any, Dict, List, Optional, Tuple

#: Set when ``hvd.init()`` failed at start-up: the reason, shown by ``%hvd status``.
init_error: Optional[str] = None


def startup() -> None:
    """Initialise hvd_magic's runtime on this rank (``hvd.rank()``/``hvd.size()`` work at once)."""
    global init_error
    try:
        import hvd_magic.collectives as hvd
        if not hvd.is_initialized():
            hvd.init()
        from hvd_magic.collectives import elastic
        elastic.on_leave(_exit_soon)
    except BaseException as exc:  # noqa: BLE001 - reported by %hvd status, never fatal
        init_error = f"{type(exc).__name__}: {exc}"
        sys.stderr.write(f"hvd_magic: hvd.init() failed on this rank: {init_error}\n")


def _exit_soon() -> None:
    """This engine leaves the pool: exit once the cell's reply is out (as a rank that
    ``%hvd resize`` sends away does)."""
    import threading
    threading.Timer(0.3, os._exit, (0,)).start()


def joined() -> bool:
    """Whether ``%hvd resize`` started this engine to join a running pool."""
    try:
        from hvd_magic.collectives.elastic import spawned
        return spawned()
    except Exception:  # noqa: BLE001 - no MPI: not joined
        return False


def resize(n: int) -> str:
    """Every rank of an elastic pool at once: grow the pool to ``n`` ranks (the new engines
    are spawned and merged in) or shrink it (ranks ``n`` and up leave: this engine exits
    right after answering). Returns ``"stays"`` or ``"leaves"``."""
    from hvd_magic.collectives import elastic
    try:
        elastic.resize(n)
    except SystemExit:
        _exit_soon()
        return "leaves"
    return "stays"


def catch_up(items: List[Tuple[str, Any]]) -> Optional[str]:
    """On a rank that joined the pool: run the pool's earlier cells (``("cell", code)``) and
    pushes (``("push", {name: value})``) in order, output hidden, ``hvd.elastic.run`` calls
    skipped (see :func:`hvd_magic.collectives.elastic.catching_up`). None, or what failed."""
    import contextlib
    import io
    from IPython import get_ipython
    from hvd_magic.collectives import elastic
    ip = get_ipython()
    elastic.catching_up(True)
    try:
        for i, (kind, payload) in enumerate(items):
            if kind == "push":
                ip.user_ns.update(payload)
                continue
            with contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                res = ip.run_cell(payload, silent=True)
            err = res.error_before_exec or res.error_in_exec
            if err is not None:
                first = payload.strip().splitlines()[0] if payload.strip() else ""
                return (f"the pool's cell {i + 1} of {len(items)} ({first[:60]!r}) raised "
                        f"{type(err).__name__}: {err}")
        return None
    finally:
        elastic.catching_up(False)


def where() -> Tuple[str, int]:
    """This rank's host name and pid (asked once when the pool starts, so that a rank that
    later stops answering can still be named by where it runs)."""
    return socket.gethostname(), os.getpid()


def info() -> Dict[str, Any]:
    """Where and what this rank is: rank, host, pid, nanny pid, GPU, runtime state."""
    import hvd_magic.collectives as hvd
    nanny = None
    try:
        import psutil
        kids = [p for p in psutil.Process().children()
                if "ipyparallel.engine.nanny" in " ".join(p.cmdline())]
        nanny = kids[0].pid if kids else None
    except Exception:  # noqa: BLE001 - best effort
        pass
    out: Dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "nanny": nanny,
                           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                           "initialized": hvd.is_initialized(), "init_error": init_error,
                           "pending": []}
    if hvd.is_initialized():
        out["rank"], out["size"] = hvd.rank(), hvd.size()
        try:
            out["pending"] = [dict(p) for p in hvd.pending()]
        except Exception as exc:  # noqa: BLE001
            out["pending"] = [f"(cannot read: {exc})"]
    return out


def reset(timeout: float = 5.0) -> str:
    """Restart the runtime after an interrupt: ``hvd.shutdown()`` then ``hvd.init()``.

    Every rank calls this at once; a request left in flight by the interrupt is dropped.
    Returns ``"ok"`` or the error text.
    """
    import hvd_magic.collectives as hvd
    try:
        hvd.shutdown(timeout=timeout)
        hvd.init()
        return "ok"
    except BaseException:  # noqa: BLE001 - the pool decides what to do
        return traceback.format_exc()


def last_result() -> Any:
    """The value of this rank's last cell (``Out`` of the previous execution count)."""
    from IPython import get_ipython
    ip = get_ipython()
    if ip is None:
        return None
    return ip.user_ns.get("Out", {}).get(ip.execution_count - 1)
