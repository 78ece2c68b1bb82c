"""Timeline: per-rank, per-tensor phase events as Chrome trace JSON, and live subscribers.

Events are plain tuples ``(rank, tensor, phase, start_us, dur_us, args)`` so they
can travel inside negotiation messages to rank 0, which writes the one file.
The file is a JSON array that is valid JSON once closed and loads in Perfetto
and chrome://tracing: one process row per rank, one thread row per tensor.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable, Optional

Event = tuple  # (rank, tensor, phase, start_us, dur_us, args-or-None)

NEGOTIATE = "NEGOTIATE"
QUEUE = "QUEUE"
MEMCPY_IN = "MEMCPY_IN_FUSION_BUFFER"
MEMCPY_OUT = "MEMCPY_OUT_FUSION_BUFFER"
CYCLE = "CYCLE_START"


def now_us() -> float:
    return time.time() * 1e6


def to_chrome(event: Event, tid: int) -> dict:
    rank, tensor, phase, start, dur, args = event
    out = {"name": phase, "ph": "X" if dur is not None else "i", "ts": round(start, 3),
           "pid": rank, "tid": tid, "cat": tensor}
    if dur is not None:
        out["dur"] = round(dur, 3)
    else:
        out["s"] = "p"
    if args:
        out["args"] = args
    return out


class TimelineWriter:
    """Appends events to a Chrome trace file; ``close()`` leaves valid JSON."""

    def __init__(self, path: str, mark_cycles: bool = False):
        self.path = path
        self.mark_cycles = mark_cycles
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        self._f = open(path, "w", encoding="utf-8")
        self._f.write("[\n")
        self._first = True
        self._tids: dict[tuple, int] = {}
        self._ranks: set = set()
        self._lock = threading.Lock()

    def _emit(self, obj: dict) -> None:
        self._f.write(("" if self._first else ",\n") + json.dumps(obj, separators=(",", ":")))
        self._first = False

    def write(self, events: list) -> None:
        if not events:
            return
        with self._lock:
            if self._f is None:
                return
            for ev in events:
                rank, tensor = ev[0], ev[1]
                if ev[2] == CYCLE and not self.mark_cycles:
                    continue
                if rank not in self._ranks:
                    self._ranks.add(rank)
                    self._emit({"name": "process_name", "ph": "M", "pid": rank,
                                "args": {"name": f"rank {rank}"}})
                    self._emit({"name": "process_sort_index", "ph": "M", "pid": rank,
                                "args": {"sort_index": rank}})
                key = (rank, tensor)
                tid = self._tids.get(key)
                if tid is None:
                    tid = self._tids[key] = len(self._tids) + 1
                    self._emit({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                                "args": {"name": tensor}})
                self._emit(to_chrome(ev, tid))
            self._f.flush()

    def close(self) -> None:
        with self._lock:
            if self._f is None:
                return
            self._f.write("\n]\n")
            self._f.close()
            self._f = None


class Subscribers:
    """In-process listeners (the notebook widgets) for this rank's events."""

    def __init__(self) -> None:
        self._subs: list[Callable[[list], None]] = []
        self._lock = threading.Lock()
        self.on_change: Callable[[], None] = lambda: None

    def add(self, fn: Callable[[list], None]) -> Callable[[], None]:
        with self._lock:
            self._subs.append(fn)
        self.on_change()

        def remove() -> None:
            with self._lock:
                if fn in self._subs:
                    self._subs.remove(fn)
            self.on_change()
        return remove

    def __bool__(self) -> bool:
        return bool(self._subs)

    def publish(self, events: list) -> None:
        for fn in list(self._subs):
            try:
                fn(events)
            except Exception:  # a broken listener must not break the collectives
                pass


class Timeline:
    """This rank's event sink: collects events when a file or a subscriber wants them.
    ``subscribers``: the listeners of the runtime this one replaces (an elastic reset starts
    the runtime again mid-cell; the panel's subscription goes on)."""

    def __init__(self, rank: int, subscribers: Optional[Subscribers] = None) -> None:
        self.rank = rank
        self.subscribers = subscribers if subscribers is not None else Subscribers()
        self.writer: Optional[TimelineWriter] = None  # rank 0 only
        self.mark_cycles = False
        self._recording = False
        self.active = False    # True while a file or a subscriber wants events (read per op)
        self._rec: list = []   # for rank 0's file, sent with the next negotiation
        self._pub: list = []   # for local subscribers, published after each cycle
        self.subscribers.on_change = self._update
        self._update()

    def _update(self) -> None:
        self.active = self._recording or bool(self.subscribers)

    @property
    def recording(self) -> bool:
        return self._recording

    @recording.setter
    def recording(self, value: bool) -> None:
        self._recording = bool(value)
        self._update()

    def add(self, tensor: str, phase: str, start_us: float, dur_us: Optional[float],
            args: Optional[dict] = None) -> None:
        ev = (self.rank, tensor, phase, start_us, dur_us, args)
        if self.recording:
            self._rec.append(ev)
        if self.subscribers:
            self._pub.append(ev)

    def take(self) -> tuple:
        """Events recorded since the last call, for rank 0's file."""
        if not self._rec:
            return ()
        events, self._rec = self._rec, []
        return tuple(events)

    def publish(self) -> None:
        """Hand events since the last call to the local subscribers."""
        if self._pub:
            events, self._pub = self._pub, []
            self.subscribers.publish(events)
