"""Engine side of the widgets: runs inside each pool rank. Standard library only at import.

``report(samples=n)`` counts samples (cheap: one addition). :func:`enable` (called once per
pool through ``apply``) hooks IPython's ``pre_run_cell`` / ``post_run_cell`` on the engine:
while a cell runs, the rank subscribes to the runtime's timeline events and a background
thread sends one batch every ``interval`` seconds with ipyparallel's ``publish_data``
(a ``data_message`` on IOPub whose parent is the running cell, so the client files it under
that cell's metadata). Keys are ``hvdm.<rank>.<seq>`` so no batch overwrites another.

A batch (plain dict): ``rank, seq, t, t0`` (cell start), ``status`` (running / done /
failed), ``error``, ``samples`` (cumulative) and ``samples_t`` (time of the latest report),
``spans`` (merged phase spans, see :func:`..model.compact_events`), ``busy_us`` (time with a
collective in flight in this batch), ``pending`` (``hvd.pending()``).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from typing import Any, Optional

MAX_SPANS = int(os.environ.get("HVD_MAGIC_TELEMETRY_MAX_SPANS", "200"))   # per batch; 0: all
INTERVAL = float(os.environ.get("HVD_MAGIC_TELEMETRY_INTERVAL", "0.25"))

_samples = 0
_samples_t: Optional[float] = None


def report(samples: int) -> None:
    """Count ``samples`` processed by this rank (call once per step); the widgets turn the
    counts into samples/s per rank, in total, and scaling efficiency. Costs ~0.2 us."""
    global _samples, _samples_t
    _samples += samples
    _samples_t = time.time()


class _Telemetry:
    def __init__(self, interval: float = INTERVAL) -> None:
        self.interval = interval
        self.lock = threading.Lock()
        self.events: Any = deque()
        self.running = False
        self.seq = 0
        self.t0 = 0.0
        self.unsub: Any = None
        self.thread: Optional[threading.Thread] = None
        self.rank = 0
        self.stall_s = 60.0
        self.wake = threading.Event()

    # engine thread of the runtime: keep it trivial
    def on_events(self, events: list) -> None:
        self.events.extend(events)

    def pre(self, *_a: Any) -> None:
        global _samples, _samples_t
        try:
            import hvd_magic.collectives as hvd
            from hvd_magic.collectives import state
            if hvd.is_initialized():
                self.rank = hvd.rank()
                self.unsub = hvd.subscribe(self.on_events)
                cfg = getattr(state.engine(), "cfg", None)
                if cfg is not None and cfg.stall_check_s > 0:
                    self.stall_s = cfg.stall_check_s
        except Exception:  # noqa: BLE001 - telemetry must never break a cell
            self.unsub = None
        with self.lock:
            self.events.clear()
            _samples, _samples_t = 0, None
            self.t0 = time.time()
            self.running = True
        # No batch now: the client shows "running" from the cell's start, the periodic thread
        # sends the first batch after one interval, and a short cell sends only its final
        # batch (one message a cell instead of two: empty cells round-trip faster).
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._loop, name="hvdm-telemetry", daemon=True)
            self.thread.start()

    def post(self, result: Any = None) -> None:
        if not self.running:
            return
        if self.unsub is not None:
            try:
                self.unsub()
            except Exception:  # noqa: BLE001
                pass
            self.unsub = None
        err = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
        with self.lock:
            self.running = False
        if err is not None:
            self.send("failed", f"{type(err).__name__}: {err}")
        else:
            self.send("done")

    def _loop(self) -> None:
        while True:
            time.sleep(self.interval)
            if self.running:
                try:
                    self.send("running")
                except Exception:  # noqa: BLE001
                    pass

    def batch(self, status: str, error: str = "") -> dict:
        from .model import compact_tail
        q = self.events
        events = [q.popleft() for _ in range(len(q))]
        spans, busy, cut = compact_tail(events, MAX_SPANS)
        pending: list = []
        if status == "running":
            try:
                import hvd_magic.collectives as hvd
                if hvd.is_initialized():
                    pending = [p for p in hvd.pending() if (p.get("waiting_s") or 0) >= 0.5]
            except Exception:  # noqa: BLE001
                pass
        self.seq += 1
        return {"rank": self.rank, "seq": self.seq, "t": time.time(), "t0": self.t0,
                "status": status, "error": error, "samples": _samples, "samples_t": _samples_t,
                "spans": spans, "cut_us": cut, "busy_us": busy, "pending": pending, "stall_s": self.stall_s}

    def send(self, status: str, error: str = "") -> None:
        with self.lock:
            if status == "running" and not self.running:
                return
            b = self.batch(status, error)
            _publish({f"hvdm.{b['rank']}.{b['seq']}": b})


def _publish(data: dict) -> None:
    from ipyparallel.datapub import publish_data
    publish_data(data)


_T: Optional[_Telemetry] = None


def enable(interval: float = INTERVAL) -> str:
    """Turn the widgets' telemetry on for every following cell on this engine (idempotent)."""
    global _T
    from IPython import get_ipython
    ip = get_ipython()
    if ip is None:
        return "no IPython here"
    if _T is None:
        _T = _Telemetry(interval)
        ip.events.register("pre_run_cell", _T.pre)
        ip.events.register("post_run_cell", _T.post)
    _T.interval = interval
    return "ok"


def disable() -> str:
    """Undo :func:`enable`."""
    global _T
    from IPython import get_ipython
    ip = get_ipython()
    if _T is not None and ip is not None:
        for name, fn in (("pre_run_cell", _T.pre), ("post_run_cell", _T.post)):
            try:
                ip.events.unregister(name, fn)
            except ValueError:
                pass
        _T.running = False
        _T = None
    return "ok"


def _stderr(msg: str) -> None:  # pragma: no cover - debugging aid
    sys.__stderr__.write(msg + "\n")
