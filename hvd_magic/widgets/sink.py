"""Which renderer a ``%%hvd`` cell gets. The renderers observe the cell: the pool
(``Pool.run_cell``) hands them output, telemetry batches (``ingest``) and the cell's end.

* :class:`.panel.WidgetSink`: the live panel, in a Jupyter kernel with ipywidgets, bokeh and
  jupyter_bokeh;
* :class:`.text.TelemetryTextSink`: text with a summary (a terminal, or no ipywidgets);
* ``--no-stream``: the plain :class:`hvd_magic.kernel.notebook.output.TextSink`, no telemetry.
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

from .. import config
from ..kernel.notebook.output import TextSink
from .session import session
from .text import TelemetryTextSink

WIDGETS_HINT = ("hvd: live widgets need ipywidgets, bokeh and jupyter_bokeh: "
                "`pip install ipywidgets bokeh jupyter_bokeh` (showing text instead)")


def widgets_available() -> bool:
    """True in a Jupyter kernel (comms) with ipywidgets, bokeh and jupyter_bokeh importable."""
    if not config.get("HVD_MAGIC_WIDGETS"):
        return False
    try:
        from IPython import get_ipython
        ip = get_ipython()
        if ip is None or type(ip).__name__ != "ZMQInteractiveShell":
            return False
    except ImportError:
        return False
    try:
        import bokeh  # noqa: F401
        import ipywidgets  # noqa: F401
        import jupyter_bokeh  # noqa: F401
    except ImportError:
        if not session().hinted:
            session().hinted = True
            sys.stderr.write(WIDGETS_HINT + "\n")
        return False
    return True


def make_sink(stream: bool = True, ranks: Optional[Sequence[int]] = None, **kw: Any) -> Any:
    """The renderer of one ``%%hvd`` cell: ``HvdMagics.sink_factory``.

    ``stream=False`` (``--no-stream``) gives the plain :class:`TextSink` with no telemetry
    at all (the baseline of benchmarks/widgets.py).
    """
    if not stream:
        return TextSink(stream_output=False)
    if widgets_available():
        from .panel import WidgetSink
        return WidgetSink(ranks=ranks, **kw)
    return TelemetryTextSink(ranks=ranks)
