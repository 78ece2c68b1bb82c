"""One rank of :func:`hvd_magic.run`: ``python -m hvd_magic.runner.worker DIR``.

Loads ``DIR/fn.pkl`` (cloudpickled ``(fn, args, kwargs)``), calls
``hvd_magic.collectives.init()``, runs ``fn`` and writes ``DIR/rank<r>.pkl``:
``("ok", result)`` or ``("error", type_name, message, traceback_text, exception_or_None)``.
A failing rank aborts the MPI job after writing, so ranks waiting on it do not hang.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Tuple

from .. import config


def _write(directory: str, rank: int, record: Tuple[Any, ...]) -> None:
    import cloudpickle
    try:
        data = cloudpickle.dumps(record)
    except Exception as exc:  # unpicklable result or exception: keep the text
        if record[0] == "ok":
            record = ("error", type(exc).__name__,
                      f"the result of fn on rank {rank} cannot be pickled: {exc}",
                      traceback.format_exc(), None)
        else:
            record = record[:4] + (None,)
        data = cloudpickle.dumps(record)
    tmp = os.path.join(directory, f".rank{rank}.pkl.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, os.path.join(directory, f"rank{rank}.pkl"))


def main(directory: str) -> int:
    """Run this rank's share; return the process exit code."""
    import cloudpickle
    from mpi4py import MPI

    import hvd_magic.collectives as hvd

    rank = MPI.COMM_WORLD.Get_rank()
    if not os.path.isfile(os.path.join(directory, "fn.pkl")):
        import socket
        sys.stderr.write(f"hvd_magic.run: rank {rank} on {socket.gethostname()} cannot see "
                         f"{directory}: on several hosts, run() needs its temporary directory "
                         "on a file system every host sees; set TMPDIR to such a directory "
                         "(e.g. on NFS) before calling it, or use hvdrun\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        return 1
    extra = [p for p in config.get("HVD_MAGIC_SYS_PATH").split(os.pathsep)
             if p and p not in sys.path]
    sys.path[1:1] = extra
    try:
        with open(os.path.join(directory, "fn.pkl"), "rb") as fh:
            fn, args, kwargs = cloudpickle.load(fh)
        hvd.init()
        result = fn(*args, **kwargs)
        record: Tuple[Any, ...] = ("ok", result)
    except SystemExit as exc:     # an elastic job shrank and this rank left it: no result
        if exc.code not in (None, 0):
            raise
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
        record = ("error", type(exc).__name__, str(exc), traceback.format_exc(), exc)
    if hvd.is_initialized():      # an elastic job's ranks are numbered anew after a change
        rank = hvd.rank()
    _write(directory, rank, record)
    if record[0] != "ok":
        sys.stdout.flush()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        return 1
    if hvd.is_initialized():
        hvd.shutdown()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m hvd_magic.runner.worker DIR\n")
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
