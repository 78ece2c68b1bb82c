"""The text renderer of a ``%%hvd`` cell (a terminal, or no ipywidgets): output as
``[rank] line``, stall lines as they happen, and a summary when the cell ends."""
from __future__ import annotations

import threading
from typing import Any, Mapping, Optional, Sequence

from ..kernel.notebook.output import PoolCellError, TextSink
from .model import CellState
from .session import session


def telemetry_interval() -> float:
    """Seconds between telemetry batches: ``HVD_MAGIC_TELEMETRY_INTERVAL`` (default 1),
    read when a sink is made."""
    from .. import config
    value = config.get("HVD_MAGIC_TELEMETRY_INTERVAL")
    if value <= 0:
        raise ValueError(f"HVD_MAGIC_TELEMETRY_INTERVAL={value:g}: use seconds > 0, e.g. 1")
    return value


class TelemetryTextSink(TextSink):
    """Terminal / no-ipywidgets renderer: ``[rank] line`` output as :class:`TextSink`, stall
    and failure lines as they happen, and a summary (throughput, efficiency, communication
    share, timeline size) when the cell ends."""

    live = True

    def __init__(self, ranks: Optional[Sequence[int]] = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.cell: Optional[CellState] = CellState(list(ranks or []))
        self.lock = threading.RLock()
        self.telemetry_interval = telemetry_interval()
        self.batches = 0
        self.code, self.size = "", 0
        self._said = ""

    def begin(self, ranks: Sequence[int], size: int, code: str) -> None:
        self.cell = CellState(ranks, session().baseline_for(code), doctor=session().doctor)
        self.code, self.size = code, size
        session().last_cell = self.cell

    def poll(self) -> None:
        """``Pool.run_cell``'s wait loop: a stall line when one is due."""
        self.tick()

    def ingest(self, batches: Sequence[Mapping[str, Any]]) -> None:
        with self.lock:
            self.batches += len(batches)
            for b in batches:
                if self.cell.stall_after_s != b.get("stall_s", self.cell.stall_after_s):
                    self.cell.stall_after_s = float(b["stall_s"])
                self.cell.ingest(b)

    def tick(self) -> None:
        level, text = self.cell.banner()
        if level == "warning" and text != self._said:
            self._said = text
            self.status(f"hvd: {text}")

    def lost(self, rank: int, why: str) -> None:
        with self.lock:
            self.cell.lose(rank, why)

    def failed(self, exc: PoolCellError) -> None:
        for f in exc.failures:
            self.cell.fail(f.rank, f.summary())
        self.finalize()

    def finalize(self) -> None:
        with self.lock:
            self.cell.finish()
            text = self.cell.summary_text()
        session().record(self.cell, self.code, self.size)
        self.status(text)
