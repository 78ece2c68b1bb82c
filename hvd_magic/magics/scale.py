"""Runs in the notebook kernel. ``%%hvd scale --np 1,2,4``: run one cell on pools of each
size and show what the scaling plot (:mod:`hvd_magic.widgets.scaling`) draws of it."""
from __future__ import annotations

import time
from typing import Any, Callable, List, Optional, Sequence

from ..widgets.model import fmt_rate
from ..widgets.scaling import ScalePoint, ScaleResult, parse_np_list


def scale(manager: Any, code: str, nps: Any) -> ScaleResult:
    """Run ``code`` at each pool size of ``nps`` (``"1,2,4"`` or a list); return the points,
    which the cell shows as the table and the plot."""
    sizes = parse_np_list(nps) if isinstance(nps, str) else sorted(set(nps))
    return ScaleResult(run_scaling(manager, code, sizes, progress=print))


def run_scaling(manager: Any, code: str, nps: Sequence[int],
                progress: Optional[Callable[[str], None]] = None) -> List[ScalePoint]:
    """Run ``code`` on pools of each size in ``nps`` (restarting the pool as needed) with
    telemetry on; returns the measured points. Needs ``hvd_magic.report(samples=n)`` in the
    cell. The 1-rank throughput becomes the baseline of later cells with the same code.
    Each point's predicted efficiency is the live panel's (:meth:`CellState.predicted`): the
    what-if model fed with the 1-rank step time, the gradient bytes the ranks' allreduces
    carried per step, and the last ``%hvd doctor`` of the pool's hosts (else this host's
    defaults); None for one rank or when the ranks' allreduces carried no bytes."""
    from ..widgets.session import session
    from ..widgets.text import TelemetryTextSink
    points: List[ScalePoint] = []
    for n in nps:
        pool = manager.ensure(n, None, None, None)
        snk = TelemetryTextSink(ranks=list(range(n)), stream_output=False)
        snk.status = lambda _t: None            # type: ignore[method-assign]
        t0 = time.time()
        pool.run_cell(code, snk)
        cell = snk.cell
        pred = cell.predicted()          # the panel's prediction, from this run's measurements
        points.append(ScalePoint(n, cell.total_rate(), cell.rates(), cell.comm_mean(),
                                 time.time() - t0,
                                 pred.predicted if pred else None,
                                 pred.source() if pred else ""))
        if n == 1 and cell.total_rate():
            # the 1-rank run is the baseline (its step time) of the larger sizes' predictions
            session().set_baseline(cell.total_rate(), code)
        if progress:
            progress(f"hvd scale: {n} rank(s): {fmt_rate(cell.total_rate())} samples/s")
    return points
