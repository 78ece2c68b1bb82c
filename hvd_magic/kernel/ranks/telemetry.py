"""Runs in each rank (a pool engine, one MPI process per rank).

Telemetry of a running cell: runs inside each pool rank, for the live panel (widgets) and
the text summary. Standard library only at import.

:func:`enable` (called once per
pool through ``apply``) hooks IPython's ``pre_run_cell`` / ``post_run_cell`` on the engine:
while a cell runs, the rank subscribes to the runtime's timeline events and a background
thread sends one batch every ``interval`` seconds (none while nothing it would show changed)
with ipyparallel's ``publish_data``
(a ``data_message`` on IOPub whose parent is the running cell, so the client files it under
that cell's metadata). Keys are ``hvdm.<rank>.<seq>`` so no batch overwrites another.

A batch (plain dict): ``rank, seq, t, t0`` (cell start), ``status`` (running / done /
failed), ``error``, ``samples`` (cumulative) and ``samples_t`` (time of the latest report),
``spans`` (merged phase spans, see :func:`.spans.compact_events`), ``busy_us`` (time with a
collective in flight in this batch), ``pending`` (``hvd.pending()``), ``elastic`` (the
changes of the ranks since the cell began, see
:func:`hvd_magic.collectives.elastic.changes`), ``steps`` (``report()`` calls) and
``allreduce_bytes`` (bytes allreduced) since the cell began, ``host``.
"""
from __future__ import annotations

import socket
import sys
import threading
import time
from collections import deque
from typing import Any, Optional

from ... import config
from ...collectives.progress import first_report, progress, reset_progress, traffic



#: Seconds into a cell after which the telemetry looks whether the timeline needs sampling.
PROBE_S = 0.05


class _Telemetry:
    def __init__(self, interval: Optional[float] = None) -> None:
        self.interval = config.get("HVD_MAGIC_TELEMETRY_INTERVAL") if interval is None else interval
        self.max_spans = config.get("HVD_MAGIC_TELEMETRY_MAX_SPANS")   # per batch; 0: all
        self.lock = threading.Lock()
        self.events: Any = deque()
        self.running = False
        self.seq = 0
        self.t0 = 0.0
        self.unsub: Any = None
        self.thread: Optional[threading.Thread] = None
        self.rank = 0
        self.stall_s = 60.0
        self.wake = threading.Event()     # set while a cell runs: the batch thread waits on it
        self.kick = threading.Event()     # cuts the batch thread's wait short (new interval)
        self.hooked = False               # pre/post registered with IPython
        self.sent = 0                     # batches sent in the current cell
        self.subscribe_fn: Any = None     # hvd.subscribe of the running cell (None: no hvd)
        self.since: Optional[float] = None    # start of what the collected events cover
        self.window: Optional[float] = None   # seconds subscribed before a batch; None: all
        self.shown: Any = None            # what the latest batch sent showed (see send)
        self.held_us = 0.0                # time covered by batches not sent (nothing changed)

    # engine thread of the runtime: keep it trivial
    def on_events(self, events: list) -> None:
        self.events.extend(events)

    # subscription: full while events are few, a window before each batch when they are many
    def _subscribe(self) -> None:
        if self.unsub is None and self.subscribe_fn is not None:
            try:
                self.unsub = self.subscribe_fn(self.on_events)
            except Exception:  # noqa: BLE001 - telemetry must never break a cell
                self.unsub = None
            self.since = time.time()

    def _unsubscribe(self) -> None:
        if self.unsub is not None:
            try:
                self.unsub()
            except Exception:  # noqa: BLE001
                pass
            self.unsub = None

    def pre(self, *_a: Any) -> None:
        self.subscribe_fn = None
        try:
            import hvd_magic.collectives as hvd
            from hvd_magic.collectives import state
            if hvd.is_initialized():
                self.rank = hvd.rank()
                self.subscribe_fn = hvd.subscribe
                cfg = getattr(state.engine(), "cfg", None)
                if cfg is not None and cfg.stall_check_s > 0:
                    self.stall_s = cfg.stall_check_s
        except Exception:  # noqa: BLE001 - telemetry must never break a cell
            self.subscribe_fn = None
        with self.lock:
            self.events.clear()
            reset_progress()
            self.t0 = time.time()
            self.sent = 0
            self.shown = None
            self.held_us = 0.0
            self.window = None
            self.since = None
            self._subscribe()
            self.running = True
        # No batch now: the client shows "running" from the cell's start, the periodic thread
        # sends the first batch after one interval, and a short cell sends only its final
        # batch (one message a cell instead of two: empty cells round-trip faster).
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._loop, name="hvdm-telemetry", daemon=True)
            self.thread.start()
        self.wake.set()

    def post(self, result: Any = None) -> None:
        if not self.running:
            return
        err = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
        with self.lock:
            self._unsubscribe()
            self.running = False
            self.wake.clear()
            # A cell that sent nothing yet and has nothing to say (no collective, no samples,
            # no error) sends no final batch either: the client marks it done from the
            # execute reply, and an empty cell costs one message less each way.
            empty = self.sent == 0 and not self.events and progress()[1] is None
        if err is not None:
            self.send("failed", f"{type(err).__name__}: {err}")
        elif not empty:
            self.send("done")

    def _loop(self) -> None:
        # Sleeps only while a cell runs (no wake-ups between cells). While the timeline is
        # sampled (``self.window``), it subscribes ``window`` s before each batch.
        while True:
            self.wake.wait()
            window = self.window
            if window is None and self.sent == 0 and self.max_spans > 0:
                # A cell's first interval, looked at every PROBE_S: once its events call for
                # sampling, it sends its first batch (which starts the sampling) instead of
                # recording every event for a whole interval. (Looked at once, a cell whose
                # loop started late, as under load, recorded the whole interval.)
                end = time.monotonic() + self.interval
                while True:
                    left = end - time.monotonic()
                    self.kick.wait(min(PROBE_S, max(left, 0.0)))
                    if self.kick.is_set() or left <= PROBE_S or self._busy():
                        break
            elif window is None:
                self.kick.wait(self.interval)
            else:
                self.kick.wait(max(self.interval - window, 0.0))
                with self.lock:
                    if self.running:
                        self._subscribe()
                self.kick.wait(window)
            self.kick.clear()
            if self.running:
                try:
                    self.send("running")
                except Exception:  # noqa: BLE001
                    pass

    def batch(self, status: str, error: str = "") -> dict:
        from .spans import compact_tail
        q = self.events
        events = [q.popleft() for _ in range(len(q))]
        now = time.time()
        since = self.since
        if since is None:                    # not subscribed: no timeline in this batch
            spans, busy, cut, covered = [], 0.0, None, 0.0
        else:
            spans, busy, cut = compact_tail(events, self.max_spans, since_us=since * 1e6)
            covered = max(now - since, 0.0)
            if self.window is not None:     # sampled: nothing is known before the window
                cut = since * 1e6 if cut is None else max(cut, since * 1e6)
            self._adapt(len(events), covered)
        if status == "running" and self.window is not None:
            self._unsubscribe()              # until the next window
            self.since = None
        else:
            self.since = now if self.unsub is not None else None
        pending: list = []
        tune = None
        changes: list = []
        try:
            import hvd_magic.collectives as hvd
            if hvd.is_initialized():
                from hvd_magic.collectives.elastic import changes as elastic_changes
                changes = elastic_changes(self.t0)
                tune = hvd.autotune_status()
                if status == "running":
                    pending = [p for p in hvd.pending() if (p.get("waiting_s") or 0) >= 0.5]
        except Exception:  # noqa: BLE001
            pass
        self.seq += 1
        samples, samples_t = progress()
        steps, nbytes = traffic()
        return {"rank": self.rank, "seq": self.seq, "t": now, "t0": self.t0,
                "status": status, "error": error, "samples": samples, "samples_t": samples_t,
                "samples_first": first_report(),
                "spans": spans, "cut_us": cut, "busy_us": busy, "sampled_us": covered * 1e6,
                "pending": pending, "stall_s": self.stall_s, "autotune": tune,
                "elastic": changes, "steps": steps, "allreduce_bytes": nbytes,
                "host": _HOST}

    def _per_interval(self, n_events: int, covered: float) -> Optional[float]:
        """Events an interval would bring at the rate of ``n_events`` in ``covered`` s
        (None: too short to tell, or sampling is off)."""
        if self.max_spans <= 0 or covered < 0.005:
            return None
        return n_events / covered * self.interval

    def _busy(self) -> bool:
        """Whether the events since the subscription began already call for sampling."""
        since = self.since
        rate = None if since is None else self._per_interval(len(self.events), time.time() - since)
        return rate is not None and rate > 2 * self.max_spans

    def _adapt(self, n_events: int, covered: float) -> None:
        """Sample the timeline when it is busy: a cell whose events would fill more than twice
        the spans a batch carries (``HVD_MAGIC_TELEMETRY_MAX_SPANS``) subscribes only for the
        part of each interval that fills them (at least 10 ms). Busy time (the communication
        share) is then measured over those windows, the spans shown are the windows' (each
        marked as a cut), and the runtime does its timeline bookkeeping a fraction of the
        time. Few events: the subscription stays on the whole cell, every event counts."""
        per_interval = self._per_interval(n_events, covered)
        if per_interval is None:
            return
        if per_interval > 2 * self.max_spans:
            self.window = min(max(self.interval * self.max_spans / per_interval, 0.01), self.interval)
        elif self.window is not None and per_interval < self.max_spans:
            self.window = None

    def send(self, status: str, error: str = "") -> None:
        with self.lock:
            if status == "running" and not self.running:
                return
            b = self.batch(status, error)
            shown = (b["samples"], b["samples_t"], b["autotune"])
            if status == "running" and self.shown == shown and _quiet(b):
                # Nothing the panel shows would change (no collective, no new samples, nothing
                # pending): no message. The time it covered goes with the next batch, so the
                # share of time in collectives stays exact.
                self.held_us += b["sampled_us"]
                self.seq -= 1
            else:
                b["sampled_us"] += self.held_us
                self.held_us = 0.0
                self.shown = shown
                self.sent += 1
                _publish({f"hvdm.{b['rank']}.{b['seq']}": b})
            if status == "running" and self.window is None and self.unsub is None:
                self._subscribe()            # back to the whole interval


def _quiet(batch: dict) -> bool:
    """A batch with no timeline, nothing pending and no elastic change."""
    return not (batch["spans"] or batch["busy_us"] or batch["pending"] or batch["elastic"])


def _publish(data: dict) -> None:
    from ipyparallel.datapub import publish_data
    publish_data(data)


#: This rank's host, for the panel's predicted efficiency (which hosts the pool spans).
_HOST = socket.gethostname()


_T: Optional[_Telemetry] = None


def enable(interval: Optional[float] = None) -> str:
    """Turn the widgets' telemetry on for every following cell on this engine (idempotent)."""
    global _T
    from IPython import get_ipython
    ip = get_ipython()
    if ip is None:
        return "no IPython here"
    if interval is None:
        interval = config.get("HVD_MAGIC_TELEMETRY_INTERVAL")
    if _T is None:
        _T = _Telemetry(interval)
    if not _T.hooked:
        ip.events.register("pre_run_cell", _T.pre)
        ip.events.register("post_run_cell", _T.post)
        _T.hooked = True
    if _T.interval != interval:
        _T.interval = interval
        _T.kick.set()
    return "ok"


def disable() -> str:
    """Undo :func:`enable` (``--no-stream`` cells): no subscription, no batches. The
    telemetry object and its idle thread stay for the next :func:`enable`."""
    from IPython import get_ipython
    ip = get_ipython()
    if _T is not None and ip is not None and _T.hooked:
        for name, fn in (("pre_run_cell", _T.pre), ("post_run_cell", _T.post)):
            try:
                ip.events.unregister(name, fn)
            except ValueError:
                pass
        _T.hooked = False
    if _T is not None:
        with _T.lock:
            _T.running = False
            _T.wake.clear()
    return "ok"


def _stderr(msg: str) -> None:  # pragma: no cover - debugging aid
    sys.__stderr__.write(msg + "\n")
