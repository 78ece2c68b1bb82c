"""The background thread that redraws running live panels, at a lower CPU priority (nice
+10 for the thread; optionally the kernel's scheduler autogroup, HVD_MAGIC_KERNEL_NICE), so
that drawing runs while the ranks wait rather than taking a core from them."""
from __future__ import annotations

import os
import threading
import time
from typing import Any, List, Optional

from .. import config
from .session import session


def kernel_nice() -> int:
    """``HVD_MAGIC_KERNEL_NICE`` (default 0: the kernel's priority is left alone; it cannot
    be raised again without CAP_SYS_NICE, so lowering it is the user's choice)."""
    value = config.get("HVD_MAGIC_KERNEL_NICE")
    if not 0 <= value <= 19:
        raise ValueError(f"HVD_MAGIC_KERNEL_NICE={value}: use a nice value from 0 to 19")
    return value


def lower_autogroup_priority(nice: int, path: str = "/proc/self/autogroup") -> Optional[int]:
    """Raise the nice value of this process's scheduler autogroup to at least ``nice``;
    returns the group's nice value afterwards (None: no autogroups here, or not allowed).

    Linux shares the CPU fairly between autogroups (one per session) before it looks at the
    nice values of the threads inside them, and the pool's ranks run in their own session.
    So a redraw in the kernel, even from a thread at nice +10, took a rank's core at equal
    weight, and all ranks lost that time at their next collective: 2-rank training with
    live widgets ran at 0.87 of ``--no-stream``; with the kernel's group at nice 19, 0.99
    (benchmarks/README.md). A user cannot lower it again (that needs CAP_SYS_NICE), so it
    stays for the kernel's life: the kernel then yields to its own busy ranks, and runs at
    full speed whenever they wait or the machine has a free core."""
    def current() -> int:        # "/autogroup-123 nice 0"
        with open(path) as f:
            return int(f.read().split("nice")[1].split()[0])

    try:
        if current() >= nice:
            return current()
        with open(path, "w") as f:
            f.write(str(nice))
        return current()
    except (OSError, IndexError, ValueError):
        return None


class _Renderer:
    """One thread per kernel that drains the telemetry of running ``%%hvd`` cells and redraws
    their panels, at a lower CPU priority: the thread at nice +10 and the kernel's
    scheduler autogroup at ``HVD_MAGIC_KERNEL_NICE`` (Linux; elsewhere normal).

    On a machine whose cores all run ranks, a redraw preempted a rank, and since the ranks
    meet in every collective, all of them lost that time. At a low priority the drawing
    mostly runs in the time ranks spend waiting in collectives.
    """

    # Look at the panels this often; each redraws only when something changed and its own
    # ``refresh`` (0.45 s) has passed: twice a second while output and batches arrive,
    # not at all while nothing does.
    period = 0.25

    def __init__(self) -> None:
        self.sinks: List[Any] = []
        self.mu = threading.Lock()        # held while ticking: remove() waits for it
        self.wake = threading.Event()
        self.thread: Optional[threading.Thread] = None
        self.niced = False
        self.group_nice: Optional[int] = None   # the kernel's autogroup nice, once lowered
        self.nice = 0                           # HVD_MAGIC_KERNEL_NICE, read by add()

    def add(self, sink: Any) -> None:
        self.nice = kernel_nice()          # a bad value fails here, not in the thread
        with self.mu:
            if sink not in self.sinks:
                self.sinks.append(sink)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="hvdm-render", daemon=True)
                self.thread.start()
        self.wake.set()

    def remove(self, sink: Any) -> None:
        with self.mu:
            if sink in self.sinks:
                self.sinks.remove(sink)

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            self.niced = True
        except (AttributeError, OSError):   # not Linux: the thread keeps the normal priority
            pass
        nice = self.nice
        # Only a session leader (a Jupyter kernel: jupyter_client starts each in a session
        # of its own) owns its autogroup; otherwise the group is the user's shell or server.
        if nice > 0 and hasattr(os, "getsid") and os.getsid(0) == os.getpid():
            self.group_nice = lower_autogroup_priority(nice)
        while True:
            if not self.sinks:
                self.wake.wait()
                self.wake.clear()
                continue
            time.sleep(self.period)
            with self.mu:
                for sink in list(self.sinks):
                    try:
                        sink.tick()
                    except Exception as exc:  # noqa: BLE001 - never kill the cell for the UI
                        session().render_error = repr(exc)


RENDERER = _Renderer()
