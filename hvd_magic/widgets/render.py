"""The background thread that redraws running live panels, at a lower CPU priority (nice
+10 for the thread), so that drawing runs while the ranks wait rather than taking a core
from them."""
from __future__ import annotations

import os
import threading
import time
from typing import Any, List, Optional

from .session import session


class _Renderer:
    """One thread per kernel that drains the telemetry of running ``%%hvd`` cells and redraws
    their panels, the thread at nice +10 (Linux; elsewhere normal).

    On a machine whose cores all run ranks, a redraw preempts a rank, and since the ranks
    meet in every collective, all of them lose that time. At a low priority the drawing
    mostly runs in the time ranks spend waiting in collectives. The thread's nice value
    counts against the ranks because the pool runs in the kernel's session, so in its
    scheduler group (``kernel.notebook.procs.spawn``).
    """

    # Look at the panels this often; each redraws only when something changed and its own
    # ``refresh`` (0.9 of the telemetry interval) has passed: about once a second while
    # output and batches arrive, not at all while nothing does.
    period = 0.25

    def __init__(self) -> None:
        self.sinks: List[Any] = []
        self.mu = threading.Lock()        # held while ticking: remove() waits for it
        self.wake = threading.Event()
        self.thread: Optional[threading.Thread] = None
        self.niced = False

    def add(self, sink: Any) -> None:
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
