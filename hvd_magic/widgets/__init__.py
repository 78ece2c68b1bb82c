"""Live widgets for ``%%hvd`` cells: rank logs, status badges, a stall/failure banner,
throughput and scaling efficiency, and a bokeh timeline of the collectives, all through
Jupyter comms (ipywidgets, jupyter_bokeh). In a terminal the same information is text.

* engine side: :mod:`hvd_magic.kernel.ranks.telemetry` (``enable()``), counting what
  ``hvd.report(n)`` (:mod:`hvd_magic.collectives.progress`) reports
* pure: :mod:`.model` (logs, spans, throughput arithmetic, snapshots), :mod:`.scaling` (pure part)
* client side, observers of a cell that ``Pool.run_cell`` feeds with output, telemetry and
  the cell's end: :mod:`.sink` (which renderer), :mod:`.panel` (the live panel),
  :mod:`.text` (text and summary), :mod:`.session` (what cells share, ``save_trace``)

ipywidgets and bokeh are imported only when a widget is made.
"""
from __future__ import annotations

from typing import Any

from ..collectives.progress import report

__all__ = ["make_sink", "report", "save_trace", "set_baseline", "scale"]


def make_sink(stream: bool = True, **kw: Any) -> Any:
    """The renderer of one ``%%hvd`` cell (``HvdMagics.sink_factory``)."""
    from .sink import make_sink as _m
    return _m(stream=stream, **kw)


def save_trace(path: Any = None) -> str:
    """Write the last cell's timeline as Chrome-trace JSON (Perfetto); returns the path."""
    from .session import save_trace as _s
    return _s(path)


def set_baseline(samples_per_s: float, code: Any = None) -> None:
    """The 1-rank samples/s that scaling efficiency compares against."""
    from .session import session
    session().set_baseline(samples_per_s, code)
