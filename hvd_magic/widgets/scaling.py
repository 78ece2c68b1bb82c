"""``%hvd scale --np 1,2,4``: run one cell at several pool sizes and plot throughput and
scaling efficiency against ranks, with the ideal (linear) line.

Pure: :func:`parse_np_list`, :func:`scale_rows`, :func:`scale_text`, :func:`scale_html`.
Drawing: :func:`plot_scaling` (bokeh), :func:`show_scaling` (widget or text);
:class:`ScaleResult`, the points ``%%hvd scale`` returns, shows itself with them. Running the cell at
each size is the magics' (:mod:`hvd_magic.magics.scale`): a view only draws.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from .model import fmt_pct, fmt_rate


@dataclass
class ScalePoint:
    """One pool size's measurement: total samples/s, per rank, communication share; and the
    efficiency the what-if model predicts for it (``predicted``, 0..1) with what that
    assumed about the link (``predicted_from``, e.g. ``"no doctor measurement: defaults"``)."""

    np: int
    total: Optional[float]
    per_rank: Dict[int, Optional[float]] = field(default_factory=dict)
    comm: Optional[float] = None
    wall_s: float = 0.0
    predicted: Optional[float] = None
    predicted_from: str = ""


def parse_np_list(text: str) -> List[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (sorted, unique; ValueError says what to write)."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items or not all(t.isdigit() and int(t) > 0 for t in items):
        raise ValueError(f"--np {text!r}: give pool sizes separated by commas, e.g. --np 1,2,4")
    return sorted({int(t) for t in items})


def scale_rows(points: Sequence[ScalePoint]) -> List[Dict[str, Any]]:
    """One row per size: ``np, total, ideal, speedup, efficiency, comm, predicted``. The baseline is
    the 1-rank point's throughput (else the smallest size's, per rank)."""
    pts = sorted(points, key=lambda p: p.np)
    base = None
    for p in pts:
        if p.total:
            base = p.total / p.np
            break
    rows = []
    for p in pts:
        ideal = base * p.np if base else None
        rows.append({"np": p.np, "total": p.total, "ideal": ideal,
                     "speedup": (p.total / base) if (base and p.total) else None,
                     "efficiency": (p.total / ideal) if (ideal and p.total) else None,
                     "comm": p.comm, "predicted": p.predicted})
    return rows


def predicted_source(points: Sequence[ScalePoint]) -> str:
    """The line under the table saying what the predicted column assumed about the link."""
    srcs = sorted({p.predicted_from for p in points if p.predicted is not None})
    if not srcs:
        return ""
    return "predicted: the what-if model (%hvd doctor --what-if) from the 1-rank step time " \
           f"and the gradient bytes per step; link: {'; '.join(srcs)}"


def scale_text(points: Sequence[ScalePoint]) -> str:
    lines = [f"{'ranks':>5}  {'samples/s':>10}  {'ideal':>10}  {'speedup':>7}  {'efficiency':>10}  "
             f"{'comm':>5}  predicted"]
    for r in scale_rows(points):
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(f"{r['np']:>5}  {fmt_rate(r['total']):>10}  {fmt_rate(r['ideal']):>10}  "
                     f"{sp:>7}  {fmt_pct(r['efficiency']):>10}  {fmt_pct(r['comm']):>5}  "
                     f"{fmt_pct(r['predicted'])}")
    src = predicted_source(points)
    return "\n".join(lines + ([src] if src else []))


def plot_scaling(points: Sequence[ScalePoint]) -> Any:
    """A bokeh layout: throughput vs ranks (with the ideal line) and efficiency vs ranks."""
    from bokeh.layouts import row
    from bokeh.models import ColumnDataSource, HoverTool
    from bokeh.plotting import figure
    rows = scale_rows(points)
    src = ColumnDataSource({k: [r[k] if r[k] is not None else float("nan") for r in rows]
                            for k in ("np", "total", "ideal", "efficiency", "comm", "predicted")})
    f1 = figure(height=260, width=380, title="throughput", x_axis_label="ranks",
                y_axis_label="samples/s", tools="pan,wheel_zoom,reset,save")
    f1.line("np", "ideal", source=src, line_dash="dashed", color="#888", legend_label="ideal")
    f1.line("np", "total", source=src, color="#1f77b4", legend_label="measured")
    f1.scatter("np", "total", source=src, size=8, color="#1f77b4")
    f1.legend.location = "top_left"
    f2 = figure(height=260, width=380, title="scaling efficiency", x_axis_label="ranks",
                y_axis_label="efficiency", y_range=(0, 1.1), tools="pan,wheel_zoom,reset,save")
    f2.line("np", "efficiency", source=src, color="#2ca02c", legend_label="efficiency")
    f2.scatter("np", "efficiency", source=src, size=8, color="#2ca02c")
    f2.line("np", "predicted", source=src, color="#9467bd", line_dash="dashed",
            legend_label="predicted")
    f2.line("np", "comm", source=src, color="#d62728", line_dash="dotted",
            legend_label="communication share")
    f2.legend.location = "bottom_left"
    for f in (f1, f2):
        f.add_tools(HoverTool(tooltips=[("ranks", "@np"), ("samples/s", "@total{0.0}"),
                                        ("efficiency", "@efficiency{0%}")]))
        f.xaxis.ticker = [r["np"] for r in rows]
    return row(f1, f2)


def scale_html(points: Sequence[ScalePoint]) -> str:
    """The table of :func:`scale_text` as HTML."""
    head = "".join(f"<th>{h}</th>" for h in ("ranks", "samples/s", "ideal", "speedup",
                                             "efficiency", "communication", "predicted"))
    body = []
    for r in scale_rows(points):
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        cells = (str(r["np"]), fmt_rate(r["total"]), fmt_rate(r["ideal"]), sp,
                 fmt_pct(r["efficiency"]), fmt_pct(r["comm"]), fmt_pct(r["predicted"]))
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    src = predicted_source(points)
    note = f'<div class="hvd-scale-src">{html.escape(src)}</div>' if src else ""
    return (f'<table class="hvd-scale"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>{note}")


class ScaleResult(list):
    """What ``%%hvd scale`` returns: its :class:`ScalePoint` s, smallest pool first (a list:
    ``points = _; points[0].total``). As a cell's value it shows as the table and the plot,
    not as a list."""

    def rows(self) -> List[Dict[str, Any]]:
        return scale_rows(self)

    def __repr__(self) -> str:
        return scale_text(self)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(scale_text(self))

    def _repr_html_(self) -> str:
        return scale_html(self)

    def _ipython_display_(self) -> None:
        show_scaling(self)


def show_scaling(points: Sequence[ScalePoint]) -> None:
    """Display the table and, in Jupyter with bokeh, the plot; elsewhere print the table."""
    from .sink import widgets_available
    if not widgets_available():
        print(scale_text(points))
        return
    from IPython.display import HTML, display
    from jupyter_bokeh import BokehModel
    from .panel import load_bokeh
    load_bokeh()
    display(HTML(scale_html(points)))
    display(BokehModel(plot_scaling(points)))
