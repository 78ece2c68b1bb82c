"""Timeline: per-rank, per-tensor phase events, Horovod's timeline file, and live subscribers.

Events are plain tuples ``(rank, tensor, phase, start_us, dur_us, args)`` so they can
travel inside negotiation messages to rank 0, which writes the one file. Each rank records
an event once a phase is over (its start and duration known); the notebook widgets get
them as they are (:class:`Subscribers`).

The file is Horovod's timeline (``horovod/common/timeline.cc``), a Chrome trace in JSON
Array format that chrome://tracing and Perfetto open: one process row per tensor, named as
Horovod's torch API names it (``allreduce.NAME``), and in it one thread row per rank (Horovod
records rank 0's only). Each request shows Horovod's nesting of begin/end events:
``NEGOTIATE_ALLREDUCE`` (with a tick named by the rank when it submitted), then
``ALLREDUCE`` holding ``QUEUE``, ``MEMCPY_IN_FUSION_BUFFER``, ``MPI_ALLREDUCE``, ...; with
cycle marks, a global ``CYCLE_START`` instant per negotiation cycle. Timestamps count
microseconds from the file's start, given in the first record as Horovod does.

The file is written while the job runs: a writer thread formats what arrived and appends it
at most every ``FLUSH_S`` seconds, whole records in one ``write`` call, so a job that is
killed leaves a file that loads (the closing ``]``, written at close, may be missing, which
the format allows) with the events up to about a second before the kill.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Callable, Optional

from .ops import ReduceOp

Event = tuple  # (rank, tensor, phase, start_us, dur_us, args-or-None)

NEGOTIATE = "NEGOTIATE"
QUEUE = "QUEUE"
MEMCPY_IN = "MEMCPY_IN_FUSION_BUFFER"
MEMCPY_OUT = "MEMCPY_OUT_FUSION_BUFFER"
CYCLE = "CYCLE_START"

#: How often the writer thread appends what arrived to the file (seconds).
FLUSH_S = 0.5

_ADASUM = int(ReduceOp.ADASUM)
# Horovod's request type of each request kind (``NEGOTIATE_<TYPE>`` and the span of the
# operation), carried as the NEGOTIATE event's args: shared dicts, nothing made per event.
_REQUEST_ARGS = {kind: {"request": rtype} for kind, rtype in (
    ("allreduce", "ALLREDUCE"), ("allgather", "ALLGATHER"), ("broadcast", "BROADCAST"),
    ("broadcast_object", "BROADCAST"), ("alltoall", "ALLTOALL"),
    ("reducescatter", "REDUCESCATTER"), ("barrier", "BARRIER"), ("join", "JOIN"))}
_ADASUM_ARGS = {"request": "ADASUM"}
# the prefix of a tensor's row, as Horovod's torch API names its requests (GetOpName)
_ROW_PREFIX = {"ADASUM": "allreduce"}
# a backend phase's operation, for a rank that has no NEGOTIATE event of it (a joined rank)
_OP_OF_PHASE = {"BCAST": "BROADCAST"}


def now_us() -> float:
    return time.time() * 1e6


def request_args(ann) -> dict:
    """The args of a request's NEGOTIATE event: its Horovod request type."""
    if ann.op == _ADASUM and ann.kind == "allreduce":
        return _ADASUM_ARGS
    return _REQUEST_ARGS.get(ann.kind) or {"request": ann.kind.upper()}


def row_name(tensor: str, rtype: str) -> str:
    """A tensor's row in the file: ``allreduce.NAME`` (unnamed requests, ``allreduce.noname.N``,
    already read so)."""
    prefix = _ROW_PREFIX.get(rtype) or rtype.lower()
    return tensor if tensor.startswith(prefix + ".") else f"{prefix}.{tensor}"


class TimelineWriter:
    """Horovod's timeline file, appended while the job runs (see the module's docstring).

    ``write`` (the engine thread) only queues events; the writer thread formats and appends
    them every ``FLUSH_S`` s; ``close()`` writes the rest and the closing ``]``."""

    def __init__(self, path: str, mark_cycles: bool = False):
        self.path = path
        self.mark_cycles = mark_cycles
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        self._fd: Optional[int] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.start_us = int(now_us())
        self._queued: list = []           # event batches not yet formatted
        self._lock = threading.Lock()     # guards _queued
        self._io = threading.Lock()       # one formatting + write at a time
        self._closed = False
        self._rows: dict[str, int] = {}   # row name -> pid (1, 2, ... as Horovod numbers them)
        self._threads: set = set()        # (pid, rank) rows named already
        self._last: dict = {}             # (pid, rank) -> latest timestamp written in that row
        self._request: dict[str, str] = {}  # tensor -> its latest Horovod request type
        self._names: dict[str, str] = {}  # event name -> its JSON string
        self._append("[\n" + _record({"name": "process_name", "ph": "M", "pid": 0, "args": {
            "start_time_since_epoch_in_micros": self.start_us}}) + ",\n" + _record(
            {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}}))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hvd_magic-timeline", daemon=True)
        self._thread.start()

    def write(self, events) -> None:
        """Queue a batch of events (every event of an operation on one rank comes in one
        batch: its span in the file ends with the batch's last phase of it)."""
        if events and not self._closed:
            with self._lock:
                self._queued.append(events)

    def _run(self) -> None:
        while not self._stop.wait(FLUSH_S):
            self.flush()

    def flush(self) -> None:
        """Format and append what was queued."""
        with self._io:
            with self._lock:
                batches, self._queued = self._queued, []
            if self._fd is None or not batches:
                return
            out: list = []
            for batch in batches:
                self._format(batch, out)
            if out:
                self._append("".join(out))

    def close(self) -> None:
        """Write what is left and the closing ``]``: valid JSON from then on."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self.flush()
        with self._io:
            if self._fd is not None:
                self._append("\n]\n")
                fd, self._fd = self._fd, None
                os.close(fd)

    def _append(self, text: str) -> None:
        """Append whole records in one write call (a write cut short is finished by the
        next ones); on an I/O error, say so once and stop writing, as Horovod does."""
        if self._fd is None:
            return
        data = text.encode("utf-8")
        try:
            while data:
                n = os.write(self._fd, data)
                data = data[n:]
        except OSError as exc:
            sys.stderr.write(f"[hvd_magic] could not write the timeline {self.path!r} ({exc}); "
                             f"no more timeline events are written\n")
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass

    # ------------------------------------------------------------------ formatting
    def _row(self, tensor: str, rtype: str, rank: int, out: list) -> tuple:
        """The (pid, rank) row of a tensor on a rank, named in the file the first time."""
        name = row_name(tensor, rtype)
        pid = self._rows.get(name)
        if pid is None:
            pid = self._rows[name] = len(self._rows) + 1
            out.append(",\n" + _record({"name": "process_name", "ph": "M", "pid": pid,
                                        "args": {"name": name}}))
            out.append(",\n" + _record({"name": "process_sort_index", "ph": "M", "pid": pid,
                                        "args": {"sort_index": pid}}))
        key = (pid, rank)
        if key not in self._threads:
            self._threads.add(key)
            out.append(",\n" + _record({"name": "thread_name", "ph": "M", "pid": pid, "tid": rank,
                                        "args": {"name": f"rank {rank}"}}))
            out.append(",\n" + _record({"name": "thread_sort_index", "ph": "M", "pid": pid,
                                        "tid": rank, "args": {"sort_index": rank}}))
        return key

    def _ts(self, row: tuple, t_us: float) -> int:
        """Microseconds since the start, never before the row's previous record: events in a
        row then stay nested in file order however the clocks rounded."""
        ts = max(int(t_us - self.start_us + 0.5), self._last.get(row, 0))
        self._last[row] = ts
        return ts

    def _name(self, name: str) -> str:
        js = self._names.get(name)
        if js is None:
            js = self._names[name] = json.dumps(name)
        return js

    def _format(self, events, out: list) -> None:
        open_ops: dict = {}     # (pid, rank) -> end of the operation's latest phase (us)
        for ev in events:
            rank, tensor, phase, start, dur, args = ev
            if phase == CYCLE:
                if rank == 0 and self.mark_cycles:
                    out.append(',\n{"ph":"i","name":"CYCLE_START","ts":%d,"pid":0,"s":"g"}'
                               % max(int(start - self.start_us + 0.5), 0))
                continue
            if dur is None:
                continue
            end = start + dur
            if phase == NEGOTIATE:
                rtype = (args or {}).get("request") or self._request.get(tensor, "ALLREDUCE")
                self._request[tensor] = rtype
                row = self._row(tensor, rtype, rank, out)
                if row in open_ops:
                    self._end(row, open_ops.pop(row), out)
                pid = row[0]
                ts = self._ts(row, start)
                out.append(',\n{"ph":"B","name":"NEGOTIATE_%s","ts":%d,"pid":%d,"tid":%d}'
                           % (rtype, ts, pid, rank))
                out.append(',\n{"ph":"X","name":"%d","ts":%d,"pid":%d,"tid":%d,"dur":0}'
                           % (rank, ts, pid, rank))
                self._end(row, end, out)
                continue
            rtype = self._request.get(tensor)
            if rtype is None:
                op = phase.split("_", 1)[-1]
                rtype = _OP_OF_PHASE.get(op, op)
            row = self._row(tensor, rtype, rank, out)
            if row not in open_ops:
                out.append(',\n{"ph":"B","name":%s,"ts":%d,"pid":%d,"tid":%d}'
                           % (self._name(rtype), self._ts(row, start), row[0], rank))
                open_ops[row] = end
            elif end > open_ops[row]:
                open_ops[row] = end
            extra = (',"args":' + json.dumps(args, separators=(",", ":"), default=str)) if args else ""
            out.append(',\n{"ph":"B","name":%s,"ts":%d,"pid":%d,"tid":%d%s}'
                       % (self._name(phase), self._ts(row, start), row[0], rank, extra))
            self._end(row, end, out)
        for row, end in open_ops.items():
            self._end(row, end, out)

    def _end(self, row: tuple, t_us: float, out: list) -> None:
        out.append(',\n{"ph":"E","ts":%d,"pid":%d,"tid":%d}' % (self._ts(row, t_us), row[0], row[1]))


def _record(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))


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
        if not value:
            self._rec = []     # (not for the next file)
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
