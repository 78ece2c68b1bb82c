"""The live panel of a ``%%hvd`` cell (ipywidgets + bokeh through Jupyter comms): status
badges, a stall/failure banner, throughput and efficiency, a log lane per rank, a bokeh
timeline; and the background thread that redraws running panels. Imported only in a
Jupyter kernel with ipywidgets, bokeh and jupyter_bokeh."""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .. import config
from ..kernel.notebook.output import PoolCellError, is_progress
from .html import badge_html, banner_html, metrics_html, snapshot_html
from .model import GROUP_COLOR, RESET_COLOR, STALLED, STATUS_TEXT, CellState, phase_group
from .session import save_trace, session
from .render import RENDERER
from .text import telemetry_interval

_CSS = """<style>
.hvdm-lane pre{max-height:240px;overflow:auto;margin:0;padding:4px;background:#f7f7f7;
font-size:12px;line-height:1.3}
.hvdm-lane-head{font-weight:bold;font-size:12px}
</style>"""


def load_bokeh() -> None:
    """BokehJS inline, once per kernel (a notebook offline cannot load it from a CDN). The loader
    output (about 8 MB) gets a display id so :func:`_drop_bokeh_loader` can empty it once the
    browser has run it: a saved notebook then does not carry BokehJS."""
    if session().bokeh_loaded:
        return
    import uuid
    from bokeh.io import notebook as bnb
    from bokeh.io import output_notebook
    from bokeh.resources import INLINE
    did = "hvdm-bokehjs-" + uuid.uuid4().hex[:8]
    orig = bnb.publish_display_data

    def publish(data: Any, metadata: Any = None, **kw: Any) -> None:
        kw["transient"] = dict(kw.get("transient") or {}, display_id=did)
        orig(data, metadata, **kw)
    bnb.publish_display_data = publish
    try:
        output_notebook(INLINE, hide_banner=True)
    finally:
        bnb.publish_display_data = orig
    session().bokeh_loaded = True
    session().bokeh_loader = did


def _drop_bokeh_loader() -> None:
    did, session().bokeh_loader = session().bokeh_loader, None
    if did and not config.get("HVD_MAGIC_KEEP_BOKEHJS"):
        from IPython.display import update_display
        update_display({"text/plain": ""}, raw=True, display_id=did)


def _close_tree(w: Any) -> None:
    """Close a widget, its layout and style, and everything it contains (ipywidgets keeps
    every widget until it is closed)."""
    if getattr(w, "comm", None) is None:         # closed already (a lane is shown twice)
        return
    for child in getattr(w, "children", ()):
        _close_tree(child)
    for part in ("layout", "style"):
        sub = getattr(w, part, None)
        if hasattr(sub, "close"):
            sub.close()
    w.close()


class WidgetSink:
    """The live panel of one ``%%hvd`` cell: status badges, stall/failure banner, throughput
    and scaling efficiency, a log lane per rank (with a filter), and a bokeh timeline with
    one row per rank; a static HTML snapshot is emitted when the cell ends."""

    live = True
    #: redraw on :data:`RENDERER`'s low-priority thread (``HVD_MAGIC_RENDER_THREAD=0``:
    #: on the kernel's main thread, from the pool's wait loop)
    redraw_in_background = config.get("HVD_MAGIC_RENDER_THREAD")

    def __init__(self, ranks: Optional[Sequence[int]] = None, max_lines: int = 200,
                 refresh: Optional[float] = None, rollover: int = 3000) -> None:
        """``refresh``: the least seconds between two redraws (default: 0.9 of the
        telemetry interval, so each batch of the ranks is drawn once)."""
        import ipywidgets as W
        from IPython.display import display
        self.W = W
        self.lock = threading.RLock()
        self.telemetry_interval = telemetry_interval()
        self.refresh = 0.9 * self.telemetry_interval if refresh is None else refresh
        self.rollover = rollover
        self.max_lines = max_lines
        self.cell: Optional[CellState] = CellState(list(ranks or []), max_lines=max_lines)
        self.batches = 0
        self.code, self.size = "", 0
        self._pending_rows: List[Any] = []
        self._drawn: Dict[Any, Any] = {}
        self._drawn_resets: set = set()
        self._last = 0.0
        # Something new arrived since the last redraw (output, a batch, a status line): the
        # periodic redraw (at most every ``refresh`` s) is skipped while nothing changed.
        self._changed = True
        self._t0_us: Optional[float] = None
        self._closed = False
        self.status_w = W.HTML("", layout=W.Layout(margin="0"))
        self.banner_w = W.HTML("")
        self.badges_w = W.HTML("")
        self.metrics_w = W.HTML(metrics_html(self.cell))
        # The filter is a Tab (all ranks | rank 0 | ...): switching happens in the browser,
        # so it works while the kernel is busy running the cell (a Dropdown's observer would
        # only run after the cell). Each lane is shown twice: in "all ranks" and in its tab.
        self.lanes_box = W.Tab([])
        self.lanes: Dict[int, Any] = {}
        # each lane's stack, gathered at a stall: a <details> element that opens on a click
        # in the browser, with no round trip to the kernel (busy running the cell)
        self.stack_ws: Dict[int, Any] = {}
        self._stacks_asked = False
        self.save_w = W.Button(description="Save Chrome trace", icon="download",
                               tooltip="write the timeline as Chrome-trace JSON for Perfetto "
                               "(runs once the cell has finished)",
                               layout=W.Layout(width="auto"))
        self.save_w.on_click(self._on_save)
        self.saved_w = W.HTML("")
        self.plot = None
        self.source = None
        self.plot_w: Any = None         # the bokeh timeline, made by _make_plot
        try:
            self._make_plot()
        except Exception as exc:  # noqa: BLE001 - panel still works without a plot
            self.plot_w = W.HTML(f"<i>timeline unavailable: {exc}</i>")
        self.box = W.VBox([W.HTML(_CSS), self.status_w, self.banner_w, self.badges_w,
                           self.metrics_w, self.lanes_box, self.plot_w,
                           W.HBox([self.save_w, self.saved_w])])
        self.box.add_class("hvdm-panel")
        display(self.box)
        self.snapshot = display({"text/plain": ""}, raw=True, display_id=True)
        self._set_ranks(self.cell.ranks)

    # -- plot
    def _make_plot(self) -> None:
        load_bokeh()
        from bokeh.models import ColumnDataSource, HoverTool
        from bokeh.plotting import figure
        from bokeh.transform import factor_cmap
        from jupyter_bokeh import BokehModel
        self.source = ColumnDataSource(dict(left=[], right=[], bottom=[], top=[], rank=[],
                                            phase=[], group=[], label=[], ms=[]))
        p = figure(height=230, sizing_mode="stretch_width",
                   tools="xpan,xwheel_zoom,box_zoom,reset,save",
                   active_drag="xpan", active_scroll="xwheel_zoom",
                   x_axis_label="seconds since the cell started", toolbar_location="above")
        # each row's colour from its group, mapped in the browser (one string column less
        # in every streamed batch of rows)
        colour = factor_cmap("group", palette=list(GROUP_COLOR.values()),
                             factors=list(GROUP_COLOR))
        p.quad(left="left", right="right", bottom="bottom", top="top", color=colour,
               legend_field="group", source=self.source, line_color=None)
        p.add_tools(HoverTool(tooltips=[("rank", "@rank"), ("phase", "@phase"),
                                        ("tensors", "@label"), ("ms", "@ms{0.000}")]))
        # elastic resets: a grey band across every rank from the failure to the resume (often
        # a few ms: a dashed line marks its start at any zoom), and a short label
        self.resets_src = ColumnDataSource(dict(left=[], right=[], bottom=[], top=[], label=[],
                                                short=[]))
        band = p.quad(left="left", right="right", bottom="bottom", top="top", source=self.resets_src,
                      fill_color=RESET_COLOR, fill_alpha=0.35, line_color=RESET_COLOR,
                      legend_label="elastic reset")
        line = p.segment(x0="left", y0="bottom", x1="left", y1="top", source=self.resets_src,
                         line_color=RESET_COLOR, line_width=2, line_dash="dashed",
                         legend_label="elastic reset")
        p.text(x="left", y="top", text="short", source=self.resets_src, text_font_size="9pt",
               text_color="#555555", text_baseline="top", x_offset=4)
        p.add_tools(HoverTool(renderers=[band, line], tooltips=[("", "@label")]))
        p.x_range.follow = "end"
        p.x_range.follow_interval = 10.0
        p.x_range.range_padding = 0.0
        p.yaxis.axis_label = "rank"
        p.ygrid.grid_line_color = None
        p.legend.orientation = "horizontal"
        p.legend.label_text_font_size = "9pt"
        p.add_layout(p.legend[0], "above")          # outside the rows
        self.plot = p
        self.plot_w = _one_message_model(BokehModel)(p)

    # -- OutputSink protocol (kernel main thread)
    def status(self, text: str) -> None:
        with self.lock:
            self._changed = True
            notes = self.cell.notes
            if notes and is_progress(notes[-1]):
                notes.pop()         # superseded by this line
            notes.append(text.rstrip())
            self.status_w.value = "<br>".join(
                f"<span style='color:#666;font-size:12px'>{_esc(t)}</span>" for t in notes)

    def stream(self, rank: int, name: str, text: str) -> None:
        with self.lock:
            self._changed = True
            self.cell.stream(rank, name, text)
        if rank not in self.lanes:
            self._set_ranks(self.cell.ranks)
        # (drawn by the low-priority thread, or by ``poll`` right after the output is read)

    def display(self, rank: int, data: Mapping[str, Any], metadata: Mapping[str, Any]) -> None:
        if set(data) <= {"text/plain"}:
            self.stream(rank, "stdout", str(data.get("text/plain", "")) + "\n")
            return
        from IPython.display import display
        with self.lock:
            out = self.lanes[rank][2] if rank in self.lanes else None
        if out is None:
            display(dict(data), metadata=dict(metadata), raw=True)
        else:
            out.append_display_data(_Raw(data, metadata))

    def result(self, rank: int, data: Mapping[str, Any]) -> None:
        self.stream(rank, "stdout", f"Out: {data.get('text/plain', '')}\n")
        self.render()

    def close(self) -> None:
        with self.lock:
            for log in self.cell.logs.values():
                log.flush()
        self.render()

    # -- the cell as a whole (Pool.run_cell)
    def begin(self, ranks: Sequence[int], size: int, code: str) -> None:
        with self.lock:
            old = self.cell
            self.code, self.size = code, size
            self.cell = CellState(ranks, session().baseline_for(code), max_lines=self.max_lines,
                                  doctor=session().doctor)
            self.cell.notes = old.notes
            session().last_cell, session().last_sink = self.cell, self
        self._set_ranks(ranks)
        self.render()
        if self.redraw_in_background:
            RENDERER.add(self)

    def poll(self) -> None:
        """``Pool.run_cell``'s wait loop: redraw when due (unless the background renderer
        does it)."""
        if not self.redraw_in_background:
            self.tick()

    def ingest(self, batches: Sequence[Mapping[str, Any]]) -> None:
        with self.lock:
            self._changed = True
            self.batches += len(batches)
            for b in batches:
                self.cell.stall_after_s = float(b.get("stall_s", self.cell.stall_after_s))
                if self._t0_us is None and b.get("t0"):
                    self._t0_us = float(b["t0"]) * 1e6
                self._pending_rows.extend(self.cell.ingest(b))

    def tick(self) -> None:
        self._maybe_render()

    def _maybe_render(self) -> None:
        if self._changed and time.monotonic() - self._last >= self.refresh:
            self.render()

    def render(self) -> None:
        """Push what changed to the browser (any thread)."""
        with self.lock:
            self._last = time.monotonic()
            self._changed = False
            cell = self.cell
            self._set_html(self.badges_w, "".join(
                badge_html(r, cell.rank[r].status, cell.rank[r].why) for r in cell.ranks))
            self._set_html(self.banner_w, banner_html(cell))
            self._set_html(self.metrics_w, metrics_html(cell))
            for r, (head, body, _out) in self.lanes.items():
                log = cell.logs.get(r)
                if log is None:
                    continue
                st = cell.rank[r]
                self._set_html(head, f"<span class='hvdm-lane-head'>rank {r} &middot; "
                                     f"<span style='color:{_color(st.status)}'>"
                                     f"{STATUS_TEXT[st.status]}</span></span>")
                if self._drawn.get(("log", r)) != log.version:
                    self._drawn[("log", r)] = log.version
                    body.value = (f"<pre class='hvdm-log' data-rank='{r}'>{log.html()}</pre>")
            rows, self._pending_rows = self._pending_rows, []
            resets = [r for r in cell.resets.finished() if r.generation not in self._drawn_resets]
            self._drawn_resets.update(r.generation for r in resets)
            origin = cell.origin()
        if rows and self.source is not None:
            self._stream_rows(rows)
        if resets and self.source is not None:
            t0 = (self._t0_us or 0.0) / 1e6
            self.resets_src.stream(dict(
                left=[r.t0 - t0 for r in resets], right=[r.t1 - t0 for r in resets],
                bottom=[min(cell.ranks) - 0.5] * len(resets),
                top=[max(cell.ranks) + 0.5] * len(resets),
                label=[r.text(origin) for r in resets],
                short=[f"reset: {r.what()}" for r in resets]))

    def _set_html(self, w: Any, value: str) -> None:
        if w.value != value:
            w.value = value

    def _stream_rows(self, rows: List[Any]) -> None:
        """Append rows to the bokeh source as numpy columns: bokeh sends numeric arrays as
        binary buffers and string arrays as plain lists, where Python lists cost one
        serializer call per value (that was most of the kernel's CPU in a fast cell)."""
        import numpy as np
        rows = rows[-self.rollover:]
        t0 = self._t0_us or min(s[0] for _r, s in rows)
        ranks = np.fromiter((r for r, _s in rows), dtype=np.int32, count=len(rows))
        start = np.fromiter((s[0] for _r, s in rows), dtype=np.float64, count=len(rows))
        end = np.fromiter((s[1] for _r, s in rows), dtype=np.float64, count=len(rows))
        phases = [s[2] for _r, s in rows]
        groups = [phase_group(p) for p in phases]
        half = np.where(np.array([p == "COMPUTE" for p in phases], dtype=bool), 0.15, 0.4)
        new: Dict[str, Any] = {
            "left": (start - t0) / 1e6, "right": (end - t0) / 1e6,
            "bottom": ranks - half, "top": ranks + half, "rank": ranks,
            "phase": np.array(phases, dtype=str), "group": np.array(groups, dtype=str),
            "label": np.array([s[3] for _r, s in rows], dtype=str),
            "ms": (end - start) / 1e3}
        self.source.stream(new, rollover=self.rollover)

    def _set_ranks(self, ranks: Sequence[int]) -> None:
        W = self.W
        with self.lock:
            changed = False
            for r in ranks:
                if r not in self.lanes:
                    head = W.HTML(f"<span class='hvdm-lane-head'>rank {r}</span>")
                    body = W.HTML("<pre class='hvdm-log'></pre>")
                    out = W.Output()
                    self.lanes[r] = (head, body, out)
                    changed = True
            if not changed:
                return
            boxes = []
            for r in sorted(self.lanes):
                head, body, out = self.lanes[r]
                stack = self.stack_ws.setdefault(r, W.HTML(""))
                lane = W.VBox([head, body, out, stack], layout=W.Layout(
                    border="1px solid #ddd", padding="2px", margin="2px 0"))
                lane.add_class("hvdm-lane")
                lane.add_class(f"hvdm-lane-{r}")
                boxes.append(lane)
            everything = W.VBox(boxes)
            for old in self.lanes_box.children:       # the containers, not the lanes
                old.layout.close()
                old.close()
            self.lanes_box.children = [everything] + boxes
            self.lanes_box.titles = ["all ranks"] + [f"rank {r}" for r in sorted(self.lanes)]
            if self.plot is not None:
                from bokeh.models import FixedTicker
                n = max(len(self.lanes), 1)
                self.plot.height = 150 + 40 * n   # toolbar and legend sit above the rows
                self.plot.yaxis.ticker = FixedTicker(ticks=sorted(self.lanes))
                self.plot.y_range.start = min(self.lanes) - 0.6
                self.plot.y_range.end = max(self.lanes) + 0.6

    def _on_save(self, _b: Any = None) -> None:
        try:
            path = save_trace(cell=self.cell)
            self.saved_w.value = (f"<span style='font-size:12px'>saved {_esc(path)} &mdash; open "
                                  "it in <a href='https://ui.perfetto.dev' target='_blank'>"
                                  "ui.perfetto.dev</a></span>")
        except Exception as exc:  # noqa: BLE001
            self.saved_w.value = f"<span style='color:#c00'>{_esc(str(exc))}</span>"

    # -- end of the cell
    def wants_stacks(self) -> bool:
        """True once per stall (some rank's status is stalled): the pool then gathers the
        ranks' stacks and hands them to :meth:`stacks`."""
        with self.lock:
            stalled = any(self.cell.rank[r].status == STALLED for r in self.cell.ranks)
            if not stalled:
                self._stacks_asked = False
                return False
            if self._stacks_asked:
                return False
            self._stacks_asked = True
            return True

    def stacks(self, stacks: Sequence[Any]) -> None:
        """Put each rank's stack (:class:`hvd_magic.stacks.group.RankStack`) under its lane,
        folded: a click on "stack" opens it (any thread)."""
        from ..stacks.group import render
        with self.lock:
            for s in stacks:
                w = self.stack_ws.get(s.rank)
                if w is None:
                    continue
                text = render([s], title=f"rank {s.rank}: the stack at {time.strftime('%H:%M:%S')}")
                w.value = (f"<details class='hvdm-stack' data-rank='{s.rank}'><summary>stack "
                           f"(where rank {s.rank} is)</summary><pre class='hvdm-log'>"
                           f"{_esc(text)}</pre></details>")

    def lost(self, rank: int, why: str) -> None:
        with self.lock:
            self._changed = True
            self.cell.lose(rank, why)

    def failed(self, exc: PoolCellError) -> None:
        with self.lock:
            for f in exc.failures:
                self.cell.fail(f.rank, f.summary())
        self.finalize()

    def finalize(self) -> None:
        RENDERER.remove(self)
        with self.lock:
            self.cell.finish()
        session().record(self.cell, self.code, self.size)
        self.render()
        with self.lock:
            snap = snapshot_html(self.cell)
            logs = self.cell.logs_text()
            text = (logs + "\n" if logs else "") + self.cell.summary_text()
        self.snapshot.update({"text/html": snap, "text/plain": text}, raw=True)
        _drop_bokeh_loader()
        session().keep_live(self)

    def release(self) -> None:
        """Close the panel's widgets and drop its bokeh document; the snapshot stays."""
        with self.lock:
            try:
                _close_tree(self.box)       # the plot's model is inside it
            except Exception:  # noqa: BLE001 - a front end gone already; drop it anyway
                pass
            self.lanes, self.plot, self.source, self._drawn = {}, None, None, {}


_MODEL_CLS: Dict[Any, Any] = {}


def _one_message_model(base: Any) -> Any:
    """jupyter_bokeh's ``BokehModel`` whose document patches carry numpy columns inline
    (base64) instead of as separate binary buffers: a streamed batch of timeline rows is one
    patch of 3 comm messages instead of 3 + 2 per numeric column (15 here). Every comm
    message wakes threads in the kernel and the front end, which share the cores with the
    ranks. Falls back to jupyter_bokeh's own sending if bokeh's internals differ."""
    cls = _MODEL_CLS.get(base)
    if cls is not None:
        return cls

    class HvdBokehModel(base):  # type: ignore[misc, valid-type]
        def close(self) -> None:
            try:
                base.close(self)
            except KeyError:    # jupyter_bokeh's close runs twice (Widget.__del__ calls it)
                pass

        def _document_patched(self, event: Any) -> None:
            if event.setter is self:
                return
            try:
                msg = _inline_patch(event)
            except Exception:  # noqa: BLE001 - another bokeh: its own way
                return base._document_patched(self, event)
            self.send({"msg": "patch", "payload": msg.header_json})
            self.send({"msg": "patch", "payload": msg.metadata_json})
            self.send({"msg": "patch", "payload": msg.content_json})

    _MODEL_CLS[base] = HvdBokehModel
    return HvdBokehModel


def _inline_patch(event: Any) -> Any:
    """bokeh's PATCH-DOC message for ``event`` with binary data inline (no buffers)."""
    from bokeh.core.serialization import Serializer
    from bokeh.protocol.messages.patch_doc import PatchJson, patch_doc
    doc = event.document
    serializer = Serializer(references=doc.models.synced_references, deferred=False)
    patch_json = PatchJson(events=serializer.encode([event]))
    doc.models.flush_synced(lambda model: not serializer.has_ref(model))
    return patch_doc(patch_doc.create_header(), {}, patch_json)


class _Raw(dict):
    """A MIME bundle for Output.append_display_data (which takes display()-able objects)."""

    def __init__(self, data: Mapping[str, Any], metadata: Mapping[str, Any]) -> None:
        super().__init__()
        self.data, self.metadata = dict(data), dict(metadata)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        return self.data, self.metadata


def _esc(text: str) -> str:
    import html
    return html.escape(text)


def _color(status: str) -> str:
    from .model import STATUS_COLOR
    return STATUS_COLOR.get(status, "#888")
