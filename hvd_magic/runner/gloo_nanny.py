"""One rank of ``hvdrun --gloo -H ...``, on its host: ``python -m hvd_magic.runner.gloo_nanny
-- COMMAND...``.

Runs COMMAND (its output is the nanny's, so it reaches hvdrun over the same connection) and
then writes :data:`EXIT_MARK` with the rank's exit status as its last line: over ssh (or an
agent that detaches) that line, not the agent's own status, says how the rank ended. Its
standard input is hvdrun's end of the connection: a line with a signal number sends that
signal to the rank's process group; end of input (hvdrun stopped the job, or the connection
dropped) stops the rank: SIGTERM, then SIGKILL after ``GRACE_S``. On Linux the rank is also
killed if the nanny itself dies, so no rank outlives its connection.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import List, Optional

#: The nanny's last line: ``EXIT_MARK status=N`` (N < 0: killed by signal -N).
EXIT_MARK = "hvdrun-gloo-exit"

#: Seconds a rank may take to end after SIGTERM before it is killed.
GRACE_S = 5.0


def _die_with_parent() -> None:
    """(In the rank's process, before exec) SIGKILL when the nanny dies (Linux)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the rank's process group, SIGKILL it after ``GRACE_S``."""
    _signal(proc, signal.SIGTERM)
    try:
        proc.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        _signal(proc, signal.SIGKILL)


def _listen(proc: subprocess.Popen) -> None:
    """Read hvdrun's requests (signal numbers) until end of input, then stop the rank."""
    for line in sys.stdin:
        word = line.strip()
        if word.isdigit():
            _signal(proc, int(word))
    if proc.poll() is None:
        _stop(proc)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.stderr.write("usage: python -m hvd_magic.runner.gloo_nanny -- COMMAND...\n")
        return 2
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux")
                                else None)
    except OSError as exc:
        sys.stderr.write(f"hvdrun: cannot start {argv[0]} on {os.uname().nodename}: {exc}\n")
        status = 127
    else:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, lambda signum, _f: _signal(proc, signum))
        threading.Thread(target=_listen, args=(proc,), daemon=True).start()
        status = proc.wait()
    sys.stderr.flush()
    sys.stdout.write(f"{EXIT_MARK} status={status}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
