"""The pure part of the widgets: no UI, no ipyparallel, no MPI. Everything here is a function
of the data it is given, so it is unit-tested on its own (``tests/test_widgets.py``).

* :class:`LogBuffer`: per-rank stdout/stderr lines, the last N kept, "... N earlier lines".
* :mod:`hvd_magic.kernel.ranks.spans`: the runtime's timeline events -> merged phase spans
  (engine side); :mod:`.html`: the static HTML of a finished cell.
* :class:`SpanTrack`: spans per rank with the gaps between collectives filled in as compute.
* :mod:`.rates`: the arithmetic of samples/s, efficiency and communication share.
* :class:`CellState`: everything one cell's widget shows, fed with telemetry batches; its
  ``summary_text()`` is what a terminal / nbconvert gets instead of the widgets.
* :mod:`.resets`: an elastic cell's lost ranks and resets.
* :func:`chrome_trace`, :func:`dumps_trace`: the timeline saved for Perfetto.
"""
from __future__ import annotations

import html
import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from ..kernel.ranks.spans import Span
from .rates import (Throughput, autotune_text, comm_fraction, efficiency,  # noqa: F401
                    fmt_pct, fmt_rate)
from .predicted import Comparison, compare, link_of
from .resets import Reset, Resets

# ---------------------------------------------------------------------------- statuses

STARTING, RUNNING, WAITING, DONE, FAILED, STALLED, LOST = (
    "starting", "running", "waiting", "done", "failed", "stalled", "lost")
STATUS_TEXT = {STARTING: "starting", RUNNING: "running", WAITING: "waiting in a collective",
               DONE: "done", FAILED: "failed", STALLED: "stalled",
               LOST: "lost (the others went on)"}
STATUS_COLOR = {STARTING: "#888888", RUNNING: "#1f77b4", WAITING: "#e6a700", DONE: "#2ca02c",
                FAILED: "#d62728", STALLED: "#ff7f0e", LOST: "#7f7f7f"}

# ---------------------------------------------------------------------------- phases

NEGOTIATE, QUEUE, COPY_IN, COPY_OUT, COMPUTE = (
    "NEGOTIATE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER", "COMPUTE")
#: Legend groups of the timeline (everything else is a reduction / data movement phase).
PHASE_GROUP = {NEGOTIATE: "negotiation", QUEUE: "queue", COPY_IN: "fusion copy",
               COPY_OUT: "fusion copy", COMPUTE: "compute"}
GROUP_COLOR = {"negotiation": "#9467bd", "queue": "#c7c7c7", "fusion copy": "#17becf",
               "reduction": "#d62728", "compute": "#a6d96a"}
RESET_COLOR = "#7f7f7f"      # an elastic reset, across every rank of the timeline


def phase_group(phase: str) -> str:
    """The legend group of a runtime phase name (MPI_ALLREDUCE, GLOO_ALLREDUCE ... are
    "reduction")."""
    return PHASE_GROUP.get(phase, "reduction")


# ---------------------------------------------------------------------------- logs

@dataclass
class LogBuffer:
    """The lines of one rank: complete lines plus the unfinished tail of each stream.

    Keeps the last ``max_lines`` lines (``dropped`` counts the ones rolled over); a line longer
    than ``max_line`` characters is cut. ``version`` changes with every visible change, so a
    renderer redraws only what changed.
    """

    max_lines: int = 200
    max_line: int = 2000
    lines: Deque[Tuple[str, str]] = field(default_factory=deque)   # (stream name, text)
    partial: Dict[str, str] = field(default_factory=dict)
    dropped: int = 0
    total: int = 0
    version: int = 0

    def add(self, name: str, text: str) -> None:
        """A piece of ``stdout``/``stderr``; ``\\r`` rewrites the current line (progress bars)."""
        if not text:
            return
        buf = self.partial.get(name, "") + text
        parts = buf.split("\n")
        self.partial[name] = _cr(parts.pop())
        for line in parts:
            self._push(name, _cr(line))
        self.version += 1

    def _push(self, name: str, line: str) -> None:
        if len(line) > self.max_line:
            line = line[: self.max_line] + f" ... ({len(line) - self.max_line} more characters)"
        self.lines.append((name, line))
        self.total += 1
        while len(self.lines) > self.max_lines:
            self.lines.popleft()
            self.dropped += 1

    def flush(self) -> None:
        """End of the cell: unfinished lines become lines."""
        for name in sorted(self.partial):
            if self.partial[name]:
                self._push(name, self.partial[name])
                self.version += 1
        self.partial.clear()

    def view(self) -> List[Tuple[str, str]]:
        """What to show: kept lines, then the unfinished ones (oldest first)."""
        return list(self.lines) + [(n, t) for n, t in sorted(self.partial.items()) if t]

    def marker(self) -> str:
        """``"... 1234 earlier lines"`` when lines rolled over, else ``""``."""
        if not self.dropped:
            return ""
        return f"\u2026 {self.dropped} earlier line{'s' if self.dropped != 1 else ''}"

    def html(self) -> str:
        """The lane as HTML: stderr in red, the rollover marker on top."""
        out = []
        if self.dropped:
            out.append(f'<span class="hvdm-fold" style="color:#888">{html.escape(self.marker())}'
                       "</span>")
        for name, line in self.view():
            esc = html.escape(line) or "&nbsp;"
            if name == "stderr":
                out.append(f'<span class="hvdm-stderr" style="color:#c00">{esc}</span>')
            else:
                out.append(f'<span class="hvdm-stdout">{esc}</span>')
        return "\n".join(out)

    def text(self, rank: int) -> str:
        lines = ([f"[{rank}] {self.marker()}"] if self.dropped else []) + [
            f"[{rank}]{'!' if n == 'stderr' else ''} {t}" for n, t in self.view()]
        return "\n".join(lines)


def _cr(line: str) -> str:
    """A line as a terminal shows it after carriage returns (the text after the last one)."""
    if "\r" not in line:
        return line
    pieces = [p for p in line.split("\r") if p]
    return pieces[-1] if pieces else ""


# ---------------------------------------------------------------------------- spans

class SpanTrack:
    """Spans of every rank, with the gaps between collectives turned into COMPUTE spans.

    ``add(rank, spans)`` returns the new rows to draw (collective spans and compute gaps
    since this rank's previous collective); the last ``keep`` spans per rank are kept for
    the Chrome trace. A gap shorter than ``min_gap_us`` is not drawn.
    """

    def __init__(self, keep: int = 20000, min_gap_us: float = 100.0) -> None:
        self.keep = keep
        self.min_gap_us = min_gap_us
        self.spans: Dict[int, Deque[Span]] = {}
        self.last_end: Dict[int, float] = {}
        self.counts: Dict[int, int] = {}

    def start(self, rank: int, t_us: float) -> None:
        """The cell began on ``rank`` at ``t_us``: compute is measured from there."""
        self.last_end.setdefault(rank, t_us)

    def skip_to(self, rank: int, t_us: float) -> None:
        """Spans before ``t_us`` were dropped (too many to send): no compute gap up to it."""
        self.last_end[rank] = max(self.last_end.get(rank, t_us), t_us)

    def add(self, rank: int, spans: Sequence[Span]) -> List[Span]:
        rows: List[Span] = []
        store = self.spans.setdefault(rank, deque(maxlen=self.keep))
        last = self.last_end.get(rank)
        for s, e, phase, label in sorted(spans):
            if last is not None and s - last >= self.min_gap_us:
                rows.append((last, s, COMPUTE, "compute"))
            rows.append((s, e, phase, label))
            last = e if last is None else max(last, e)
        if last is not None:
            self.last_end[rank] = last
        store.extend(rows)
        self.counts[rank] = self.counts.get(rank, 0) + len(rows)
        return rows

    def all_spans(self) -> Dict[int, List[Span]]:
        return {r: list(s) for r, s in sorted(self.spans.items())}


def chrome_trace(spans: Mapping[int, Sequence[Span]]) -> List[Dict[str, Any]]:
    """Chrome trace events (Perfetto, chrome://tracing): one process per rank, one thread
    row for collectives and one for compute."""
    out: List[Dict[str, Any]] = []
    for rank in sorted(spans):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank,
                    "args": {"sort_index": rank}})
        out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 1,
                    "args": {"name": "collectives"}})
        out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 2,
                    "args": {"name": "compute"}})
        for s, e, phase, label in spans[rank]:
            out.append({"name": phase, "ph": "X", "ts": round(s, 3), "dur": round(e - s, 3),
                        "pid": rank, "tid": 2 if phase == COMPUTE else 1, "cat": phase_group(phase),
                        "args": {"tensors": label}})
    return out


@dataclass
class RankState:
    status: str = STARTING
    why: str = ""                      # failure / stall text
    pending: List[Dict[str, Any]] = field(default_factory=list)
    busy_us: float = 0.0               # collective time since the cell began (union)
    t0: Optional[float] = None         # cell start on this rank (s, wall clock)
    t_last: Optional[float] = None     # time of the latest batch
    seq: int = -1
    sampled_us: float = 0.0            # time the busy measurement covers (all, or windows)
    busy_window: Deque[Tuple[float, float, float]] = field(default_factory=deque)
    # (t, busy_us total, sampled_us total)
    steps: int = 0                     # report() calls since the cell began
    allreduce_bytes: int = 0           # bytes its allreduces carried since the cell began
    host: str = ""


class CellState:
    """What one ``%%hvd`` cell's widget shows, fed by :meth:`ingest` with telemetry batches
    (dicts, see :mod:`.telemetry`) and by :meth:`stream` with output. Pure: the renderers
    read it; tests drive it directly.
    """

    def __init__(self, ranks: Sequence[int], single_rate: Optional[float] = None,
                 max_lines: int = 200, stall_after_s: float = 60.0, window: float = 3.0,
                 doctor: Any = None) -> None:
        self.ranks = list(ranks)
        self.logs: Dict[int, LogBuffer] = {r: LogBuffer(max_lines) for r in self.ranks}
        self.rank: Dict[int, RankState] = {r: RankState() for r in self.ranks}
        self.tput: Dict[int, Throughput] = {r: Throughput(window) for r in self.ranks}
        self.track = SpanTrack()
        self.single_rate = single_rate
        self.stall_after_s = stall_after_s
        self.window = window
        # The pool's status lines this cell: its start, notes, restarts (a progress line,
        # output.is_progress, is replaced by the next one)
        self.notes: List[str] = []
        self.stall_lines: List[str] = []   # stall warnings the runtime printed
        self.failures: Dict[int, str] = {}
        self.autotune: Optional[Dict[str, Any]] = None   # HOROVOD_AUTOTUNE's setting, from rank 0
        self.finished = False
        self.t_start = time.time()
        self.resets = Resets(self.ranks)
        self.doctor = doctor               # the session's last %hvd doctor report, or None

    # -- inputs
    def stream(self, rank: int, name: str, text: str) -> None:
        if rank not in self.logs:
            self._add_rank(rank)
        self.logs[rank].add(name, text)
        if name == "stderr" and "WARNING: stall" in text:
            self.stall_lines = [ln.strip() for ln in text.splitlines()
                                if "waited" in ln or "WARNING: stall" in ln][:8]

    def _add_rank(self, rank: int) -> None:
        self.ranks.append(rank)
        self.ranks.sort()
        self.logs[rank] = LogBuffer(next(iter(self.logs.values())).max_lines if self.logs else 200)
        self.rank[rank] = RankState()
        self.tput[rank] = Throughput(self.window)

    def ingest(self, batch: Mapping[str, Any]) -> List[Tuple[int, Span]]:
        """One telemetry batch from a rank; returns the new timeline rows ``(rank, span)``."""
        r = int(batch["rank"])
        if r not in self.rank:
            self._add_rank(r)
        st = self.rank[r]
        seq = int(batch.get("seq", 0))
        if seq <= st.seq:
            return []
        st.seq = seq
        now = float(batch.get("t", time.time()))
        if st.t0 is None and batch.get("t0") is not None:
            st.t0 = float(batch["t0"])
            self.track.start(r, st.t0 * 1e6)
        prev = st.t_last if st.t_last is not None else st.t0
        st.t_last = now
        st.busy_us += float(batch.get("busy_us", 0.0))
        sampled = batch.get("sampled_us")
        if sampled is None:            # the whole time since the previous batch
            sampled = max(now - prev, 0.0) * 1e6 if prev is not None else 0.0
        st.sampled_us += float(sampled)
        st.busy_window.append((now, st.busy_us, st.sampled_us))
        while len(st.busy_window) > 2 and st.busy_window[0][0] < now - self.window:
            st.busy_window.popleft()
        if batch.get("samples_first") and self.tput[r].first is None:
            t_first, n_first = batch["samples_first"]
            self.tput[r].add(float(t_first), float(n_first))
        if batch.get("samples_t") is not None:
            self.tput[r].add(float(batch["samples_t"]), float(batch.get("samples", 0)))
        st.pending = list(batch.get("pending") or [])
        if batch.get("steps") is not None:
            st.steps, st.allreduce_bytes = int(batch["steps"]), int(batch.get("allreduce_bytes") or 0)
            st.host = str(batch.get("host") or "")
        if batch.get("autotune") and (r == 0 or self.autotune is None):
            self.autotune = dict(batch["autotune"])
        status = batch.get("status")
        if status == FAILED:
            st.status, st.why = FAILED, str(batch.get("error") or "")
            self.failures[r] = st.why
        elif status == DONE:
            st.status, st.why = DONE, ""
        elif status:
            oldest = max((p.get("waiting_s") or 0.0 for p in st.pending), default=0.0)
            if oldest >= self.stall_after_s:
                st.status = STALLED
            elif oldest >= 0.5:
                st.status = WAITING
            else:
                st.status = RUNNING
        for change in batch.get("elastic") or ():
            self.reset(self.resets.add(change))
        if batch.get("cut_us") is not None:
            self.track.skip_to(r, float(batch["cut_us"]))
        rows = self.track.add(r, [tuple(s) for s in batch.get("spans") or []])
        return [(r, s) for s in rows]

    def fail(self, rank: int, why: str) -> None:
        """A failure the pool knows of (an exception, a rank that died)."""
        if rank not in self.rank:
            self._add_rank(rank)
        self.rank[rank].status, self.rank[rank].why = FAILED, why
        self.failures[rank] = why

    def lose(self, rank: int, why: str) -> None:
        """An elastic cell lost ``rank`` and went on without it: from now on throughput and
        efficiency count the ranks left."""
        if rank not in self.rank:
            self._add_rank(rank)
        self.rank[rank].status, self.rank[rank].why = LOST, why

    def reset(self, reset: Optional[Reset]) -> None:
        """An elastic reset the ranks reported (new, or just finished): its lost ranks are
        marked, and once training resumed, throughput (and so efficiency) counts again from
        then, on the ranks left."""
        if reset is None:
            return
        for r in reset.lost + reset.left:
            if r not in self.rank or self.rank[r].status != LOST:     # the first word stays
                self.lose(r, reset.text(self.origin()))
        if reset.t1 is not None:
            for r in self.live_ranks():
                self.tput[r].restart(reset.t1)

    def origin(self) -> Optional[float]:
        """The cell's start on the ranks (wall clock s; None before the first batch)."""
        starts = [st.t0 for st in self.rank.values() if st.t0 is not None]
        return min(starts) if starts else None

    def live_ranks(self) -> List[int]:
        return [r for r in self.ranks if self.rank[r].status != LOST]

    def finish(self) -> None:
        self.finished = True
        for log in self.logs.values():
            log.flush()
        for r, st in self.rank.items():
            if st.status not in (FAILED, DONE, LOST):
                st.status = DONE if st.seq >= 0 or r not in self.failures else FAILED

    # -- outputs
    def rates(self) -> Dict[int, Optional[float]]:
        """Per-rank samples/s: the recent window while running, the whole run once finished."""
        return {r: (t.average() if self.finished else t.rate()) for r, t in self.tput.items()
                if self.rank[r].status != LOST}

    def total_rate(self) -> Optional[float]:
        vals = [v for v in self.rates().values() if v is not None]
        return sum(vals) if vals else None

    def efficiency(self) -> Optional[float]:
        return efficiency(self.total_rate(), len(self.live_ranks()), self.single_rate)

    def comm(self) -> Dict[int, Optional[float]]:
        """Per rank: share of time with a collective in flight (recent window, or whole cell)."""
        out: Dict[int, Optional[float]] = {}
        for r, st in self.rank.items():
            if st.status == LOST:
                continue
            if len(st.busy_window) >= 2 and not self.finished:
                (_t0, b0, s0), (_t1, b1, s1) = st.busy_window[0], st.busy_window[-1]
                out[r] = comm_fraction(b1 - b0, s1 - s0)
            elif st.sampled_us > 0:
                out[r] = comm_fraction(st.busy_us, st.sampled_us)
            else:
                out[r] = None
        return out

    def comm_mean(self) -> Optional[float]:
        vals = [v for v in self.comm().values() if v is not None]
        return sum(vals) / len(vals) if vals else None

    def predicted(self) -> Optional[Comparison]:
        """Measured beside predicted efficiency for this pool (:mod:`.predicted`); None until
        the ranks reported steps, samples/s and allreduced bytes (or with several hosts and
        no ``%hvd doctor`` of them)."""
        rates = self.rates()
        hosts: Dict[str, int] = {}
        steps, nbytes = [], []
        for r in self.live_ranks():
            st, last = self.rank[r], self.tput[r].last
            if not st.host or not st.steps or last is None or not rates.get(r):
                continue
            hosts[st.host] = hosts.get(st.host, 0) + 1
            per_step = last[1] / st.steps                   # samples per step
            steps.append((per_step, per_step / rates[r]))
            nbytes.append(st.allreduce_bytes / st.steps)
        if len(steps) < max(2, len(self.live_ranks())):    # (one rank: the baseline itself)
            return None
        per_step = sum(p for p, _ in steps) / len(steps)
        step_s = sum(s for _, s in steps) / len(steps)
        single = per_step / self.single_rate if self.single_rate else None
        return compare(step_s, self.comm_mean() or 0.0, max(nbytes), len(hosts),
                       max(hosts.values()), link_of(self.doctor, hosts), single)

    def banner(self) -> Tuple[str, str]:
        """(level, text): ``("error", ...)`` for failures, ``("warning", ...)`` for stalls,
        ``("", "")`` when all is well."""
        if self.failures:
            parts = [f"rank {r} failed: {why}" for r, why in sorted(self.failures.items())]
            return "error", "; ".join(parts)
        stalls = []
        seen = set()
        for r in self.ranks:
            st = self.rank[r]
            if st.status != STALLED:
                continue
            for p in st.pending:
                if p.get("name") in seen or (p.get("waiting_s") or 0) < self.stall_after_s:
                    continue
                seen.add(p.get("name"))
                stalls.append(describe_pending(p, st.t_last))
        if not stalls and self.stall_lines and not self.finished:
            stalls = self.stall_lines
        if stalls:
            return "warning", "stall: " + "; ".join(stalls)
        return "", ""

    def logs_text(self, last: int = 50) -> str:
        """Each rank's kept output as rank-prefixed lines (the last ``last`` per rank)."""
        blocks = []
        for r in sorted(self.logs):
            lines = self.logs[r].text(r).splitlines()
            if len(lines) > last:
                lines = [f"[{r}] … {len(lines) - last} more lines above"] + lines[-last:]
            if lines:
                blocks.append("\n".join(lines))
        return "\n".join(blocks)

    def summary_text(self) -> str:
        """The same information as the widgets, as text (terminal IPython, nbconvert)."""
        rates = self.rates()
        comm = self.comm()
        lines = []
        statuses = ", ".join(f"rank {r} {STATUS_TEXT[self.rank[r].status]}" for r in self.ranks)
        lines.append(f"hvd: {statuses}")
        for reset in self.resets:
            lines.append(f"hvd: {reset.text(self.origin())}")
        if any(v is not None for v in rates.values()):
            per = ", ".join(f"rank {r} {fmt_rate(rates[r])}" for r in self.live_ranks())
            since = " since the last reset" if self.resets.last_resume() is not None else ""
            lines.append(f"hvd: throughput {fmt_rate(self.total_rate())} samples/s in total{since} "
                         f"({per})")
            eff = self.efficiency()
            if eff is not None:
                lines.append(f"hvd: scaling efficiency {fmt_pct(eff)} of {len(self.live_ranks())} x "
                             f"{fmt_rate(self.single_rate)} samples/s (1 rank)")
            else:
                lines.append("hvd: scaling efficiency: no 1-rank baseline yet (run the cell "
                             "with -np 1, or %hvd scale)")
        if any(v is not None for v in comm.values()):
            per = ", ".join(f"rank {r} {fmt_pct(comm[r])}" for r in self.live_ranks())
            lines.append(f"hvd: collectives in flight {fmt_pct(self.comm_mean())} of the time ({per})")
        pred = self.predicted()
        if pred is not None:
            lines.append(f"hvd: {pred.text()}")
        tune = autotune_text(self.autotune)
        if tune:
            lines.append(f"hvd: {tune}")
        n = sum(self.track.counts.values())
        if n:
            lines.append(f"hvd: timeline: {n} spans; hvd_magic.widgets.save_trace('trace.json') "
                         "writes them for Perfetto")
        level, text = self.banner()
        if level:
            lines.append(f"hvd: {'ERROR' if level == 'error' else 'WARNING'}: {text}")
        return "\n".join(lines)


def describe_pending(p: Mapping[str, Any], now: Optional[float] = None) -> str:
    """``"allreduce of 'grad.w' waits for rank(s) 1 (submitted by 0) since 12:01:02 (15.0 s)"``."""
    waited = float(p.get("waiting_s") or 0.0)
    since = ""
    if now is not None:
        since = " since " + time.strftime("%H:%M:%S", time.localtime(now - waited))
    missing = p.get("missing_ranks")
    who = ("the other ranks" if not missing else
           "rank(s) " + ", ".join(map(str, missing)))
    by = p.get("submitted_by") or []
    return (f"{p.get('kind', 'collective')} of tensor '{p.get('name')}' waits for {who}"
            f"{' (submitted by ' + ', '.join(map(str, by)) + ')' if by else ''}"
            f"{since} ({waited:.1f} s)")


def dumps_trace(spans: Mapping[int, Sequence[Span]]) -> str:
    return json.dumps(chrome_trace(spans), separators=(",", ":"))
