"""A rank's stacks from C, for a rank on another host than its gatherer.

A rank on hvdrun's host that holds the GIL in C code does not run its Python handler of
SIGUSR2; the gatherer then sends it :data:`.dump.SIGNAL_HELD`, whose handler (faulthandler's)
needs no GIL. A rank on another host cannot be sent that signal: ``mpiexec`` forwards only
SIGUSR2. So such a rank starts this small process at ``hvd.init()`` (:func:`.dump.install`)
and hands it the write end of Python's signal wake-up pipe: the interpreter's C handler
writes the signal's number there at once, GIL or not. The watcher then does on the rank's
host what the gatherer does on its own: it waits :data:`.dump.ANSWER_S` for the Python
handler's answer (that handler writes :data:`.dump.ANSWERED` into the same pipe), else sends the
rank SIGNAL_HELD, and writes what faulthandler dumped to the rank's stderr, each line marked
as the Python handler marks its own (:data:`.dump.FRAME`). It ends when the rank does (the
pipe closes) and removes the dump file.

    python -m hvd_magic.stacks.watch FD RANK PID MAIN_IDENT DUMP_FILE
"""
from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time

from .dump import (ANSWER_S, ANSWERED, END, FRAME, SETTLE_S, SIGNAL, SIGNAL_HELD, TIMEOUT,
                   file_size)


def _dump_from_c(pid: int, path: str) -> str:
    """Send SIGNAL_HELD to ``pid`` and return what its handler appends to ``path``."""
    offset = file_size(path)
    try:
        os.kill(pid, SIGNAL_HELD)
    except OSError:
        return ""
    deadline = time.monotonic() + TIMEOUT
    last, since = offset, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        size = file_size(path)
        if size != last:
            last, since = size, time.monotonic()
        elif size > offset and time.monotonic() - since >= SETTLE_S:
            break
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(last - offset).decode(errors="replace")


def watch(fd: int, rank: int, pid: int, main: int, path: str) -> None:
    mark = FRAME.format(rank=rank)
    end = END.format(pid=pid, host=socket.gethostname(), main=main)
    asked = None          # time.monotonic() of a SIGNAL not answered yet
    while True:
        wait = None if asked is None else max(asked + ANSWER_S - time.monotonic(), 0.0)
        ready, _, _ = select.select([fd], [], [], wait)
        if ready:
            data = os.read(fd, 512)
            if not data:
                return                               # the rank is gone
            for byte in data:
                if byte == ANSWERED:
                    asked = None
                elif byte == SIGNAL and asked is None:
                    asked = time.monotonic()
            continue
        asked = None                                 # no answer from Python: from C
        body = _dump_from_c(pid, path)
        if body:
            text = "".join(f"{mark}{line}\n" for line in body.splitlines() + [end])
            os.write(2, text.encode())


def main(argv: list) -> int:
    fd, rank, pid, main_ident, path = argv
    # Signals the launcher forwards to the rank's process group are the rank's to handle
    # (PRRTE sends SIGUSR2 to the whole group; its default action would end this process).
    # The watcher runs in a session of its own, so this only guards a signal sent to it.
    for sig in (signal.SIGINT, SIGNAL, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    try:
        watch(int(fd), int(rank), int(pid), int(main_ident), path)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
