"""What the ``%%hvd`` cells of one kernel (one notebook) share on the widget side, in one
object: the 1-rank baselines of scaling efficiency, the last ``%hvd doctor`` report (the
links the panel's predicted efficiency uses), the last cell (for ``save_trace``), the
finished panels kept live, and whether BokehJS was loaded. :func:`session` returns the
kernel's; ``session().reset()`` forgets everything."""
from __future__ import annotations

import collections
import hashlib
import os
import time
from typing import Any, Dict, Optional

from .model import CellState, dumps_trace

#: Finished cells whose live panels stay interactive (zoomable timeline, the save button).
#: Each panel is about 50 widgets and a bokeh document, 0.4 MB of the kernel's memory, so an
#: older panel is closed when a newer one finishes; its static snapshot stays in the output.
LIVE_PANELS = 10


def workload_key(code: str) -> str:
    """Which baseline a cell's code uses (a hash of the code)."""
    return hashlib.sha1(code.strip().encode()).hexdigest()[:16]


class Session:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.baselines: Dict[str, float] = {}     # workload key (or "*") -> 1-rank samples/s
        self.last_cell: Optional[CellState] = None
        self.last_sink: Any = None
        self.live: "collections.deque[Any]" = collections.deque()   # finished live panels
        self.hinted = False                       # the "widgets need ..." hint was shown
        self.bokeh_loaded = False
        self.bokeh_loader: Optional[str] = None   # display id of BokehJS still in the output
        self.render_error: Optional[str] = None   # the background renderer's last error
        self.doctor: Any = None                   # the last %hvd doctor report (its links)

    def set_baseline(self, samples_per_s: float, code: Optional[str] = None) -> None:
        """The 1-rank samples/s that scaling efficiency compares against (for the cell with
        ``code``; with no code, for every cell that has no baseline of its own)."""
        self.baselines[workload_key(code) if code is not None else "*"] = float(samples_per_s)

    def baseline_for(self, code: str) -> Optional[float]:
        return self.baselines.get(workload_key(code), self.baselines.get("*"))

    def record(self, cell: Optional[CellState], code: str, size: int) -> None:
        """A finished cell: the last one; on a 1-rank pool, its throughput becomes the
        baseline of later cells with the same code."""
        self.last_cell = cell
        if cell is not None and size == 1 and len(cell.ranks) == 1:
            rate = cell.total_rate()
            if rate:
                self.baselines[workload_key(code)] = rate

    def keep_live(self, panel: Any) -> None:
        """Keep ``panel`` live and release the oldest beyond :data:`LIVE_PANELS`."""
        self.live.append(panel)
        while len(self.live) > LIVE_PANELS:
            self.live.popleft().release()


_SESSION = Session()


def session() -> Session:
    """This kernel's session (a kernel serves one notebook)."""
    return _SESSION


def save_trace(path: Optional[str] = None, cell: Optional[CellState] = None) -> str:
    """Write the last cell's timeline (or ``cell``'s) as Chrome-trace JSON for Perfetto
    (https://ui.perfetto.dev) or chrome://tracing; returns the path."""
    cell = cell or _SESSION.last_cell
    if cell is None:
        raise RuntimeError("no %%hvd cell with the live panel or text summary has run yet")
    path = path or time.strftime("hvd-timeline-%Y%m%d-%H%M%S.json")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(dumps_trace(cell.track.all_spans()))
    return os.path.abspath(path)
